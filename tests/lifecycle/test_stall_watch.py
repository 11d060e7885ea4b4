"""The stall watchdog's parts, fast: the timeouts, the progress probe on the backend's own scalar
files, and the decision rules for a stalled segment. (The whole flow on the local Slurm cluster:
test_lifecycle_stall.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from beam_hpc.lifecycle.decide import Outcome, decide
from beam_hpc.lifecycle.stall import FLOOR_S, STARTUP_EXTRA_S, ProgressProbe, StallWatch, timeouts
from beam_hpc.plan.paths import RunPaths
from beam_hpc.run import metric_names


def test_default_timeouts_follow_the_measured_step_and_save_with_a_floor() -> None:
    t = timeouts(None, None, slowest_step_s=400.0, last_save_s=150.0)
    assert (t.stall_s, t.startup_s) == (2200, 2200 + STARTUP_EXTRA_S)  # 4 x (400 + 150)
    assert "slowest step 400.0 s + last save 150.0 s" in t.basis
    fast = timeouts(None, None, slowest_step_s=3.0, last_save_s=None)
    assert fast.stall_s == FLOOR_S and "floor" in fast.basis
    unmeasured = timeouts(None, None, slowest_step_s=None, last_save_s=None)
    assert unmeasured.stall_s == FLOOR_S and "no rollout measured yet" in unmeasured.basis


def test_recipe_timeouts_win_and_zero_turns_the_watch_off() -> None:
    t = timeouts(90, None, slowest_step_s=5000.0, last_save_s=100.0)
    assert (t.stall_s, t.startup_s, t.basis) == (90, 90 + STARTUP_EXTRA_S, "lifecycle.stall_timeout_s")
    assert timeouts(90, 600, slowest_step_s=None, last_save_s=None).startup_s == 600
    off = timeouts(0, None, slowest_step_s=1.0, last_save_s=1.0)
    assert (off.stall_s, off.startup_s) == (0, 0) and "off" in off.describe()


def test_recipe_fields_take_seconds_and_refuse_the_rest() -> None:
    from beam_hpc.config.recipe import LifecycleSpec

    assert LifecycleSpec(stall_timeout_s=30, startup_timeout_s=0).stall_timeout_s == 30
    assert LifecycleSpec().stall_timeout_s is None and LifecycleSpec().startup_timeout_s is None


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _rollout(paths: RunPaths, k: int, at: float, step_s: float) -> None:
    """One finished step as the reference backend mirrors it (no TensorBoard here)."""
    f = Path(paths.dumps, metric_names.METRICS_FILE)
    f.parent.mkdir(parents=True, exist_ok=True)
    with open(f, "a") as fh:
        fh.write(json.dumps({"kind": "rollout", "rollout_id": k, "time": at, metric_names.ROLLOUT_TIME: step_s}) + "\n")


def test_the_probe_counts_only_this_segments_steps_and_rereads_only_changed_files(tmp_path: Path, monkeypatch) -> None:
    paths = RunPaths(str(tmp_path))
    _rollout(paths, 0, 100.0, 9.0)  # an earlier segment's
    clock = Clock(500.0)
    probe = ProgressProbe(paths, offset=200.0, every_s=5.0, clock=clock)
    assert not probe.poll() and probe.steps == 0 and probe.last_rollout is None
    _rollout(paths, 1, 510.0, 4.0)
    assert not probe.poll()  # looked less than every_s ago
    clock.t = 506.0
    assert probe.poll() and (probe.steps, probe.last_rollout, probe.last_at, probe.slowest_step_s) == (1, 1, 506.0, 4.0)
    reads = []
    import beam_hpc.lifecycle.stall as stall_mod

    monkeypatch.setattr(stall_mod, "read_scalars", lambda *a: reads.append(a) or pytest.fail("re-read unchanged files"))
    clock.t = 520.0
    assert not probe.poll(force=True) and reads == []  # nothing changed: no read
    monkeypatch.undo()
    _rollout(paths, 2, 521.0, 7.0)
    clock.t = 530.0
    assert probe.poll() and (probe.steps, probe.last_rollout, probe.last_at) == (2, 2, 521.0)


def test_the_watch_fires_after_the_timeout_from_the_last_step_or_the_driver_start(tmp_path: Path) -> None:
    paths = RunPaths(str(tmp_path))
    clock = Clock(1000.0)
    watch = StallWatch(paths, 900.0, stall_timeout_s=60, startup_timeout_s=300, measured=None,
                       rollouts_at_start=6, clock=clock, probe_every_s=0.0)
    assert watch.check() is None  # not started: the driver does not run yet
    watch.start()
    clock.t = 1299.0
    assert watch.check() is None
    clock.t = 1301.0
    first = watch.check()
    assert first is not None and (first.phase, first.last_rollout, first.rollout, first.timeout_s) == ("startup", None, 6, 300)
    assert "before the segment's first rollout" in first.describe()
    _rollout(paths, 6, 1302.0, 250.0)
    clock.t = 1303.0
    assert watch.check() is None  # a step came: the running phase, 60 s from it
    clock.t = 1361.0
    assert watch.check() is None
    clock.t = 1363.0
    s = watch.check()
    assert s is not None and (s.phase, s.last_rollout, s.rollout, s.since, s.timeout_s) == ("running", 6, 7, 1302.0, 60)
    assert s.silent_s == pytest.approx(61.0) and "rollout 7 is stuck" in s.describe()
    assert s.to_record()["rollout"] == 7


def test_the_default_timeout_grows_with_a_slow_step_seen_in_this_segment(tmp_path: Path) -> None:
    paths = RunPaths(str(tmp_path))
    clock = Clock(1000.0)
    watch = StallWatch(paths, 900.0, stall_timeout_s=None, startup_timeout_s=None,
                       measured={"rollout_s": 100.0, "save_s": 50.0}, rollouts_at_start=0, clock=clock,
                       probe_every_s=0.0)
    assert watch.timeouts().stall_s == FLOOR_S  # 4 x 150 < floor
    watch.start()
    _rollout(paths, 0, 1000.0 + 600.0, 600.0)  # one step of 10 minutes
    clock.t = 1601.0
    assert watch.check() is None
    assert watch.timeouts().stall_s == 4 * (600 + 50)
    clock.t = 1600.0 + 2599.0
    assert watch.check() is None
    clock.t = 1600.0 + 2601.0
    assert watch.check() is not None


# -- decisions ---------------------------------------------------------------------------------------


def _stalled(rollout: int, start: int, end: int, dumps: list[str]) -> dict:
    return {"segment": f"s{rollout}", "start": {"rollouts_at_start": start},
            "end": {"reason": "stalled", "rollouts_at_end": end, "stall": {"rollout": rollout, "dumps": dumps}}}


def _decide(start: int, end: int, stall: dict, history: list[dict]):
    o = Outcome(reason="stalled", rollouts_at_start=start, rollouts_at_end=end, num_rollout=20, rollouts_run=3, stall=stall)
    return decide(o, history=history, max_segments=10, cancelled=False, requeue_on_preemption=True)


def test_a_stall_resubmits_and_the_same_stall_twice_in_a_row_stops_the_chain() -> None:
    first = _decide(2, 4, {"rollout": 5, "dumps": ["/r/logs/1-0/stacks/h-1.txt"]}, [])
    assert first.action == "resubmit" and "stalled after 2 new rollouts" in first.detail
    again = _decide(4, 4, {"rollout": 5, "dumps": ["/r/logs/2-0/stacks/h-9.txt"]},
                    [_stalled(5, 2, 4, ["/r/logs/1-0/stacks/h-1.txt"])])
    assert again.action == "none" and "stalled twice in a row at rollout 5" in again.detail
    assert "/r/logs/1-0/stacks/h-1.txt" in again.detail and "/r/logs/2-0/stacks/h-9.txt" in again.detail
    elsewhere = _decide(4, 6, {"rollout": 7, "dumps": []}, [_stalled(5, 2, 4, [])])
    assert elsewhere.action == "resubmit"  # another rollout, after progress: a new hang, worth a segment
    # a stall without progress after another failure without progress: the failure rule stops it
    stuck = _decide(4, 4, {"rollout": 4, "dumps": []}, [_stalled(9, 4, 4, [])])
    assert stuck.action == "none" and "failed without progress too" in stuck.detail


def test_no_stall_is_claimed_where_the_progress_cannot_be_read(tmp_path: Path, monkeypatch, caplog) -> None:
    """Miles writes only TensorBoard events; where the segment runs without the `tensorboard`
    package nothing would ever show progress, so the watch says it is off instead of stopping a
    healthy run after the startup timeout."""
    import sys

    paths = RunPaths(str(tmp_path))
    Path(paths.tensorboard).mkdir(parents=True)
    Path(paths.tensorboard, "events.out.tfevents.1.host").write_bytes(b"\0" * 64)
    monkeypatch.setitem(sys.modules, "tensorboard.backend.event_processing", None)  # not installed here
    clock = Clock(1000.0)
    watch = StallWatch(paths, 900.0, stall_timeout_s=10, startup_timeout_s=10, measured=None, rollouts_at_start=0,
                       clock=clock, probe_every_s=0.0)
    watch.start()
    clock.t = 5000.0
    with caplog.at_level("WARNING"):
        assert watch.check() is None and watch.check() is None
    assert watch.probe.unreadable and caplog.text.count("stall watchdog off") == 1


def test_the_stop_message_names_a_few_dumps_and_the_directories_of_many() -> None:
    many = [f"/r/logs/2-0/stacks/n{i}-1.txt" for i in range(30)]
    d = _decide(4, 4, {"rollout": 5, "dumps": many}, [_stalled(5, 2, 4, ["/r/logs/1-0/stacks/h-1.txt"])])
    assert d.action == "none" and "/r/logs/1-0/stacks/h-1.txt" in d.detail and "n6-1.txt" in d.detail
    assert "and 23 more in /r/logs/2-0/stacks" in d.detail and "n29-1.txt" not in d.detail
