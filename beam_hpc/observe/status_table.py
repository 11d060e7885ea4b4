"""The text view of `beam-hpc status`: :func:`format_status` turns gather's dict into lines.

Owns one concern, presentation: every number here was computed by :mod:`beam_hpc.observe.status`
(which owns gathering and the derived numbers); this module only words and lays them out, so the
JSON (``status --json``) and the table can never disagree.
"""

from __future__ import annotations

import math
import time
from typing import Any

from beam_hpc.observe.eval_set import EvalData
from beam_hpc.progress import duration, text_table
from beam_hpc.run import tracking


def _clock(t: float | None) -> str:
    return time.strftime("%m-%d %H:%M:%S", time.localtime(t)) if t else "-"


def _num(x: float | None, fmt: str = "{:.3f}") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else fmt.format(x)


def _format_gpu_hours(gh: dict[str, Any] | None) -> list[str]:
    """The GPU-hours lines: held, useful with goodput, and lost by cause (0 causes left out)."""
    if not gh or gh.get("held") is None:
        return [] if not gh else [f"GPU-hours  - ({gh.get('basis')})"]
    good = f", goodput {gh['goodput'] * 100:.0f}%" if gh.get("goodput") is not None else ""
    partial = " (partial: older ledger lines lack the fields to attribute all losses)" if gh.get("partial") else ""
    out = [f"GPU-hours  {gh['held']:,.2f} held by {gh['gpus']} GPUs, {gh['useful']:,.2f} useful{good}{partial}"]
    lost = [f"{cause} {hours:,.2f}" for cause, hours in gh["lost"].items() if hours]
    out.append("lost       " + ("; ".join(lost) if lost else "none"))
    return out


def _span(values: list[int]) -> str:
    if not values:
        return "-"
    return f"{values[0]}-{values[-1]}" if len(values) > 2 and values[-1] - values[0] == len(values) - 1 else \
        ",".join(map(str, values))


def _format_extra_rollout(x: dict[str, Any] | None) -> list[str]:
    """One line per extra rollout job, then their share of the samples, then their GPU-hours."""
    if not x or not x.get("jobs"):
        return []
    out = []
    for j in x["jobs"]:
        state = j["state"] + (f" ({j['reason']})" if j.get("reason") else "")
        if j.get("slurm_state"):
            state += f", Slurm {j['slurm_state']}"
        why = f", replacing lost rollout node {j['replaces']}" if j.get("replaces") else ""
        cost = f", {j.get('gpu_hours') or 0.0:,.2f} GPU-hours" if j.get("replaces") else ""  # a replacement's own cost
        out.append(f"extra job  {j['job_id']}: {j['nodes']} node(s){why}, {state}; served rollouts {_span(j['rollouts'])}, "
                   f"versions {_span(j['versions'])} ({j['units']} units, {j['samples']} samples{cost})")
    share = f"{x['share'] * 100:.1f}%" if x.get("share") is not None else "-"
    out.append(f"extra      {share} of the rollout samples served by extra jobs ({x['samples']} samples)")
    out.append(f"extra GPU-hours {x['gpu_hours']:,.2f} ({x['node_hours']:,.2f} node-hours), beside the run's own")
    return out


def _format_ettr(e: dict[str, Any] | None) -> list[str]:
    """The ETTR line: training on kept rollouts over the wall time held, and over the span."""
    if not e:
        return []
    if e.get("value") is None:
        return ["ETTR       - (no segment has ended yet)"]
    span = f"; {e['span_ratio'] * 100:.0f}% of the span, queue waits included" if e.get("span_ratio") else ""
    notes = [n for n, on in (("the running segment left out until it ends", e.get("running_left_out")),
                             ("partial: some rollouts timed at the run's mean step", e.get("partial"))) if on]
    return [f"ETTR       {e['value'] * 100:.0f}% ({duration(e['training_s'])} training {e['rollouts_kept']} kept "
            f"rollouts / {duration(e['held_s'])} held by {e['segments']} segment(s){span})"
            + (f" [{'; '.join(notes)}]" if notes else "")]


def _format_node_losses(nl: dict[str, Any] | None) -> list[str]:
    """One line per rollout node lost mid-segment (when, where, its cost, its replacement), then the totals."""
    if not nl or not nl.get("losses"):
        return []
    out = []
    for x in nl["losses"]:
        when = "at a time not recorded" if x["time"] is None else f"at {_clock(x['time'])}" + (
            " (when its replacement was asked)" if x["time_basis"] == "replacement asked" else "")
        if x["idle_gpu_hours"] is None:
            cost = "its cost is unknown (" + ("the ledger does not say when it was lost" if x["time"] is None
                                              else "no readable plan.json: its GPUs are unknown") + ")"
        else:
            cost = (f"its {x['gpus']} GPUs out {x['idle_gpu_hours']:,.2f} GPU-hours "
                    + ("so far (the segment runs; held until its end line records the loss)" if x["running"]
                       else "to the segment's end, no longer held by the run"))
        rep = x.get("replacement")
        if rep is not None:
            where = f" in {rep['partition']}" if rep.get("partition") else ""
            state = f"{rep['state']}, " if rep.get("state") else ""
            rep_txt = f"replaced by job {rep['job_id']}{where} ({state}{rep.get('gpu_hours') or 0.0:,.2f} GPU-hours)"
        elif nl.get("max_replacements") is not None and nl["replacements"] >= nl["max_replacements"]:
            rep_txt = (f"no replacement: the run asked for {nl['replacements']} of lifecycle.max_replacements="
                       f"{nl['max_replacements']}")
        else:
            rep_txt = f"no replacement recorded (see logs/{x['segment']}/segment.log)"
        out.append(f"lost node  {x['node']} in segment {x['segment']} {when}: {cost}; {rep_txt}")
    partial = " (partial: some losses have no known cost)" if nl.get("partial") else ""
    out.append(f"node loss  {len(nl['losses'])} rollout node(s) lost, {nl['idle_gpu_hours']:,.2f} GPU-hours of "
               f"their GPUs out{partial}; replacements {nl['replacement_gpu_hours']:,.2f} GPU-hours of their own")
    return out


def format_status(s: dict[str, Any]) -> str:
    """The default, human view of :func:`gather`'s dict."""
    r, ev, gp, eta, sl = s["rollouts"], s["eval"], s["goodput"], s["eta"], s["slurm"]
    title = ", ".join(x for x in (s.get("job_name"), f"recipe {s['recipe']}" if s.get("recipe") else None,
                                 f"backend {s['backend']}" if s.get("backend") else None) if x)
    lines = [f"run        {s['run_dir']}" + (f"  ({title})" if title else "")]
    live = sl.get("state") or "-"
    if sl.get("components"):
        c = sl["components"][0]
        live += f" on {c.get('NodeList')} ({c.get('RunTime')} of {c.get('TimeLimit')})"
    if sl.get("reason") and sl.get("reason") != "None":
        live += f", reason {sl['reason']}"
    job = f"job {sl['job_id']} {live}" if sl.get("job_id") else "no job queued"
    lines.append(f"state      {s['state']}; {job}" + (f" [{sl['note']}]" if sl.get("note") and not sl.get("controller") else ""))
    if sl.get("controller"):
        lines.append(f"slurm      could not be asked ({sl['controller']}): what follows is the run directory's alone")
    pending = s.get("resubmission_pending")
    if pending:
        lines.append(f"next step  the resubmission is pending ({pending['why']}); once `scontrol ping` says UP, "
                     f"run: {pending['command']}")
    total = r["total"] if r["total"] is not None else "?"
    frac = f" ({r['fraction'] * 100:.0f}%)" if r["fraction"] is not None else ""
    lines.append(f"rollouts   {r['done']} of {total} checkpointed{frac}, {r['generated']} generated")
    ck = s["last_checkpoint"]
    ck_txt = f"rollout {ck['iteration']} -> {ck['path']}" if ck["iteration"] is not None else "none yet"
    if ck["problems"]:
        ck_txt += "  PROBLEM: " + "; ".join(ck["problems"])
    lines.append(f"checkpoint {ck_txt}")
    mc = ev.get("miles_checker") or {}
    miles_txt = _num(mc.get("accuracy")) if mc.get("accuracy") is not None else (mc.get("state") or "not recorded")
    lines.append(f"eval       {ev['label']}: accuracy {_num(ev['accuracy'])} (beam-hpc checker), "
                 f"{miles_txt} (Miles checker), mean response length "
                 f"{_num(ev['response_len'], '{:.1f}')} tokens"
                 + (f" (rollout {ev['rollout']})" if ev["rollout"] is not None else "")
                 + (f" [{ev['accuracy_tag']}]" if ev["label"] != ev["name"] else ""))
    lines.append(f"eval data  {EvalData(**ev['data']).describe()}")
    rollout_len = s["reward"].get("response_len")
    lines.append(f"reward     {_num(s['reward']['value'])}"
                 + (f", mean response length {rollout_len:.1f} tokens" if rollout_len is not None else "")
                 + (f" (rollout {s['reward']['rollout']})" if s["reward"]["rollout"] is not None else ""))
    gp_txt = f"{gp['value'] * 100:.0f}%" if gp["value"] is not None else "-"
    lines.append(f"goodput    {gp_txt} ({duration(gp['kept_rollout_s'])} of kept rollouts / "
                 f"{duration(gp['allocated_s'])} allocated)")
    lines += _format_ettr(s.get("ettr"))
    if eta["remaining_rollouts"] == 0:
        eta_txt = "done: every rollout is generated"
    elif eta["eta_s"] is not None:
        rate = eta["s_per_rollout_allocated"] or eta["s_per_rollout_step"]
        eta_txt = f"{duration(eta['eta_s'])} of allocation for {eta['remaining_rollouts']} rollouts"
        eta_txt += f" at {rate:.1f} s each" if rate else ""
        if eta["finish_at"]:
            eta_txt += f", about {_clock(eta['finish_at'])} if it keeps running"
    else:
        eta_txt = "- (no measured rate yet)"
    lines.append(f"ETA        {eta_txt}")
    lines += _format_gpu_hours(s.get("gpu_hours"))
    lines += _format_extra_rollout(s.get("extra_rollout"))
    lines += _format_node_losses(s.get("node_losses"))
    for e in s.get("excluded_nodes") or []:
        lines.append(f"excluded   {e['node']} (since segment {e['segment']}: {e['why']})")
    for st in s.get("stalls") or []:
        silent = f"nothing finished for {st['silent_s']:.0f} s" if st.get("silent_s") is not None else "stalled"
        suspects = f"; suspect {', '.join(st['suspects'])}" if st.get("suspects") else ""
        lines.append(f"stalled    segment {st['segment']} at rollout {st['rollout']} ({silent}, timeout "
                     f"{st['timeout_s']} s); {st['dumps']} stack dump(s) in {st['stacks']}{suspects}; next: {st['next']}")
    if wandb_line := tracking.describe(s.get("wandb"), s["run_dir"]):
        lines.append(f"tracking   {wandb_line}")
    lines.append("")
    headers = ["segment", "job", "restart", "host", "start", "duration", "rollouts", "reason", "next"]
    table = []
    for row in s["segments"]:
        a, b = row["rollouts_at_start"], row["rollouts_at_end"]
        roll = f"{a if a is not None else '?'}->{b if b is not None else '?'}"
        if row.get("rollouts_run") is not None:
            roll += f" ({row['rollouts_run']} run)"
        dur = duration(row["duration_s"]) + ("~" if row["end_estimated"] else "") if row["duration_s"] is not None else "-"
        nxt = row["next_action"] or "-"
        if row["next_job_id"]:
            nxt += f" {row['next_job_id']}"
        table.append([row["segment"], row["job_id"], str(row["restart"]), row["host"] or "-",
                      _clock(row["start"]), dur, roll, row["reason"] or row["state"], nxt])
    lines.append(text_table(headers, table) if table else "no segment has started yet")
    lines += [f"warning: {w}" for w in s["warnings"]]
    return "\n".join(lines)
