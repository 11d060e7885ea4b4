"""Noticing that a segment must stop: the walltime lead, preemption, requeue, cancel, time limit.

Why each piece exists (Slurm's behaviour, measured on a real cluster):

- The walltime warning (``--signal=B:USR1@lead``) may come up to 30 s early or late, so the
  watchdog also keeps its own deadline: the job's EndTime (``scontrol show job``) minus the lead.
  Whichever comes first starts the final save (:mod:`beam_hpc.lifecycle.save`).
- With ``preempt_send_user_signal`` and a partition GraceTime, preemption arrives as the *same*
  USR1; ``PreemptTime`` set and EndTime moved to now + GraceTime tell the two apart. A job that
  ends by itself during its grace time is COMPLETED, not requeued, so after a graceful save the
  segment requeues itself (:func:`beam_hpc.lifecycle.actions.requeue_self`).
- SIGTERM comes from ``scontrol requeue`` / preemption without grace (Slurm already counts the
  restart), ``scancel`` or the time limit; only KillWait seconds are left, so the segment writes
  its ledger line and relies on the last complete checkpoint. Slurm is asked through
  :mod:`beam_hpc.slurm.client` (``query=`` is the seam tests replace).
"""

from __future__ import annotations

import logging
import signal
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from pathlib import Path
from types import FrameType
from typing import Any

from beam_hpc.run.ledger import Reason
from beam_hpc.slurm.client import JobInfo, JobState, SlurmUnavailable, show_job

log = logging.getLogger(__name__)


class InterruptKind(StrEnum):
    """Why a segment must stop (the strings are what logs and the runtime's stop reason show)."""

    WALLTIME = "walltime"  # lead reached: save, then resubmit
    PREEMPTED = "preempted"  # grace time: save if it fits, then requeue
    REQUEUED = "requeued"  # Slurm already requeued the job: no time to save
    CANCELLED = "cancelled"  # scancel / beam-hpc cancel
    TIMELIMIT = "timelimit"  # the walltime itself passed: no time to save
    NODE_FAILED = "node-failed"  # Slurm ends the job for a failed node and does not requeue it


@dataclass(frozen=True)
class Interrupt:
    """Why a segment must stop now (see :class:`InterruptKind`)."""

    kind: InterruptKind
    source: str  # USR1 | deadline | SIGTERM | SIGINT
    hard_end: float | None  # when Slurm will kill the job, when known
    detail: str

    @property
    def reason(self) -> Reason:
        """The ledger reason of a segment this interrupt ended."""
        return _REASON[self.kind]

    @property
    def leaves_no_time(self) -> bool:
        """Slurm stops the job any moment now: the end is recorded at once, with no save and no
        teardown first (requeued, cancelled, the time limit itself)."""
        return self.kind in (InterruptKind.REQUEUED, InterruptKind.CANCELLED, InterruptKind.TIMELIMIT,
                             InterruptKind.NODE_FAILED)

    @property
    def asks_for_a_save(self) -> bool:
        """The walltime lead or a preemption's grace time: there is time to save first."""
        return self.kind in (InterruptKind.WALLTIME, InterruptKind.PREEMPTED)


_REASON = {InterruptKind.WALLTIME: Reason.WALLTIME, InterruptKind.TIMELIMIT: Reason.WALLTIME,
           InterruptKind.PREEMPTED: Reason.PREEMPTED, InterruptKind.REQUEUED: Reason.PREEMPTED,
           InterruptKind.CANCELLED: Reason.CANCELLED, InterruptKind.NODE_FAILED: Reason.NODE_FAILURE}


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
        query: Callable[[str], JobInfo | None] = show_job,
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
                new = Interrupt(InterruptKind.WALLTIME, "deadline", self.end_time,
                                f"own deadline: job end time minus lead {self.lead_s} s reached")
        if new is not None and (self._fired is None or _urgency(new) > _urgency(self._fired)):
            self._fired = new
            log.warning("interrupt: %s (%s): %s", new.kind, new.source, new.detail)
            return new
        return None

    def _classify_usr1(self) -> Interrupt:
        info = self.refresh()
        if info is not None and _preempted(info):
            return Interrupt(InterruptKind.PREEMPTED, "USR1", info.end_time,
                             f"preempted at {fmt_clock(info.preempt_time)}; grace ends {fmt_clock(info.end_time)}")
        return Interrupt(InterruptKind.WALLTIME, "USR1", self.end_time,
                         f"walltime warning (USR1, lead {self.lead_s} s); job ends {fmt_clock(self.end_time)}")

    def _classify_term(self, source: str) -> Interrupt:
        if self._cancel_flag and Path(self._cancel_flag).exists():
            return Interrupt(InterruptKind.CANCELLED, source, self._clock(), "cancelled with beam-hpc cancel")
        info = None
        if self.job_id is not None:
            try:
                info = self._query(self.job_id)
            except SlurmUnavailable as err:
                log.warning("cannot ask Slurm why %s came: %s", source, err)
        if info is not None and info.restarts > self.restart:
            why = "preemption" if info.preempt_time is not None else "scontrol requeue or preemption"
            return Interrupt(InterruptKind.REQUEUED, source, self._clock(),
                             f"{source}: Slurm requeued job {self.job_id} ({why}); restart {info.restarts} follows")
        if info is not None and _preempted(info):
            # the end of a preemption's grace time: Slurm requeues the job (PreemptMode=REQUEUE), and
            # may count the restart only after this signal; near EndTime, it is not the time limit
            return Interrupt(InterruptKind.REQUEUED, source, self._clock(),
                             f"{source}: the grace time of the preemption at {fmt_clock(info.preempt_time)} is over; "
                             f"Slurm requeues job {self.job_id}")
        if info is not None and _node_failed(info):
            # a job that is not requeued (--no-requeue): Slurm moves EndTime to now as a scancel
            # does, so without this the segment would read a cancel and the chain would stop
            return Interrupt(InterruptKind.NODE_FAILED, source, self._clock(),
                             f"{source}: Slurm ended job {self.job_id} for a failed node (Reason={info.reason}) "
                             "and does not requeue it")
        end = info.end_time if info is not None and info.end_time is not None else self.end_time
        limit = info.limit_end if info is not None else None
        if end is not None and self._clock() >= end - 5:
            if limit is None or self._clock() >= limit - 5:
                return Interrupt(InterruptKind.TIMELIMIT, source, self._clock(),
                                 f"{source} at the time limit ({fmt_clock(end)})")
            # scancel: Slurm moves EndTime to the moment of the cancel, while the limit is still ahead
            return Interrupt(InterruptKind.CANCELLED, source, self._clock(),
                             f"{source}: the job was cancelled (scancel; its time limit was {fmt_clock(limit)})")
        return Interrupt(InterruptKind.CANCELLED, source, self._clock(), f"{source}: the job was cancelled")


def _node_failed(info: JobInfo) -> bool:
    """Slurm is ending this job because one of its nodes failed: JobState NODE_FAIL, or, while the
    job's processes are still being signalled, COMPLETING with Reason NodeDown (what the leader
    of a --no-requeue job reads at its SIGTERM)."""
    return info.state == JobState.NODE_FAIL or info.reason == "NodeDown"


def _preempted(info: JobInfo) -> bool:
    """This incarnation of the job was chosen for preemption (a PreemptTime before its latest
    submission belongs to an earlier incarnation: a requeue resets SubmitTime)."""
    return info.preempt_time is not None and (info.submit_time is None or info.preempt_time >= info.submit_time)


_URGENCY = {InterruptKind.WALLTIME: 1, InterruptKind.PREEMPTED: 2, InterruptKind.TIMELIMIT: 3,
            InterruptKind.REQUEUED: 3, InterruptKind.CANCELLED: 3, InterruptKind.NODE_FAILED: 3}


def _urgency(i: Interrupt) -> int:
    return _URGENCY[i.kind]


def fmt_clock(t: float | None) -> str:
    """A timestamp as the HH:MM:SS of the log lines ("unknown" when Slurm did not say)."""
    return "unknown" if t is None else datetime.fromtimestamp(t).strftime("%H:%M:%S")
