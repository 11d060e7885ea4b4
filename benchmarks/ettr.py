"""Projected ETTR at 96, 1,024 and 8,192 GPUs: full restart against in-place rollout-node replacement.

    python benchmarks/ettr.py [--runs 40] [--seed 1] [--days 7] [--json out.json]

ETTR (issue 42) is the time spent training on work that is kept over the wall time held. This
script simulates a run's chain of segments under node failures and reads ETTR off the simulated
ledger with the product's own reader (:mod:`beam_hpc.observe.ettr`): each segment writes the start
and end lines a real segment writes (:func:`beam_hpc.run.ledger.start_record`, ``end_record``), and
what follows each segment is decided by the product's rule book, :func:`beam_hpc.lifecycle.decide.decide`,
fed the same :class:`~beam_hpc.lifecycle.decide.Outcome` and ledger history a real segment feeds it.
So the retry-once rule, the max-segments guard and the stop after two failures without progress
act here as they act in a real chain.

What happens when a node is lost is the policy's, a parameter (:class:`Policy`):

- ``full-restart`` (:class:`FullRestart`): today's behaviour. Slurm revokes the allocation, the
  segment ends as a node failure, decide() resubmits from the last checkpoint.
- ``in place`` (:class:`InPlaceReplacement`): the policy issue 42 items 1-2 ask for, modelled. The
  product now goes on without a lost rollout node for the reference backend only
  (``beam_hpc.slurm.script.survives_node_loss``: a dedicated rollout group of 2+ nodes; a Miles
  run, the seed's, still ends the segment), and submits a replacement at most
  ``lifecycle.max_replacements`` times a run (``beam_hpc.lifecycle.replace``). The model: a lost
  rollout node takes its SGLang engine (``gpus_per_engine``/8 nodes) out; the units it held go back
  to the queue and nothing is trained again; training goes on at the capacity left (the step slows
  as below); a replacement joins after ``replace_s`` (queue wait + its own bring-up + catching up
  on weights), while the run's cap allows (the recipe's default, and no cap). A lost trainer node,
  a loss before the first rollout, or the loss of every engine ends the segment as a full restart
  does. :meth:`Policy.on_node_lost` is the seam where the product's rule can replace this class.

The model of a run (each value is printed with its source):

- a node is lost at the rate of its 8 GPUs at the per-GPU interruption rate (Poisson); which node
  is drawn in proportion to the groups' sizes;
- a step (one rollout generated and trained on) takes ``step_s`` at full capacity. The seed's
  configurations are asynchronous with pools sized to balance generation and training, so a step
  is the slower of the two: with ``k`` of ``E`` engines lost it takes ``step_s * max(1, E/(E-k))``;
- a checkpoint every ``interval`` rollouts costs ``save_s`` (held, not training); a failure loses
  the rollouts since the last one; a failure is noticed ``detect_s`` after it happens;
- each segment spends ``bringup_s`` (held) before its first rollout and waits ``queue_s`` (not
  held) in the queue before it starts; at the walltime lead it saves on request and ends;
- in place, the step in flight when an engine is lost is charged whole at the slower speed (its
  units go back to the queue), and a replacement holds its GPUs from ``queue_s`` after the loss
  until the segment ends (reported as replacement GPU-hours, outside the run's own);
- when decide() stops the chain before the run is done, an operator resubmits it ``operator_s`` later
  (not held), and decide()'s count of segments starts again (as a raised ``lifecycle.max_segments``).

Two ETTR figures: ETTR as the ledger defines it (a slowed step counts whole, as training), and
"at full speed": the kept rollouts at the full-capacity step, over the same held time, which charges
the in-place policy for the capacity it ran without.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from beam_hpc.config.recipe import LifecycleSpec  # noqa: E402
from beam_hpc.lifecycle.decide import Action, Outcome, decide  # noqa: E402
from beam_hpc.observe.ettr import ettr  # noqa: E402
from beam_hpc.run import ledger  # noqa: E402
from beam_hpc.run.ledger import Reason  # noqa: E402

GPUS_PER_NODE = 8
# lifecycle.max_replacements: the product's per-run cap on replacement jobs (beam_hpc/lifecycle/replace.py)
RECIPE_CAP = LifecycleSpec.model_fields["max_replacements"].default
# Llama 3 (arXiv 2407.21783, section 3.3.4): 466 job interruptions in a 54-day snapshot of
# pre-training on 16,384 H100 GPUs (419 unexpected, 78% of those hardware).
LLAMA3_INTERRUPTIONS, LLAMA3_DAYS, LLAMA3_GPUS = 466, 54, 16_384
PER_GPU_HOUR = LLAMA3_INTERRUPTIONS / (LLAMA3_GPUS * LLAMA3_DAYS * 24)


@dataclass(frozen=True)
class Scale:
    """One run size and the phase costs it pays."""

    name: str
    trainer_nodes: int
    rollout_nodes: int
    bringup_s: float  # segment start -> first rollout (held)
    queue_s: float  # waiting in the queue before a resubmitted segment starts (not held)
    replace_s: float  # in place: a rollout node lost -> its replacement serving
    gpus_per_engine: int = 16

    @property
    def gpus(self) -> int:
        return (self.trainer_nodes + self.rollout_nodes) * GPUS_PER_NODE

    @property
    def engines(self) -> int:
        return self.rollout_nodes * GPUS_PER_NODE // self.gpus_per_engine


@dataclass(frozen=True)
class Costs:
    """Phase costs that do not depend on the run's size (the seed recipe's step, save and walltime)."""

    step_s: float = 600.0
    save_s: float = 300.0
    interval: int = 20
    walltime_s: float = 24 * 3600.0
    lead_s: float = 900.0
    detect_s: float = 60.0
    operator_s: float = 3600.0
    max_segments: int = 50
    per_gpu_hour: float = PER_GPU_HOUR


# The seed's dedicated configuration (recipes/dedicated.yaml): 8 trainer + 4 rollout nodes of 8
# GPUs, SGLang engines of 16 GPUs; larger runs keep its 2:1 split and engine size.
SCALES = (
    Scale("96 GPUs (seed)", 8, 4, bringup_s=15 * 60, queue_s=5 * 60, replace_s=15 * 60),
    Scale("1,024 GPUs", 86, 42, bringup_s=22 * 60, queue_s=10 * 60, replace_s=15 * 60),
    Scale("8,192 GPUs", 682, 342, bringup_s=30 * 60, queue_s=20 * 60, replace_s=20 * 60),
)

SOURCES = {
    "per-GPU interruption rate": f"{PER_GPU_HOUR:.3g} per GPU-hour: Llama 3, 466 interruptions in 54 days on 16,384 "
                                 "H100s (arXiv 2407.21783, 3.3.4); each taken as one node lost",
    "topology": "recipes/dedicated.yaml: 8 trainer + 4 rollout nodes, 16-GPU engines; the 2:1 split kept at scale",
    "step_s 600": "assumption: the seed recipe's lead floor (900 s) covers one 4,096-token rollout and a 501B save",
    "save_s 300": "assumption within the lead floor; Qwen3-30B-A3B saves in GRPO take 6-8 min (NeMo-RL #1208)",
    "interval 20, walltime 24 h, lead 900 s, max_segments 50": "recipes/dedicated.yaml",
    "bring-up 15 / 22 / 30 min": "verl 3.7 min before Ray (verl #384), NeMo-RL 20-30 min set-up (NeMo-RL #3596), "
                                 "~22 min to re-initialise DeepSeek-V3 at 1k GPUs (Megatron-LM PR #5325); the local "
                                 "cluster's 16 s to the first rollout (issue 42) is the tiny model's",
    "queue 5 / 10 / 20 min": "assumption (a resubmission of the same shape, the failed node excluded)",
    "replacement 15 / 15 / 20 min": "assumption: a rollout job of the run's shape through `rollout add` "
                                    "(queue, Ray, engine load, weights)",
    "detect 60 s": "assumption; the local cluster notices a dead node step in ~5 s "
                   "(benchmarks/results/faults-2026-12-04.md)",
    "operator 1 h": "assumption: a chain that decide() stopped is resubmitted by a person",
}


# -- the policy seam ------------------------------------------------------------------------------
@dataclass(frozen=True)
class NodeLost:
    """What a policy is told when a node is lost mid-segment."""

    group: str  # "trainer" | "rollout"
    engines: int  # the run's engines at full capacity
    engines_up: int  # engines still serving, the lost one's no longer counted
    replacements: int  # replacements already submitted in this run


@dataclass(frozen=True)
class Reaction:
    """End the segment (the chain goes on as decide() says), or go on and get a replacement
    ``replace_after_s`` later (None: no replacement)."""

    end_segment: bool
    replace_after_s: float | None = None


class Policy(Protocol):
    name: str

    def on_node_lost(self, lost: NodeLost) -> Reaction: ...


@dataclass(frozen=True)
class FullRestart:
    """Today: any lost node revokes the allocation and ends the segment."""

    name: str = "full restart"

    def on_node_lost(self, lost: NodeLost) -> Reaction:
        return Reaction(end_segment=True)


@dataclass(frozen=True)
class InPlaceReplacement:
    """Issue 42 items 1-2, modelled: a lost rollout node's engine is replaced in place (see the
    module doc), at most ``cap`` times a run (the product's ``lifecycle.max_replacements``)."""

    replace_s: float
    cap: int = RECIPE_CAP
    name: str = "in place"

    def on_node_lost(self, lost: NodeLost) -> Reaction:
        if lost.group == "trainer" or lost.engines_up <= 0:
            return Reaction(end_segment=True)
        return Reaction(end_segment=False,
                        replace_after_s=self.replace_s if lost.replacements < self.cap else None)


# -- one simulated run ----------------------------------------------------------------------------
@dataclass
class RunResult:
    ettr: float
    ettr_full_speed: float
    span_ettr: float
    segments: int
    node_losses: int
    restarts: int
    chain_stops: int  # decide() said none before the run was done (either reason below)
    stops_no_progress: int  # two segments in a row failed without a new checkpoint
    stops_max_segments: int  # lifecycle.max_segments reached
    replacement_gpu_h: float
    days: float


@dataclass
class _Segment:
    start: float
    at_start: int
    ops: list[tuple[float, str]] = field(default_factory=list)


def _gap(rng: random.Random, rate: float) -> float:
    """Held seconds to the next node loss (never, at rate 0)."""
    return rng.expovariate(rate) if rate > 0 else float("inf")


def simulate(scale: Scale, costs: Costs, policy: Policy, num_rollout: int, rng: random.Random) -> RunResult:
    """One run to ``num_rollout`` rollouts; its ETTR read from the ledger it leaves."""
    nodes = scale.trainer_nodes + scale.rollout_nodes
    node_rate_s = nodes * GPUS_PER_NODE * costs.per_gpu_hour / 3600.0  # node losses per held second
    nodes_per_engine = scale.gpus_per_engine // GPUS_PER_NODE
    lines: list[dict[str, Any]] = []
    history: list[dict[str, Any]] = []  # decide()'s: the segments since the chain (re)started
    now, saved, job = 0.0, 0, 0
    losses = restarts = stops = replacements = no_progress = too_many = 0
    replacement_gpu_s = 0.0
    next_loss = now + _gap(rng, node_rate_s)
    while saved < num_rollout:
        job += 1
        start = ledger.start_record(job_id=str(job), restart=0, host="sim", rollouts_at_start=saved,
                                    num_rollout=num_rollout, resume=saved > 0, walltime_s=int(costs.walltime_s),
                                    lead_s=int(costs.lead_s), now=now)
        t0, at_start = now, saved
        deadline = t0 + costs.walltime_s - costs.lead_s
        if next_loss < now:  # losses happen while held: the clock of failures runs in held time only
            next_loss = now + _gap(rng, node_rate_s)
        engines_up = scale.engines
        back: list[float] = []  # when lost engines' replacements serve
        done, steps, step_time = saved, 0, 0.0
        reason: Reason | None = None
        t = t0 + scale.bringup_s
        joined: list[float] = []  # when each replacement job of this segment started holding GPUs
        if next_loss < t:  # lost during bring-up: no progress
            losses += 1
            t, reason = next_loss + costs.detect_s, Reason.NODE_FAILURE
            next_loss += _gap(rng, node_rate_s)
        while reason is None:
            back.sort()
            while back and back[0] <= t:
                back.pop(0)
                engines_up += 1
            step = costs.step_s * max(1.0, scale.engines / engines_up)
            save = costs.save_s if (done + 1) % costs.interval == 0 or done + 1 == num_rollout else 0.0
            if t + step + save > deadline:  # the walltime lead: save on request, stop
                if done > saved:
                    t, saved = t + costs.save_s, done
                reason = Reason.WALLTIME
                break
            if next_loss < t + step + save:
                losses += 1
                lost_at = next_loss
                next_loss = lost_at + _gap(rng, node_rate_s)
                group = "trainer" if rng.random() < scale.trainer_nodes / nodes else "rollout"
                up = engines_up - 1 if group == "rollout" else engines_up
                r = policy.on_node_lost(NodeLost(group, scale.engines, up, replacements))
                if r.end_segment:
                    t, reason = lost_at + costs.detect_s, Reason.NODE_FAILURE
                    break
                engines_up = up  # the step in flight goes on, slower: its units go back to the queue
                if r.replace_after_s is not None:
                    replacements += 1
                    back.append(lost_at + r.replace_after_s)
                    joined.append(lost_at + scale.queue_s)
                continue
            t += step + save
            step_time += step
            steps += 1
            done += 1
            if save:
                saved = done
            if done >= num_rollout:
                reason = Reason.COMPLETED
        if reason == Reason.NODE_FAILURE:
            restarts += 1
        # a replacement holds its engine's GPUs from its start to this segment's end (the next
        # segment starts whole, the failed nodes excluded)
        replacement_gpu_s += sum(nodes_per_engine * GPUS_PER_NODE * max(0.0, t - j) for j in joined)
        end = ledger.end_record(job_id=str(job), restart=0, rollouts_at_end=saved, reason=reason, detail="",
                                next_action="none", next_job_id=None,
                                rollout_s=step_time / steps if steps else None, save_s=costs.save_s,
                                ready_s=scale.bringup_s, rollouts_run=steps, now=t)
        outcome = Outcome(reason=reason, rollouts_at_start=at_start, rollouts_at_end=saved, num_rollout=num_rollout,
                          rollouts_run=steps)
        decision = decide(outcome, history=history, max_segments=costs.max_segments, cancelled=False,
                          requeue_on_preemption=True)
        end["next"] = {"action": decision.action.value, "job_id": None}
        seg = {"segment": start["segment"], "start": start, "end": end}
        lines.append(seg)
        history.append(seg)
        now = t
        if decision.action == Action.NONE and saved < num_rollout:  # stopped: a person resubmits
            stops += 1
            no_progress += "failed without progress too" in decision.detail
            too_many += "max_segments" in decision.detail
            history = []
            now += costs.operator_s
        elif decision.action != Action.NONE:
            now += scale.queue_s
    e = ettr(lines, now=now)
    full_speed = e.rollouts_kept * costs.step_s
    return RunResult(ettr=e.ratio or 0.0, ettr_full_speed=full_speed / e.held_s if e.held_s else 0.0,
                     span_ettr=e.span_ratio or 0.0, segments=len(lines), node_losses=losses, restarts=restarts,
                     chain_stops=stops, stops_no_progress=no_progress, stops_max_segments=too_many,
                     replacement_gpu_h=replacement_gpu_s / 3600.0, days=now / 86400.0)


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def project(runs: int, seed: int, days: float, costs: Costs = Costs()) -> list[dict[str, Any]]:
    """Each scale under each policy, ``runs`` runs each with the same failure seeds for both policies."""
    num_rollout = int(days * 86400 / costs.step_s)
    rows = []
    for scale in SCALES:
        for policy in (FullRestart(),
                       InPlaceReplacement(scale.replace_s, name=f"in place, cap {RECIPE_CAP}"),
                       InPlaceReplacement(scale.replace_s, cap=10**6, name="in place, no cap")):
            results = [simulate(scale, costs, policy, num_rollout, random.Random(f"{seed}:{scale.name}:{i}"))
                       for i in range(runs)]
            col = {k: [getattr(r, k) for r in results] for k in asdict(results[0])}
            rows.append({
                "scale": scale.name, "gpus": scale.gpus, "trainer_nodes": scale.trainer_nodes,
                "rollout_nodes": scale.rollout_nodes, "engines": scale.engines, "policy": policy.name,
                "node_losses_per_day": scale.gpus * costs.per_gpu_hour * 24,
                **{f"{k}_mean": statistics.fmean(v) for k, v in col.items()},
                "ettr_p10": _pct(col["ettr"], 0.1), "ettr_p90": _pct(col["ettr"], 0.9),
            })
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    head = ("| run | GPUs (trainer + rollout nodes; engines) | node losses / day | policy | ETTR mean (p10-p90) | "
            "ETTR at full speed | ETTR over wall span | segments | restarts | chain stops (no progress / max segments) | "
            "replacement GPU-h | days |")
    out = [head, "|" + "---|" * 12]
    for r in rows:
        out.append(f"| {r['scale']} | {r['gpus']} ({r['trainer_nodes']} + {r['rollout_nodes']}; {r['engines']}) | "
                   f"{r['node_losses_per_day']:.2f} | {r['policy']} | {r['ettr_mean']:.3f} "
                   f"({r['ettr_p10']:.3f}-{r['ettr_p90']:.3f}) | {r['ettr_full_speed_mean']:.3f} | "
                   f"{r['span_ettr_mean']:.3f} | {r['segments_mean']:.1f} | {r['restarts_mean']:.1f} | "
                   f"{r['chain_stops_mean']:.2f} ({r['stops_no_progress_mean']:.2f} / {r['stops_max_segments_mean']:.2f}) | "
                   f"{r['replacement_gpu_h_mean']:.0f} | {r['days_mean']:.1f} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=40, help="simulated runs per scale and policy (default 40)")
    p.add_argument("--seed", type=int, default=1, help="failure draws (the same for both policies)")
    p.add_argument("--days", type=float, default=7.0, help="training a run needs at full speed, in days (default 7)")
    p.add_argument("--interval", type=int, default=Costs.interval,
                   help=f"checkpoint every this many rollouts (default {Costs.interval}, the recipe's)")
    p.add_argument("--json", type=Path, help="also write the rows here")
    args = p.parse_args(argv)
    problems = [f"--{name}: {value}; give a number above 0" for name, value in
                (("runs", args.runs), ("days", args.days), ("interval", args.interval)) if value <= 0]
    if problems:
        print("\n".join(problems), file=sys.stderr)
        return 2
    costs = Costs(interval=args.interval)
    rows = project(args.runs, args.seed, args.days, costs)
    print(f"{args.runs} runs per row, seed {args.seed}, {args.days:g} days of training at full speed "
          f"({int(args.days * 86400 / costs.step_s)} rollouts), a checkpoint every {costs.interval} rollouts\n")
    print(table(rows))
    print("\ninputs:\n" + "\n".join(f"- {k}: {v}" for k, v in SOURCES.items()))
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "costs": asdict(costs), "scales": [asdict(s) for s in SCALES],
                                         "sources": SOURCES, "runs": args.runs, "seed": args.seed,
                                         "days": args.days}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
