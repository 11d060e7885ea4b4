"""Failed-node exclusion: the nodes a run leaves behind, and whether the rest can still hold it.

Why: a segment that fails because of one node (its node step died, it failed the NVMe or
shared-filesystem check, its GPUs were missing, its Ray never joined) would very likely land on the
same idle node again and fail the same way, holding every other node through bring-up each time.
So the segment's ledger end line names the node(s) and why (``failed_nodes``), and every later
segment of the run leaves them out: ``--exclude`` on a resubmission or ``submit --resume`` (it
applies to every het component), ``scontrol update ExcNodeList`` right after a requeue, before the
job is eligible again. The set accumulates over the run (read back from the ledger), minus what the
user cleared with ``submit --resume --include-node NAME|all``, which goes to
``node-exclusions.json`` (a clearing is not a segment, so not a ledger line). :func:`shortfall`
says when the nodes left can no longer hold the recipe's groups; the decision then stops the chain
with that message instead of queueing a job that can never start.

A node lost under a job that does not go on without it (a Miles run, a one-node group:
:func:`beam_hpc.plan.node_loss.survives_node_loss`) makes Slurm revoke the whole job, and requeue
it: the segment sees only a SIGTERM, and its own node steps may not have ended yet. So a segment
that Slurm stopped asks Slurm what became of its own nodes (:func:`failed_in_slurm`, one
``scontrol show node``), and :func:`failed_by_slurm` (pure) says which of them count as failed.

A job that asked ``--no-kill`` is not stopped by a node's failure: Slurm takes the node out of the
job (the component's NodeList shrinks at once, measured on Slurm 22.05) and ends the steps on it,
which under load takes seconds. The driver often dies first (its objects or actors were on the
node); :func:`taken_from_job` then names the node from the job's own record (one ``scontrol show
job``), so the segment ends as the node failure it is and later segments leave the node out.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from beam_hpc.files import write_json_atomic
from beam_hpc.plan.paths import RunPaths

if TYPE_CHECKING:
    from beam_hpc.slurm.client import NodeInfo

log = logging.getLogger(__name__)

ALL = "*"  # a clearing of every node (``--include-node all``)


@dataclass(frozen=True)
class Exclusion:
    """One excluded node: why, which segment failed on it, and when (its end line's time)."""

    node: str
    why: str
    segment: str
    time: float


def from_ledger(segments: Sequence[Mapping[str, Any]], cleared: Iterable[Mapping[str, Any]] = ()) -> list[Exclusion]:
    """The effective exclusions of merged ledger ``segments`` (beam_hpc.run.ledger.read_ledger),
    less the ``cleared`` records: one per node, its latest failure, in order of first failure."""
    cut: dict[str, float] = {}
    for c in cleared:
        node, at = c.get("node"), c.get("time")
        if isinstance(node, str) and isinstance(at, (int, float)):
            cut[node] = max(cut.get(node, 0.0), float(at))
    out: dict[str, Exclusion] = {}
    for seg in segments:
        end = seg.get("end") or {}
        at = end.get("time") if isinstance(end.get("time"), (int, float)) else 0.0
        for item in end.get("failed_nodes") or []:
            node = item.get("node") if isinstance(item, Mapping) else None
            if not isinstance(node, str) or not node:
                continue
            if at <= max(cut.get(node, 0.0), cut.get(ALL, 0.0)):
                continue
            out.pop(node, None)
            out[node] = Exclusion(node, str(item.get("why") or ""), str(seg.get("segment", "?")), float(at))
    return sorted(out.values(), key=lambda e: e.time)


def names(exclusions: Iterable[Exclusion]) -> list[str]:
    return [e.node for e in exclusions]


def cleared_path(output_dir: str | Path) -> Path:
    """``node-exclusions.json``: a list of ``{"node": NAME or "*", "time": T}``; each clears every
    exclusion of that node recorded before T."""
    return Path(RunPaths(str(output_dir)).node_exclusions)


def read_cleared(output_dir: str | Path) -> list[dict[str, Any]]:
    """The run's clearings; none when the file is missing or unreadable (an unreadable file must
    not stop a run: at worst a node stays excluded)."""
    try:
        data = json.loads(cleared_path(output_dir).read_text())
    except (OSError, ValueError):
        return []
    return [c for c in data if isinstance(c, dict)] if isinstance(data, list) else []


def record_cleared(output_dir: str | Path, nodes: Sequence[str], *, now: float | None = None) -> list[dict[str, Any]]:
    """Clear ``nodes`` (``all`` clears every node) from the run's exclusions, as of ``now``;
    returns the records added. Written atomically next to the ledger."""
    at = time.time() if now is None else now
    added = [{"node": ALL if n == "all" else n, "time": at} for n in dict.fromkeys(nodes)]
    if added:
        path, records = cleared_path(output_dir), read_cleared(output_dir) + added
        write_json_atomic(path, records)
    return added


def effective(output_dir: str | Path, segments: Sequence[Mapping[str, Any]],
              extra: Iterable[Mapping[str, Any]] = (), *, segment: str = "", now: float | None = None) -> list[Exclusion]:
    """The run's exclusions now: the ledger's, this segment's ``extra`` failed nodes (not yet
    in the ledger) included, less the run's clearings."""
    at = time.time() if now is None else now
    pending = {"segment": segment, "end": {"time": at, "failed_nodes": list(extra)}}
    return from_ledger([*segments, pending], read_cleared(output_dir))


def shortfall(needs: Sequence[tuple[str, int, str | None]], partition_nodes: Mapping[str | None, Sequence[str]],
              excluded: Iterable[str]) -> str | None:
    """Why the nodes left cannot hold the groups, or None when they can (or when a partition's
    nodes are unknown: then Slurm decides). ``needs``: (group, nodes, partition) per group;
    groups in one partition need their nodes together (a het job's components never share a node)."""
    gone = set(excluded)
    by_partition: dict[str | None, list[tuple[str, int]]] = {}
    for group, nodes, partition in needs:
        by_partition.setdefault(partition, []).append((group, nodes))
    for partition, groups in by_partition.items():
        members = partition_nodes.get(partition)
        if not members:
            continue
        left = [n for n in members if n not in gone]
        need = sum(n for _, n in groups)
        if len(left) < need:
            where = f"partition {partition}" if partition else "the default partition"
            wants = " + ".join(f"{n} ({g})" for g, n in groups)
            out = sorted(gone & set(members))
            return (f"{where} has {len(members)} nodes, {len(out)} of them excluded after failing ({', '.join(out)}): "
                    f"{len(left)} left, but the recipe's groups need {need} = {wants}; fix or replace the "
                    "nodes, then resubmit with --resume --include-node NAME (or --include-node all)")
    all_members = {n for m in partition_nodes.values() for n in m}
    if all(p in partition_nodes and partition_nodes[p] for p in by_partition):
        total = sum(n for _, n, _ in needs)
        left_all = all_members - gone
        if len(left_all) < total:
            return (f"the groups' partitions have {len(left_all)} nodes left after excluding {', '.join(sorted(gone))}, "
                    f"but the recipe's groups need {total}; fix or replace the nodes, then resubmit with "
                    "--resume --include-node NAME (or --include-node all)")
    return None


def plan_shortfall(groups: Sequence[Any], excluded: Sequence[str]) -> str | None:
    """:func:`shortfall` for a plan's groups (``.name``, ``.nodes``, ``.partition``), with the
    partitions' nodes asked of Slurm (:func:`beam_hpc.slurm.client.partition_nodes`). None
    without exclusions (nothing is asked then)."""
    if not excluded:
        return None
    from beam_hpc.slurm import client

    partitions = {g.partition for g in groups}
    members = {p: client.partition_nodes(p) for p in partitions}
    known = {p: m for p, m in members.items() if m is not None}
    return shortfall([(g.name, g.nodes, g.partition) for g in groups], known, excluded)


def for_submission(output_dir: str | Path, include: Sequence[str] = (), *, now: float | None = None) -> list[str]:
    """What ``beam-hpc submit --resume [--include-node NAME|all ...]`` excludes: first records the
    clearings (``all`` clears every node), then returns the run's remaining exclusions. A name
    that is not excluded is refused (InputError), so that a typo does not pass silently."""
    from beam_hpc.errors import InputError, shorten
    from beam_hpc.plan.paths import LEDGER_FILE
    from beam_hpc.run import ledger

    segments, _ = ledger.read_ledger(Path(output_dir, LEDGER_FILE))
    current = from_ledger(segments, read_cleared(output_dir))
    unknown = [n for n in include if n != "all" and n not in names(current)]
    if unknown:
        have = ", ".join(names(current)) or "none"
        raise InputError(f"--include-node: {shorten(unknown)} not excluded in this run "
                         f"(excluded now: {have})")
    if include:
        record_cleared(output_dir, include, now=now)
    return names(from_ledger(segments, read_cleared(output_dir)))


# The flags of Slurm's node State (``DOWN+NOT_RESPONDING``, ``MIXED+FAIL``) that say the node is gone
# or failing: Slurm revokes a job on a DOWN node, and one that does not answer is DOWN after
# SlurmdTimeout. DRAIN is not among them: a drained node is healthy, only closed to new jobs (for a
# maintenance, a reboot), and its jobs run on.
FAILED_STATES = frozenset({"DOWN", "FAIL", "FAILING", "NOT_RESPONDING"})


def failed_by_slurm(nodes: Iterable[NodeInfo]) -> list[dict[str, str]]:
    """The nodes Slurm has DOWN, FAIL or NOT_RESPONDING, as failed nodes (``{"node", "why"}``, the
    ledger's ``failed_nodes``): the why is Slurm's state and the reason it gives (who set it, when).
    Each node once, in the order given."""
    out: list[dict[str, str]] = []
    for n in nodes:
        flags = {f.strip().rstrip("*~#%$@^-!").upper() for f in n.state.split("+")}
        if not flags & FAILED_STATES or any(f["node"] == n.name for f in out):
            continue
        why = f"Slurm had the node {n.state} when it stopped the job"
        out.append({"node": n.name, "why": f"{why} (reason: {n.reason})" if n.reason else why})
    return out


def failed_in_slurm(nodelists: Sequence[str], *, query: Callable[..., list[NodeInfo]] | None = None,
                    timeout: float = 5.0) -> list[dict[str, str]]:
    """The nodes of a job's allocation (its components' ``SLURM_JOB_NODELIST``s) that Slurm has
    failed now (:func:`failed_by_slurm`). Asked within Slurm's KillWait, so briefly (``timeout``),
    and an unanswered question is no failed node: the end line is written either way."""
    from beam_hpc.slurm import client

    ask = query or client.show_nodes
    try:
        return failed_by_slurm(ask([n for n in nodelists if n], timeout=timeout))
    except client.SlurmError as err:
        log.warning("cannot ask Slurm whether a node of this job failed (%s); none is recorded", err.last_line)
        return []


def nodes_taken(allocated: Mapping[str, Sequence[str]], now: Mapping[str, Sequence[str]]) -> list[str]:
    """The nodes each group was allocated that its component no longer holds (pure; a group Slurm
    did not answer for is left out rather than counted as empty)."""
    return [n for g, nodes in allocated.items() if g in now for n in nodes if n not in set(now[g])]


def taken_from_job(job_id: str, component_ids: Mapping[str, str], allocated: Mapping[str, Sequence[str]], *,
                   timeout: float = 5.0) -> list[dict[str, str]]:
    """The nodes Slurm has taken from this running ``--no-kill`` job (see the module docstring), as
    ``failed_nodes`` entries. Asked briefly; an unanswered question names no node."""
    from beam_hpc.slurm import client

    try:
        records = client.show_job_records(job_id, timeout=timeout) or []
        by_id = {r.get("JobId"): r for r in records}
        now = {g: client.expand_hostnames(by_id[cid].get("NodeList", ""), timeout=timeout)
               for g, cid in component_ids.items() if cid in by_id}
    except client.SlurmError as err:
        log.warning("cannot ask Slurm whether it took a node from this job (%s); none is recorded", err.last_line)
        return []
    return [{"node": n, "why": "Slurm took the node from the job (a node failure under --no-kill)"}
            for n in nodes_taken(allocated, now)]
