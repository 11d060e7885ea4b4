"""Acting on a decision from inside the job: submit the next segment, or requeue this one.

Both go through :mod:`beam_hpc.slurm.client` with the job's SLURM_* variables removed
(:func:`beam_hpc.slurm.client.slurm_env_free`): a resubmitted job would otherwise inherit e.g.
SLURM_RESTART_COUNT and take itself for a requeue.

Given a ``deadline``, both ride out a controller that cannot be reached or is busy: they retry with
a short backoff while Slurm's words say so (``SlurmUnavailable.transient``), and first look whether
an attempt whose answer was lost went through after all. A refusal on the merits ends at once with
Slurm's words. When the deadline comes first, :class:`ResubmissionPending` says what to run. Slurm's
controller enforces time limits, so while it is down nothing kills the job; when it is back the job
gets SIGTERM and KillWait seconds: :class:`KillClock` is that deadline.
"""

from __future__ import annotations

import contextlib
import logging
import math
import shlex
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from beam_hpc.plan.segment_args import SegmentArgs
from beam_hpc.slurm import client

log = logging.getLogger(__name__)

T = TypeVar("T")

RETRY_FIRST_S = 1.0  # backoff between attempts: short, so that the controller's first answers after
RETRY_MAX_S = 4.0  # an outage include ours (sbatch itself tries to connect for about 9 s an attempt)
ATTEMPT_TIMEOUT_S = 30.0  # one attempt among retries, at most (never past the deadline)
# Less time left than this: an attempt would be cut before sbatch is done trying to connect, and a
# cut attempt may have landed; so it goes out only when `scontrol ping` says the controller is up.
MIN_ATTEMPT_S = 12.0
SINGLE_TIMEOUT_S = 60.0  # the one attempt made without a deadline

# When to give up: epoch seconds, or a callable read before each attempt (the deadline may move:
# KillClock), or None for a single attempt.
Deadline = float | Callable[[], float] | None


@dataclass
class KillClock:
    """When Slurm will kill this job, as a deadline for the retries: never while no SIGTERM came
    (the controller enforces the time limit; while it cannot be reached nothing kills the job, and
    once it answers, the retry in flight lands before its next time-limit sweep), and ``kill_wait_s``
    minus ``reserve_s`` (for the ledger's end line) after the SIGTERM that ends the job. ``cap``: an
    absolute time to give up at regardless (None: none)."""

    kill_wait_s: float = 30.0  # Slurm's KillWait (scontrol show config; 30 s by default)
    reserve_s: float = 2.0
    cap: float | None = None
    term_at: float | None = None
    clock: Callable[[], float] = field(default=time.time, repr=False)

    def sigterm(self, at: float | None = None) -> None:
        """Record the SIGTERM that starts KillWait (the first one counts)."""
        if self.term_at is None:
            self.term_at = self.clock() if at is None else at

    def __call__(self) -> float:
        end = math.inf if self.term_at is None else self.term_at + max(0.0, self.kill_wait_s - self.reserve_s)
        return end if self.cap is None else min(end, self.cap)


class ResubmissionPending(client.SlurmUnavailable):
    """Slurm could not be reached (or was busy) until the deadline: the next segment was not
    submitted (or this job not requeued). ``command`` is exactly what the run's own resubmission
    ran, to be run by hand once ``scontrol ping`` says UP; :meth:`record` is the ledger's
    ``resubmission_pending`` field."""

    def __init__(self, command: Sequence[str], last: client.SlurmUnavailable, *, attempts: int,
                 waited_s: float, unsure: bool = False) -> None:
        self.command = list(command)
        self.attempts = attempts
        self.waited_s = waited_s
        self.why = f"Slurm did not take it in {attempts} attempt(s) over {waited_s:.0f} s: {last.last_line}"
        if unsure:
            self.why += "; an attempt whose answer was lost may have gone through: look in `squeue --me` first"
        super().__init__(last.argv, f"{self.why}; run `{self.shell}` once `scontrol ping` says UP",
                         last.returncode, transient=True, may_have_landed=unsure)

    @property
    def shell(self) -> str:
        return shlex.join(self.command)

    def record(self) -> dict[str, str]:
        """The end line's ``resubmission_pending``: ``{"command": ..., "why": ...}``."""
        return {"command": self.shell, "why": self.why}


def _deadline_at(deadline: Deadline) -> float:
    if deadline is None:
        return -math.inf
    return deadline() if callable(deadline) else float(deadline)


def retry(attempt: Callable[[float], T], *, command: Sequence[str], deadline: Deadline,
          landed: Callable[[], T | None] | None = None, settle: Callable[[T], T] | None = None,
          sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.time,
          probe: Callable[[float], object] = lambda timeout: client.ping(timeout=timeout)) -> T:
    """``attempt(timeout)`` until it returns. A transient SlurmUnavailable is retried with backoff
    until ``deadline`` (then ResubmissionPending naming ``command``); anything else is raised as it
    is. After an attempt that may have landed, ``landed()`` is asked first: its answer is the
    result, None means "not there" and lets the request go out again, and a SlurmUnavailable (Slurm
    cannot say) means ask again next round. A lost request may still be carried out after such a
    "not there" (a controller working off its backlog answers a look before an older request), so
    once one was in doubt: a refusal is checked against ``landed()`` (Slurm may refuse the repeat
    because the first went through), and a success goes through ``settle`` (which removes what
    the lost attempt made twice). With less than MIN_ATTEMPT_S left, an attempt goes out only if
    ``probe`` (``scontrol ping``) finds the controller up."""
    started, delay, attempts = clock(), RETRY_FIRST_S, 0
    unsure = doubted = False  # an earlier attempt may have been carried out (now / ever)
    last: client.SlurmUnavailable | None = None
    while True:
        left = _deadline_at(deadline) - clock()
        if deadline is not None and left < MIN_ATTEMPT_S:
            try:
                probe(max(1.0, min(3.0, left)))
            except client.SlurmUnavailable as down:  # no time for a whole attempt, and no controller
                raise ResubmissionPending(command, last or down, attempts=attempts, waited_s=clock() - started,
                                          unsure=unsure) from None
        try:
            if unsure and landed is not None:
                found = landed()
                if found is not None:
                    log.info("an earlier attempt of `%s` went through after all", shlex.join(command))
                    return found
                unsure = False
            attempts += 1
            result = attempt(SINGLE_TIMEOUT_S if deadline is None else max(1.0, min(ATTEMPT_TIMEOUT_S, left)))
            return settle(result) if doubted and settle is not None else result
        except client.SlurmUnavailable as err:
            if not err.transient:
                raise
            last = err
            unsure = unsure or err.may_have_landed
            doubted = doubted or err.may_have_landed
        except client.SlurmError:
            if doubted and landed is not None:
                with contextlib.suppress(client.SlurmError):
                    found = landed()
                    if found is not None:
                        return found
            raise
        if clock() + delay >= _deadline_at(deadline):
            if deadline is None:
                raise last
            raise ResubmissionPending(command, last, attempts=attempts, waited_s=clock() - started, unsure=unsure)
        log.warning("Slurm could not be reached or was busy (%s); trying again in %.0f s", last.last_line, delay)
        sleep(delay)
        delay = min(delay * 2, RETRY_MAX_S)


def resubmit_command(script: str, args: SegmentArgs, *, lead_s: int, dependency: str,
                     output: str | None = None, exclude: Sequence[str] = ()) -> list[str]:
    """sbatch line for the next segment: the same script with the next segment's arguments
    (:class:`beam_hpc.plan.segment_args.SegmentArgs`, the type every submission uses), after this
    job (``afterany:<this job>``), with the walltime warning at the current lead (options on the
    command line override the script's #SBATCH lines). Not ``singleton``: on a heterogeneous job
    (Slurm 22.05) each component waits for the other, which has the same name, and the job pends
    forever. A ``--num-rollout`` total this segment was given is in ``args`` (plan.json is never
    rewritten in the job, so the next segment is told again). ``output``: the run's batch log
    pattern (its logs/ exists by now; the script's own default is the submit directory).
    ``exclude``: the run's failed nodes (beam_hpc.lifecycle.exclusions), as ``--exclude``, which
    applies to every het component. Run by hand later, the line still works: Slurm drops a
    dependency on a job it no longer knows."""
    opts = [f"--dependency={dependency}", f"--signal=B:USR1@{int(lead_s)}"]
    if output:
        opts.append(f"--output={output}")
    if exclude:
        opts.append(f"--exclude={','.join(exclude)}")
    return client.sbatch_argv([*opts, script, *args.argv()])


def resubmit(script: str, args: SegmentArgs, *, lead_s: int, dependency: str, output: str | None = None,
             exclude: Sequence[str] = (), deadline: Deadline = None,
             sleep: Callable[[float], None] = time.sleep) -> str:
    """Submit the next segment; returns its job id. Raises SlurmError (a RuntimeError) with
    sbatch's words when Slurm refuses, and, with a ``deadline``, ResubmissionPending when Slurm
    could not be reached until then (without one: the SlurmUnavailable of the one attempt). An
    attempt whose answer was lost is looked for among the jobs that depend on this one."""
    cmd = resubmit_command(script, args, lead_s=lead_s, dependency=dependency, output=output, exclude=exclude)
    env = client.slurm_env_free()
    after = dependency.rpartition(":")[2]

    def landed() -> str | None:
        found = client.dependents(after, env=env, timeout=ATTEMPT_TIMEOUT_S)
        return found[0] if found else None

    def settle(job: str) -> str:
        """Keep ``job``; withdraw any other successor, made by an attempt whose answer was lost."""
        try:
            twins = [j for j in client.dependents(after, env=env, timeout=ATTEMPT_TIMEOUT_S) if j != job]
            if twins:
                log.warning("withdrawing job(s) %s: the same resubmission, sent by an attempt whose answer was lost",
                            ", ".join(twins))
                client.cancel(twins, env=env, timeout=ATTEMPT_TIMEOUT_S)
        except client.SlurmError as err:
            log.warning("could not look for a twin of job %s (%s): look for a second job depending on job %s "
                        "in `squeue --me` and scancel it", job, err, after)
        return job

    known = after.isdigit()
    return retry(lambda timeout: client.sbatch(cmd[1:], env=env, timeout=timeout, survive_term=True),
                 command=cmd, deadline=deadline, landed=landed if known else None, settle=settle if known else None,
                 sleep=sleep)


def requeue_self(job_id: str, exclude: Sequence[str] = (), *, restart: int | None = None,
                 deadline: Deadline = None, sleep: Callable[[float], None] = time.sleep) -> None:
    """Requeue this job (same id, restart count + 1). Needed after a graceful save during a
    preemption grace time: a job that ends by itself then is COMPLETED and never requeued.
    ``exclude``: the run's failed nodes, set as the job's ExcNodeList right after the requeue,
    while the requeued job pends (Slurm delays its eligibility; a running job's ExcNodeList
    cannot be changed, so not before). ``restart``: this job's restart count, to see whether a
    requeue whose answer was lost went through. Raises SlurmError (a RuntimeError) with Slurm's
    words, or ResubmissionPending as :func:`resubmit` does."""
    env = client.slurm_env_free()
    argv = ["scontrol", "requeue", str(job_id)]

    def send(timeout: float) -> bool:
        client.requeue(job_id, env=env, timeout=timeout)
        return True

    def landed() -> bool | None:  # None: not requeued, send again (SlurmUnavailable: cannot say)
        info = client.show_job(job_id, timeout=ATTEMPT_TIMEOUT_S)
        requeued = info is not None and ((restart is not None and info.restarts > restart) or info.state in (
            client.JobState.PENDING, client.JobState.REQUEUED, client.JobState.REQUEUE_HOLD))
        return True if requeued else None

    retry(send, command=argv, deadline=deadline, landed=landed, sleep=sleep)
    if exclude:
        exclude_from_requeued(job_id, exclude, deadline=deadline, sleep=sleep)


def exclude_from_requeued(job_id: str, exclude: Sequence[str], *, deadline: Deadline = None,
                          sleep: Callable[[float], None] = time.sleep) -> None:
    """Set the requeued job's ExcNodeList to ``exclude`` (the run's failed nodes), so that its
    next start leaves them out: after this job's own requeue, or Slurm's (a node lost under a job
    that does not go on without it). Only a pending job takes it; a requeued job is pending (and
    completing) from the requeue on, and cannot start again before this one has ended. Raises
    SlurmError (a RuntimeError) with Slurm's words, or ResubmissionPending as :func:`resubmit` does."""
    env = client.slurm_env_free()
    retry(lambda timeout: client.set_excluded_nodes(job_id, exclude, env=env, timeout=timeout),
          command=["scontrol", "update", f"JobId={job_id}", f"ExcNodeList={','.join(exclude)}"],
          deadline=deadline, sleep=sleep)
