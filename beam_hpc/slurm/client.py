"""The one Slurm client: every ``sbatch``, ``scontrol``, ``squeue``, ``scancel``, ``sinfo`` and
``sacctmgr`` call beam-hpc makes, the doctor's one-task-per-node ``srun``, and every parse of their
output.

Why one module: each output (``sbatch --parsable``'s ``<id>[;cluster]``, ``scontrol --oneliner show
job``'s ``Key=Value`` lines, ``squeue``'s het components ``<leader>+<offset>``) is parsed once, job
states are an enum (:class:`JobState`), and a failure carries Slurm's own words: :class:`SlurmError`
a refusal on the merits, :class:`SlurmUnavailable` when Slurm could not be asked (``transient``
when it was unreachable or busy: :func:`unreachable`; retrying may help). Outside it: the job's own
``srun`` steps (:mod:`beam_hpc.job.launchers`; under pyxis the batch host's container steps are
:mod:`beam_hpc.node.container`'s) and submitit's own squeue poll (:mod:`beam_hpc.slurm.submitit_het`).

A client run from inside a job inherits the job's SLURM_* variables, which e.g. make a resubmitted
job believe it is a requeue; callers in a job pass ``env=slurm_env_free()``.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from pathlib import Path

from beam_hpc.errors import RuntimeFailure

# What scontrol/scancel say about a job id the controller no longer (or never) knew.
_GONE = "Invalid job id"


class SlurmError(RuntimeFailure):
    """A Slurm command refused or failed; ``detail`` is Slurm's own words (stderr, else stdout)."""

    def __init__(self, argv: Sequence[str], detail: str, returncode: int | None = None) -> None:
        self.argv = list(argv)
        self.detail = detail
        self.returncode = returncode
        super().__init__(f"{' '.join(self.argv)}: {detail}")

    @property
    def last_line(self) -> str:
        """The line of Slurm's message that says what went wrong (the last one)."""
        lines = self.detail.strip().splitlines()
        return lines[-1] if lines else f"exit status {self.returncode}"


class SlurmUnavailable(SlurmError):
    """Slurm did not answer (no such command, a timeout, or the controller is down): nothing can be
    concluded about the job. ``timed_out``: our own time limit ran out. ``transient``: the
    controller could not be reached or was busy (a timeout, or :func:`unreachable` words), so the
    same request may succeed later; False for a missing command or a missing slurmdbd.
    ``may_have_landed``: the request may have reached the controller all the same (a timeout on
    either side, or the command killed by a signal): Slurm 22.05 acts on a request whose answer
    timed out (seen on the local cluster: a ``sbatch`` that said ``Socket timed out`` created the
    job once the controller went on), so look before sending it again."""

    def __init__(self, argv: Sequence[str], detail: str, returncode: int | None = None,
                 *, timed_out: bool = False, transient: bool | None = None,
                 may_have_landed: bool | None = None) -> None:
        super().__init__(argv, detail, returncode)
        self.timed_out = timed_out
        self.transient = (timed_out or unreachable(detail)) if transient is None else transient
        if may_have_landed is None:  # only a refused connection or a "not now" is certain
            may_have_landed = self.transient and not any(words in detail for words in _NOT_TAKEN)
        self.may_have_landed = may_have_landed


# What Slurm 22.05's commands say when the controller cannot be reached or is too busy to answer:
# the strings of slurm_errno.c, as sbatch, squeue, scontrol and scancel printed them on the local
# cluster with slurmctld stopped ("Unable to contact slurm controller (connect failure)", after
# about 9 s; 18 s for `scontrol show job` and `scancel --signal` of a step, which try twice) or
# stopped with SIGSTOP ("Socket timed out on send/recv operation", after MessageTimeout).
_UNREACHABLE = (
    "Unable to contact slurm controller",  # connect, send, receive or shutdown failure
    "Socket timed out on send/recv operation",
    "Zero Bytes were transmitted or received",
    "Communication connection failure",
    "Message send failure",
    "Message receive failure",
    "Connection refused",
    "Connection reset by peer",
    "Slurm backup controller in standby mode",
    # EAGAIN: sbatch retries it by itself ("Slurm temporarily unable to accept job, sleeping and
    # retrying") and says this when its retries run out; also a busy slurmdbd behind the controller
    "Resource temporarily unavailable",
    "Slurm temporarily unable to accept job",
    "Unable to create job record, try again",  # the job table is full for now
    # `scontrol requeue` with no answer: slurm_requeue2 (src/api/requeue.c) ignores the send's
    # failure and reports the empty reply's type instead (seen with slurmctld stopped and SIGSTOPped)
    "Unexpected message received",
)
# Of those, the words that say the request was certainly not taken (nothing reached the controller,
# or it said "not now"); after any other, the request may have been carried out.
_NOT_TAKEN = (
    "(connect failure)", "Connection refused", "standby mode", "Resource temporarily unavailable",
    "temporarily unable to accept job", "Unable to create job record",
)


def unreachable(text: str) -> bool:
    """Whether Slurm's words say the controller could not be reached or was busy (retrying may
    help), as opposed to a refusal on the merits (a bad partition, an account limit)."""
    return any(words in text for words in _UNREACHABLE)


class JobState(StrEnum):
    """A job's state as ``scontrol``/``squeue`` spell it (long form). A str, so comparisons with
    and JSON of the plain strings stay as they were. A state not listed here comes back as a
    member named UNKNOWN whose value is Slurm's raw text (``JobState("NEW_STATE").value`` ==
    ``"NEW_STATE"``); :attr:`known` tells it apart."""

    PENDING = "PENDING"
    CONFIGURING = "CONFIGURING"
    RUNNING = "RUNNING"
    COMPLETING = "COMPLETING"
    SUSPENDED = "SUSPENDED"
    STOPPED = "STOPPED"
    SIGNALING = "SIGNALING"
    STAGE_OUT = "STAGE_OUT"
    RESIZING = "RESIZING"
    REQUEUED = "REQUEUED"
    REQUEUE_HOLD = "REQUEUE_HOLD"
    REQUEUE_FED = "REQUEUE_FED"
    RESV_DEL_HOLD = "RESV_DEL_HOLD"
    REVOKED = "REVOKED"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    TIMEOUT = "TIMEOUT"
    PREEMPTED = "PREEMPTED"
    NODE_FAIL = "NODE_FAIL"
    BOOT_FAIL = "BOOT_FAIL"
    DEADLINE = "DEADLINE"
    OUT_OF_MEMORY = "OUT_OF_MEMORY"
    SPECIAL_EXIT = "SPECIAL_EXIT"
    UNKNOWN = "UNKNOWN"

    @classmethod
    def _missing_(cls, value: object) -> JobState | None:
        if not isinstance(value, str):
            return None
        text = value.strip()
        if text in cls._value2member_map_:  # " RUNNING" or similar
            return cls._value2member_map_[text]  # type: ignore[return-value]
        member = str.__new__(cls, text)
        member._name_ = "UNKNOWN"
        member._value_ = text
        return member

    @property
    def known(self) -> bool:
        return self.name != "UNKNOWN"

    @property
    def terminal(self) -> bool:
        """The job will not run again (unless requeued by hand)."""
        return self in _TERMINAL


_TERMINAL = frozenset({
    JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED, JobState.TIMEOUT, JobState.PREEMPTED,
    JobState.NODE_FAIL, JobState.BOOT_FAIL, JobState.DEADLINE, JobState.OUT_OF_MEMORY,
    JobState.SPECIAL_EXIT,
})


# -- running a command ----------------------------------------------------------------------------
def slurm_env_free(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for a Slurm client run from inside a job: without the job's SLURM_* and
    SBATCH_* variables (a resubmitted job would otherwise inherit e.g. SLURM_RESTART_COUNT and
    think it is a requeue), keeping SLURM_CONF so that it talks to the same cluster."""
    base = dict(os.environ if env is None else env)
    out = {k: v for k, v in base.items() if not k.startswith(("SLURM_", "SBATCH_", "SALLOC_"))}
    if "SLURM_CONF" in base:
        out["SLURM_CONF"] = base["SLURM_CONF"]
    return out


def _words(proc: subprocess.CompletedProcess) -> str:
    return (proc.stderr or "").strip() or (proc.stdout or "").strip()


def _call(argv: Sequence[str], *, env: Mapping[str, str] | None = None,
          timeout: float | None = 60) -> subprocess.CompletedProcess:
    """Run one Slurm command; SlurmUnavailable when it cannot run or does not answer in time.
    A non-zero exit is left to the caller, which knows what it means for its command."""
    shown = list(argv[len(_IMMUNE_TO_SIGTERM):]) if list(argv[:len(_IMMUNE_TO_SIGTERM)]) == _IMMUNE_TO_SIGTERM else argv
    try:
        return subprocess.run(list(argv), capture_output=True, text=True, check=False,
                              env=None if env is None else dict(env), timeout=timeout)
    except subprocess.TimeoutExpired as err:
        raise SlurmUnavailable(shown, f"{shown[0]} did not answer within {timeout:.0f} s", timed_out=True) from err
    except FileNotFoundError as err:
        raise SlurmUnavailable(shown, f"{shown[0]}: not found") from err
    except OSError as err:
        raise SlurmUnavailable(shown, f"{shown[0]}: {err}") from err


def failure(argv: Sequence[str], proc: subprocess.CompletedProcess) -> SlurmError:
    """The error for a Slurm command that exited non-zero: SlurmUnavailable (transient) when its
    words say the controller was unreachable or busy, or a signal ended it; else SlurmError, a
    refusal in Slurm's own words."""
    words = _words(proc)
    if proc.returncode < 0:
        return SlurmUnavailable(argv, words or f"{argv[0]} was killed by signal {-proc.returncode}",
                                proc.returncode, transient=True)
    if unreachable(words):
        return SlurmUnavailable(argv, words, proc.returncode)
    return SlurmError(argv, words, proc.returncode)


def _checked(argv: Sequence[str], **kw: object) -> subprocess.CompletedProcess:
    proc = _call(argv, **kw)  # type: ignore[arg-type]
    if proc.returncode != 0:
        raise failure(argv, proc)
    return proc


# -- sbatch -----------------------------------------------------------------------------------------
def sbatch_argv(args: Sequence[str]) -> list[str]:
    """The command line ``sbatch --parsable <args>`` (``--parsable``: the one output we parse)."""
    return ["sbatch", "--parsable", *[a for a in args if a != "--parsable"]]


def parse_sbatch_id(stdout: str) -> str | None:
    """The job id in ``sbatch --parsable`` output (``<id>`` or ``<id>;<cluster>``); None if absent."""
    first = stdout.strip().split(";", 1)[0].strip() if stdout.strip() else ""
    return first if first.isdigit() else None


class NoJobId(SlurmError):
    """sbatch exited 0 but printed no job id; ``stdout`` is what it printed instead."""

    def __init__(self, argv: Sequence[str], stdout: str) -> None:
        self.stdout = stdout
        super().__init__(argv, f"no job id in sbatch's output {stdout!r}", 0)


def sbatch(args: Sequence[str], *, env: Mapping[str, str] | None = None, timeout: float | None = 60,
           survive_term: bool = False) -> str:
    """Submit ``sbatch --parsable <args>``; returns the job id. Raises SlurmError with sbatch's
    words when it refuses, SlurmUnavailable when the controller cannot be reached or is busy,
    NoJobId when its output holds no id. ``survive_term``: sbatch ignores SIGTERM (see
    ``_IMMUNE_TO_SIGTERM``), for a job that submits while Slurm may be ending it."""
    argv = sbatch_argv(args)
    proc = _call([*_IMMUNE_TO_SIGTERM, *argv] if survive_term else argv, env=env, timeout=timeout)
    if proc.returncode != 0:
        raise failure(argv, proc)
    job_id = parse_sbatch_id(proc.stdout)
    if job_id is None:
        raise NoJobId(argv, proc.stdout)
    return job_id


# -- scontrol show job ------------------------------------------------------------------------------
@dataclass(frozen=True)
class JobInfo:
    """The fields of ``scontrol show job`` that beam-hpc needs (het leader's line)."""

    job_id: str
    state: JobState
    restarts: int  # Slurm's restart count: bumped as soon as a requeue is ordered
    end_time: float | None  # when Slurm will stop the job (moves to now + GraceTime on preemption)
    preempt_time: float | None  # set once the job was chosen for preemption
    submit_time: float | None = None  # when it was (re)submitted; a requeue resets it
    # StartTime + TimeLimit: when the time limit falls. Not EndTime: scancel moves EndTime to the
    # moment of the cancel, so only this tells a cancel's SIGTERM from the time limit's
    limit_end: float | None = None
    time_limit_s: int | None = None  # TimeLimit in seconds (None: UNLIMITED, or Slurm said something else)
    # Slurm's Reason field. At the SIGTERM of a job Slurm ends for a failed node and does not requeue
    # (--no-requeue), the leader reads JobState=COMPLETING Reason=NodeDown (NODE_FAIL only once it
    # has ended); a scancel reads Reason=None (measured on Slurm 22.05, hetjob leader included)
    reason: str | None = None


def slurm_time(value: str | None) -> float | None:
    """A Slurm timestamp (controller's local time, no zone) as epoch seconds; None for unset."""
    if not value or value in ("None", "Unknown", "N/A", "(null)"):
        return None
    try:
        return datetime.strptime(value, "%Y-%m-%dT%H:%M:%S").timestamp()
    except ValueError:
        return None


def parse_key_values(line: str) -> dict[str, str]:
    """``Key=Value Key2=Value2`` (one ``--oneliner`` record) as a dict; tokens without ``=`` skipped."""
    return dict(tok.split("=", 1) for tok in line.split() if "=" in tok)


def parse_show_job_records(text: str) -> list[dict[str, str]]:
    """``scontrol --oneliner show job`` output as one dict per component (het leader first)."""
    return [f for f in (parse_key_values(line) for line in text.splitlines()) if "JobId" in f or "JobState" in f]


def parse_show_job(text: str) -> JobInfo | None:
    """The het leader's :class:`JobInfo` from ``scontrol --oneliner show job`` output."""
    for fields in parse_show_job_records(text):
        if "JobId" not in fields:
            continue
        return JobInfo(
            job_id=fields["JobId"],
            state=JobState(fields.get("JobState", "UNKNOWN")),
            restarts=int(fields.get("Restarts", "0") or 0),
            end_time=slurm_time(fields.get("EndTime")),
            preempt_time=slurm_time(fields.get("PreemptTime")),
            submit_time=slurm_time(fields.get("SubmitTime")),
            limit_end=_limit_end(fields),
            time_limit_s=_time_limit_s(fields),
            reason=fields.get("Reason"),
        )
    return None


def _time_limit_s(fields: dict[str, str]) -> int | None:
    """TimeLimit in seconds (None for UNLIMITED, or when Slurm says something else)."""
    from beam_hpc.config.recipe import parse_walltime

    limit = fields.get("TimeLimit", "")
    if not limit[:1].isdigit():
        return None
    try:
        return parse_walltime(limit)
    except ValueError:
        return None


def _limit_end(fields: dict[str, str]) -> float | None:
    """StartTime + TimeLimit (None while pending, for UNLIMITED, or when Slurm says something else)."""
    start, limit = slurm_time(fields.get("StartTime")), _time_limit_s(fields)
    return None if start is None or limit is None else start + limit


def _show_job_text(job_id: str, timeout: float | None) -> str | None:
    argv = ["scontrol", "--oneliner", "show", "job", str(job_id)]
    proc = _call(argv, timeout=timeout)
    if proc.returncode != 0:
        if _GONE in (proc.stderr or "") + (proc.stdout or ""):
            return None
        raise SlurmUnavailable(argv, _words(proc), proc.returncode, transient=unreachable(_words(proc)))
    return proc.stdout


def show_job_records(job_id: str, *, timeout: float | None = 15) -> list[dict[str, str]] | None:
    """Every component's ``scontrol show job`` fields; None once Slurm no longer knows the job.
    Raises SlurmUnavailable when Slurm cannot be asked."""
    text = _show_job_text(job_id, timeout)
    return None if text is None else parse_show_job_records(text)


def show_job(job_id: str, timeout: float | None = 15) -> JobInfo | None:
    """What Slurm knows about ``job_id``; None once the job is gone (finished and purged, or never
    existed). Raises SlurmUnavailable when Slurm cannot be asked."""
    text = _show_job_text(job_id, timeout)
    return None if text is None else parse_show_job(text)


def job_state(job_id: str, timeout: float | None = 15) -> JobState | None:
    """The job's (het leader's) state; None once Slurm no longer knows the job."""
    info = show_job(job_id, timeout=timeout)
    return None if info is None else info.state


# -- squeue ---------------------------------------------------------------------------------------
def parse_squeue_ids(text: str) -> list[str]:
    """Job ids from ``squeue -h -o %i`` lines; het components ``7+1`` count as their leader ``7``
    (each job once, in squeue's order)."""
    ids: list[str] = []
    for line in text.splitlines():
        job = line.strip().split("+", 1)[0].strip()
        if job and job not in ids:
            ids.append(job)
    return ids


def queued_job_ids(name: str, *, timeout: float | None = 60) -> list[str]:
    """Ids of the jobs named ``name`` that Slurm still has (pending or running)."""
    proc = _checked(["squeue", "-h", "-n", name, "-o", "%i"], timeout=timeout)
    return parse_squeue_ids(proc.stdout)


def parse_dependents(text: str, job_id: str) -> list[str]:
    """From ``squeue -h -o %i|%E`` lines, the jobs whose dependency names job ``job_id`` (e.g.
    ``afterany:41(unfulfilled)``); het components count as their leader."""
    out: list[str] = []
    for line in text.splitlines():
        job, _, dependency = line.strip().partition("|")
        names = {part.split("(", 1)[0].split(":", 1)[-1] for part in dependency.replace("?", ",").split(",")}
        leader = job.split("+", 1)[0].strip()
        if str(job_id) in names and leader and leader not in out:
            out.append(leader)
    return out


def dependents(job_id: str, *, env: Mapping[str, str] | None = None, timeout: float | None = 60) -> list[str]:
    """This user's queued jobs that depend on job ``job_id`` (how a resubmission whose answer was
    lost is found again: it depends ``afterany`` on the job that submitted it)."""
    proc = _checked(["squeue", "-h", "--me", "-o", "%i|%E"], env=env, timeout=timeout)
    return parse_dependents(proc.stdout, job_id)


# -- scancel / scontrol requeue ---------------------------------------------------------------------
def cancel(job_ids: Sequence[str] = (), *, name: str | None = None, signal: str | None = None,
           env: Mapping[str, str] | None = None, timeout: float | None = 60) -> None:
    """``scancel`` the given jobs (or steps, ``<job>.<step>``), or every job named ``name``; with
    ``signal`` (e.g. ``TERM``) only that signal is sent. A job Slurm no longer knows is no error.
    Raises SlurmError with scancel's words otherwise."""
    if not job_ids and not name:
        return
    argv = ["scancel"]
    if signal:
        argv.append(f"--signal={signal}")
    argv += [f"--name={name}"] if name else [str(j) for j in job_ids]
    proc = _call(argv, env=env, timeout=timeout)
    if proc.returncode != 0 and _GONE not in proc.stderr:
        raise failure(argv, proc)


# A job that requeues itself is answered by Slurm with SIGTERM to every process of the job, the
# scontrol that asked included ("CANCELLED ... DUE TO JOB REQUEUE", then SIGTERM: submitit issue
# 1708 shows that order). When that SIGTERM beats scontrol's exit (a loaded controller or node),
# scontrol dies of it and a requeue that happened reads as a failure: submitit 1.5's own
# ``_requeue`` then records the job as failed. The shell sets SIGTERM to ignored, which exec keeps,
# so scontrol lives to report Slurm's answer; SIGKILL after KillWait still ends it.
_IMMUNE_TO_SIGTERM = ["sh", "-c", 'trap "" TERM; exec "$@"', "slurm-client"]


def requeue(job_id: str, *, env: Mapping[str, str] | None = None, timeout: float | None = 60) -> None:
    """``scontrol requeue <job>`` (same id, restart count + 1); SlurmError with Slurm's words.
    Safe to call from inside the job being requeued (see ``_IMMUNE_TO_SIGTERM``)."""
    argv = ["scontrol", "requeue", str(job_id)]
    proc = _call([*_IMMUNE_TO_SIGTERM, *argv], env=env, timeout=timeout)
    if proc.returncode != 0:
        raise failure(argv, proc)


# -- scontrol show hostnames ------------------------------------------------------------------------
def expand_hostnames(nodelist: str, *, timeout: float | None = 60) -> list[str]:
    """``n[1-2],n4`` -> [n1, n2, n4], through Slurm's own parser."""
    if not nodelist:
        return []
    proc = _checked(["scontrol", "show", "hostnames", nodelist], timeout=timeout)
    return proc.stdout.split()


# -- controller and partitions (doctor) -------------------------------------------------------------
def ping(*, timeout: float = 20) -> str:
    """``scontrol ping``'s first line when the controller is UP; SlurmUnavailable (transient, its
    detail the lines that name each controller, e.g. ``Slurmctld(primary) at vm is DOWN``)
    otherwise. With slurmctld stopped it answers at once; a controller that is alive but does not
    answer (SIGSTOP, overload) takes MessageTimeout, so callers pass a short ``timeout``."""
    argv = ["scontrol", "ping"]
    proc = _call(argv, timeout=timeout)
    if "UP" not in proc.stdout:
        named = [line.strip() for line in proc.stdout.splitlines() if line.startswith("Slurmctld")]
        raise SlurmUnavailable(argv, "; ".join(named) or _words(proc), proc.returncode, transient=True,
                               may_have_landed=False)
    return proc.stdout.strip().splitlines()[0]


def srun_help(*, timeout: float = 20) -> str:
    """``srun --help``: the options srun takes here, SPANK plugins' (pyxis's) included."""
    return _checked(["srun", "--help"], timeout=timeout).stdout


DEFAULT_KILL_WAIT_S = 30  # Slurm's default KillWait


def parse_config_seconds(text: str, key: str) -> int | None:
    """A ``Key = N sec`` line of ``scontrol show config`` as seconds (None when absent)."""
    for line in text.splitlines():
        name, _, value = line.partition("=")
        if name.strip() == key:
            number = value.strip().split(" ", 1)[0]
            return int(number) if number.isdigit() else None
    return None


def kill_wait_s(*, timeout: float = 15) -> int:
    """Slurm's KillWait: the seconds between the SIGTERM that ends a job and its SIGKILL
    (``scontrol show config``, which needs the controller); Slurm's default, 30, when it cannot
    say. A segment reads it at its start, while the controller answers."""
    try:
        proc = _call(["scontrol", "show", "config"], timeout=timeout)
    except SlurmUnavailable:
        return DEFAULT_KILL_WAIT_S
    found = parse_config_seconds(proc.stdout, "KillWait") if proc.returncode == 0 else None
    return DEFAULT_KILL_WAIT_S if found is None else found


def controller_names(env: Mapping[str, str] | None = None) -> list[str]:
    """The controllers slurm.conf names (``SlurmctldHost``, or the old ``ControlMachine``), read
    from the file itself (SLURM_CONF, else /etc/slurm/slurm.conf): what a message names when
    ``scontrol ping`` cannot say. Empty when the file cannot be read (a configless site)."""
    path = (os.environ if env is None else env).get("SLURM_CONF") or "/etc/slurm/slurm.conf"
    try:
        lines = Path(path).read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return []
    names = []
    for line in lines:
        key, _, value = line.split("#", 1)[0].strip().partition("=")
        if key.strip().lower() in ("slurmctldhost", "controlmachine") and value.strip():
            names.append(value.strip())
    return names


def describe_controller(err: SlurmError | None = None, *, timeout: float = 5) -> str:
    """One phrase naming the controller that did not answer, for a person: ``scontrol ping``'s
    lines (``Slurmctld(primary) at vm is DOWN``; ``err`` may be that ping's error, else it is
    asked here), else the slurm.conf names with what went wrong."""
    last = err.last_line if err is not None else "no answer"
    if err is not None and err.argv[:2] == ["scontrol", "ping"]:
        if err.detail.startswith("Slurmctld"):
            return err.detail
    else:
        try:
            up = ping(timeout=timeout)
        except SlurmUnavailable as down:
            if down.detail.startswith("Slurmctld"):
                return down.detail
            last = down.last_line
        else:  # back already: say what failed, and that it answers now
            return f"{last} (now {up})"
    names = controller_names()
    return f"slurmctld at {', '.join(names)}: {last}" if names else f"the Slurm controller: {last}"


def _output(argv: Sequence[str], timeout: float) -> str:
    """stdout of a query whose failure just means "nothing to report" ("" then)."""
    try:
        return _call(argv, timeout=timeout).stdout
    except SlurmUnavailable:
        return ""


def partition_names(*, timeout: float = 20) -> list[str]:
    """Every partition's name (``sinfo -o %R``); empty when sinfo cannot say."""
    return _output(["sinfo", "--noheader", "--format=%R"], timeout).split()


def show_partition(name: str, *, timeout: float = 20) -> dict[str, str] | None:
    """``scontrol show partition <name>`` as fields (``State``, ``Nodes``, ...); None when Slurm
    does not know the partition (or cannot say)."""
    try:
        proc = _call(["scontrol", "--oneliner", "show", "partition", name], timeout=timeout)
    except SlurmUnavailable:
        return None
    if proc.returncode != 0 or f"PartitionName={name}" not in proc.stdout:
        return None
    return parse_key_values(proc.stdout)


def partition_gres(partition: str, *, timeout: float = 20) -> str:
    """The partition's GRES lines (``sinfo -o %G``), e.g. ``gpu:h200:8(S:0-1)``; "" when unknown."""
    return _output(["sinfo", "--noheader", f"--partition={partition}", "--format=%G"], timeout)


def gres_counts(sinfo_gres: str, name: str) -> list[int]:
    """Counts of GRES ``name`` per node set, from `sinfo -o %G` lines such as ``gpu:2``,
    ``gpu:h200:8(S:0-1)`` or ``gpu:a100:4,shard:8``."""
    counts = []
    for line in sinfo_gres.split():
        for item in line.split(","):
            parts = item.split("(")[0].split(":")
            if parts[0] == name and len(parts) >= 2 and parts[-1].isdigit():
                counts.append(int(parts[-1]))
    return counts


def partition_features(partition: str, *, timeout: float = 20) -> set[str]:
    """Node features available in the partition (``sinfo -o %f``)."""
    features: set[str] = set()
    for line in _output(["sinfo", "--noheader", f"--partition={partition}", "--format=%f"], timeout).split():
        features.update(f for f in line.split(",") if f and f != "(null)")
    return features


# -- failed-node exclusion (beam_hpc.lifecycle.exclusions) ------------------------------------------
def partition_nodes(name: str | None, *, timeout: float = 20) -> list[str] | None:
    """The node names of partition ``name`` (None: the default partition), from ``scontrol show
    partition``; None when Slurm does not know it or cannot say (the caller then lets Slurm decide)."""
    try:
        proc = _call(["scontrol", "--oneliner", "show", "partition"] + ([name] if name else []), timeout=timeout)
    except SlurmUnavailable:
        return None
    if proc.returncode != 0:
        return None
    for line in proc.stdout.splitlines():
        fields = parse_key_values(line)
        if (fields.get("PartitionName") == name) if name else fields.get("Default") == "YES":
            nodes = fields.get("Nodes", "")
            if not nodes or nodes == "(null)":
                return []
            try:
                return expand_hostnames(nodes, timeout=timeout)
            except SlurmError:
                return None
    return None


@dataclass(frozen=True)
class NodeInfo:
    """One node as ``scontrol show node`` describes it now: what tells a node Slurm took from a job
    (:func:`beam_hpc.lifecycle.exclusions.failed_by_slurm`)."""

    name: str
    state: str  # Slurm's State, flags joined by "+": ``DOWN+NOT_RESPONDING``, ``IDLE+FAIL``, ``MIXED+DRAIN``
    reason: str = ""  # Reason, with who set it and when in brackets; "" when the node has none


# Reason is free text with spaces (``Reason=Not responding [slurm@2026-12-07T11:51:53]``), the
# last field of Slurm 22.05's line; up to the next ``Key=`` in case a later version adds fields.
_NODE_REASON = re.compile(r"(?:^|\s)Reason=(.*?)(?=\s+[A-Z][A-Za-z_]*=|\s*$)")


def parse_show_nodes(text: str) -> list[NodeInfo]:
    """``scontrol --oneliner show node`` output as one :class:`NodeInfo` per node."""
    out = []
    for line in text.splitlines():
        fields = parse_key_values(line)
        name = fields.get("NodeName")
        if not name:
            continue
        found = _NODE_REASON.search(line)
        out.append(NodeInfo(name, fields.get("State", ""), found.group(1).strip() if found else ""))
    return out


def show_nodes(nodes: Sequence[str], *, env: Mapping[str, str] | None = None,
               timeout: float | None = 15) -> list[NodeInfo]:
    """What Slurm says of ``nodes`` now (names or host lists such as ``n[1-2]``, the allocation's
    ``SLURM_JOB_NODELIST``s as they are), in one ``scontrol --oneliner show node``. Raises
    SlurmUnavailable when Slurm cannot be asked, SlurmError when it refuses (a node it does not know)."""
    wanted = [n for n in nodes if n]
    if not wanted:
        return []
    argv = ["scontrol", "--oneliner", "show", "node", ",".join(wanted)]
    return parse_show_nodes(_checked(argv, env=env, timeout=timeout).stdout)


def set_excluded_nodes(job_id: str, nodes: Sequence[str], *, env: Mapping[str, str] | None = None,
                       timeout: float | None = 60) -> None:
    """``scontrol update JobId=<job> ExcNodeList=<nodes>`` on a pending (e.g. just requeued) job;
    on a het leader it applies to every component. SlurmError with Slurm's words."""
    _checked(["scontrol", "update", f"JobId={job_id}", f"ExcNodeList={','.join(nodes)}"], env=env, timeout=timeout)


# -- node-local disk (beam_hpc.submission.tmp_disk, doctor) -----------------------------------------
@dataclass(frozen=True)
class PartitionTmpDisk:
    """What the nodes of one partition declare as node-local disk (slurm.conf ``TmpDisk``, MB).
    Slurm places a ``--tmp`` request only on nodes that declare at least that much; a node whose
    TmpDisk is unset declares 0, so an unset TmpDisk everywhere makes every ``--tmp`` unplaceable."""

    partition: str  # the partition's name (the default partition's, when none was named)
    tmp_disk_mb: dict[str, int]  # node -> declared TmpDisk in MB (0: not configured)


TMP_DISK_FORMAT = "%N|%d|%P"  # node, TmpDisk (MB), partition ("*" marks the default)


def parse_tmp_disk(text: str, partition: str | None) -> PartitionTmpDisk | None:
    """``sinfo --Node --format=%N|%d|%P`` lines -> the nodes of ``partition`` (None: the default
    partition, the one sinfo marks with ``*``); None when no line names that partition."""
    found: dict[str, int] = {}
    name = partition
    for line in text.splitlines():
        parts = [p.strip() for p in line.split("|")]
        if len(parts) != 3 or not parts[1].isdigit():
            continue
        node, mb, part = parts
        is_default = part.endswith("*")
        part = part.rstrip("*")
        if (part == partition) if partition is not None else is_default:
            name = part
            found[node] = int(mb)
    return PartitionTmpDisk(name, found) if found and name else None


def tmp_disk(partition: str | None, *, timeout: float = 20) -> PartitionTmpDisk | None:
    """The TmpDisk every node of ``partition`` (None: the default partition) declares; None when
    Slurm does not know the partition. Raises SlurmUnavailable when sinfo cannot answer."""
    argv = ["sinfo", "--noheader", "--Node", f"--format={TMP_DISK_FORMAT}"]
    if partition is not None:
        argv.append(f"--partition={partition}")
    proc = _call(argv, timeout=timeout)
    if proc.returncode != 0:
        raise SlurmUnavailable(argv, _words(proc), proc.returncode)
    return parse_tmp_disk(proc.stdout, partition)


# -- accounts (doctor) --------------------------------------------------------------------------------
def has_association(user: str, account: str, *, timeout: float = 15) -> bool:
    """Whether ``user`` may charge ``account`` (an association in ``sacctmgr``). Raises
    SlurmUnavailable when sacctmgr is missing or cannot answer (e.g. a cluster without slurmdbd)."""
    argv = ["sacctmgr", "--noheader", "--parsable2", "show", "associations",
            "where", f"user={user}", f"account={account}", "format=Account"]
    proc = _call(argv, timeout=timeout)
    if proc.returncode != 0:
        raise SlurmUnavailable(argv, _words(proc), proc.returncode)
    return account in proc.stdout.split()


# -- one task on each node (doctor --in-job) --------------------------------------------------------
@dataclass(frozen=True)
class NodeRequest:
    """Where :func:`srun_each_node` runs: a fresh allocation of ``nodes`` nodes (``immediate_s``:
    give up when Slurm cannot start it that soon), or, with ``inside``, the nodes of the
    allocation the caller runs in (``--overlap``, beside its own steps)."""

    nodes: int
    inside: bool = False
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    gres: str | None = None  # e.g. "gpu:8"
    immediate_s: int = 300
    time_limit: str = "00:05:00"


def srun_each_node_argv(command: Sequence[str], where: NodeRequest, *, job_name: str) -> list[str]:
    """The ``srun`` line that runs ``command`` once on every node of ``where``."""
    argv = ["srun", "--ntasks-per-node=1", f"--job-name={job_name}", "--kill-on-bad-exit=0",
            f"--nodes={where.nodes}"]
    if where.inside:
        argv.append("--overlap")
    else:
        argv += [f"--time={where.time_limit}", f"--immediate={where.immediate_s}"]
        for flag, value in (("partition", where.partition), ("account", where.account),
                            ("qos", where.qos), ("gres", where.gres)):
            if value:
                argv.append(f"--{flag}={value}")
    return argv + list(command)


def srun_each_node(command: Sequence[str], where: NodeRequest, *, job_name: str,
                   timeout: float | None) -> subprocess.CompletedProcess:
    """Run ``command`` once on every node of ``where``; returns srun's finished process whatever
    its exit (the tasks' stdout is the caller's protocol). Outside an allocation the job's SLURM_*
    variables are dropped so that srun asks for a fresh one. Raises SlurmUnavailable when srun is
    missing or does not finish within ``timeout``."""
    env = None if where.inside else slurm_env_free()
    return _call(srun_each_node_argv(command, where, job_name=job_name), env=env, timeout=timeout)
