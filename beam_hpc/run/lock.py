"""One segment at a time per run directory: ``<output>/run.lock``.

Why: two segments on one output directory (a user's second ``sbatch``, a resubmission racing a
requeue) would train from the same checkpoint and overwrite each other's. The lock records who
holds it (Slurm job id, restart count, host, pid) so that it can be judged without the holder: a
lock whose job Slurm no longer runs (gone, or in any state but RUNNING) is stale and taken over (a
SIGKILLed job never released it, and only Slurm knows it is dead); a lock holding our own job id is
ours from an earlier restart (a requeue keeps the id); if Slurm cannot be asked, the lock is refused
(better a clear error than two writers). Outside Slurm (``beam-hpc execute``) the holder is a pid
on a host, stale when that pid is gone. Check-and-take-over happens under an ``flock`` on a guard
file, and the lock file is created atomically, so two starters cannot both win.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from beam_hpc.errors import RuntimeFailure
from beam_hpc.files import locked, write_atomic
from beam_hpc.slurm.client import JobInfo, JobState, SlurmUnavailable, show_job


class RunLockError(RuntimeFailure):
    """The run directory is in use by a live segment (the message names it and what to do)."""


@dataclass(frozen=True)
class Holder:
    job_id: str | None  # Slurm job id, None outside Slurm
    restart: int
    host: str
    pid: int
    time: float

    @classmethod
    def me(cls, job_id: str | None, restart: int = 0) -> Holder:
        return cls(job_id=job_id, restart=restart, host=socket.gethostname(), pid=os.getpid(), time=time.time())

    def describe(self) -> str:
        who = f"job {self.job_id} (restart {self.restart})" if self.job_id else "a local run"
        return f"{who} on {self.host}, pid {self.pid}"


def read_holder(path: str | Path) -> Holder | None:
    try:
        data = json.loads(Path(path).read_text())
        job = data.get("job_id")
        return Holder(job_id=None if job is None else str(job), restart=int(data.get("restart", 0)), host=str(data["host"]),
                      pid=int(data["pid"]), time=float(data.get("time", 0.0)))
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError, AttributeError):  # torn or hand-edited (not even a mapping): nobody's
        return Holder(job_id=None, restart=0, host="?", pid=-1, time=0.0)


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stale_reason(holder: Holder, *, query: Callable[[str], JobInfo | None] = show_job) -> str | None:
    """Why ``holder`` no longer holds the run (None when it may still be working). Raises
    SlurmUnavailable when Slurm cannot say."""
    if holder.pid == -1:
        return "the lock file is unreadable"
    if holder.job_id is None:
        if holder.host == socket.gethostname() and not _pid_alive(holder.pid):
            return f"pid {holder.pid} on {holder.host} has exited"
        return None
    info = query(holder.job_id)
    if info is None:
        return f"Slurm no longer knows job {holder.job_id}"
    if info.state != JobState.RUNNING:
        return f"job {holder.job_id} is {info.state}, not RUNNING"
    return None


def _guard(path: Path) -> contextlib.AbstractContextManager:
    """The flock under which the lock is judged and taken over (``run.lock.guard``)."""
    return locked(path.with_name(path.name + ".guard"))


def _write(path: Path, holder: Holder, *, exclusive: bool) -> None:
    body = json.dumps(asdict(holder), sort_keys=True) + "\n"
    if not exclusive:
        write_atomic(path, body)
        return
    # create-if-absent, not replace: a hard link of a finished temporary is atomic also on NFS, and
    # fails with FileExistsError when someone holds the lock (write_atomic's rename would overwrite)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(body)
    try:
        os.link(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def acquire(path: str | Path, me: Holder, *, query: Callable[[str], JobInfo | None] = show_job) -> Holder | None:
    """Take the run lock for ``me``. Returns the previous holder when a stale lock (or our own job's
    lock from before a requeue) was taken over, None when the lock was free. Raises RunLockError
    when a live segment holds it, or when Slurm cannot tell whether it is live."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with _guard(p):
        try:
            _write(p, me, exclusive=True)
            return None
        except FileExistsError:
            pass
        holder = read_holder(p)
        if holder is None:  # released between our two looks
            _write(p, me, exclusive=True)
            return None
        if me.job_id is not None and holder.job_id == me.job_id:
            _write(p, me, exclusive=False)  # our own job, from an earlier restart
            return holder
        try:
            why = stale_reason(holder, query=query)
        except SlurmUnavailable as err:
            raise RunLockError(
                f"{p} is held by {holder.describe()} and Slurm cannot say whether it still runs ({err}); "
                "try again when Slurm answers"
            ) from err
        if why is None:
            raise RunLockError(
                f"{p.parent} is in use by {holder.describe()}; wait for it to end, or stop it with "
                f"`beam-hpc cancel {p.parent}`, or use another --output-dir"
            )
        _write(p, me, exclusive=False)
        return holder


def release(path: str | Path, me: Holder) -> bool:
    """Remove the lock if ``me`` still holds it (a successor that took it over keeps it)."""
    p = Path(path)
    with _guard(p):
        holder = read_holder(p)
        if holder is None or (holder.job_id, holder.host, holder.pid) != (me.job_id, me.host, me.pid):
            return False
        p.unlink()
        return True


def check_free(path: str | Path, *, query: Callable[[str], JobInfo | None] = show_job) -> None:
    """Raise RunLockError if a live segment holds the run (login-node check before a submission)."""
    p = Path(path)
    holder = read_holder(p)
    if holder is None:
        return
    try:
        why = stale_reason(holder, query=query)
    except SlurmUnavailable:
        return  # the job's own lock check will decide; a login node without Slurm may still submit later
    if why is None:
        raise RunLockError(
            f"{p.parent} is in use by {holder.describe()}; wait for it to end, or stop it with "
            f"`beam-hpc cancel {p.parent}`, or use another --output-dir"
        )
