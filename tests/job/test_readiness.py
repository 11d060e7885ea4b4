"""beam_hpc.job.readiness: the readiness rule on node lists shaped like ray.nodes(), and the naming of
nodes that never joined (from the node steps' real report files)."""

from __future__ import annotations

import time

from job_plans import make_test_plan

from beam_hpc.job.readiness import Expected, evaluate, lacking_in_existing, missing_nodes
from beam_hpc.node.ray_node import ClusterRuntime, write_json_atomic

EXPECTED = [Expected("trainer", 2, 4), Expected("rollout", 1, 2)]


def _node(ip: str, group: str | None, gpus: int, alive: bool = True, resources: dict | None = None) -> dict:
    res = {"GPU": float(gpus), "CPU": 2.0, **({f"beam_{group}": float(gpus)} if group else {}), **(resources or {})}
    return {"Alive": alive, "NodeManagerAddress": ip, "NodeManagerHostname": f"h{ip[-1]}", "NodeID": f"id{ip[-1]}",
            "Labels": {"beam-group": group} if group else {}, "Resources": res}


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


SITE = [Expected("trainer", 1, 2, ("trainer",)), Expected("rollout", 1, 2, ("rollout",))]


def test_an_existing_cluster_may_have_more_but_every_node_needs_its_group_resource():
    head = _node("10.0.0.1", None, 0)  # a CPU-only head of no group, as sites run them
    nodes = [head, _node("10.0.0.2", "trainer", 2), _node("10.0.0.3", "trainer", 2), _node("10.0.0.4", "rollout", 2)]
    assert not evaluate(nodes, SITE).ready  # the job's own cluster must match exactly
    status = evaluate(nodes, SITE, at_least=True)
    assert status.ready and status.joined["trainer"]["nodes"] == 2 and "nodes of no group: 10.0.0.1" in status.summary
    assert status.joined["rollout"]["hosts"][0]["node_id"] == "id4"
    unpinned = _node("10.0.0.4", "rollout", 2)
    del unpinned["Resources"]["beam_rollout"]  # labelled, but placement could never use it
    status = evaluate(nodes[:3] + [unpinned], SITE, at_least=True)
    assert not status.ready and "10.0.0.4 (label beam-group=rollout but no resource beam_rollout)" in status.summary


def test_what_an_existing_cluster_lacks_is_said_per_group_with_the_fix():
    status = evaluate([_node("10.0.0.2", "trainer", 1)], SITE, at_least=True)
    msg = lacking_in_existing(status, SITE, "10.0.0.1:6379")
    assert msg.startswith("the existing Ray cluster at 10.0.0.1:6379 (site ray_address) lacks what the job needs: ")
    assert ("group trainer needs 1 node(s) labelled beam-group=trainer with resource(s) beam_trainer and 2 GPU(s) "
            "in all, the cluster has 1 such node(s) with 1 GPU(s)") in msg
    assert "group rollout needs 1 node(s)" in msg and "the cluster has 0 such node(s) with 0 GPU(s)" in msg
    assert """ray start --address=10.0.0.1:6379 --labels=beam-group=rollout --resources='{"beam_rollout": 2}' --num-gpus=2""" in msg
    assert "It has: trainer: 10.0.0.2 (1 GPUs); rollout: none." in msg and "without ray_address / --ray-address" in msg


def test_attach_retries_a_head_that_is_late_until_the_deadline_and_not_the_sites_cluster():
    """A head whose GCS answers before it can take a driver: ray.init raises (ConnectionError, as seen
    at load 20 on 2 cores), and the job's readiness tries again until its deadline instead of failing
    the segment at once; the site's own cluster gets one try (its error says what to fix)."""
    import pytest

    from beam_hpc.job.readiness import attach

    calls, resets = [], []

    def init_after(n: int):
        def init() -> None:
            calls.append(time.time())
            if len(calls) < n:
                raise ConnectionError("Failed to connect to Ray cluster at 127.0.0.10:41020")
        return init

    assert attach(init_after(3), lambda: resets.append(1), retry_until=time.time() + 30, pause_s=0.01) == 3
    assert len(resets) == 2
    calls.clear()
    with pytest.raises(ConnectionError):  # past the deadline: the error goes up, to be reported
        attach(init_after(100), lambda: None, retry_until=time.time() + 0.2, pause_s=0.05)
    assert 2 <= len(calls) < 100
    calls.clear()
    with pytest.raises(ConnectionError):  # the site's cluster: no retry
        attach(init_after(2), lambda: None, retry_until=None, pause_s=0.01)
    assert len(calls) == 1
