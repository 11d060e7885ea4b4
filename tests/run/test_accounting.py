"""GPU-hours held, useful and lost (issue 16 item 3): the arithmetic on a hand-made ledger,
written through the real ledger writer and read back through the real reader."""

from __future__ import annotations

from pathlib import Path

import pytest

from beam_hpc.run import accounting, ledger

GPUS = 96
T0 = 1_000_000.0


def _write(path: Path) -> None:
    """Four segments of one run, times in seconds from T0:
    1. walltime at 3600: Ray ready after 300, 30 rollouts of 100 s run, 28 checkpointed (rollouts
       0 -> 28), last save at 3200 -> re-done 2 x 100 = 200, tail 400 - 200 = 200;
    2. node failure at 3900+600 with no progress: all 600 s lost;
    3. killed hard (no end line) at 4600..5000, next segment finds no new checkpoint: 400 s failed;
    4. completed at 5000..8000: ready after 200, 28 -> 55, 27 run, no tail (completed)."""
    a = lambda **kw: ledger.append(path, kw.pop("rec"))  # noqa: E731
    s = dict(host="h", num_rollout=55, resume=False, walltime_s=3600, lead_s=120)
    a(rec=ledger.start_record(job_id="1", restart=0, rollouts_at_start=0, now=T0, **s))
    a(rec={**ledger.end_record(job_id="1", restart=0, rollouts_at_end=28, reason="walltime", detail="d",
                               next_action="resubmit", next_job_id="2", rollout_s=100.0, save_s=20.0, now=T0 + 3600),
           "ready_s": 300.0, "rollouts_run": 30, "last_save_at": T0 + 3200})
    a(rec=ledger.start_record(job_id="2", restart=0, rollouts_at_start=28, now=T0 + 3900, **s))
    a(rec={**ledger.end_record(job_id="2", restart=0, rollouts_at_end=28, reason="node-failure", detail="d",
                               next_action="resubmit", next_job_id="3", rollout_s=None, save_s=None, now=T0 + 4500),
           "ready_s": 250.0, "rollouts_run": 0})
    a(rec=ledger.start_record(job_id="3", restart=0, rollouts_at_start=28, now=T0 + 4600, **s))
    a(rec=ledger.start_record(job_id="4", restart=0, rollouts_at_start=28, now=T0 + 5000, **s))
    a(rec={**ledger.end_record(job_id="4", restart=0, rollouts_at_end=55, reason="completed", detail="d",
                               next_action="none", next_job_id=None, rollout_s=100.0, save_s=20.0, now=T0 + 8000),
           "ready_s": 200.0, "rollouts_run": 27, "last_save_at": T0 + 7990})


def test_gpu_hours_held_and_lost_by_cause_on_a_hand_made_ledger(tmp_path: Path) -> None:
    path = tmp_path / "ledger.jsonl"
    _write(path)
    segments, warnings = ledger.read_ledger(path)
    assert not warnings and len(segments) == 4
    hours = accounting.account(segments, GPUS, now=T0 + 9000)
    h = GPUS / 3600
    held_s = 3600 + 600 + 400 + 3000
    assert hours.held_h == pytest.approx(held_s * h)
    assert hours.lost_h[accounting.BRINGUP] == pytest.approx((300 + 200) * h)
    assert hours.lost_h[accounting.REDONE] == pytest.approx(200 * h)
    assert hours.lost_h[accounting.TAIL] == pytest.approx(200 * h)
    assert hours.lost_h[accounting.FAILED] == pytest.approx((600 + 400) * h)
    useful_s = held_s - (500 + 200 + 200 + 1000)
    assert hours.useful_h == pytest.approx(useful_s * h)
    assert hours.goodput == pytest.approx(useful_s / held_s)
    assert not hours.partial


def test_a_running_segment_is_held_not_judged_and_old_lines_are_partial(tmp_path: Path) -> None:
    path = tmp_path / "ledger.jsonl"
    s = dict(host="h", num_rollout=10, resume=False, walltime_s=3600, lead_s=120)
    ledger.append(path, ledger.start_record(job_id="1", restart=0, rollouts_at_start=0, now=T0, **s))
    ledger.append(path, ledger.end_record(job_id="1", restart=0, rollouts_at_end=4, reason="walltime", detail="",
                                          next_action="resubmit", next_job_id="2", rollout_s=10.0, save_s=1.0,
                                          now=T0 + 100))  # an old-style end line: no ready_s, rollouts_run
    ledger.append(path, ledger.start_record(job_id="2", restart=0, rollouts_at_start=4, now=T0 + 200, **s))
    hours = accounting.account(ledger.read_ledger(path)[0], 8, now=T0 + 260)
    assert hours.held_h == pytest.approx((100 + 60) * 8 / 3600)
    assert hours.useful_h == pytest.approx(100 * 8 / 3600)  # the running segment is not judged yet
    assert hours.partial and sum(hours.lost_h.values()) == 0


def test_estimate_states_hours_and_segments_or_says_unknown() -> None:
    est = accounting.estimate(gpus=96, rollouts_left=100, walltime_s=4 * 3600, lead_s=600, rollout_s=300.0,
                              basis="measured by the run's last segments", bringup_s=600)
    # per segment: (14400 - 600 - 600) / 300 = 44 rollouts -> 3 segments; wall 100*300 + 3*600
    assert est.segments == 3 and est.wall_s == pytest.approx(31_800)
    assert est.gpu_hours == pytest.approx(96 * 31_800 / 3600)
    assert "about 848.0" in est.describe() and "3 segment(s)" in est.describe()
    unknown = accounting.estimate(gpus=96, rollouts_left=100, walltime_s=3600, lead_s=600, rollout_s=None,
                                  basis="", bringup_s=600)
    assert unknown.gpu_hours is None and "unknown until the first segment" in unknown.describe()


def test_a_stall_costs_its_silent_time_or_the_whole_segment_when_it_kept_nothing(tmp_path: Path) -> None:
    """Stalls are their own cause: a segment that saved progress and then stalled loses the time
    from its last finished rollout to its end (the timeout, the dumps, the teardown); one that
    stalled before saving anything loses all of it."""
    path = tmp_path / "ledger.jsonl"
    s = dict(host="h", num_rollout=20, resume=False, walltime_s=3600, lead_s=120)
    ledger.append(path, ledger.start_record(job_id="1", restart=0, rollouts_at_start=0, now=T0, **s))
    ledger.append(path, {**ledger.end_record(
        job_id="1", restart=0, rollouts_at_end=4, reason="stalled", detail="d", next_action="resubmit", next_job_id="2",
        rollout_s=100.0, save_s=10.0, now=T0 + 2000, stall={"rollout": 5, "last_rollout": 4, "since": T0 + 800,
                                                             "caught_at": T0 + 1990, "timeout_s": 1190, "dumps": []}),
        "ready_s": 300.0, "rollouts_run": 5, "last_save_at": T0 + 790})
    ledger.append(path, ledger.start_record(job_id="2", restart=0, rollouts_at_start=4, now=T0 + 2100, **s))
    ledger.append(path, {**ledger.end_record(
        job_id="2", restart=0, rollouts_at_end=4, reason="stalled", detail="d", next_action="none", next_job_id=None,
        rollout_s=None, save_s=None, now=T0 + 2700, stall={"rollout": 4, "last_rollout": None, "since": T0 + 2200,
                                                             "caught_at": T0 + 2690, "timeout_s": 490, "dumps": []}),
        "ready_s": 100.0, "rollouts_run": 0})
    segments, warnings = ledger.read_ledger(path)
    assert not warnings
    hours = accounting.account(segments, 8, now=T0 + 3000)
    h = 8 / 3600
    assert hours.lost_h[accounting.STALLED] == pytest.approx((1200 + 600) * h)  # 2000 - 800, and all of segment 2
    assert hours.lost_h[accounting.REDONE] == pytest.approx(100 * h)  # rollout 4 was trained, not saved
    assert hours.lost_h[accounting.FAILED] == 0 and hours.lost_h[accounting.BRINGUP] == pytest.approx(300 * h)
    assert hours.useful_h == pytest.approx((2000 - 1200 - 100 - 300) * h)


def test_a_lost_rollout_node_is_held_only_until_its_loss(tmp_path: Path) -> None:
    """A segment of 8 GPU nodes x 4 (32 GPUs) that lost a rollout node 400 s into its 1,000 s and
    went on (a ``failed_nodes`` entry with ``lost_at``, as beam_hpc.job.runner writes it): Slurm
    excised the node then and stopped billing it, so its 8 GPUs are held 400 s, not 1,000. A node
    that a node failure blames (no ``lost_at``) ends the segment with it: nothing to take off."""
    path = tmp_path / "ledger.jsonl"
    s = dict(host="h", num_rollout=20, resume=False, walltime_s=3600, lead_s=120)
    ledger.append(path, ledger.start_record(job_id="5", restart=0, rollouts_at_start=0, now=T0, **s))
    ledger.append(path, ledger.end_record(
        job_id="5", restart=0, rollouts_at_end=20, reason="completed", detail="d", next_action="none",
        next_job_id=None, rollout_s=40.0, save_s=5.0, ready_s=100.0, rollouts_run=20, now=T0 + 1000,
        failed_nodes=[{"node": "n6", "why": "rollout node lost mid-segment (it went on)", "lost_at": T0 + 400},
                      {"node": "n2", "why": "node step failed"}]))
    segments, _ = ledger.read_ledger(path)
    hours = accounting.account(segments, 32, now=T0 + 2000, lost_node_gpus=8)
    assert hours.held_h == pytest.approx((32 * 1000 - 8 * 600) / 3600)
    assert hours.useful_h == pytest.approx((32 * (1000 - 100) - 8 * 600) / 3600)  # bring-up 100 s lost by all
    unknown = accounting.account(segments, 32, now=T0 + 2000)  # the node's GPUs unknown: all held, as before
    assert unknown.held_h == pytest.approx(32 * 1000 / 3600)
