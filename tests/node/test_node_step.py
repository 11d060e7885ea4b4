"""beam_hpc.node.step without Slurm or Ray: a worker whose head is late, and the node's private directory.

The readiness deadline belongs to the job: a worker that gave up on a late head would end its node step
with an error, and the job records the node of the first failed step as the bad one and excludes it next
time. The node's own fault it was not: the worker must wait on, say so in its report, and be stopped by
the job (here: the SIGTERM flag its signal handler sets).
"""

from __future__ import annotations

import dataclasses
import json
import socket
import threading
import time
from pathlib import Path

from job_plans import make_test_plan

from beam_hpc.node.ray_node import ClusterRuntime, RayNode, ray_ports
from beam_hpc.node.step import NodeStep


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_worker_whose_head_misses_the_deadline_waits_on_and_is_not_failed(tmp_path: Path) -> None:
    plan = make_test_plan(tmp_path / "run", trainer_nodes=1, rollout_nodes=1, gpus=1, local_run=True)
    gcs = _free_port()  # nothing listens there: the head never comes up
    rt = ClusterRuntime(job_id="7", job_num=7, restart=0, job_tag="t.7.0", head_ip="127.0.0.1", gcs_port=gcs,
                        host_stride=1, token_path=str(tmp_path / "token"), segment_dir=str(tmp_path / "seg"),
                        nonce="n", deadline=time.time() - 1, nodelists={"trainer": ["a"], "rollout": ["b"]})
    step = NodeStep(plan, plan.group("rollout"), rt, local_index=0, ip="127.0.0.1", gpus=1, cpus=1)
    node = RayNode(group="rollout", roles=("rollout",), index=1, ip="127.0.0.1", head_ip="127.0.0.1",
                   ports=dataclasses.replace(ray_ports(plan.site.ray, 7), gcs=gcs), num_cpus=1, num_gpus=1,
                   object_store_bytes=1, temp_dir=str(tmp_path / "ray"))
    stopper = threading.Timer(1.5, lambda: setattr(step, "stop_reason", "SIGTERM"))
    stopper.start()
    result: list[BaseException | None] = []

    def wait() -> None:
        try:
            step._wait_for_gcs(node)
            result.append(None)
        except BaseException as err:  # the test reads which one
            result.append(err)

    waiter = threading.Thread(target=wait)
    waiter.start()
    waiter.join(timeout=30)
    stopper.cancel()
    assert result and type(result[0]).__name__ == "Stop", result  # ended by the job's stop, not by an error
    report = json.loads(rt.node_report("rollout", 0).read_text())
    assert report["state"] == "waiting-for-head"
    assert "did not answer before the job's readiness deadline" in report["error"]


def test_a_worker_waits_for_the_heads_ray_not_only_its_gcs_port(tmp_path: Path) -> None:
    """The head's GCS answers minutes before its raylet registers on a loaded node, and a worker's
    `ray start` in that gap fails ("No node info found for head node in GCS"): the worker waits until
    the head's node step reports that `ray start` said Ray is up."""
    plan = make_test_plan(tmp_path / "run", trainer_nodes=1, rollout_nodes=1, gpus=1, local_run=True)
    with socket.socket() as gcs:  # the head's GCS: listening from the start
        gcs.bind(("127.0.0.1", 0))
        gcs.listen(8)
        port = gcs.getsockname()[1]
        rt = ClusterRuntime(job_id="7", job_num=7, restart=0, job_tag="t.7.0", head_ip="127.0.0.1", gcs_port=port,
                            host_stride=1, token_path=str(tmp_path / "token"), segment_dir=str(tmp_path / "seg"),
                            nonce="n", deadline=time.time() + 60, nodelists={"trainer": ["a"], "rollout": ["b"]})
        head = NodeStep(plan, plan.group("trainer"), rt, local_index=0, ip="127.0.0.1", gpus=1, cpus=1)
        head._write_report("running", ray_pid=1, attempt=1)  # `ray start` runs, Ray not up yet
        step = NodeStep(plan, plan.group("rollout"), rt, local_index=0, ip="127.0.0.1", gpus=1, cpus=1)
        node = RayNode(group="rollout", roles=("rollout",), index=1, ip="127.0.0.1", head_ip="127.0.0.1",
                       ports=dataclasses.replace(ray_ports(plan.site.ray, 7), gcs=port), num_cpus=1, num_gpus=1,
                       object_store_bytes=1, temp_dir=str(tmp_path / "ray"))
        done = threading.Event()
        waiter = threading.Thread(target=lambda: (step._wait_for_gcs(node), done.set()))
        waiter.start()
        assert not done.wait(1.5)  # the port answers, the head's Ray is not up: still waiting
        head._write_report("running", ray_started=True)
        assert done.wait(10)
        waiter.join(timeout=10)
