"""beam_hpc.readiness: the readiness rule on node lists shaped like ray.nodes(), and the naming of
nodes that never joined (from the node steps' real report files)."""

from __future__ import annotations

import time

from beam_hpc.ray_node import ClusterRuntime, write_json_atomic
from beam_hpc.readiness import Expected, evaluate, missing_nodes
from job_plans import make_test_plan

EXPECTED = [Expected("trainer", 2, 4), Expected("rollout", 1, 2)]


def _node(ip: str, group: str | None, gpus: int, alive: bool = True) -> dict:
    return {"Alive": alive, "NodeManagerAddress": ip, "NodeManagerHostname": f"h{ip[-1]}",
            "Labels": {"beam-group": group} if group else {}, "Resources": {"GPU": float(gpus), "CPU": 2.0}}


def test_ready_only_when_every_node_and_gpu_of_every_group_joined():
    nodes = [_node("127.0.0.10", "trainer", 2), _node("127.0.0.11", "trainer", 2)]
    status = evaluate(nodes, EXPECTED)
    assert not status.ready and status.summary.startswith("trainer: 2/2 nodes, 4/4 GPUs; rollout: 0/1")
    status = evaluate(nodes + [_node("127.0.0.12", "rollout", 2)], EXPECTED)
    assert status.ready and status.joined["rollout"]["hosts"][0]["ip"] == "127.0.0.12"


def test_dead_nodes_missing_gpus_and_strangers_keep_it_not_ready():
    base = [_node("127.0.0.10", "trainer", 2), _node("127.0.0.11", "trainer", 2), _node("127.0.0.12", "rollout", 2)]
    assert not evaluate(base[:2] + [_node("127.0.0.12", "rollout", 2, alive=False)], EXPECTED).ready
    assert not evaluate(base[:2] + [_node("127.0.0.12", "rollout", 1)], EXPECTED).ready
    stranger = evaluate(base + [_node("127.0.0.99", None, 0)], EXPECTED)
    assert not stranger.ready and "unexpected nodes: 127.0.0.99" in stranger.summary


def test_missing_nodes_are_named_with_their_state_and_log(tmp_path):
    plan = make_test_plan(tmp_path / "run", trainer_nodes=2, rollout_nodes=1)
    rt = ClusterRuntime(job_id="7", job_num=7, restart=0, job_tag="t", head_ip="127.0.0.10", gcs_port=1,
                        host_stride=16, token_path="/t", segment_dir=str(tmp_path / "seg"), nonce="n",
                        deadline=time.time(), nodelists={"trainer": ["n1", "n2"], "rollout": ["n3"]})
    write_json_atomic(rt.node_report("trainer", 0), {"ip": "127.0.0.10", "state": "running"})
    write_json_atomic(rt.node_report("trainer", 1), {"ip": "127.0.0.11", "state": "failed", "error": "disk full"})
    status = evaluate([_node("127.0.0.10", "trainer", 2)], [Expected(g.name, g.nodes, g.gpus) for g in plan.groups])
    missing = missing_nodes(status, plan, rt)
    assert len(missing) == 2
    assert missing[0].startswith("trainer node 1 (n2, 127.0.0.11: disk full; log ") and "node-trainer-1.log" in missing[0]
    assert missing[1].startswith("rollout node 0 (n3: its node step never reported")
