"""Where a run stands, from its run directory alone (plus Slurm when it answers): `beam-hpc status`.

Owns two concerns: gathering (the ledger's segments, the live Slurm state, the checkpoint, the
scalars) and the numbers derived from them (rollouts done, goodput, ETA, GPU-hours, eval by both
answer checkers). Reading the run directory itself is :mod:`beam_hpc.observe.run_dir`, the scalar
series :mod:`beam_hpc.run.scalars`, the segment rows :mod:`beam_hpc.observe.segment_rows`, the live
Slurm state :mod:`beam_hpc.observe.live_job`, the lost rollout nodes and their cost
:mod:`beam_hpc.observe.node_losses`, the text table :mod:`beam_hpc.observe.status_table`.

It runs on a login node, possibly while the job writes to the same directory, possibly long after
the job is gone: so it reads only files their writers publish atomically or append to line by line,
tolerates a torn last ledger line, skips a wrong-typed one with a warning naming file and line, and
treats Slurm as optional (no answer: the status still comes out, with a note). Each derived number
carries its definition in the JSON as ``basis``. The JSON layout (``STATUS_SCHEMA``) is stable:
fields are added, never renamed.
"""

from __future__ import annotations

import statistics
import time
from enum import StrEnum
from pathlib import Path
from typing import Any

from beam_hpc.errors import shorten
from beam_hpc.lifecycle.decide import Action
from beam_hpc.observe.ettr import ettr
from beam_hpc.observe.eval_set import eval_set_of
from beam_hpc.observe.live_job import ACTIVE_STATES, WAITING_STATES, slurm_job_state
from beam_hpc.observe.node_losses import node_losses, rollout_node_gpus
from beam_hpc.observe.run_dir import RunDirError, check_run_dir, checkpoint_problems, load_plan
from beam_hpc.observe.segment_rows import SegmentState, current_job, segment_rows
from beam_hpc.plan.paths import RunPaths
from beam_hpc.run import checkpoint_layout, metric_names, tracking
from beam_hpc.run.ledger import Reason, read_ledger
from beam_hpc.run.scalars import Scalars, read_scalars
from beam_hpc.slurm import client as slurm_client

STATUS_SCHEMA = 1
# Definitions (each also in the JSON's "basis" string):
# - rollouts done: k + 1 for the last complete checkpoint k; rollouts generated: one past the highest
#   rollout id in the metrics (may run ahead of the checkpoint).
# - goodput: seconds of rollout steps kept (ids below the last complete checkpoint, the last attempt of
#   each) over the wall time of all segments; start-up, saves and re-done rollouts make it fall below 1.
# - eval: the latest numbers on the run's evaluation set (beam_hpc.observe.eval_set); ``accuracy`` is
#   beam-hpc's checker, ``miles_checker`` Miles's own (what the seed reported), "unavailable" where Miles
#   could not be imported when the run scored.
# - ETTR (beam_hpc.observe.ettr): stricter than goodput: the kept rollouts' step seconds over the wall
#   time of the finished segments (a running one is left out until it ends).
# - node losses (beam_hpc.observe.node_losses): rollout nodes lost mid-segment that the run went on
#   without, each with the GPU-hours its GPUs were held serving nothing and its replacement's own.
# - ETA: remaining rollouts x the measured allocated seconds per kept rollout (start-up and saves
#   included, queue waits not).
# -- gather ------------------------------------------------------------------------------------
def gather(run_dir: str | Path, *, slurm: bool = True, now: float | None = None) -> dict[str, Any]:
    """Everything `beam-hpc status` shows, as a JSON-ready dict (layout: ``STATUS_SCHEMA``)."""
    root = check_run_dir(run_dir)
    paths = RunPaths(str(root))
    plan = load_plan(root)
    if plan is None and not Path(paths.ledger).exists():
        raise RunDirError(f"{root}: no plan.json and no ledger.jsonl; give the run's --output-dir "
                          "(the directory that `beam-hpc submit` printed)")
    now = time.time() if now is None else now
    records, warnings = read_ledger(paths.ledger)
    scalars = read_scalars(root, warnings)

    # The job to ask Slurm about is known from the ledger before the rows are final.
    pre_rows = segment_rows(root, records, scalars, None, now)
    job = current_job(pre_rows)
    live = slurm_job_state(job) if (slurm and job) else None
    rows = segment_rows(root, records, scalars, live, now)

    starts = [r.get("start", {}) for r in records if r.get("start")]
    total = starts[-1].get("num_rollout") if starts else None
    if total is None and plan is not None:
        total = plan.get("recipe", {}).get("num_rollout")
        if isinstance(total, bool) or not isinstance(total, int) or total < 0:
            if total is not None:
                warnings.append(f"{paths.plan}: recipe.num_rollout is {shorten(total, 60)}, not a count; ignored")
            total = None

    ckpt_dir = Path(paths.checkpoints)
    last_iter = checkpoint_layout.latest_iteration(ckpt_dir)  # a corrupt pointer: exit 2, named
    ckpt_problems = checkpoint_problems(ckpt_dir, last_iter) if last_iter is not None else []
    done = 0 if last_iter is None else last_iter + 1
    seen = [pts[-1].step for tag, pts in scalars.series.items() if tag.startswith("rollout/") and pts]
    generated = max(seen) + 1 if seen else done

    goodput = _goodput(rows, scalars, done)
    extra = _extra_rollout(root, plan, max(generated, done), slurm=slurm, now=now)
    return {
        "schema": STATUS_SCHEMA,
        "run_dir": str(root),
        "generated_at": now,
        "run_id": (plan or {}).get("run_id"),
        "job_name": (plan or {}).get("job_name"),
        "recipe": (plan or {}).get("recipe", {}).get("name"),
        "backend": (plan or {}).get("recipe", {}).get("backend"),
        "state": _summary_state(rows, live, done, total),
        "segments": rows,
        "segment_count": len(rows),
        "job_ids": sorted({r["job_id"] for r in rows}, key=lambda j: (len(j), j)),
        "restarts": sum(1 for r in rows if r["restart"] > 0),
        "rollouts": {
            "done": done, "generated": max(generated, done), "total": total,
            "fraction": (done / total) if total else None,
            "basis": "done = rollouts covered by the last complete checkpoint",
        },
        "last_checkpoint": {
            "iteration": last_iter, "rollouts_done": done,
            "path": str(checkpoint_layout.iteration_dir(ckpt_dir, last_iter)) if last_iter is not None else None,
            "problems": ckpt_problems,
        },
        "eval": _eval(scalars, plan),
        "reward": _latest(scalars, metric_names.ROLLOUT_REWARD, metric_names.ROLLOUT_RESPONSE_LEN,
                          names=("value", "response_len")),
        "goodput": goodput,
        "gpu_hours": _gpu_hours(records, plan, now),
        "excluded_nodes": _excluded_nodes(root, records),
        "extra_rollout": extra,
        "node_losses": node_losses(root, records, plan, extra["jobs"], now=now),
        "ettr": _ettr(records, now),
        "stalls": _stalls(records, paths),
        "eta": _eta(rows, scalars, goodput, done, generated, total, live, now),
        "resubmission_pending": rows[-1]["resubmission_pending"] if rows else None,
        "slurm": live if live is not None else {
            "reachable": None, "job_id": job, "state": None, "reason": None, "components": [],
            "note": "not asked (--no-slurm)" if (job and not slurm) else "", "controller": None},
        "metrics_source": scalars.source,
        "wandb": tracking.summary(root, [r["segment"] for r in records]),
        "warnings": warnings,
    }


def _eval(scalars: Scalars, plan: dict[str, Any] | None) -> dict[str, Any]:
    """The latest eval numbers with the set they were measured on (name, label, tags, data file and
    rows: beam_hpc.observe.eval_set). ``aime25_accuracy`` / ``aime25_response_len`` are kept from
    the first layout and are filled only when the set is the seed's aime25; else they are None."""
    ev = eval_set_of(plan, frozenset(scalars.series))
    out = _latest(scalars, ev.accuracy_tag, ev.response_len_tag, names=("accuracy", "response_len"))
    seed = ev.name == metric_names.DEFAULT_EVAL_NAME
    miles_pts, unavailable = scalars.miles_checker_accuracy(ev.name)
    if miles_pts:
        miles = {"accuracy": miles_pts[-1].value, "rollout": miles_pts[-1].step, "state": "measured"}
    else:
        miles = {"accuracy": None, "rollout": None,
                 "state": "unavailable" if unavailable else "not recorded"}
    miles["basis"] = ("Miles's own answer checking (miles.rollout.rm_hub.math_utils.grade_answer_verl), "
                      "as the seed reported its eval; 'accuracy' is beam-hpc's checker")
    out.update(ev.to_dict(),
               aime25_accuracy=out["accuracy"] if seed else None,
               aime25_response_len=out["response_len"] if seed else None,
               miles_checker=miles)
    return out


def _latest(scalars: Scalars, *tags: str, names: tuple[str, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {n: None for n in names}
    out["rollout"] = None
    for tag, name in zip(tags, names, strict=False):
        pt = scalars.last(tag)
        if pt is not None:
            out[name] = pt.value
            out["rollout"] = pt.step if out["rollout"] is None else max(out["rollout"], pt.step)
    return out


def _goodput(rows: list[dict[str, Any]], scalars: Scalars, done: int) -> dict[str, Any]:
    times = scalars.by_step(metric_names.ROLLOUT_TIME)
    kept = [times[i].value for i in range(done) if i in times]
    missing = done - len(kept)
    if missing and kept:  # fill gaps (a dump lost with a killed segment) with the typical step time
        kept += [statistics.median(kept)] * missing
    kept_s = float(sum(kept))
    allocated = float(sum(r["duration_s"] or 0.0 for r in rows))
    return {
        "value": (kept_s / allocated) if allocated > 0 and kept else None,
        "kept_rollout_s": kept_s,
        "allocated_s": allocated,
        "kept_rollouts": done,
        "estimated_rollouts": missing if kept else 0,
        "basis": "seconds of kept rollout steps / wall time of all segments",
    }


def _gpu_hours(records: list[dict[str, Any]], plan: dict[str, Any] | None, now: float) -> dict[str, Any]:
    """GPU-hours held so far, useful, and lost by cause (beam_hpc.run.accounting over the
    ledger; GPUs = every group's); ``partial`` when old ledger lines lack the fields a cause needs."""
    from beam_hpc.run import accounting

    try:
        gpus: int | None = sum(int(g["nodes"]) * int(g["gpus_per_node"]) for g in plan["groups"]) if plan else None
    except (KeyError, TypeError, ValueError):
        gpus = None
    if gpus is None:
        return {"gpus": None, "held": None, "useful": None, "lost": {c: None for c in accounting.CAUSES},
                "goodput": None, "partial": True, "basis": "no readable plan.json: the run's GPUs are unknown"}
    h = accounting.account(records, gpus, now=now, lost_node_gpus=rollout_node_gpus(plan) or 0)
    return {"gpus": gpus, "held": h.held_h, "useful": h.useful_h, "lost": dict(h.lost_h), "goodput": h.goodput,
            "partial": h.partial, "basis": "GPUs x segment wall time, less lost rollout nodes' GPUs from their "
                                           "loss, from the ledger (beam_hpc.run.accounting)"}


def _ettr(records: list[dict[str, Any]], now: float) -> dict[str, Any]:
    """Effective training time ratio (beam_hpc.observe.ettr), stricter than goodput: only the
    training steps of the rollouts the final checkpoints keep, over the wall time held."""
    e = ettr(records, now=now)
    return {"value": e.ratio, "training_s": e.training_s, "held_s": e.held_s, "span_ratio": e.span_ratio,
            "rollouts_kept": e.rollouts_kept, "segments": e.segments, "running_left_out": e.running,
            "partial": e.partial,
            "basis": "rollout-step seconds of the kept rollouts, each once / wall time of the finished segments; "
                     "span_ratio: over first start to last end, queue waits included"}


def _extra_rollout(root: Path, plan: dict[str, Any] | None, generated: int, *, slurm: bool,
                   now: float) -> dict[str, Any]:
    """The run's extra rollout jobs (beam_hpc.elastic.registry): each one's state and what it served,
    the share of the run's rollout samples they served, and their GPU-hours (not in the run's own)."""
    from beam_hpc.elastic import registry

    jobs = registry.extra_jobs(root)
    batch = (plan or {}).get("recipe", {}).get("batch", {})
    try:
        total = generated * int(batch["prompts"]) * int(batch["responses_per_prompt"])
    except (KeyError, TypeError, ValueError):
        total = 0
    samples = sum(j.samples for j in jobs)
    rows = []
    for j in jobs:
        live = slurm_client.job_state(j.job_id) if slurm and j.state != "left" else None
        rows.append({"job_id": j.job_id, "nodes": j.nodes, "partition": j.partition, "state": j.state,
                     "reason": j.reason, "slurm_state": live.value if live else None, "units": j.units_served,
                     "samples": j.samples, "rollouts": j.rollouts, "versions": j.versions,
                     "gpu_hours": j.gpu_hours(now=now), "node_hours": j.node_seconds(now=now) / 3600.0,
                     # a replacement of a lost rollout node (beam_hpc.elastic.replace): the node it replaces
                     "replaces": next((e.get("replaces") for e in j.events if e.get("event") == "replacement"), None)})
    return {"jobs": rows, "samples": samples, "share": (samples / total) if total and jobs else None,
            "gpu_hours": sum(r["gpu_hours"] for r in rows), "node_hours": sum(r["node_hours"] for r in rows),
            "basis": "share = samples the extra jobs served / (rollouts generated x prompts x responses); "
                     "their GPU-hours are their own nodes' (started to left), not in the run's"}


def _stalls(records: list[dict[str, Any]], paths: RunPaths) -> list[dict[str, Any]]:
    """The segments that stalled (beam_hpc.lifecycle.stall): the rollout that never finished, how
    long nothing finished before the segment acted, and where its stack dumps are."""
    out = []
    for r in records:
        end = r.get("end") or {}
        stall = end.get("stall")
        if end.get("reason") != Reason.STALLED or not isinstance(stall, dict):
            continue
        since, caught = stall.get("since"), stall.get("caught_at")
        out.append({"segment": r["segment"], "rollout": stall.get("rollout"), "time": end.get("time"),
                    "silent_s": round(caught - since, 1) if isinstance(since, (int, float)) and isinstance(caught, (int, float)) else None,
                    "timeout_s": stall.get("timeout_s"), "dumps": len(stall.get("dumps") or []),
                    "stacks": str(paths.segment_named(r["segment"]).stacks),
                    "suspects": list(stall.get("suspects") or []), "next": (end.get("next") or {}).get("action")})
    return out


def _excluded_nodes(root: Path, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The run's failed nodes that its next segments leave out (those cleared with
    ``submit --resume --include-node`` are not shown)."""
    from beam_hpc.lifecycle import exclusions

    return [{"node": e.node, "why": e.why, "segment": e.segment, "time": e.time}
            for e in exclusions.from_ledger(records, exclusions.read_cleared(root))]


def _eta(rows: list[dict[str, Any]], scalars: Scalars, goodput: dict[str, Any], done: int,
         generated: int, total: int | None, live: dict[str, Any] | None, now: float) -> dict[str, Any]:
    step_times = [p.value for p in scalars.series.get(metric_names.ROLLOUT_TIME, [])][-10:]
    if not step_times:
        step_times = [r["timings"].get("rollout_s") for r in rows if r["timings"].get("rollout_s")]
    step_rate = statistics.median(step_times) if step_times else None
    alloc_rate = goodput["allocated_s"] / done if done and goodput["allocated_s"] > 0 else None
    remaining = max(total - max(generated, done), 0) if total is not None else None
    rate = alloc_rate or step_rate
    eta_s = remaining * rate if (remaining is not None and rate) else None
    if remaining == 0:
        eta_s = 0.0
    running = live is not None and live.get("state") in ACTIVE_STATES
    return {
        "remaining_rollouts": remaining,
        "s_per_rollout_step": step_rate,
        "s_per_rollout_allocated": alloc_rate,
        "eta_s": eta_s,
        "finish_at": (now + eta_s) if (eta_s is not None and running) else None,
        "basis": ("allocated seconds per kept rollout (includes start-up and saves, not queue waits)"
                  if alloc_rate else "median rollout step time (no kept rollout yet)"),
    }


class RunState(StrEnum):
    """The run's one-word ``state`` (the JSON holds these strings)."""

    COMPLETED = "completed"
    RUNNING = "running"
    PENDING = "pending"
    NOT_STARTED = "not-started"
    RESUBMISSION_PENDING = "resubmission-pending"  # the chain waits for the command its last segment could not run
    STOPPED = "stopped"
    UNKNOWN = "unknown"  # the chain should go on, but Slurm cannot confirm it


def _summary_state(rows: list[dict[str, Any]], live: dict[str, Any] | None, done: int,
                   total: int | None) -> RunState:
    state = (live or {}).get("state")
    if total and done >= total:
        return RunState.COMPLETED
    if state in ACTIVE_STATES:
        return RunState.RUNNING
    if state in WAITING_STATES:
        return RunState.PENDING
    if not rows:
        return RunState.NOT_STARTED
    ended = rows[-1]["state"] == SegmentState.ENDED
    if ended and rows[-1]["resubmission_pending"]:
        return RunState.RESUBMISSION_PENDING
    if ended and rows[-1]["next_action"] in (None, Action.NONE):
        return RunState.STOPPED
    if live is None or not live.get("reachable"):
        return RunState.UNKNOWN
    return RunState.STOPPED
