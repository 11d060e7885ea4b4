"""The smoke driver (``beam-hpc submit RECIPE --smoke``, ``python -m beam_hpc.job.runner --smoke``): the
whole job with a driver that only proves placement.

For every role of every group it reserves one bundle per GPU (one per node on GPU-less groups),
each bundle asking for the role's group resource (``beam_trainer`` / ``beam_rollout``), runs one
task in each bundle, and records where it ran: hostname, node address, the node's group label and
the GPU ids Ray gave it. ``smoke.json`` in the run directory then shows groups -> nodes -> GPU
counts, every task's placement, any misplaced task, and the readiness time. Exit code 0 only when
every task ran on a node of a group that has that role. Users run it before a long run; tests and
benchmarks run it too.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
import time
from pathlib import Path

from beam_hpc.files import write_json_atomic
from beam_hpc.logging_setup import log_to_stream, module_logger
from beam_hpc.plan.paths import SegmentPaths
from beam_hpc.plan.plan import Plan
from beam_hpc.plan.ray_labels import GROUP_LABEL_KEY, GROUP_RESOURCE_PREFIX

log = module_logger(__name__)  # also run as python -m
PG_TIMEOUT_S = 120.0


def smoke_driver_argv(plan: Plan) -> list[str]:
    """The ``--smoke`` driver: one task per GPU bundle of each group, then smoke.json."""
    return [plan.node_python, "-m", "beam_hpc.job.smoke", "--plan", plan.paths.plan, "--ray-address", "{ray_address}"]


def _where() -> dict:
    """Runs inside a Ray task: where am I?"""
    import ray

    ctx = ray.get_runtime_context()
    return {
        "hostname": socket.gethostname(),
        "ip": ray.util.get_node_ip_address(),
        "node_id": ctx.get_node_id(),
        "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
        "pid": os.getpid(),
        "ray_auth_mode": os.environ.get("RAY_AUTH_MODE"),  # inherited from this node's `ray start`
        **_temp_dir_modes(),
    }


def _temp_dir_modes() -> dict:
    """Ray's temp dir on this node and the modes of it and of its parent: Ray makes its own 0777, so
    only a private (0700) parent keeps other users of the node away from its sockets
    (beam_hpc.node.ray_node.temp_dir_for). Read through Ray's worker state, which has no public API."""
    import stat

    import ray

    try:
        temp = ray._private.worker.global_worker.node.get_temp_dir_path()
        modes = [oct(stat.S_IMODE(os.stat(d).st_mode)) for d in (temp, os.path.dirname(temp))]
    except (AttributeError, OSError):
        return {"ray_temp_dir": None}
    return {"ray_temp_dir": temp, "ray_temp_dir_mode": modes[0], "ray_temp_parent_mode": modes[1]}


def run_smoke(plan: Plan, address: str) -> dict:
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING, namespace="beam-smoke")
    nodes = {n["NodeID"]: n for n in ray.nodes() if n["Alive"]}
    groups: dict[str, dict] = {}
    for n in nodes.values():
        g = (n.get("Labels") or {}).get(GROUP_LABEL_KEY, "?")
        groups.setdefault(g, {"nodes": {}, "gpus": 0})
        gpus = int(n["Resources"].get("GPU", 0))
        groups[g]["nodes"][n["NodeManagerAddress"]] = {"hostname": n["NodeManagerHostname"], "gpus": gpus}
        groups[g]["gpus"] += gpus
    where = ray.remote(_where)
    tasks, misplaced = [], []
    for group in plan.groups:
        for role in group.roles:
            res = f"{GROUP_RESOURCE_PREFIX}{role}"
            if group.gpus_per_node:
                bundles = [{"GPU": 1, res: 1} for _ in range(group.gpus)]
                strategy = "PACK"
            else:
                bundles = [{res: 1} for _ in range(group.nodes)]
                strategy = "STRICT_SPREAD"
            pg = placement_group(bundles, strategy=strategy)
            if not _ready(pg):
                remove_placement_group(pg)
                raise RuntimeError(f"placement group for role {role} ({len(bundles)} x {bundles[0]}) "
                                   f"not placed within {PG_TIMEOUT_S:.0f} s")
            refs = [where.options(num_cpus=0, num_gpus=1 if group.gpus_per_node else 0,
                                  scheduling_strategy=PlacementGroupSchedulingStrategy(pg, i)).remote()
                    for i in range(len(bundles))]
            for i, r in enumerate(ray.get(refs)):
                label = (nodes.get(r["node_id"], {}).get("Labels") or {}).get(GROUP_LABEL_KEY)
                task = {"role": role, "group": group.name, "bundle": i, "node_group": label, **r}
                tasks.append(task)
                if label not in {g.name for g in plan.groups if role in g.roles}:
                    misplaced.append(task)
            remove_placement_group(pg)
    ray.shutdown()
    return {"groups": groups, "tasks": tasks, "misplaced": misplaced}


def _ready(pg: object) -> bool:
    import ray

    ready, _ = ray.wait([pg.ready()], timeout=PG_TIMEOUT_S)  # type: ignore[attr-defined]
    return bool(ready)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m beam_hpc.job.smoke", description=__doc__.splitlines()[0])
    parser.add_argument("--plan", required=True)
    parser.add_argument("--ray-address", required=True)
    parser.add_argument("--output", default=None, help="default: RUN_DIR/smoke.json")
    args = parser.parse_args(argv)
    log_to_stream()
    plan = Plan.load(args.plan)
    t = time.time()
    result = run_smoke(plan, args.ray_address)
    seg = os.environ.get("BEAM_SEGMENT_DIR")
    ready_json = SegmentPaths(seg).ready if seg else None
    ready = json.loads(ready_json.read_text()) if ready_json is not None and ready_json.exists() else {}
    result.update(ok=not result["misplaced"], ready_s=ready.get("ready_s"), smoke_s=round(time.time() - t, 3),
                  job_id=os.environ.get("BEAM_JOB_ID"), address=args.ray_address)
    out = Path(args.output or plan.paths.smoke)
    write_json_atomic(out, result)
    for task in result["misplaced"]:
        log.error("misplaced: %s task on %s (group %s)", task["role"], task["hostname"], task["node_group"])
    log.info("smoke %s: %d tasks, %d misplaced; %s", "ok" if result["ok"] else "FAILED",
             len(result["tasks"]), len(result["misplaced"]), out)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
