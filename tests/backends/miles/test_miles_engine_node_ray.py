"""What Miles's engine recovery does when the engine's whole node is gone, on a real Ray cluster.

Miles main (radixark/miles@31f1ca961; the facts in the Miles double's ``miles/utils/health_monitor.py``)
restarts a dead engine on the *same placement-group bundle*. When the engine's node is gone, Ray
marks the bundle RESCHEDULING and places it again only on a node whose resources (and, under
beam-hpc's placement patch, labels) fit it. So, with the double's server group, rollout manager and
health monitor on a three-process loopback Ray cluster (a head without GPUs, an engine node, later
a spare):

- the node of the only engine is killed (its raylet, workers and the SGLang server): the health
  monitor kills the engine's slot;
- once the GCS has declared the node dead, the next weight update's recover blocks: no node can
  hold the bundle (Miles has no time limit there; this test waits 15 s). A recover that starts
  before the GCS knows places the restarted engine on the dead node, and it raises ActorDiedError
  (the health check, every 0.5 s here, can beat the GCS's node check);
- a node with a free GPU and the bundle's label joins the same Ray cluster: Ray reschedules the
  bundle onto it, recover returns, the engine runs there and serves the new weights.

Why it matters (issue 42): a Miles run can go on without an engine's node only if its Slurm job
survives the loss and new capacity joins the *segment's own Ray cluster* as a node. beam-hpc does
both: the job keeps ``--no-kill`` (``beam_hpc.plan.node_loss``), and after the save a replacement
job's node joins in the lost node's place (``beam_hpc.elastic.ray_replacement``; the whole flow on
Slurm: tests/backends/miles/test_miles_engine_recovery_slurm.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest
from test_miles_placement import LABEL, STANDIN, LoopbackRay, _forget_miles, _free_port

from beam_hpc.node import procs

pytestmark = [pytest.mark.slow, pytest.mark.ray]

HEAD, ENGINE_NODE, SPARE = "127.0.0.80", "127.0.0.81", "127.0.0.82"
GROUP = "engines"
BLOCKED_S = 15.0


def _wait(what: str, predicate, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.3)


def test_a_lost_engine_node_blocks_recovery_until_a_node_joins_the_ray_cluster() -> None:
    import ray
    from ray.util.placement_group import placement_group, placement_group_table

    cluster = LoopbackRay()
    cluster.port = _free_port(HEAD)  # LoopbackRay's own head address is test_miles_placement's
    cluster.address = f"{HEAD}:{cluster.port}"
    # the GCS declares a node dead after 3 missed 1 s checks (Ray's defaults take about 30 s)
    cluster.env.update(RAY_health_check_period_ms="1000", RAY_health_check_failure_threshold="3",
                       RAY_health_check_timeout_ms="1000")
    saved = {k: os.environ.get(k) for k in ("RAY_AUTH_MODE", "RAY_USAGE_STATS_ENABLED")}
    os.environ.update({"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"})
    sys.path.insert(0, str(STANDIN))
    _forget_miles()
    events: list[tuple[str, dict]] = []
    try:
        cluster._start(HEAD, "head", "--head", f"--port={cluster.port}", "--include-dashboard=false")
        _wait("the Ray head", lambda: cluster.procs[0].poll() is None and _listens(HEAD, cluster.port), 90)
        ray.init(address=cluster.address, logging_level="WARNING")
        engine_node = _join(cluster, ENGINE_NODE)
        from miles.ray.rollout.rollout_manager import RolloutManager

        args = SimpleNamespace(rollout_num_gpus_per_engine=1, num_gpus_per_node=2, hf_checkpoint="m", seed=1,
                               use_fault_tolerance=True, ft_components=None, rollout_health_check_interval=0.5,
                               rollout_health_check_timeout=5.0, rollout_health_check_first_wait=0.0,
                               rollout_batch_size=2, n_samples_per_prompt=1)
        pg = placement_group([{"GPU": 1, "CPU": 1}], strategy="PACK", bundle_label_selector=[{LABEL: GROUP}])
        ray.get(pg.ready(), timeout=120)
        manager = RolloutManager(args, (pg, [0], [0]), lambda what, **f: events.append((what, f)))
        manager.update_weights("0")
        assert manager.generate(0)["weight_versions"] == ["0"]  # and the monitor runs until the next update
        first = manager.group.all_engines[0].info
        assert first["node"] == ENGINE_NODE, first

        gone = procs.with_descendants([engine_node.pid])  # the node: ray start, raylet, workers, server
        for pid in gone:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _wait("the health monitor to kill the engine", lambda: [w for w, _ in events] == ["started", "killed"], 120)
        # The update starts once the GCS has declared the node dead and Ray is placing the bundle
        # again. Before that an engine restarted on the bundle is placed on the dead node and dies,
        # and Miles's recover raises ActorDiedError (seen here when the check interval beat the GCS).
        _wait("the GCS to declare the engine node dead", lambda: not _alive(ENGINE_NODE), 60)
        _wait("the bundle to be rescheduled",
              lambda: [t["state"] for t in placement_group_table().values()] == ["RESCHEDULING"], 60)
        done, raised = threading.Event(), []

        def update() -> None:  # an exception here would otherwise only end the thread
            try:
                manager.update_weights("1")
            except BaseException as e:
                raised.append(e)
            done.set()

        threading.Thread(target=update, daemon=True).start()
        assert not done.wait(BLOCKED_S), f"recover returned with no node to hold the engine's bundle: {raised}"
        assert [t["state"] for t in placement_group_table().values()] == ["RESCHEDULING"]
        assert manager.group.all_engines[0].state == "allocated"  # the actor exists, Ray cannot place it

        _join(cluster, SPARE)
        assert done.wait(180), "recover did not return once a node could hold the bundle"
        assert not raised, f"the weight update raised {raised[0]!r}"
        again = manager.group.all_engines[0].info
        assert again["node"] == SPARE and again["bundle"] == first["bundle"], (first, again)
        assert manager.generate(1)["weight_versions"] == ["1"]  # the new engine got the update before serving
        assert [w for w, _ in events] == ["started", "killed", "recovered"], events
        manager.dispose()
    finally:
        ray.shutdown()
        cluster.down()
        sys.path.remove(str(STANDIN))
        _forget_miles()
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def _join(cluster: LoopbackRay, ip: str, attempts: int = 3) -> subprocess.Popen:
    """Start a Ray node at ``ip`` and wait until the GCS counts it alive.

    On a loaded two-core host a raylet can miss Ray's fixed 30 s registration wait and its
    ``ray start`` exits: the node is started again (as beam-hpc's own node start retries).
    """
    for _ in range(attempts):
        cluster._start(ip, GROUP, f"--address={cluster.address}")
        proc = cluster.procs[-1]
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None and not _alive(ip):
            time.sleep(0.3)
        if _alive(ip):
            return proc
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    log = (cluster.base / f"{ip}.log").read_text(errors="replace")[-2000:]
    raise AssertionError(f"the Ray node {ip} did not join after {attempts} starts; its log ends:\n{log}")


def _alive(ip: str) -> bool:
    import ray

    return any(n["Alive"] and n["NodeManagerAddress"] == ip for n in ray.nodes())


def _listens(ip: str, port: int) -> bool:
    import socket

    try:
        socket.create_connection((ip, port), timeout=1).close()
    except OSError:
        return False
    return True
