"""The rollout nodes a run lost mid-segment and went on without, and what each loss cost (issue 42):
the ``lost node`` lines of `beam-hpc status`.

Why a reader of its own: a loss the segment survives leaves no failed segment behind, so neither the
segment table nor the GPU-hours by cause (beam_hpc.run.accounting) show it; an operator still needs to
see which node went, when, in which segment, whether capacity came back and what it all cost.

Two records, both on shared storage:

- the ledger's end line: each lost rollout node is one entry of ``failed_nodes`` (beam_hpc.job.runner
  hands them to beam_hpc.lifecycle.end, which writes them with beam_hpc.run.ledger.end_record). An
  entry is a loss where it carries ``lost_at`` (the time of the loss, a number, which the runner
  writes), or, in a ledger written before ``lost_at`` was, where its ``why`` starts with
  :data:`LOST_WHY` (the runner's words);
- the run's elastic registry: the ``replacement`` event (beam_hpc.elastic.replace) the segment
  records when it asked for a replacement: the job, the node it replaces, the segment and the time
  it was asked, seconds after the loss. A segment that is still running has no end line yet, so its
  losses show from these events alone until it ends.

The time of a loss is ``lost_at`` where the ledger has it, else the time the replacement was asked
(later than the loss by the detection and the ``rollout add``: the cost below is then a lower bound),
else unknown (no cost is given rather than a guess).

What a loss cost: the lost node's GPUs (the rollout group's ``gpus_per_node``) from the loss to the
segment's end (to now while it runs): rollout capacity the run went without. Slurm excises a lost
node from a ``--no-kill`` job and stops billing it at the loss, and the run's held GPU-hours
(beam_hpc.run.accounting) leave those GPUs out from then on, once the segment's end line records
the loss. Beside it, the replacement's
own GPU-hours: its nodes' time from their start to their leaving (beam_hpc.elastic.registry), not in
the run's. Not counted: the unit the lost node was serving, which goes back to the queue and is
served again by the nodes left (at most one unit per worker of the node; the ledger does not record
it), and the slower rollouts until the replacement joins.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from beam_hpc.elastic.replace import replacements
from beam_hpc.run.accounting import as_number, segment_time

# How beam_hpc/job/runner.py begins the ``why`` of a rollout node it went on without.
LOST_WHY = "rollout node lost mid-segment"
BASIS = ("a loss: the lost node's GPUs from the loss to the segment's end (now, while it runs), capacity the run "
         "went without and no longer held (Slurm stops billing a lost node); a replacement: its own nodes' "
         "GPU-hours, not in the run's")




def is_lost_rollout_node(entry: dict[str, Any]) -> bool:
    """A ``failed_nodes`` entry of a rollout node the segment went on without."""
    return as_number(entry.get("lost_at")) is not None or str(entry.get("why", "")).startswith(LOST_WHY)


def rollout_node_gpus(plan: dict[str, Any] | None) -> int | None:
    """GPUs of one node of the run's rollout group (None: no readable plan, or no such group)."""
    for g in (plan or {}).get("groups") or []:
        if isinstance(g, dict) and g.get("name") == "rollout":
            gpus = g.get("gpus_per_node")
            return gpus if isinstance(gpus, int) and not isinstance(gpus, bool) else None
    return None


def _cap(plan: dict[str, Any] | None) -> int | None:
    cap = (((plan or {}).get("recipe") or {}).get("lifecycle") or {}).get("max_replacements")
    return cap if isinstance(cap, int) and not isinstance(cap, bool) else None


def _segment_ends(records: list[dict[str, Any]], now: float) -> dict[str, tuple[float | None, bool]]:
    """Each segment's end (the end line's time; a killed one's: when the next started, at most its
    time limit; a running one's: ``now``) and whether it still runs."""
    starts = [r.get("start") for r in records]
    out: dict[str, tuple[float | None, bool]] = {}
    for i, seg in enumerate(records):
        t = segment_time(seg, next_start=next((s for s in starts[i + 1:] if s), None), now=now)
        t0 = as_number((seg.get("start") or {}).get("time"))
        out[seg["segment"]] = (t0 + t.wall_s if t is not None and t0 is not None else None,
                               bool(t is not None and t.running))
    return out


def node_losses(root: str | Path, records: list[dict[str, Any]], plan: dict[str, Any] | None,
                extra_jobs: list[dict[str, Any]], *, now: float) -> dict[str, Any]:
    """The run's lost rollout nodes, oldest first, each with its cost and its replacement, and the
    totals. ``records``: the merged ledger (beam_hpc.run.ledger.read_ledger); ``extra_jobs``: status's
    rows of the run's extra jobs (``job_id``, ``gpu_hours``, ``partition``, ``state``)."""
    asked = replacements(root)
    jobs = {j["job_id"]: j for j in extra_jobs}
    ends = _segment_ends(records, now)
    gpus = rollout_node_gpus(plan)
    found: list[dict[str, Any]] = []
    for seg in records:
        for entry in (seg.get("end") or {}).get("failed_nodes") or []:
            if isinstance(entry, dict) and is_lost_rollout_node(entry):
                found.append({"node": str(entry.get("node")), "segment": seg["segment"],
                              "why": str(entry.get("why", "")), "lost_at": as_number(entry.get("lost_at"))})
    ended = {(f["node"], f["segment"]) for f in found}
    for a in asked:  # a running segment's losses: its end line is not written yet
        if (a.get("replaces"), a.get("segment")) not in ended:
            found.append({"node": str(a.get("replaces")), "segment": str(a.get("segment")), "why": "", "lost_at": None})
    losses = []
    for f in found:
        rep = next((a for a in asked if a.get("replaces") == f["node"] and a.get("segment") == f["segment"]), None)
        t, basis = f["lost_at"], "recorded"
        if t is None and rep is not None and as_number(rep.get("time")) is not None:
            t, basis = as_number(rep.get("time")), "replacement asked"
        end, running = ends.get(f["segment"], (None, False))
        idle = gpus * max(0.0, end - t) / 3600.0 if (gpus is not None and t is not None and end is not None) else None
        job = jobs.get(str(rep.get("job_id"))) if rep is not None else None
        losses.append({
            "node": f["node"], "segment": f["segment"], "time": t, "time_basis": basis if t is not None else None,
            "why": f["why"], "segment_end": end, "running": running, "gpus": gpus, "idle_gpu_hours": idle,
            "replacement": None if rep is None else {
                "job_id": rep.get("job_id"), "partition": (job or {}).get("partition"),
                "state": (job or {}).get("state"), "gpu_hours": (job or {}).get("gpu_hours")},
        })
    losses.sort(key=lambda x: (x["time"] is None, x["time"] or 0.0))
    cap = _cap(plan)
    return {
        "losses": losses,
        "idle_gpu_hours": sum(x["idle_gpu_hours"] or 0.0 for x in losses),
        "replacement_gpu_hours": sum((x["replacement"] or {}).get("gpu_hours") or 0.0 for x in losses),
        "replacements": len(asked), "max_replacements": cap,
        "partial": any(x["idle_gpu_hours"] is None for x in losses),
        "basis": BASIS,
    }
