"""Readiness: the job's Ray cluster is ready when every expected node and GPU of every group has
joined, with the group's label, and nothing else has. On the site's own long-lived cluster (site
``ray_address``) other nodes may be there too: it is ready when every group has at least its nodes
and GPUs, and otherwise the error says what each lacking group needs, what the cluster has, and
how to fix it.

It polls the cluster's real state (``ray.nodes()``), never sleeps a fixed time: the public
launchers' ``sleep 10`` / ``sleep 5`` are too short on a busy cluster and too long on an idle one
(on the local test cluster every node joined in 9-17 s for 2-8 nodes). On its deadline it names the nodes that never
joined, with their node-step logs.

The job runs this as a subprocess (``python -m beam_hpc.job.readiness``), inside the container and
with the job's token, so the job process itself never imports Ray, and a dead node step can stop
the wait at once by killing it. :func:`evaluate` is pure, so the rule is unit-tested without Ray.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from beam_hpc.files import write_json_atomic
from beam_hpc.logging_setup import log_to_stream, module_logger
from beam_hpc.node.ray_node import ClusterRuntime
from beam_hpc.plan.plan import Plan
from beam_hpc.plan.ray_labels import GROUP_LABEL_KEY, GROUP_RESOURCE_PREFIX

log = module_logger(__name__)  # also run as python -m

POLL_S = 0.25
EXIT_READY, EXIT_ERROR, EXIT_TIMEOUT = 0, 1, 3


@dataclass(frozen=True)
class Expected:
    group: str
    nodes: int
    gpus: int
    roles: tuple[str, ...] = ()  # a node counts only with every role's resource beam_<role>

    @property
    def resources(self) -> list[str]:
        return [f"{GROUP_RESOURCE_PREFIX}{r}" for r in self.roles]


@dataclass
class Status:
    ready: bool
    joined: dict[str, dict] = field(default_factory=dict)  # group -> {"nodes", "gpus", "hosts"}
    unexpected: list[str] = field(default_factory=list)
    summary: str = ""


def expected_of(plan: Plan) -> list[Expected]:
    return [Expected(g.name, g.nodes, g.gpus, tuple(g.roles)) for g in plan.groups]


def evaluate(nodes: list[dict], expected: list[Expected], *, at_least: bool = False) -> Status:
    """Compare alive Ray nodes (dicts as ``ray.nodes()`` returns them) with the expectation.

    A node belongs to a group by its label and must carry the group's resources (placement pins
    bundles to those). ``at_least`` (an existing cluster): more nodes or GPUs than expected, and
    nodes of no group, are fine; otherwise the counts must match and strangers make it not ready.
    """
    alive = [n for n in nodes if n.get("Alive")]
    by_group = {e.group: e for e in expected}
    joined: dict[str, dict] = {e.group: {"nodes": 0, "gpus": 0, "hosts": []} for e in expected}
    unexpected = []
    for n in alive:
        group = (n.get("Labels") or {}).get(GROUP_LABEL_KEY)
        ip = n.get("NodeManagerAddress", "?")
        resources = n.get("Resources") or {}
        gpus = int(resources.get("GPU", 0))
        if group not in joined:
            unexpected.append(f"{ip} (label {GROUP_LABEL_KEY}={group}, {gpus} GPUs)")
            continue
        lacking = [r for r in by_group[group].resources if not resources.get(r)]
        if lacking:
            unexpected.append(f"{ip} (label {GROUP_LABEL_KEY}={group} but no resource {', '.join(lacking)})")
            continue
        j = joined[group]
        j["nodes"] += 1
        j["gpus"] += gpus
        j["hosts"].append({"ip": ip, "hostname": n.get("NodeManagerHostname", "?"), "gpus": gpus,
                           "node_id": n.get("NodeID")})
    if at_least:
        ready = all(joined[e.group]["nodes"] >= e.nodes and joined[e.group]["gpus"] >= e.gpus for e in expected)
    else:
        ready = not unexpected and all(
            joined[e.group]["nodes"] == e.nodes and joined[e.group]["gpus"] == e.gpus for e in expected)
    summary = "; ".join(f"{e.group}: {joined[e.group]['nodes']}/{e.nodes} nodes, "
                        f"{joined[e.group]['gpus']}/{e.gpus} GPUs" for e in expected)
    if unexpected:
        summary += ("; nodes of no group: " if at_least else "; unexpected nodes: ") + ", ".join(unexpected)
    return Status(ready, joined, unexpected, summary)


def lacking_in_existing(status: Status, expected: list[Expected], address: str) -> str:
    """Why the site's own cluster cannot take the job: each lacking group with what is there, what
    is needed and how to fix it (the job starts no node there, so only the site can)."""
    parts = []
    for e in expected:
        j = status.joined.get(e.group, {"nodes": 0, "gpus": 0})
        if j["nodes"] >= e.nodes and j["gpus"] >= e.gpus:
            continue
        res = json.dumps({r: max(e.gpus // max(e.nodes, 1), 1) for r in e.resources})
        parts.append(
            f"group {e.group} needs {e.nodes} node(s) labelled {GROUP_LABEL_KEY}={e.group} with "
            f"resource(s) {', '.join(e.resources) or '-'} and {e.gpus} GPU(s) in all, the cluster has "
            f"{j['nodes']} such node(s) with {j['gpus']} GPU(s); add them with `ray start "
            f"--address={address} --labels={GROUP_LABEL_KEY}={e.group} --resources='{res}' "
            f"--num-gpus={e.gpus // max(e.nodes, 1)}` (RAY_AUTH_MODE=token), or lower topology.{e.group}")
    there = "; ".join(f"{g}: {', '.join(h['ip'] + ' (' + str(h['gpus']) + ' GPUs)' for h in j['hosts']) or 'none'}"
                      for g, j in status.joined.items())
    if status.unexpected:
        there += "; nodes of no group: " + ", ".join(status.unexpected)
    return (f"the existing Ray cluster at {address} (site ray_address) lacks what the job needs: "
            + "; ".join(parts) + f". It has: {there}. Or submit without ray_address / --ray-address, and "
            "beam-hpc starts its own Ray in the allocation")


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


def never_joined(plan: Plan, rt: ClusterRuntime, report: dict, message: str) -> list[dict[str, str]]:
    """The job's side of a failed wait: the Slurm nodes whose Ray never joined (the node steps'
    reported addresses against ready.json's joined hosts), to exclude next time. None are blamed
    when no node joined at all (or the report says nothing): then the head, the network or the site
    is at fault, not one node."""
    joined = {h.get("ip") for j in (report.get("joined") or {}).values() for h in j.get("hosts", [])}
    if not joined:
        return []
    missing = []
    for g in plan.groups:
        for i in range(g.nodes):
            try:
                ip = json.loads(rt.node_report(g.name, i).read_text()).get("ip")
            except (OSError, ValueError):
                ip = None
            if ip is None or ip not in joined:
                missing.append({"node": rt.node_name(g.name, i), "why": f"its Ray did not join in time ({message})"})
    return missing if len(missing) < sum(g.nodes for g in plan.groups) else []


def wait_ready(plan: Plan, rt: ClusterRuntime, *, output: Path | None = None, poll_s: float = POLL_S) -> Status:
    """Poll until ready or ``rt.deadline``; write the report to ``output`` (ready.json)."""
    import ray

    t0 = time.time()
    expected = expected_of(plan)
    host, port = rt.head_ip, rt.gcs_port
    unanswered = (f"the existing Ray cluster at {rt.address} (site ray_address) does not answer; check that it "
                  "runs and that this host can reach it" if rt.existing
                  else f"the head's GCS at {rt.address} never answered")
    while True:  # the GCS must accept connections before ray.init can attach
        try:
            with socket.create_connection((host, port), timeout=1.0):
                break
        except OSError:
            if time.time() > rt.deadline:
                return _finish(Status(False, summary=unanswered), plan, rt, t0, output)
            time.sleep(poll_s)
    def init() -> None:
        ray.init(address=rt.address, log_to_driver=False, logging_level=logging.WARNING,
                 namespace="beam-readiness")

    try:
        attach(init, ray.shutdown, retry_until=None if rt.existing else rt.deadline)
    except Exception as err:  # Ray raises plain ConnectionError / RuntimeError here
        if not rt.existing:
            return _finish(Status(False, summary=(
                f"the job's Ray head at {rt.address} accepted connections but no driver could attach "
                f"before the readiness deadline ({type(err).__name__}: {str(err).splitlines()[0][:300]})")),
                plan, rt, t0, output)
        # a wrong token shows as the cause; a driver attaches through a Ray node on its own host
        cause = f" ({str(err.__cause__).splitlines()[0][:300]})" if err.__cause__ else ""
        return _finish(Status(False, summary=(
            f"cannot attach to the existing Ray cluster at {rt.address} (site ray_address) from "
            f"{socket.gethostname()}: {type(err).__name__}: {err}{cause}; check that ray_token_file holds "
            "that cluster's token, and run the job on a node of the cluster (Ray drivers attach "
            "through a node on their own host)")), plan, rt, t0, output)
    try:
        while True:
            status = evaluate(ray.nodes(), expected, at_least=rt.existing)
            if status.ready or time.time() > rt.deadline:
                return _finish(status, plan, rt, t0, output)
            time.sleep(poll_s)
    finally:
        ray.shutdown()


def attach(init: Callable[[], None], reset: Callable[[], None], *, retry_until: float | None,
           pause_s: float = 2.0) -> int:
    """``init`` (``ray.init`` against the cluster) until it succeeds; returns the attempts it took.

    Why retry: a head's GCS accepts connections seconds before the head can take a driver (its raylet
    still registering), and on a loaded node that gap exceeds ``ray.init``'s own wait, which then
    raises. For the job's own cluster that is lateness, not failure: try again (after ``reset``, which
    clears the half-made connection) until ``retry_until`` (the readiness deadline); then, or at once
    when ``retry_until`` is None (the site's cluster, whose error says what to fix), the error is
    raised."""
    attempts = 0
    while True:
        attempts += 1
        try:
            init()
            return attempts
        except Exception as err:  # Ray raises plain ConnectionError / RuntimeError here
            if retry_until is None or time.time() + pause_s > retry_until:
                raise
            log.info("the head does not take a driver yet (%s: %s); trying again", type(err).__name__,
                     str(err).splitlines()[0][:200] if str(err) else "")
            with contextlib.suppress(Exception):
                reset()
            time.sleep(pause_s)


def _finish(status: Status, plan: Plan, rt: ClusterRuntime, t0: float, output: Path | None) -> Status:
    report = {**asdict(status), "address": rt.address, "waited_s": round(time.time() - t0, 3), "time": time.time()}
    if not status.ready and rt.existing:
        if status.joined:  # it answered: say what it lacks
            status.summary = lacking_in_existing(status, expected_of(plan), rt.address)
        report["summary"] = status.summary
    elif not status.ready:
        missing = missing_nodes(status, plan, rt)
        report["missing"] = missing
        status.summary = (f"Ray cluster not ready by its deadline ({status.summary})"
                          + ("; never joined: " + "; ".join(missing) if missing else ""))
        report["summary"] = status.summary
    if output is not None:
        write_json_atomic(output, report)
    return status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m beam_hpc.job.readiness", description=__doc__.splitlines()[0])
    parser.add_argument("--plan", required=True)
    parser.add_argument("--runtime", required=True, help="the segment's runtime.json")
    parser.add_argument("--output", required=True, help="where to write ready.json")
    args = parser.parse_args(argv)
    log_to_stream()
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
