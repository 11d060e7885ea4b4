"""beam_hpc.lifecycle.end with rollout nodes lost while the segment went on (issue 42): they are
recorded like failed nodes whatever the segment's end (the end line's ``failed_nodes``, the run's
exclusions), whereas the nodes a node failure blames count only when the segment ended by one.
The real flow: tests/lifecycle/test_rollout_node_lost_slurm.py. A node Slurm had failed when it
stopped (requeued) the job is recorded the same way, and the requeued job leaves it out; the real
flow: tests/backends/miles/test_miles_engine_recovery_slurm.py."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import pytest
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


def _scontrol_on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A stand-in ``scontrol`` that records each call (one line each) and answers nothing."""
    script, asked = tmp_path / "bin" / "scontrol", tmp_path / "asked"
    script.parent.mkdir()
    script.write_text(f"#!/bin/sh\necho \"$@\" >> {asked}\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{script.parent}{os.pathsep}{os.environ['PATH']}")
    return asked


@pytest.mark.parametrize("requeue_self", [False, True])
def test_a_node_slurm_failed_is_recorded_on_a_requeue_and_the_requeued_job_leaves_it_out(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, requeue_self: bool) -> None:
    asked = _scontrol_on_path(tmp_path, monkeypatch)
    plan = make_test_plan(tmp_path / "run", trainer_nodes=1, rollout_nodes=1)
    facts = SegmentFacts(plan, "78", "78", 0, time.time(), history=[], lead_s=60)
    outcome = Outcome(reason=Reason.PREEMPTED, rollouts_at_start=0, rollouts_at_end=2, num_rollout=20, rollouts_run=2)
    down = {"node": "n6", "why": "Slurm had the node DOWN+NOT_RESPONDING when it stopped the job (reason: Not responding)"}
    ending = end_segment(outcome, facts, detail="SIGTERM: Slurm requeued job 78", metrics=SegmentMetrics(2, 2.0, 0.5),
                         failed_nodes=[{"node": "n5", "why": "node step failed"}], slurm_failed=[down],
                         requeue_self=requeue_self)
    (seg,), _ = ledger.read_ledger(plan.paths.ledger)
    line = seg["end"]
    assert line["reason"] == "preempted" and line["next"]["action"] == "requeue" and ending.exit_code == 0
    assert line["failed_nodes"] == [down] and ending.excluded == ("n6",)  # n5: no node failure ended it
    assert "Slurm had node(s) n6 failed" in line["detail"]
    updates = [c for c in asked.read_text().splitlines() if c.startswith("update")]
    if requeue_self:  # the job requeues itself after the lock, and sets its ExcNodeList then
        assert updates == []
    else:  # Slurm requeued it: the pending job's ExcNodeList is set now, before this job ends
        assert updates == ["update JobId=78 ExcNodeList=n6"]


def test_a_node_failure_slurm_does_not_requeue_resubmits_without_the_node(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A --no-requeue job Slurm ended for a failed node (the watchdog's node-failed interrupt, read
    from Reason=NodeDown on the real cluster: tests/lifecycle/test_watchdog_slurm.py): the runtime
    blamed no node, Slurm named one. The segment is a node failure, resubmitted from the checkpoint
    with the node left out; before, it read as a cancel and the chain stopped."""
    asked = _scontrol_on_path(tmp_path, monkeypatch)
    for name, answer in (("sbatch", "echo 79"), ("squeue", "true")):  # the resubmission's two Slurm calls
        tool = asked.parent / "bin" / name
        tool.write_text(f"#!/bin/sh\necho {name} \"$@\" >> {asked}\n{answer}\n")
        tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    plan = make_test_plan(tmp_path / "run", trainer_nodes=1, rollout_nodes=1)
    Path(plan.paths.script).parent.mkdir(parents=True, exist_ok=True)
    Path(plan.paths.script).write_text("#!/bin/bash\n")
    facts = SegmentFacts(plan, "78", "78", 0, time.time(), history=[], lead_s=60)
    outcome = Outcome(reason=Reason.NODE_FAILURE, rollouts_at_start=0, rollouts_at_end=2, num_rollout=20,
                      rollouts_run=2)
    down = {"node": "n6", "why": "Slurm had the node DOWN+FAIL when it stopped the job (reason: disk)"}
    ending = end_segment(outcome, facts, detail="SIGTERM: Slurm ended job 78 for a failed node (Reason=NodeDown)",
                         metrics=SegmentMetrics(2, 2.0, 0.5), slurm_failed=[down])
    (seg,), _ = ledger.read_ledger(plan.paths.ledger)
    line = seg["end"]
    assert line["reason"] == "node-failure" and line["next"] == {"action": "resubmit", "job_id": "79"}, line
    assert line["failed_nodes"] == [down] and ending.excluded == ("n6",)
    (submitted,) = [c for c in asked.read_text().splitlines() if c.startswith("sbatch")]
    assert "--exclude=n6" in submitted.split() and "--dependency=afterany:78" in submitted.split(), submitted
