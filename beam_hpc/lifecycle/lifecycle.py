"""A segment's life inside Slurm: notice the end coming, save the rollout in flight, decide what next.

Why each piece exists (facts: anchors-report.md 1.3, 1.4, 3; local-slurm-cluster.md 4, 9):

- Miles has no signal handler of its own; the one way to make it save on demand is its
  ``--save-trigger-sentinel`` file, honoured at the next rollout boundary (the reference backend
  honours the same file). So "save now" means: create the sentinel, then wait until the backend
  has consumed it *and* the checkpoint pointer (``latest_checkpointed_iteration.txt``, written
  last) has advanced. Only then is the rollout in flight safe, and only then is the driver stopped.
  Miles looks only at whether the file exists and trains on after the save until the segment stops
  it (its rollouts take minutes; the segment notices within ``SENTINEL_POLL_S``). The file's JSON
  also says ``"then": "stop"``, a beam-hpc extension: the reference backend, whose tiny rollouts
  take a fraction of a second, exits right after that save, so no rollout is trained that nobody
  keeps.
- The walltime warning (``--signal=B:USR1@lead``) may come up to 30 s early or late, so the
  watchdog also keeps its own deadline: the job's EndTime (``scontrol show job``) minus the lead.
  Whichever comes first starts the final save.
- With ``preempt_send_user_signal`` and a partition GraceTime, preemption arrives as the *same*
  USR1; ``scontrol show job`` tells the two apart (``PreemptTime`` is set, and EndTime has moved
  to now + GraceTime). A job that ends by itself during its grace time is COMPLETED, not
  requeued, so after a graceful save the segment requeues itself (``scontrol requeue``).
- SIGTERM comes from ``scontrol requeue`` / preemption without grace (Slurm already counts the
  restart), from ``scancel``, or from the time limit; KillWait (seconds) is all that is left, so
  the segment only writes its ledger line, and relies on the last complete checkpoint.

:func:`decide` is the pure rule book for what follows a segment; the rest is thin I/O around it.
"""

from __future__ import annotations

from beam_hpc.errors import RuntimeFailure

import json
import logging
import os
import signal
import subprocess
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from types import FrameType
from typing import Any

from beam_hpc.run import checkpoint_layout

from beam_hpc.run import metric_names
from beam_hpc.plan.plan import RunPaths

log = logging.getLogger("beam_hpc.lifecycle.lifecycle")

FAILURES = ("error", "node-failure")
SENTINEL_POLL_S = 0.2  # a rollout trained after the save is lost work: notice the save promptly
# Seconds kept free before the hard end for stopping the driver, tearing Ray down and writing the
# ledger (measured teardown on the local cluster: 4 s, up to 26 s with a freshly joined worker).
TEARDOWN_RESERVE_S = 15.0


class SlurmUnavailable(RuntimeFailure):
    """Slurm did not answer (no scontrol, or the controller is down): nothing can be concluded."""


# -- what Slurm says about a job ------------------------------------------------------------------
@dataclass(frozen=True)
class JobInfo:
    """The fields of ``scontrol show job`` that the lifecycle needs (het leader's line)."""

    job_id: str
    state: str  # JobState, e.g. RUNNING, PENDING, COMPLETING
    restarts: int  # Slurm's restart count: bumped as soon as a requeue is ordered
    end_time: float | None  # when Slurm will stop the job (moves to now + GraceTime on preemption)
    preempt_time: float | None  # set once the job was chosen for preemption
    submit_time: float | None = None  # when it was (re)submitted; a requeue resets it


def _slurm_time(value: str | None) -> float | None:
    if not value or value in ("None", "Unknown", "N/A", "(null)"):
        return None
    try:  # scontrol prints the controller's local time without a zone
        return datetime.strptime(value, "%Y-%m-%dT%H:%M:%S").timestamp()
    except ValueError:
        return None


def parse_job(text: str) -> JobInfo | None:
    """Parse ``scontrol --oneliner show job`` output; the first line is the het leader."""
    for line in text.splitlines():
        fields = dict(tok.split("=", 1) for tok in line.split() if "=" in tok)
        if "JobId" not in fields:
            continue
        return JobInfo(
            job_id=fields["JobId"],
            state=fields.get("JobState", "UNKNOWN"),
            restarts=int(fields.get("Restarts", "0") or 0),
            end_time=_slurm_time(fields.get("EndTime")),
            preempt_time=_slurm_time(fields.get("PreemptTime")),
            submit_time=_slurm_time(fields.get("SubmitTime")),
        )
    return None


def job_info(job_id: str, timeout: float = 15) -> JobInfo | None:
    """What Slurm knows about ``job_id``; None once the job is gone (finished and purged, or never
    existed). Raises SlurmUnavailable when Slurm cannot be asked."""
    try:
        proc = subprocess.run(["scontrol", "--oneliner", "show", "job", str(job_id)],
                              capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise SlurmUnavailable(f"scontrol show job {job_id}: {err}") from err
    if proc.returncode != 0:
        if "Invalid job id" in proc.stderr:
            return None
        raise SlurmUnavailable(f"scontrol show job {job_id}: {proc.stderr.strip() or proc.stdout.strip()}")
    return parse_job(proc.stdout)


def slurm_env_free(env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a Slurm client run from inside a job: without the job's SLURM_* and
    SBATCH_* variables (a resubmitted job would otherwise inherit e.g. SLURM_RESTART_COUNT and
    think it is a requeue), keeping SLURM_CONF so that it talks to the same cluster."""
    base = dict(os.environ if env is None else env)
    out = {k: v for k, v in base.items() if not k.startswith(("SLURM_", "SBATCH_", "SALLOC_"))}
    if "SLURM_CONF" in base:
        out["SLURM_CONF"] = base["SLURM_CONF"]
    return out


# -- the watchdog ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Interrupt:
    """Why a segment must stop now. ``kind``: walltime (lead reached: save, then resubmit),
    preempted (grace time: save if it fits, then requeue), requeued (Slurm already requeued the
    job: no time to save), cancelled (scancel / beam-hpc cancel), timelimit (the walltime itself
    passed: no time to save)."""

    kind: str
    source: str  # USR1 | deadline | SIGTERM | SIGINT
    hard_end: float | None  # when Slurm will kill the job, when known
    detail: str


class Watchdog:
    """Turns USR1, SIGTERM and the job's own deadline into one :class:`Interrupt`.

    Handlers record the signal and call ``on_signal`` (Python runs them in the main thread between
    bytecodes, so they may do real work: the segment acts on SIGTERM at once, because only Slurm's
    KillWait is left); :meth:`check`, called from the segment's loop or from ``on_signal``, asks
    Slurm what the signal meant.
    """

    def __init__(
        self,
        job_id: str | None,
        restart: int,
        lead_s: int,
        *,
        query: Callable[[str], JobInfo | None] = job_info,
        clock: Callable[[], float] = time.time,
        refresh_s: float = 60.0,
        cancel_flag: str | None = None,
    ) -> None:
        self.job_id = job_id
        self.restart = restart
        self.lead_s = lead_s
        self._query = query
        self._clock = clock
        self._refresh_s = refresh_s
        self._cancel_flag = cancel_flag
        # appended by signal handlers, drained by check(); deque ops are atomic, and a lock here
        # would deadlock when a handler interrupts check() in the same (main) thread
        self._pending: deque[str] = deque()
        self.on_signal: Callable[[str], None] | None = None
        self._next_refresh = 0.0
        self.end_time: float | None = None
        self._fired: Interrupt | None = None
        self._old: dict[int, Any] = {}

    # signals ---------------------------------------------------------------------------------
    def install(self) -> None:
        for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
            self._old[sig] = signal.signal(sig, self._on_signal)

    def uninstall(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        self._pending.append(name)
        if self.on_signal is not None:  # e.g. the segment's urgent path on SIGTERM
            self.on_signal(name)

    # deadline --------------------------------------------------------------------------------
    @property
    def deadline(self) -> float | None:
        return None if self.end_time is None else self.end_time - self.lead_s

    def refresh(self) -> JobInfo | None:
        """Re-read EndTime (a user may extend the limit with ``scontrol update``)."""
        self._next_refresh = self._clock() + self._refresh_s
        if self.job_id is None:
            return None
        try:
            info = self._query(self.job_id)
        except SlurmUnavailable as err:
            log.warning("cannot read the job's end time (keeping %s): %s", self.end_time, err)
            return None
        if info is not None and info.end_time is not None:
            self.end_time = info.end_time
        return info

    # the one question --------------------------------------------------------------------------
    def check(self) -> Interrupt | None:
        """The interrupt to act on now, or None. Once one fired, later checks return the more
        urgent of it and any newer one (a SIGTERM during a graceful save wins)."""
        pending: list[str] = []
        while self._pending:
            pending.append(self._pending.popleft())
        new: Interrupt | None = None
        if "SIGTERM" in pending or "SIGINT" in pending:
            new = self._classify_term("SIGTERM" if "SIGTERM" in pending else "SIGINT")
        elif "SIGUSR1" in pending:
            new = self._classify_usr1()
        elif self._fired is None:
            now = self._clock()
            if now >= self._next_refresh:
                self.refresh()
            if self.deadline is not None and now >= self.deadline:
                new = Interrupt("walltime", "deadline", self.end_time,
                                f"own deadline: job end time minus lead {self.lead_s} s reached")
        if new is not None and (self._fired is None or _urgency(new) > _urgency(self._fired)):
            self._fired = new
            log.warning("interrupt: %s (%s): %s", new.kind, new.source, new.detail)
            return new
        return None

    def _classify_usr1(self) -> Interrupt:
        info = self.refresh()
        if info is not None and _preempted(info):
            return Interrupt("preempted", "USR1", info.end_time,
                             f"preempted at {_fmt(info.preempt_time)}; grace ends {_fmt(info.end_time)}")
        return Interrupt("walltime", "USR1", self.end_time,
                         f"walltime warning (USR1, lead {self.lead_s} s); job ends {_fmt(self.end_time)}")

    def _classify_term(self, source: str) -> Interrupt:
        if self._cancel_flag and Path(self._cancel_flag).exists():
            return Interrupt("cancelled", source, self._clock(), "cancelled with beam-hpc cancel")
        info = None
        if self.job_id is not None:
            try:
                info = self._query(self.job_id)
            except SlurmUnavailable as err:
                log.warning("cannot ask Slurm why %s came: %s", source, err)
        if info is not None and info.restarts > self.restart:
            why = "preemption" if info.preempt_time is not None else "scontrol requeue or preemption"
            return Interrupt("requeued", source, self._clock(),
                             f"{source}: Slurm requeued job {self.job_id} ({why}); restart {info.restarts} follows")
        if info is not None and _preempted(info):
            # the end of a preemption's grace time: Slurm requeues the job (PreemptMode=REQUEUE), and
            # may count the restart only after this signal; near EndTime, it is not the time limit
            return Interrupt("requeued", source, self._clock(),
                             f"{source}: the grace time of the preemption at {_fmt(info.preempt_time)} is over; "
                             f"Slurm requeues job {self.job_id}")
        end = info.end_time if info is not None and info.end_time is not None else self.end_time
        if end is not None and self._clock() >= end - 5:
            return Interrupt("timelimit", source, self._clock(), f"{source} at the time limit ({_fmt(end)})")
        return Interrupt("cancelled", source, self._clock(), f"{source}: the job was cancelled")


def _preempted(info: JobInfo) -> bool:
    """This incarnation of the job was chosen for preemption (a PreemptTime before its latest
    submission belongs to an earlier incarnation: a requeue resets SubmitTime)."""
    return info.preempt_time is not None and (info.submit_time is None or info.preempt_time >= info.submit_time)


_URGENCY = {"walltime": 1, "preempted": 2, "timelimit": 3, "requeued": 3, "cancelled": 3}


def _urgency(i: Interrupt) -> int:
    return _URGENCY[i.kind]


def _fmt(t: float | None) -> str:
    return "unknown" if t is None else datetime.fromtimestamp(t).strftime("%H:%M:%S")


# -- save now ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SaveResult:
    saved: bool
    iteration: int | None  # latest complete checkpoint after the wait
    seconds: float
    detail: str


def request_save(paths: RunPaths, reason: str) -> None:
    """Create the save sentinel (Miles's --save-trigger-sentinel file), atomically, asking the
    backend to exit after the save (``"then": "stop"``, see above): the segment stops it anyway."""
    body = {"reason": reason, "time": time.time(), **checkpoint_layout.THEN_STOP}
    checkpoint_layout.write_atomic(paths.sentinel, json.dumps(body) + "\n")


def clear_save_request(paths: RunPaths) -> bool:
    """Remove a sentinel nobody consumed (so that a later segment does not save at its first
    boundary for a reason that no longer holds). Returns True if one was there."""
    try:
        os.unlink(paths.sentinel)
        return True
    except FileNotFoundError:
        return False


def save_and_wait(
    paths: RunPaths,
    *,
    deadline: float,
    driver_running: Callable[[], bool],
    reason: str,
    interrupted: Callable[[], bool] = lambda: False,
    clock: Callable[[], float] = time.time,
    poll_s: float = SENTINEL_POLL_S,
) -> SaveResult:
    """Ask the backend to save at its next rollout boundary and wait until that checkpoint is
    complete: the sentinel consumed and the pointer advanced past where it was. Gives up at
    ``deadline``, when the driver exits, or when ``interrupted()`` says something more urgent
    came; then the last complete checkpoint is what a later segment resumes from."""
    t0 = clock()
    ckpt = paths.checkpoints
    before = checkpoint_layout.latest_iteration(ckpt)
    request_save(paths, reason)
    log.info("save requested (%s); last complete checkpoint %s; waiting until %s", reason, before, _fmt(deadline))
    while True:
        now_it = checkpoint_layout.latest_iteration(ckpt)
        advanced = now_it is not None and (before is None or now_it > before)
        if advanced and not Path(paths.sentinel).exists():
            return SaveResult(True, now_it, clock() - t0, f"checkpoint {now_it} saved on request")
        if not driver_running():
            why = "the driver exited before the checkpoint landed"
            break
        if interrupted():
            why = "interrupted by a more urgent signal"
            break
        if clock() >= deadline:
            why = f"no checkpoint within the save deadline ({deadline - t0:.0f} s)"
            break
        time.sleep(poll_s)
    now_it = checkpoint_layout.latest_iteration(ckpt)
    advanced = now_it is not None and (before is None or now_it > before)
    if advanced:  # landed at the last instant (the sentinel may go a moment later)
        return SaveResult(True, now_it, clock() - t0, f"checkpoint {now_it} saved on request")
    return SaveResult(False, now_it, clock() - t0, f"{why}; relying on checkpoint {now_it}")


# -- what the segment did ---------------------------------------------------------------------------
@dataclass(frozen=True)
class SegmentMetrics:
    rollouts_run: int  # rollout steps this segment finished (kept or not)
    rollout_s: float | None  # mean seconds per rollout step
    save_s: float | None  # seconds of the last save


def metrics_offset(paths: RunPaths) -> int:
    """Where this segment's lines of dumps/metrics.jsonl will begin."""
    try:
        return Path(paths.dumps, metric_names.METRICS_FILE).stat().st_size
    except FileNotFoundError:
        return 0


def segment_metrics(paths: RunPaths, offset: int) -> SegmentMetrics:
    """Rollout and save timings from the metrics lines appended since ``offset`` (this segment's
    own, so rollouts re-done after a kill are counted where they were run)."""
    p = Path(paths.dumps, metric_names.METRICS_FILE)
    times: list[float] = []
    save: float | None = None
    try:
        with open(p, "rb") as fh:
            fh.seek(offset)
            data = fh.read().decode(errors="replace")
    except FileNotFoundError:
        data = ""
    for line in data.splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # a torn last line of a killed writer
        if not isinstance(rec, dict):
            continue
        if isinstance(rec.get(metric_names.ROLLOUT_TIME), (int, float)):
            times.append(float(rec[metric_names.ROLLOUT_TIME]))
        if isinstance(rec.get(metric_names.SAVE_TIME), (int, float)):
            save = float(rec[metric_names.SAVE_TIME])
    return SegmentMetrics(len(times), sum(times) / len(times) if times else None, save)


# -- what next --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Outcome:
    """What a segment did, as far as the decision is concerned."""

    reason: str  # a ledger reason
    rollouts_at_start: int
    rollouts_at_end: int
    num_rollout: int
    rollouts_run: int = 0  # rollout steps finished in this segment (0: failed before its first)
    retryable: bool = True  # False for errors that another segment would repeat (bad input)


@dataclass(frozen=True)
class Decision:
    action: str  # resubmit | requeue | none
    detail: str


def _failed_without_progress(seg: dict[str, Any]) -> bool:
    start, end = seg.get("start") or {}, seg.get("end")
    if end is None:  # killed hard: its successor cannot tell, so count it as a failure
        return True
    return end.get("reason") in FAILURES and end.get("rollouts_at_end", 0) <= start.get("rollouts_at_start", 0)


def decide(
    outcome: Outcome,
    *,
    history: list[dict[str, Any]],
    max_segments: int,
    cancelled: bool,
    requeue_on_preemption: bool,
) -> Decision:
    """The rule book (issue 4, guards), in order:

    1. ``num_rollout`` reached -> none; cancelled -> none; not retryable -> none.
    2. ``max_segments`` segments run (this one included) -> none.
    3. preempted -> requeue (same job id), unless the recipe turned requeueing off.
    4. failed (error, node-failure) without progress: retried once; two such segments in a row
       (e.g. twice before the first rollout) -> none, because a third would fail the same way.
    5. otherwise no progress (the checkpoint did not advance over a whole segment) -> none: the
       walltime is too short for one rollout and its save, so resubmitting would loop forever.
    6. walltime, or a failure after progress -> resubmit with --resume.

    ``history`` is the ledger's segments before this one (:func:`beam_hpc.run.ledger.read_ledger`).
    """
    o = outcome
    if o.rollouts_at_end >= o.num_rollout:
        return Decision("none", f"num_rollout {o.num_rollout} reached")
    if cancelled or o.reason == "cancelled":
        return Decision("none", "the run was cancelled; no further segment")
    if not o.retryable:
        return Decision("none", "this error would repeat in another segment; fix it and resubmit with --resume")
    run = len(history) + 1
    if run >= max_segments:
        return Decision("none", f"lifecycle.max_segments ({max_segments}) segments have run; raise it and resubmit with --resume")
    progress = o.rollouts_at_end > o.rollouts_at_start
    if o.reason == "preempted":
        if not requeue_on_preemption:
            return Decision("none", "preempted, and lifecycle.requeue_on_preemption is false")
        return Decision("requeue", "preempted: the same job id is requeued and resumes from the last checkpoint")
    if o.reason in FAILURES and not progress:
        before = "before its first rollout" if o.rollouts_run == 0 else "without a new checkpoint"
        if history and _failed_without_progress(history[-1]):
            return Decision("none", f"{o.reason} {before}, and the segment before failed without progress too; "
                                    "stopping instead of failing again (see the segment logs)")
        return Decision("resubmit", f"{o.reason} {before}; retrying once")
    if not progress:
        return Decision("none", f"no progress in this segment ({o.reason} with the checkpoint still at "
                                f"{o.rollouts_at_end} rollouts); raise lifecycle.walltime or lower the lead")
    return Decision("resubmit", f"{o.reason} after {o.rollouts_at_end - o.rollouts_at_start} new rollouts; "
                                "continuing with --resume")


# -- acting on it -----------------------------------------------------------------------------------
def resubmit_command(script: str, *, lead_s: int, resume: bool, dependency: str) -> list[str]:
    """sbatch line for the next segment: the same script, after this job (``afterany:<this job>``),
    with the walltime warning at the current lead (options on the command line override the
    script's #SBATCH lines). Not ``singleton``: on a heterogeneous job (Slurm 22.05) each
    component waits for the other, which has the same name, and the job pends forever."""
    cmd = ["sbatch", "--parsable", f"--dependency={dependency}", f"--signal=B:USR1@{int(lead_s)}", script]
    if resume:
        cmd.append("--resume")
    return cmd


def resubmit(script: str, *, lead_s: int, resume: bool, dependency: str) -> str:
    """Submit the next segment; returns its job id. Raises RuntimeError with sbatch's words."""
    cmd = resubmit_command(script, lead_s=lead_s, resume=resume, dependency=dependency)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=slurm_env_free(), timeout=60, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"resubmission refused: {' '.join(cmd)}: {proc.stderr.strip() or proc.stdout.strip()}")
    job_id = proc.stdout.strip().split(";")[0]
    if not job_id.isdigit():
        raise RuntimeError(f"resubmission: no job id in sbatch's output {proc.stdout!r}")
    return job_id


def requeue_self(job_id: str) -> None:
    """Requeue this job (same id, restart count + 1). Needed after a graceful save during a
    preemption grace time: a job that ends by itself then is COMPLETED and never requeued."""
    proc = subprocess.run(["scontrol", "requeue", str(job_id)], capture_output=True, text=True,
                          env=slurm_env_free(), timeout=60, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"scontrol requeue {job_id} failed: {proc.stderr.strip() or proc.stdout.strip()}")


# -- stopping the chain from outside ------------------------------------------------------------------
@dataclass(frozen=True)
class CancelResult:
    flag: str
    job_ids: tuple[str, ...]  # jobs of the run that scancel was sent to
    job_name: str | None  # scancel --name was sent for it too (catches a successor not yet recorded)
    errors: tuple[str, ...]


def run_job_ids(paths: RunPaths) -> list[str]:
    """Jobs that may still work on the run: the lock holder, the last segment without an end line,
    and the successor named by the last end line."""
    from beam_hpc.run.ledger import read_ledger
    from beam_hpc.run.lock import read_holder

    ids: list[str] = []
    holder = read_holder(paths.lock)
    if holder is not None and holder.job_id:
        ids.append(holder.job_id)
    segments, _ = read_ledger(paths.ledger)
    if segments:
        last = segments[-1]
        if "end" not in last and "start" in last:
            ids.append(str(last["start"]["job_id"]))
        nxt = (last.get("end") or {}).get("next") or {}
        if nxt.get("job_id"):
            ids.append(str(nxt["job_id"]))
    return [i for n, i in enumerate(ids) if i.isdigit() and i not in ids[:n]]


def cancel_run(run_dir: str) -> CancelResult:
    """Stop a run's chain: write the cancel flag (no segment resubmits, requeues or starts after
    it), then scancel its jobs. The flag goes first so that a segment woken by the scancel already
    sees it. Raises FileNotFoundError when ``run_dir`` is not a run directory."""
    paths = RunPaths(os.path.abspath(run_dir))
    plan_file = Path(paths.plan)
    if not plan_file.is_file() and not Path(paths.ledger).is_file():
        raise FileNotFoundError(f"{run_dir}: no plan.json and no ledger.jsonl; give the run's --output-dir")
    checkpoint_layout.write_atomic(paths.cancel_flag, json.dumps({"time": time.time(), "by": os.environ.get("USER", "")}) + "\n")
    job_name = None
    try:
        job_name = json.loads(plan_file.read_text()).get("job_name")
    except (OSError, ValueError):
        pass
    ids = run_job_ids(paths)
    errors: list[str] = []
    commands = ([["scancel", *ids]] if ids else []) + ([["scancel", f"--name={job_name}"]] if job_name else [])
    for cmd in commands:
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=slurm_env_free(), timeout=60, check=False)
        except (OSError, subprocess.TimeoutExpired) as err:
            errors.append(f"{' '.join(cmd)}: {err}")
            continue
        if proc.returncode != 0 and "Invalid job id" not in proc.stderr:
            errors.append(f"{' '.join(cmd)}: {proc.stderr.strip()}")
    return CancelResult(paths.cancel_flag, tuple(ids), job_name, tuple(errors))


def cancel_requested(paths: RunPaths) -> bool:
    return Path(paths.cancel_flag).exists()


def withdraw(job_id: str) -> None:
    """scancel a job this segment just submitted (the run was cancelled in the meantime)."""
    subprocess.run(["scancel", str(job_id)], capture_output=True, text=True, env=slurm_env_free(), timeout=60, check=False)
