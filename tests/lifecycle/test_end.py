"""beam_hpc.lifecycle.end: from an Outcome to the decision carried out, the end line and the exit
code. Cases that need no Slurm command (a local run's resubmission is only decided; a requeue is
Slurm's or, after a graceful preemption save, the job's own once the lock is released); a real
resubmission and self-requeue: tests/lifecycle/test_lifecycle_slurm.py."""

from __future__ import annotations

import time
from pathlib import Path

from job_plans import make_test_plan

from beam_hpc.lifecycle.decide import Action, Outcome
from beam_hpc.lifecycle.end import EXIT_ERROR, EXIT_OK, After, SegmentFacts, end_segment
from beam_hpc.lifecycle.save import SaveResult
from beam_hpc.lifecycle.segment_metrics import SegmentMetrics
from beam_hpc.run import ledger
from beam_hpc.run.ledger import Reason


def _end(tmp_path: Path, reason: Reason, *, job_id: str | None, requeue_self: bool = False,
         saved: SaveResult | None = None):
    plan = make_test_plan(tmp_path / "run", trainer_nodes=1, rollout_nodes=1)
    facts = SegmentFacts(plan, job_id, job_id or "l123", 0, time.time(), history=[], lead_s=60)
    outcome = Outcome(reason=reason, rollouts_at_start=0, rollouts_at_end=4, num_rollout=20, rollouts_run=5)
    ending = end_segment(outcome, facts, detail="what happened", metrics=SegmentMetrics(5, 2.0, 0.5),
                         saved=saved, ready_s=1.23456, requeue_self=requeue_self)
    (seg,), warnings = ledger.read_ledger(plan.paths.ledger)
    assert not warnings
    return ending, seg["end"]


def test_a_graceful_preemption_requeues_itself_after_the_lock_and_exits_0(tmp_path: Path) -> None:
    saved = SaveResult(True, 3, 4.5, "checkpoint 3 saved on request")
    ending, line = _end(tmp_path, Reason.PREEMPTED, job_id="77", requeue_self=True, saved=saved)
    assert ending.decision.action is Action.REQUEUE and ending.next_job_id == "77"
    assert ending.after is After.REQUEUE_SELF and ending.exit_code == EXIT_OK
    assert line["reason"] == "preempted" and line["next"] == {"action": "requeue", "job_id": "77"}
    assert line["detail"].startswith("what happened -> preempted: the same job id is requeued")
    assert line["timings"] == {"rollout_s": 2.0, "save_s": 4.5} and line["ready_s"] == 1.235  # the save's own seconds
    ending, _ = _end(tmp_path / "slurm", Reason.PREEMPTED, job_id="78")  # Slurm requeued it (SIGTERM): not ours
    assert ending.after is After.NOTHING


def test_a_local_run_decides_a_resubmission_but_sends_none(tmp_path: Path) -> None:
    ending, line = _end(tmp_path, Reason.ERROR, job_id=None)
    assert ending.decision.action is Action.NONE and ending.next_job_id is None and ending.exit_code == EXIT_ERROR
    assert line["detail"] == ("what happened -> error after 4 new rollouts; continuing with --resume "
                              "(not in Slurm: nothing to resubmit)")
    assert line["next"] == {"action": "none", "job_id": None} and line["timings"]["save_s"] == 0.5
