"""beam_hpc.lifecycle.stopping: the segment's state as interrupts, saves and stalls move it.

Real signals to this process, a real driver process, the real sentinel and checkpoint files; the
running job is a stand-in with the three methods stopping calls (JobRunner needs Ray and a
cluster: the real thing is tested on the local Slurm cluster, tests/lifecycle/test_lifecycle_slurm.py
and test_lifecycle_stall.py). Slurm's answers come through the watchdog's ``query=``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from beam_hpc.config.recipe import LifecycleSpec
from beam_hpc.lifecycle.stall import StallWatch
from beam_hpc.lifecycle.stopping import State, Stopping
from beam_hpc.lifecycle.watchdog import InterruptKind, Watchdog
from beam_hpc.plan.paths import RunPaths
from beam_hpc.run import checkpoint_layout
from beam_hpc.run.ledger import Reason
from beam_hpc.slurm.client import JobInfo, JobState


class Job:
    """The running job as stopping sees it: a real driver process, and the stops it was asked for."""

    def __init__(self) -> None:
        self.driver: subprocess.Popen | None = subprocess.Popen(["sleep", "60"])
        self.asked: list[str] = []
        self.stops = 0

    def request_stop(self, reason: str) -> None:
        self.asked.append(reason)

    def stop(self) -> float:
        self.stops += 1
        if self.driver is not None and self.driver.poll() is None:
            self.driver.terminate()
            self.driver.wait()
        return 0.0

    def dump_stacks(self) -> dict[str, Any]:
        return {"dumps": ["logs/1-0/stacks/trainer-0-123.txt"], "skipped": [], "suspects": ["n2"]}


@dataclass
class Rig:
    st: Stopping
    job: Job
    slurm_says: JobInfo  # what Slurm answers about the job
    ended: list[tuple[Reason, str]]  # what ``finish`` was called with


@pytest.fixture
def rig(tmp_path: Path):
    """A Stopping on a run directory with checkpoint 4, its watchdog's handlers installed."""
    paths = RunPaths(str(tmp_path))
    checkpoint_layout.mark_latest(paths.checkpoints, 4)
    wd = Watchdog("40", 0, 60, query=lambda _j: r.slurm_says, cancel_flag=str(tmp_path / "CANCELLED"))

    def finish(reason: Reason, detail: str) -> None:
        with r.st.finishing():
            r.ended.append((reason, detail))

    st = Stopping(LifecycleSpec(walltime="01:00:00", save_timeout_s=20), paths, wd, finish)
    r = Rig(st, Job(), JobInfo("40", JobState.RUNNING, 0, time.time() + 3600, None), [])
    wd.on_signal = st.on_signal
    wd.install()
    try:
        yield r
    finally:
        wd.uninstall()
        r.job.stop()


def _deliver(sig: int) -> None:
    os.kill(os.getpid(), sig)
    time.sleep(0.01)  # the handler runs at the next bytecode boundary


def _save_at_the_next_boundary(st: Stopping, iteration: int, seen: list[State]) -> threading.Thread:
    """What a backend does with the sentinel: save, pointer last, then remove the sentinel;
    ``seen`` gets the segment's state when the sentinel came."""
    paths = st.paths

    def run() -> None:
        deadline = time.monotonic() + 10
        while not os.path.exists(paths.sentinel) and time.monotonic() < deadline:
            time.sleep(0.02)
        seen.append(st.state)
        checkpoint_layout.iteration_dir(paths.checkpoints, iteration).mkdir(parents=True)
        checkpoint_layout.mark_latest(paths.checkpoints, iteration)
        os.unlink(paths.sentinel)

    t = threading.Thread(target=run)
    t.start()
    return t


def test_the_walltime_lead_saves_then_stops_the_driver_and_a_requeue_then_ends_it_at_once(rig: Rig) -> None:
    st, job = rig.st, rig.job
    st.attach(job, StallWatch(st.paths, 0.0, stall_timeout_s=0, startup_timeout_s=0, measured=None,
                              rollouts_at_start=5))
    assert st.state is State.RUNNING and job.asked == []
    seen: list[State] = []
    backend = _save_at_the_next_boundary(st, 9, seen)
    _deliver(signal.SIGUSR1)  # the walltime lead: acted on at the runtime's next tick
    st.tick(job)
    backend.join()
    assert seen == [State.SAVING]
    assert st.state is State.STOPPING and st.interrupt.kind is InterruptKind.WALLTIME
    assert st.saved.saved and st.saved.iteration == 9
    assert job.asked == ["walltime"] and job.stops == 1 and job.driver.poll() is not None
    assert rig.ended == []  # the end waits for the teardown
    rig.slurm_says = JobInfo("40", JobState.COMPLETING, 1, time.time(), None)  # Slurm requeued the job
    _deliver(signal.SIGTERM)  # acted on in the handler itself: KillWait is all there is
    assert st.state is State.FINISHED and st.interrupt.kind is InterruptKind.REQUEUED
    assert [reason for reason, _ in rig.ended] == [Reason.PREEMPTED]
    _deliver(signal.SIGTERM)  # nothing acts twice once the end is written
    assert len(rig.ended) == 1


def test_a_stall_dumps_and_stops_and_a_walltime_lead_after_it_saves_nothing(rig: Rig) -> None:
    st, job = rig.st, rig.job
    watch = StallWatch(st.paths, 0.0, stall_timeout_s=1, startup_timeout_s=1, measured=None, rollouts_at_start=5)
    st.attach(job, watch)  # the first tick starts the watch's clock
    watch.started_at -= 5  # no rollout for 5 s, with a 1 s timeout
    st.tick(job)
    assert st.state is State.STOPPING and st.stall.stall.rollout == 5
    assert job.asked == ["stalled"] and st.stall.record()["suspects"] == ["n2"]
    assert "1 stack dump(s) in" in st.stall.describe(st.paths.segment("40", 0).stacks)
    _deliver(signal.SIGUSR1)
    st.tick(job)  # the lead comes during the stall's teardown: a stalled driver saves nothing
    assert st.interrupt.kind is InterruptKind.WALLTIME and st.saved is None
    assert not os.path.exists(st.paths.sentinel) and job.asked == ["stalled", "walltime"]
    assert st.state is State.STOPPING and rig.ended == []


def test_a_failed_end_leaves_the_state_it_found(rig: Rig) -> None:
    st = rig.st
    with pytest.raises(OSError), st.finishing():
        assert st.over
        raise OSError("disk full")
    assert st.state is State.RUNNING and not st.over


def test_a_lost_node_the_run_cannot_train_on_without_is_saved_for_first(rig: Rig) -> None:
    """A Miles run's lost rollout node (beam_hpc.plan.node_loss: save first): the save at the next
    boundary, as for the walltime lead; the runtime then either ends the segment (the end is the
    node failure's, not an interrupt's: nothing is recorded here) or waits for a replacement."""
    st, job = rig.st, rig.job
    st.attach(job, StallWatch(st.paths, 0.0, stall_timeout_s=0, startup_timeout_s=0, measured=None,
                              rollouts_at_start=5))
    seen: list[State] = []
    backend = _save_at_the_next_boundary(st, 7, seen)
    assert st.save_for_lost_node("node step on n4 failed") is True
    backend.join()
    assert seen == [State.SAVING] and st.state is State.STOPPING
    assert st.saved.saved and st.saved.iteration == 7 and "saved on request" in st.saved.detail
    assert st.interrupt is None and rig.ended == [] and job.asked == []
    assert st.save_for_lost_node("a second node") is False  # only from RUNNING: no second save meanwhile
    assert st.saved.iteration == 7


def test_after_the_save_a_replacement_wait_runs_the_segment_again_with_the_stall_clock_held(rig: Rig) -> None:
    """The runtime waits for a lost node's replacement: the segment is RUNNING again (a walltime
    lead then saves as ever), and the stall watch counts from the wait's end, then from the join."""
    st, job = rig.st, rig.job
    watch = StallWatch(st.paths, 0.0, stall_timeout_s=30, startup_timeout_s=30, measured=None, rollouts_at_start=5)
    st.attach(job, watch)
    watch.start(time.time() - 100)  # the driver started long ago: the stall timeout has passed
    backend = _save_at_the_next_boundary(st, 7, [])
    assert st.save_for_lost_node("node step on n4 failed") is True
    backend.join()
    wait_end = time.time() + 60
    st.count_stall_from(wait_end)
    assert st.state is State.RUNNING and watch.started_at == wait_end and watch.check() is None
    st.count_stall_from(time.time())  # joined: the next rollout has a whole stall timeout
    assert watch.check() is None
    backend = _save_at_the_next_boundary(st, 8, [])
    _deliver(signal.SIGUSR1)  # the walltime lead, later in the same segment
    st.tick(job)
    backend.join()
    assert st.interrupt.kind is InterruptKind.WALLTIME and st.saved.saved and st.saved.iteration == 8


def test_a_save_for_a_lost_node_that_never_comes_gives_up_at_the_stall_timeout(rig: Rig) -> None:
    """Miles waiting in its weight update for the lost engine finishes no rollout, so no save comes:
    the wait ends at the stall timeout (here 1 s; the recipe's save_timeout_s is 20), and the
    segment goes on to end from the last checkpoint."""
    st, job = rig.st, rig.job
    st.attach(job, StallWatch(st.paths, 0.0, stall_timeout_s=1, startup_timeout_s=1, measured=None,
                              rollouts_at_start=5))
    t0 = time.monotonic()
    assert st.save_for_lost_node("node step on n4 failed") is False
    assert 0.9 < time.monotonic() - t0 < 5
    assert not st.saved.saved and st.saved.iteration == 4 and "no checkpoint within the save deadline" in st.saved.detail
    assert st.state is State.STOPPING and job.driver.poll() is None  # the runtime stops it, not this
