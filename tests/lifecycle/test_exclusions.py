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


def test_slurms_down_fail_and_not_responding_nodes_are_failed_and_a_drained_one_is_not() -> None:
    from beam_hpc.lifecycle.exclusions import failed_by_slurm
    from beam_hpc.slurm.client import NodeInfo

    nodes = [NodeInfo("n1", "ALLOCATED"), NodeInfo("n2", "DOWN+NOT_RESPONDING", "Not responding [slurm@2026-12-07T11:51:53]"),
             NodeInfo("n3", "IDLE+FAIL", "beam-test [root@t]"), NodeInfo("n4", "MIXED+DRAIN", "maintenance [root@t]"),
             NodeInfo("n5", "IDLE+NOT_RESPONDING"), NodeInfo("n6", "DRAINED"), NodeInfo("n7", "IDLE+POWERED_DOWN"),
             NodeInfo("n8", "down*"), NodeInfo("n2", "DOWN"), NodeInfo("n9", "DOWN+DRAIN", "bad gpu [root@t]"),
             NodeInfo("n10", "FAILING")]
    failed = failed_by_slurm(nodes)
    assert [f["node"] for f in failed] == ["n2", "n3", "n5", "n8", "n9", "n10"]  # each once, in Slurm's order
    assert failed[0]["why"] == ("Slurm had the node DOWN+NOT_RESPONDING when it stopped the job "
                                "(reason: Not responding [slurm@2026-12-07T11:51:53])")
    assert failed[2]["why"] == "Slurm had the node IDLE+NOT_RESPONDING when it stopped the job"  # no reason given
    assert failed_by_slurm([]) == []


def test_a_question_slurm_does_not_answer_fails_no_node() -> None:
    from beam_hpc.lifecycle.exclusions import failed_in_slurm
    from beam_hpc.slurm.client import NodeInfo, SlurmUnavailable

    asked: list[tuple[list[str], float]] = []

    def answer(nodes: list[str], *, timeout: float) -> list[NodeInfo]:
        asked.append((nodes, timeout))
        return [NodeInfo("n1", "MIXED"), NodeInfo("n4", "DOWN", "gone [root@t]")]

    assert failed_in_slurm(["n1", "", "n4"], query=answer, timeout=3) == [
        {"node": "n4", "why": "Slurm had the node DOWN when it stopped the job (reason: gone [root@t])"}]
    assert asked == [(["n1", "n4"], 3)]  # the components' node lists as they are, one question

    def silent(nodes: list[str], *, timeout: float) -> list[NodeInfo]:
        raise SlurmUnavailable(["scontrol"], "Unable to contact slurm controller (connect failure)")

    assert failed_in_slurm(["n1"], query=silent) == []
