"""Readiness: the job's Ray cluster is ready when every expected node and GPU of every group has
joined, with the group's label, and nothing else has.

It polls the cluster's real state (``ray.nodes()``), never sleeps a fixed time: the public
launchers' ``sleep 10`` / ``sleep 5`` are too short on a busy cluster and too long on an idle one
(shared/reference/local-slurm-cluster.md section 11). On its deadline it names the nodes that never
joined, with their node-step logs.

The job runs this as a subprocess (``python -m beam_hpc.readiness``), inside the container and
with the job's token, so the job process itself never imports Ray, and a dead node step can stop
the wait at once by killing it. :func:`evaluate` is pure, so the rule is unit-tested without Ray.
"""

from __future__ import annotations

import argparse
import json
import logging
import socket
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from beam_hpc.plan import GROUP_LABEL_KEY, Plan
from beam_hpc.ray_node import ClusterRuntime, write_json_atomic

log = logging.getLogger("beam_hpc.readiness")

POLL_S = 0.25
EXIT_READY, EXIT_ERROR, EXIT_TIMEOUT = 0, 1, 3


@dataclass(frozen=True)
class Expected:
    group: str
    nodes: int
    gpus: int


@dataclass
class Status:
    ready: bool
    joined: dict[str, dict] = field(default_factory=dict)  # group -> {"nodes", "gpus", "hosts"}
    unexpected: list[str] = field(default_factory=list)
    summary: str = ""


def expected_of(plan: Plan) -> list[Expected]:
    return [Expected(g.name, g.nodes, g.gpus) for g in plan.groups]


def evaluate(nodes: list[dict], expected: list[Expected]) -> Status:
    """Compare alive Ray nodes (dicts as ``ray.nodes()`` returns them) with the expectation."""
    alive = [n for n in nodes if n.get("Alive")]
    joined: dict[str, dict] = {e.group: {"nodes": 0, "gpus": 0, "hosts": []} for e in expected}
    unexpected = []
    for n in alive:
        group = (n.get("Labels") or {}).get(GROUP_LABEL_KEY)
        ip = n.get("NodeManagerAddress", "?")
        if group not in joined:
            unexpected.append(f"{ip} (label {GROUP_LABEL_KEY}={group})")
            continue
        j = joined[group]
        j["nodes"] += 1
        j["gpus"] += int((n.get("Resources") or {}).get("GPU", 0))
        j["hosts"].append({"ip": ip, "hostname": n.get("NodeManagerHostname", "?"),
                           "gpus": int((n.get("Resources") or {}).get("GPU", 0))})
    ready = not unexpected and all(
        joined[e.group]["nodes"] == e.nodes and joined[e.group]["gpus"] == e.gpus for e in expected)
    summary = "; ".join(f"{e.group}: {joined[e.group]['nodes']}/{e.nodes} nodes, "
                        f"{joined[e.group]['gpus']}/{e.gpus} GPUs" for e in expected)
    if unexpected:
        summary += "; unexpected nodes: " + ", ".join(unexpected)
    return Status(ready, joined, unexpected, summary)


def missing_nodes(status: Status, plan: Plan, rt: ClusterRuntime) -> list[str]:
    """Name the expected nodes that are not among the joined ones, from the node steps' reports
    (address) and Slurm's node lists (name), with the log to read."""
    joined_ips = {h["ip"] for j in status.joined.values() for h in j["hosts"]}
    out = []
    for g in plan.groups:
        for i in range(g.nodes):
            name = rt.node_name(g.name, i)
            report_path = rt.node_report(g.name, i)
            try:
                report = json.loads(report_path.read_text())
            except (OSError, ValueError):
                report = None
            if report is None:
                out.append(f"{g.name} node {i} ({name}: its node step never reported; log {rt.node_log(g.name, i)})")
            elif report.get("ip") not in joined_ips:
                detail = report.get("error") or f"state {report.get('state')}"
                out.append(f"{g.name} node {i} ({name}, {report.get('ip')}: {detail}; log {rt.node_log(g.name, i)})")
    return out


def wait_ready(plan: Plan, rt: ClusterRuntime, *, output: Path | None = None, poll_s: float = POLL_S) -> Status:
    """Poll until ready or ``rt.deadline``; write the report to ``output`` (ready.json)."""
    import ray

    t0 = time.time()
    expected = expected_of(plan)
    host, port = rt.head_ip, rt.gcs_port
    while True:  # the GCS must accept connections before ray.init can attach
        try:
            with socket.create_connection((host, port), timeout=1.0):
                break
        except OSError:
            if time.time() > rt.deadline:
                return _finish(Status(False, summary=f"the head's GCS at {rt.address} never answered"),
                               plan, rt, t0, output)
            time.sleep(poll_s)
    ray.init(address=rt.address, log_to_driver=False, logging_level=logging.WARNING,
             namespace="beam-readiness")
    try:
        while True:
            status = evaluate(ray.nodes(), expected)
            if status.ready or time.time() > rt.deadline:
                return _finish(status, plan, rt, t0, output)
            time.sleep(poll_s)
    finally:
        ray.shutdown()


def _finish(status: Status, plan: Plan, rt: ClusterRuntime, t0: float, output: Path | None) -> Status:
    report = {**asdict(status), "address": rt.address, "waited_s": round(time.time() - t0, 3), "time": time.time()}
    if not status.ready:
        missing = missing_nodes(status, plan, rt)
        report["missing"] = missing
        status.summary = (f"Ray cluster not ready by its deadline ({status.summary})"
                          + ("; never joined: " + "; ".join(missing) if missing else ""))
        report["summary"] = status.summary
    if output is not None:
        write_json_atomic(output, report)
    return status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m beam_hpc.readiness", description=__doc__.splitlines()[0])
    parser.add_argument("--plan", required=True)
    parser.add_argument("--runtime", required=True, help="the segment's runtime.json")
    parser.add_argument("--output", required=True, help="where to write ready.json")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    plan = Plan.load(args.plan)
    rt = ClusterRuntime.load(args.runtime)
    status = wait_ready(plan, rt, output=Path(args.output))
    if status.ready:
        log.info("ready: %s", status.summary)
        return EXIT_READY
    log.error("%s", status.summary)
    return EXIT_TIMEOUT


if __name__ == "__main__":
    sys.exit(main())
