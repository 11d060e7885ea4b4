"""ETTR from the ledger (beam_hpc.observe.ettr): synthetic ledgers whose answers are known by hand,
and the real ledger of the 2026-12-04 fault campaign (seed 1), committed in benchmarks/results."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from beam_hpc.observe.ettr import ettr, read_ettr
from beam_hpc.run import ledger
from beam_hpc.run.accounting import account

ROOT = Path(__file__).resolve().parents[2]


def _start(job: str, at: float, from_rollout: int, *, damaged: list[int] = ()) -> dict:  # type: ignore[assignment]
    return ledger.start_record(job_id=job, restart=0, host="n1", rollouts_at_start=from_rollout, num_rollout=30,
                               resume=from_rollout > 0, walltime_s=3600, lead_s=60, now=at,
                               damaged_checkpoints=[{"iteration": d, "why": "torn"} for d in damaged])


def _end(job: str, at: float, saved: int, *, reason: str, step_s: float | None, run: int, ready_s: float = 10.0) -> dict:
    return ledger.end_record(job_id=job, restart=0, rollouts_at_end=saved, reason=reason, detail="", next_action="none",
                             next_job_id=None, rollout_s=step_s, save_s=1.0, ready_s=ready_s, rollouts_run=run,
                             now=at)


def _write(path: Path, records: list[dict]) -> Path:
    for r in records:
        ledger.append(path / "ledger.jsonl", r)
    return path


def test_kept_rollouts_at_their_step_time_over_held_time(tmp_path: Path) -> None:
    """Two segments, a walltime stop between them: 10 rollouts at 5 s, then 10 at 4 s, in 100 s each,
    with a 30 s queue wait between them that is not held."""
    run = _write(tmp_path, [_start("1", 0, 0), _end("1", 100, 10, reason="walltime", step_s=5.0, run=10),
                            _start("2", 130, 10), _end("2", 230, 20, reason="completed", step_s=4.0, run=10)])
    e, warnings = read_ettr(run, now=1000)
    assert not warnings and (e.training_s, e.held_s, e.span_s, e.rollouts_kept) == (90.0, 200.0, 230.0, 20)
    assert e.ratio == pytest.approx(0.45) and e.span_ratio == pytest.approx(90 / 230)
    assert not e.partial and not e.running


def test_work_after_the_last_save_and_a_damaged_checkpoints_rollouts_are_held_not_training(tmp_path: Path) -> None:
    """Segment 1 trains 14 rollouts at 2 s but its node fails after the save at 10: 4 are lost.
    Segment 2 saves 24 at 3 s, but segment 3 finds checkpoint 23 torn and resumes from 20: segment
    2's rollouts 20-23 are lost too, and trained again at 1 s. Kept: 0-9 at 2 s, 10-19 at 3 s,
    20-29 at 1 s."""
    run = _write(tmp_path, [
        _start("1", 0, 0), _end("1", 50, 10, reason="node-failure", step_s=2.0, run=14),
        _start("2", 60, 10), _end("2", 110, 24, reason="walltime", step_s=3.0, run=14),
        _start("3", 120, 20, damaged=[23]), _end("3", 150, 30, reason="completed", step_s=1.0, run=10)])
    e, _ = read_ettr(run, now=1000)
    assert (e.training_s, e.held_s, e.rollouts_kept) == (10 * 2.0 + 10 * 3.0 + 10 * 1.0, 130.0, 30)
    hours = account(ledger.read_ledger(run / "ledger.jsonl")[0], 1, now=1000)
    assert e.ratio is not None and hours.goodput is not None and e.ratio < hours.goodput  # stricter than goodput


def test_a_segment_killed_without_an_end_line_and_a_running_one(tmp_path: Path) -> None:
    """Segment 1 dies without an end line after saving 6 (segment 2 starts there): its 6 rollouts
    are timed at the run's mean step (partial), its held time runs to segment 2's start. Segment 3
    is still running: left out of both sides until it ends."""
    run = _write(tmp_path, [_start("1", 0, 0), _start("2", 40, 6),
                            _end("2", 100, 12, reason="walltime", step_s=4.0, run=6), _start("3", 110, 12)])
    e, _ = read_ettr(run, now=130)
    assert (e.training_s, e.held_s, e.rollouts_kept, e.segments) == (12 * 4.0, 100.0, 12, 2)
    assert e.partial and e.running and e.span_s == 100.0


def test_no_finished_segment_has_no_ratio(tmp_path: Path) -> None:
    assert ettr([], now=0).ratio is None
    e, _ = read_ettr(_write(tmp_path, [_start("1", 0, 0)]), now=50)
    assert e.ratio is None and e.running


def test_the_fault_campaigns_real_ledger() -> None:
    """Seed 1 of benchmarks/results/faults-2026-12-04.md: 7 segments, each struck by a fault. The
    rollouts kept, read off its ledger by hand: 0-18 by 67-0, 19 by 69-0 (stalled after it), 20-37 by
    83-1 (83-0 saved 20-23, but 83-1 passed over the torn checkpoint 23 and trained them again),
    38-39 by 107-0, 40-43 by 121-0, 44-79 by 131-0."""
    record = json.loads((ROOT / "benchmarks" / "results" / "faults-2026-12-04-seed1.json").read_text())
    segs = record["ledger"]
    step = {s["segment"]: s["end"]["timings"]["rollout_s"] for s in segs}
    kept = {"67-0": 19, "69-0": 1, "83-1": 18, "107-0": 2, "121-0": 4, "131-0": 36}
    e = ettr(segs, now=record["ended_at"])
    assert e.rollouts_kept == 80 == sum(kept.values()) and e.segments == 7 and not e.partial
    assert e.training_s == pytest.approx(sum(n * step[s] for s, n in kept.items()))
    assert e.held_s == pytest.approx(sum(s["end"]["time"] - s["start"]["time"] for s in segs))
    goodput = account(segs, record["gpus"], now=record["ended_at"]).goodput
    assert e.ratio == pytest.approx(0.377, abs=0.001) and goodput is not None and e.ratio < goodput
