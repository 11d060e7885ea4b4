"""beam_hpc.lifecycle.watchdog: real signals to this process; Slurm's answers come through ``query=``."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from beam_hpc.lifecycle.watchdog import InterruptKind, Watchdog
from beam_hpc.slurm.client import JobInfo, JobState, parse_show_job


class FakeClock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def watchdog_factory(tmp_path: Path):
    made: list[Watchdog] = []

    def make(info: JobInfo | None, restart: int = 0, clock: FakeClock | None = None) -> Watchdog:
        wd = Watchdog("40", restart, 60, query=lambda _j: info, clock=clock or FakeClock(1000.0),
                      cancel_flag=str(tmp_path / "CANCELLED"))
        wd.install()
        made.append(wd)
        return wd

    yield make
    for wd in made:
        wd.uninstall()


def _deliver(sig: int) -> None:
    os.kill(os.getpid(), sig)
    time.sleep(0.01)  # the handler runs at the next bytecode boundary


def test_watchdog_tells_walltime_from_preemption(watchdog_factory) -> None:
    wd = watchdog_factory(JobInfo("40", JobState.RUNNING, 0, 1100.0, None))
    assert wd.check() is None
    _deliver(signal.SIGUSR1)
    intr = wd.check()
    assert intr.kind == "walltime" and intr.source == "USR1" and intr.hard_end == 1100.0
    assert intr.kind is InterruptKind.WALLTIME
    wd2 = watchdog_factory(JobInfo("40", JobState.RUNNING, 0, 1020.0, 1000.0))
    _deliver(signal.SIGUSR1)
    assert wd2.check().kind == "preempted"


def test_watchdog_keeps_its_own_deadline(watchdog_factory) -> None:
    clock = FakeClock(1000.0)
    wd = watchdog_factory(JobInfo("40", JobState.RUNNING, 0, 1100.0, None), clock=clock)
    assert wd.check() is None and wd.deadline == 1040.0
    clock.t = 1040.0
    intr = wd.check()
    assert intr.kind == "walltime" and intr.source == "deadline"
    assert wd.check() is None  # fired once


def test_watchdog_classifies_sigterm(watchdog_factory, tmp_path: Path) -> None:
    wd = watchdog_factory(JobInfo("40", JobState.COMPLETING, 1, 2000.0, None))
    _deliver(signal.SIGTERM)
    assert wd.check().kind == "requeued"
    wd = watchdog_factory(JobInfo("40", JobState.COMPLETING, 0, 1001.0, None))
    _deliver(signal.SIGTERM)
    assert wd.check().kind == "timelimit"
    wd = watchdog_factory(JobInfo("40", JobState.COMPLETING, 0, 1001.0, None, limit_end=1001.0))
    _deliver(signal.SIGTERM)
    assert wd.check().kind == "timelimit"
    # a plain scancel: Slurm shows COMPLETING with EndTime moved to the cancel (measured on the local
    # cluster), while StartTime + TimeLimit is still ahead; it is no time limit (benchmarks/faults.py
    # found this: the segment recorded a walltime stop and would have resubmitted after progress)
    wd = watchdog_factory(JobInfo("40", JobState.COMPLETING, 0, 1000.0, None, limit_end=2200.0))
    _deliver(signal.SIGTERM)
    stop = wd.check()
    assert stop.kind == "cancelled" and "scancel" in stop.detail
    wd = watchdog_factory(JobInfo("40", JobState.RUNNING, 0, 1000.0, 980.0))  # a preemption's grace is over
    _deliver(signal.SIGTERM)
    assert wd.check().kind == "requeued"
    wd = watchdog_factory(JobInfo("40", JobState.RUNNING, 1, 1000.0, 900.0, submit_time=950.0), restart=1)
    _deliver(signal.SIGTERM)  # the PreemptTime of the incarnation before the requeue does not count
    assert wd.check().kind == "timelimit"
    wd = watchdog_factory(JobInfo("40", JobState.COMPLETING, 0, 2000.0, None))
    _deliver(signal.SIGTERM)
    assert wd.check().kind == "cancelled"
    # a --no-requeue job Slurm ends for a failed node: the same moved EndTime as a scancel, told apart
    # by the leader's Reason (the line as the real cluster showed it at the SIGTERM; the real flow:
    # tests/lifecycle/test_watchdog_slurm.py)
    at_term = parse_show_job("JobId=40 JobState=COMPLETING Reason=NodeDown Requeue=0 Restarts=0 "
                             "TimeLimit=00:10:00 SubmitTime=2026-12-07T15:19:55 StartTime=2026-12-07T15:19:56 "
                             "EndTime=2026-12-07T15:19:59 PreemptTime=None")
    wd = watchdog_factory(at_term, clock=FakeClock(at_term.end_time))
    _deliver(signal.SIGTERM)
    stop = wd.check()
    assert stop.kind == "node-failed" and stop.reason == "node-failure" and "Reason=NodeDown" in stop.detail
    wd = watchdog_factory(JobInfo("40", JobState.NODE_FAIL, 0, 1000.0, None, limit_end=2200.0))
    _deliver(signal.SIGTERM)
    assert wd.check().kind == "node-failed"
    (tmp_path / "CANCELLED").write_text("x")
    wd = watchdog_factory(JobInfo("40", JobState.COMPLETING, 1, 2000.0, None))
    _deliver(signal.SIGTERM)
    assert wd.check().detail.startswith("cancelled with beam-hpc cancel")


def test_sigterm_overrides_a_walltime_save_in_progress(watchdog_factory) -> None:
    wd = watchdog_factory(JobInfo("40", JobState.RUNNING, 0, 1100.0, None))
    _deliver(signal.SIGUSR1)
    assert wd.check().kind == "walltime"
    _deliver(signal.SIGUSR1)
    assert wd.check() is None  # the same thing again: nothing new
    wd._query = lambda _j: JobInfo("40", JobState.COMPLETING, 1, 1100.0, None)
    _deliver(signal.SIGTERM)
    assert wd.check().kind == "requeued"


def test_each_interrupt_ends_a_segment_with_its_ledger_reason() -> None:
    """The time limit is a walltime stop and a requeue by Slurm a preemption, as the ledger's
    readers (status, accounting, decide) count them; only the lead and a grace time leave time to save."""
    from beam_hpc.lifecycle.watchdog import Interrupt
    from beam_hpc.run.ledger import Reason

    expected = {InterruptKind.WALLTIME: (Reason.WALLTIME, True), InterruptKind.TIMELIMIT: (Reason.WALLTIME, False),
                InterruptKind.PREEMPTED: (Reason.PREEMPTED, True), InterruptKind.REQUEUED: (Reason.PREEMPTED, False),
                InterruptKind.CANCELLED: (Reason.CANCELLED, False),
                InterruptKind.NODE_FAILED: (Reason.NODE_FAILURE, False)}
    for kind, (reason, saves) in expected.items():
        intr = Interrupt(kind, "USR1", None, "d")
        assert (intr.reason, intr.asks_for_a_save, intr.leaves_no_time) == (reason, saves, not saves), kind
