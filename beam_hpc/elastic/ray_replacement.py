"""A Miles run's lost rollout node replaced inside the running segment: a node of a new one-node
job that joins the segment's own Ray cluster in the lost node's place (issue 42 items 2 and 3).

Why a Ray node and not an extra rollout job as a reference run gets: Miles restarts a dead engine
only on the engine's own placement-group bundle (radixark/miles@31f1ca961, the Miles double's
``miles/utils/health_monitor.py`` names the lines), and Ray places a lost node's bundle again only
on a node of the same Ray cluster whose resources and labels fit it. So the replacement runs the
segment's own node step (:mod:`beam_hpc.node.step`) for the lost node's place in its group: the
same group label and resources, the segment's Ray token, and a place in the job of its own
(:attr:`Order.index`: past the job's nodes, so that on a loopback test site, where every node
shares one host, its address, ports and temp dir are not the lost node's; on a real cluster the
node's own address and the job's usual ports). Once its raylet has joined, Ray reschedules the bundle, the
restart Miles waits for in its next weight update returns, and the segment trains on.

The seam, one file each way, all under the shared run directory:

- the segment (:mod:`beam_hpc.job.runner`) writes an :class:`Order` for the lost node,
  ``elastic/replacing/<node>.json``, before it asks for the job (``beam-hpc rollout add RUN
  --nodes 1 --exclude NODE --replaces NODE``, :mod:`beam_hpc.elastic.replace`);
- the new job's node program (``beam_hpc.elastic.extra_node --replaces NODE``) reads the order and
  runs the node step for that place (:func:`step_argv`), with its report at
  :func:`report_path`, until the segment ends, the run ends, or Slurm takes the job back;
- the segment reads that report (:func:`joined`): ``ray_started`` is the join.

Security: the replacement reads the segment's Ray token where the segment's own node steps read it
(a 0600 file under the run directory's ``.ray-auth/``, so only the run's owner can), and joins only
the cluster the order names; the order itself holds no secret.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from beam_hpc.backends.reference.rollouts.rendezvous import elastic_dir
from beam_hpc.files import write_json_atomic
from beam_hpc.plan.paths import SegmentPaths
from beam_hpc.plan.plan import Plan
from beam_hpc.run import ledger

ORDERS_DIR = "replacing"  # under elastic/
NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")  # a Slurm node name: also a file name under ORDERS_DIR


@dataclass(frozen=True)
class Order:
    """The place a lost node leaves in one segment's Ray cluster, for its replacement to take."""

    node: str  # the lost node's Slurm name
    group: str  # its group in the plan
    local_index: int  # its index in the group
    index: int  # the replacement's place in the job (beam_hpc.node.step's index): past the job's own nodes
    runtime: str  # the segment's runtime.json: head address, token path, nonce
    nonce: str
    segment: str  # ``<job>-<restart>``, as the ledger names it
    asked_at: float

    @property
    def segment_dir(self) -> Path:
        return Path(self.runtime).parent


def replacement_index(plan: Plan, asked: int) -> int:
    """The place in the job of the segment's ``asked``-th replacement (0-based): past every node of
    the plan's groups, so that no node of the job shares it."""
    return sum(g.nodes for g in plan.groups) + asked


def order_path(run_dir: str | Path, node: str) -> Path:
    return elastic_dir(run_dir) / ORDERS_DIR / f"{node}.json"


def write_order(run_dir: str | Path, order: Order) -> Path:
    """The order for ``order.node`` (a later loss of the same node replaces an earlier order)."""
    path = order_path(run_dir, order.node)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, asdict(order))
    return path


def read_order(run_dir: str | Path, node: str) -> Order | None:
    """The order for lost node ``node``, or None when there is none (or it cannot be read)."""
    try:
        return Order(**json.loads(order_path(run_dir, node).read_text()))
    except (OSError, ValueError, TypeError):
        return None


def report_path(order: Order, job_id: str) -> Path:
    """The replacement's node step report: beside the segment's own, without overwriting the lost
    node's (``nodes/<group>-<i>-replacement-<job>.json``)."""
    return SegmentPaths(str(order.segment_dir)).node_reports / f"{order.group}-{order.local_index}-replacement-{job_id}.json"


def joined(order: Order) -> dict | None:
    """The report of a replacement whose Ray node has started in the order's place, or None."""
    pattern = report_path(order, "*")  # every replacement job's report for this place
    for path in sorted(pattern.parent.glob(pattern.name)):
        try:
            report = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # being written: the next look reads it
        if report.get("ray_started") and report.get("state") == "running":
            return report
    return None


def step_argv(order: Order, plan: Plan, job_id: str, python: str) -> list[str]:
    """The segment's node step for the order's place, run by the replacement's node program."""
    return [python, "-m", "beam_hpc.node.step", "--plan", plan.paths.plan, "--group", order.group,
            "--runtime", order.runtime, "--nonce", order.nonce, "--node-index", str(order.local_index),
            "--index", str(order.index), "--report", str(report_path(order, job_id))]


def segment_over(plan: Plan, segment: str) -> bool:
    """Whether the ledger has the end line of ``segment``: the Ray cluster the order named is gone
    (a later segment starts its own, with a whole rollout group), so the replacement leaves."""
    segments, _ = ledger.read_ledger(plan.paths.ledger)
    return any(s["segment"] == segment and "end" in s for s in segments)


def request_problems(plan: Plan, node: str, *, nodes: int) -> list[str]:
    """Why ``rollout add --replaces NODE`` cannot be submitted (one line each), or nothing: a Miles
    run only (a reference run's extra job joins its rollout service by itself), one node, and an
    order for ``node`` from a segment that is still running."""
    from beam_hpc.errors import shorten

    if not NODE_NAME.fullmatch(node):
        return [f"--replaces: {shorten(node)} is not a Slurm node name (letters, digits, '.', '_', '-'); give the "
                "node the segment lost, as its log names it"]
    out = []
    if plan.recipe.backend != "miles":
        out.append(f"--replaces: {shorten(node)}: only a Miles run's segment takes a replacement into its Ray "
                   f"cluster; a {plan.recipe.backend} run's extra job joins by itself: drop --replaces")
    if nodes != 1:
        out.append(f"--nodes: {nodes} with --replaces: a replacement takes one lost node's place; give --nodes 1")
    order = read_order(plan.output_dir, node)
    if order is None:
        out.append(f"--replaces: {shorten(node)}: the run has no order to replace it ({order_path(plan.output_dir, node)}); "
                   "only a segment that lost the node writes one: give the node it named, or leave --replaces out")
    elif segment_over(plan, order.segment):
        out.append(f"--replaces: {shorten(node)}: segment {order.segment}, which lost it, has ended; the next "
                   "segment starts with a whole rollout group: nothing to replace")
    return out
