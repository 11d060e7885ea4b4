"""beam_hpc.lifecycle.exclusions: the run's failed nodes, over the ledger, and when they stop the chain."""

from __future__ import annotations

from pathlib import Path

import pytest

from beam_hpc.errors import InputError
from beam_hpc.lifecycle.decide import Action, Outcome, decide
from beam_hpc.run import ledger


def _failed_on(job: str, t: float, *nodes: str) -> list[dict]:
    start = ledger.start_record(job_id=job, restart=0, host="h", rollouts_at_start=0, num_rollout=10,
                                resume=False, walltime_s=600, lead_s=60, now=t - 10)
    end = ledger.end_record(job_id=job, restart=0, rollouts_at_end=0, reason="node-failure", detail="d",
                            next_action="resubmit", next_job_id=None, rollout_s=None, save_s=None, now=t,
                            failed_nodes=[{"node": n, "why": f"{n} broke"} for n in nodes])
    return [start, end]


def test_exclusions_accumulate_over_the_ledger_and_clearings_undo_them(tmp_path: Path) -> None:
    from beam_hpc.lifecycle import exclusions

    path = tmp_path / "ledger.jsonl"
    for rec in _failed_on("1", 100.0, "n3") + _failed_on("2", 200.0, "n5", "n3"):
        ledger.append(path, rec)
    segs, _ = ledger.read_ledger(path)
    ex = exclusions.from_ledger(segs)
    assert [(e.node, e.segment, e.time) for e in ex] == [("n5", "2-0", 200.0), ("n3", "2-0", 200.0)]
    assert exclusions.names(exclusions.from_ledger(segs, [{"node": "n3", "time": 150.0}])) == ["n5", "n3"]
    assert exclusions.names(exclusions.from_ledger(segs, [{"node": "n3", "time": 250.0}])) == ["n5"]
    assert exclusions.names(exclusions.from_ledger(segs, [{"node": "*", "time": 250.0}])) == []
    # this segment's failures count before its end line is written
    assert exclusions.names(exclusions.effective(tmp_path, segs, [{"node": "n7", "why": "x"}])) == ["n5", "n3", "n7"]
    # submit --resume --include-node: a typo is refused, a real name is cleared and recorded
    with pytest.raises(InputError, match="not excluded"):
        exclusions.for_submission(tmp_path, ["n9"])
    assert exclusions.for_submission(tmp_path, ["n3"]) == ["n5"]
    assert exclusions.for_submission(tmp_path) == ["n5"]
    assert exclusions.for_submission(tmp_path, ["all"]) == []


def test_exclusions_stop_the_chain_when_the_nodes_left_cannot_hold_the_groups() -> None:
    from beam_hpc.lifecycle.exclusions import shortfall

    parts = {"gpu": ["n1", "n2", "n3", "n4"], None: ["n1", "n2", "n3", "n4"]}
    needs = [("trainer", 2, "gpu"), ("rollout", 1, "gpu")]
    assert shortfall(needs, parts, ["n3"]) is None
    why = shortfall(needs, parts, ["n3", "n4"])
    assert why and "partition gpu has 4 nodes, 2 of them excluded after failing (n3, n4): 2 left" in why
    assert "--include-node" in why
    assert shortfall(needs, {}, ["n1", "n2", "n3", "n4"]) is None  # unknown partition: Slurm decides
    out = Outcome(reason="node-failure", rollouts_at_start=0, rollouts_at_end=0, num_rollout=10)
    d = decide(out, history=[], max_segments=10, cancelled=False, requeue_on_preemption=True, nodes_short=why)
    assert d.action == Action.NONE and "retrying once, but partition gpu" in d.detail
    d = decide(out, history=[], max_segments=10, cancelled=False, requeue_on_preemption=True, nodes_short=None)
    assert d.action == Action.RESUBMIT
