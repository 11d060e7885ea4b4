"""beam_hpc.lifecycle.end with rollout nodes lost while the segment went on (issue 42): they are
recorded like failed nodes whatever the segment's end (the end line's ``failed_nodes``, the run's
exclusions), whereas the nodes a node failure blames count only when the segment ended by one.
The real flow: tests/lifecycle/test_rollout_node_lost_slurm.py."""

from __future__ import annotations

import time
from pathlib import Path

from job_plans import make_test_plan

from beam_hpc.lifecycle.decide import Outcome
from beam_hpc.lifecycle.end import SegmentFacts, end_segment
from beam_hpc.lifecycle.segment_metrics import SegmentMetrics
from beam_hpc.run import ledger
from beam_hpc.run.ledger import Reason

LOST = {"node": "n6", "why": "rollout node lost mid-segment (it went on): node step failed: exit code 0"}


def _end(tmp_path: Path, *, lost: list[dict[str, str]], failed: list[dict[str, str]]) -> tuple[tuple[str, ...], dict]:
    plan = make_test_plan(tmp_path / "run", trainer_nodes=2, rollout_nodes=2)
    facts = SegmentFacts(plan, "78", "78", 0, time.time(), history=[], lead_s=60)
    outcome = Outcome(reason=Reason.COMPLETED, rollouts_at_start=0, rollouts_at_end=20, num_rollout=20, rollouts_run=20)
    ending = end_segment(outcome, facts, detail="done", metrics=SegmentMetrics(20, 2.0, 0.5), failed_nodes=failed,
                         lost_nodes=lost)
    (seg,), _ = ledger.read_ledger(plan.paths.ledger)
    return ending.excluded, seg["end"]


def test_a_lost_rollout_node_is_recorded_and_excluded_though_the_segment_completed(tmp_path: Path) -> None:
    excluded, line = _end(tmp_path, lost=[LOST], failed=[])
    assert line["reason"] == "completed" and line["failed_nodes"] == [LOST]
    assert "n6" in excluded


def test_nodes_a_node_failure_would_blame_count_only_when_one_ended_the_segment(tmp_path: Path) -> None:
    excluded, line = _end(tmp_path, lost=[], failed=[{"node": "n7", "why": "node step failed"}])
    assert line["failed_nodes"] == [] and "n7" not in excluded
