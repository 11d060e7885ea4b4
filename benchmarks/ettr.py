"""Projected ETTR at 96, 1,024 and 8,192 GPUs: full restart against the product's own rules for a lost node and a process fault.

    python benchmarks/ettr.py [--runs 40] [--seed 1] [--days 7] [--interval N] [--rate llama3|robustrl|both|X]
                              [--process-share F] [--replacement-wait S] [--json out.json]

ETTR (issue 42) is the time spent training on work that is kept over the wall time held. This
script simulates a run's chain of segments under node losses and process faults on live nodes
(:class:`ProcessFault`) and reads ETTR off the simulated
ledger with the product's own reader (:mod:`beam_hpc.observe.ettr`). It is driven by beam-hpc's
decision code, not by a model of it:

- each simulated configuration is a real :class:`~beam_hpc.plan.plan.Plan`, made by the product's
  ``plan_for`` (``make_plan`` with the backend's driver command and its layout checks) from
  ``recipes/dedicated.yaml`` (the seed's 96-GPU recipe) with the topology and batch of each size
  (:data:`SHAPES`) and the backend named (:func:`config_for`). The checkpoint interval, walltime,
  lead, ``max_segments``, ``max_replacements`` and the stall timeout are read from that plan;
- what the segment does when a node is lost is the product's answer (:class:`ProductRule`):
  :func:`beam_hpc.plan.node_loss.on_node_loss` on the plan's group of the lost node, then
  :func:`beam_hpc.elastic.replace.on_node_lost` with whether that answer is GO_ON, the segment's
  own nodes of that group still up, the replacements the run has asked for, and the recipe's
  ``lifecycle.max_replacements``; the same calls the job makes (``beam_hpc.job.runner`` and
  ``beam_hpc.elastic.replace.replace_lost``). So a reference run's rollout group of 2+ nodes goes
  on (GO_ON); a Miles run's rollout group that keeps a whole engine without the node (the seed's:
  4 nodes, engines of 2) saves first (SAVE_FIRST, :func:`lost_node_end`): the rollout in flight
  finishes on the engines left and one save keeps it; then, while the run may still ask for a
  replacement (``beam_hpc.elastic.replace.may_replace``: the same ``on_node_lost`` call with the
  run's count and ``lifecycle.max_replacements``) and ``lifecycle.replacement_wait_s`` > 0, the
  segment asks for a node to take the lost one's place in its Ray cluster and waits for it
  (:func:`replacement_wait`): joined within the wait, it trains on after Miles restarts the lost
  engine there; not, it ends as ``node-failure`` naming the node once the wait is over (at once
  with no replacement to ask for). A loss too late for that rollout's save ends the segment from
  the last periodic checkpoint after the stall timeout, with no wait; every other group, a
  trainer's included, ends its segment (END);
- each segment writes the start and end lines a real segment writes (:func:`beam_hpc.run.ledger.start_record`,
  ``end_record``), and what follows it is decided by :func:`beam_hpc.lifecycle.decide.decide`, fed the
  same :class:`~beam_hpc.lifecycle.decide.Outcome` and ledger history a real segment feeds it (the
  retry-once rule, the ``max_segments`` guard, the stop after two failures without progress);
- a segment whose rollouts cannot go on (the product went on, but no engine is whole) ends when
  the product's stall watchdog fires (:func:`beam_hpc.lifecycle.stall.timeouts`), as ``stalled``;
- what a process fault on a live node does is the product's too (:meth:`ProductRule.on_process_fault`):
  a trainer process's fault fails the driver (``error``, no node excluded); on the rollout group a
  Miles run's driver restarts the dead engine in place (:func:`restarts_dead_engines`: the plan's
  driver argv carries ``--use-fault-tolerance``, which ``beam_hpc.backends.miles.args._outputs``
  puts on every Miles run), and a reference run's driver starts a new worker in the dead one's
  slot and goes on with the others meanwhile (:func:`restarts_dead_workers`, below).

What the reference backend does when a rollout worker's process dies on a node that stays up, read
from the code: the driver's unit feeder gets ``RayActorError`` for the unit in flight and calls
``beam_hpc.backends.reference.rollouts.unit_service.UnitService._worker_lost``, which puts the
worker's units back at the head of the queue (the workers left, and outside ones, serve them) and
calls ``UnitService._restart_in_place``: where the worker's Ray node is still alive, a new worker
actor is started in its slot (``beam_hpc.backends.reference.loop.driver.Loop.new_worker``, the
rollout group's resource the dead one freed). The feeder swaps it in once it has loaded the model
(``UnitService._joined``: its ``where`` answered), hands it the weights of the versions a unit may
still ask for directly (``RolloutWorker.hold_weights``), and the queue leases to it again. While it
starts, the segment goes on with the other workers, and it does not end even when the dead worker
was the last one: ``UnitService._check_capacity`` raises only when no own worker is alive, none is
starting and no outside worker is registered, i.e. only when the restart itself fails (the new
worker dies while starting, or has not loaded within ``RESTART_WAIT_S``, 600 s). Modelled here: the
worker is out ``worker_restart_s`` from its death and then serves again (:class:`_Capacity`); with
no worker left the step waits for it. The restart always succeeds in the model, and
``MAX_RESTARTS`` (3 a worker a segment, after which the worker stays lost) is not modelled: a worker
faulting 3 times within one segment is far above any rate modelled here (about one process fault
per 8 rollout-node-days at 8,192 GPUs at Llama 3's rate). A lost node's worker is not restarted (it
is dropped and a replacement asked for, the node-loss rule), and ``backend_options.weight_sync:
nccl`` still ends the segment (the dead worker was a rank of the trainer's broadcast group, which
takes no new rank). That path does not read ``lifecycle.rollout_node_loss``, so the full-restart
row restarts the worker too.

``full restart`` is the product too: the same reference recipe with ``lifecycle.rollout_node_loss:
restart``, under which on_node_loss says END for every group, so any lost node ends the segment
and decide() resubmits from the last checkpoint (the product before issue 42). A rollout worker's
process fault does not end its segment (the reference driver restarts the worker in place whatever
``rollout_node_loss`` says), so this row is "full restart" for node losses only. The seed's Miles
recipe differs from it twice: a lost rollout node is saved first and then waited for a
replacement (SAVE_FIRST), and a rollout process fault restarts the engine before the next weight
update, which waits for it, against a worker restarted beside the others while they serve.

The model of a run (each value is printed with its source):

- interruptions come at the rate of the run's GPUs at the per-GPU interruption rate (Poisson, in
  held time). Each is a process fault on a live node with probability ``process_share`` (Llama 3's
  Table 5: 'software bug' 12.9% + 'NCCL watchdog timeouts' 1.7% of the unexpected interruptions,
  faults a restart on the same GPUs clears; :data:`LLAMA3_PROCESS_SHARE`), else a node lost (the
  hardware categories, which need the node or GPU replaced). The share splits the rate, it adds
  nothing: the total is Llama 3's (or RobustRL's, with Llama 3's share: an assumption). Either
  kind's group is drawn in proportion to the groups' sizes, and the node among the group's nodes
  up; ``--process-share 0`` draws no kind and gives the node-loss-only projection draw for draw;
- a Miles engine whose process died is out from its death to the next weight update (the step in
  flight runs slower, as for an engine not whole), and then Miles starts it again on the same
  bundle before that update, which waits for it: ``engine_restart_s`` held, nothing generated or
  trained (the recovery path ``actor_group.update_weights -> ServerGroup.recover``, recorded in
  tests/support/standins/miles_standin/miles/utils/health_monitor.py). Unless the death fell after
  the last health check before that update (:func:`update_window_s`: within the check interval of
  it): then the update goes to the dead engine and fails, the driver exits 1 (after the step's
  training and its save, if one was due: Miles trains, saves, then updates) and the segment ends
  as ``error``. A death that leaves no engine serving ends it too (Miles's 60 retries fail the
  rollout);
- a reference worker whose process died leaves its node's engine not whole for
  ``worker_restart_s`` (its new worker loading the model; no replacement job), then it serves
  again, counted from the first step that starts after that (as a replacement's is); the segment
  goes on meanwhile. With no whole engine left the step waits for the worker (it starts over when
  the worker is back: the units done before its death are charged again, at most one step);
- a step (one rollout generated and trained on) takes ``step_s`` at full capacity. The seed's
  configurations are asynchronous with pools sized to balance generation and training, so a step
  is the slower of the two: with ``w`` of ``E`` engines whole it takes ``step_s * E / w``. An
  engine of ``gpus_per_engine`` spans ``gpus_per_engine / gpus_per_node`` nodes and is whole while
  all of them are up;
- a checkpoint every ``checkpoint.interval`` rollouts costs ``save_s`` (held, not training); a
  failure loses the rollouts since the last one; a failure is noticed ``detect_s`` after it happens;
- a Miles rollout node lost with a whole engine left (SAVE_FIRST): the segment asks for a save
  when it notices the loss; Miles looks for it at the step's boundary, after the training and
  before the weight update. In time, the step's remaining work runs on the engines left (slower by
  the engines lost) and one ``save_s`` keeps it. Then the replacement wait below, or (the run's
  ``lifecycle.max_replacements`` reached, ``lifecycle.replacement_wait_s: 0``) the segment
  ends. A loss within ``detect_s``
  of the boundary (as it stood before the loss) is too late: ``detect_s / step_s`` of the losses
  during a step, 10% at 60 / 600 s. The step is then trained (and saved if its periodic save was
  due) and the segment waits ``Stopping.save_for_lost_node``'s bound (the stall timeout, or
  ``lifecycle.save_timeout_s`` if shorter: 1,800 s at the defaults) before it ends from the last
  checkpoint, with no replacement wait (the job waits only after a save that came). No engine left
  to finish the rollout: no save, it ends as END. Interruptions during the wait are not drawn (as
  during a stall's wait);
- a Miles replacement (after that save, ``beam_hpc.job.runner._waits_for_replacement``): one
  replacement is asked for when the save is in (counted against ``lifecycle.max_replacements``
  whether or not it comes in time, as the run's registry counts it). Its one-node job starts
  ``queue_s`` later (the queue wait a reference replacement pays) and its Ray node joins the
  segment's cluster ``ray_join_s`` after that; the whole allocation is held idle meanwhile
  (Miles waits in its weight update). The product's deadline bounds the join only
  (``_check_replacement``): joined within ``lifecycle.replacement_wait_s`` of the ask, Miles then
  starts the lost engine on the new node (``engine_restart_s``, held, nothing generated) and the
  segment trains on whole, nothing trained again; the job holds its node from its start to the
  segment's end. Not joined by then, the segment ends as ``node-failure`` after the whole wait
  (the job cancelled; its node held from its start, if it started, to then), and the next segment
  resumes from the save, as without a wait. A save in after the walltime lead, or of the run's
  last rollout, is not followed by a wait; a wait is cut short by the walltime. Interruptions
  during the wait and the engine restart are not drawn;
- each segment spends ``bringup_s`` (held) before its first rollout and waits ``queue_s`` (not
  held) in the queue before it starts; at the walltime lead it saves on request and ends. A node
  lost during bring-up ends the segment under both policies (the job goes on without a node only
  once its driver runs, ``beam_hpc.job.runner``);
- where the product goes on after a node loss, the lost node's units go back to the queue and nothing is trained
  again; the step in flight is charged whole at the slower speed; the replacement (one node, as
  ``rollout add --nodes 1`` asks) serves ``replace_s`` after the loss and makes its engine whole
  again, and holds its node from ``queue_s`` after the loss until the segment ends (reported as
  replacement GPU-hours, outside the run's own). The next segment starts whole, the lost nodes
  excluded;
- when decide() stops the chain before the run is done, an operator resubmits it ``operator_s``
  later (not held), and decide()'s count of segments starts again (as a raised ``max_segments``);
- a run still unfinished after ``horizon`` times its failure-free length is given up and counted
  in "unfinished"; its ETTR is read from the ledger it left.

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

from beam_hpc.backends.reference.loop.driver import LoopOptions  # noqa: E402
from beam_hpc.backends.registry import plan_for  # noqa: E402
from beam_hpc.config.recipe import load_recipe  # noqa: E402
from beam_hpc.config.site import load_site  # noqa: E402
from beam_hpc.elastic.replace import on_node_lost  # noqa: E402
from beam_hpc.errors import InputError  # noqa: E402
from beam_hpc.lifecycle import stall  # noqa: E402
from beam_hpc.lifecycle.decide import Action, Outcome, decide  # noqa: E402
from beam_hpc.observe.ettr import ettr  # noqa: E402
from beam_hpc.plan.node_loss import NodeLossAction, on_node_loss, survives_node_loss  # noqa: E402
from beam_hpc.plan.plan import GroupPlan, Plan  # noqa: E402
from beam_hpc.run import ledger  # noqa: E402
from beam_hpc.run.ledger import Reason  # noqa: E402

RECIPE = ROOT / "recipes" / "dedicated.yaml"  # the seed's 96-GPU recipe (backend: miles)
SITE = ROOT / "env" / "example-site.yaml"  # 8 GPUs a node, as the seed's H200 nodes
# Llama 3 (arXiv 2407.21783, section 3.3.4): 466 job interruptions in a 54-day snapshot of
# pre-training on 16,384 H100 GPUs (419 unexpected, 78% of those hardware).
LLAMA3_INTERRUPTIONS, LLAMA3_DAYS, LLAMA3_GPUS = 466, 54, 16_384
LLAMA3_PER_GPU_HOUR = LLAMA3_INTERRUPTIONS / (LLAMA3_GPUS * LLAMA3_DAYS * 24)
# RobustRL (arXiv 2512.22492): ETTR > 80% against 60% for a full restart on 256 GPUs "under 10%
# failure injection frequency". The abstract does not define the unit; read here as each 8-GPU
# node failing with probability 10% a day (an assumption, 24 x Llama 3's rate).
ROBUSTRL_NODE_DAY = 0.10
ROBUSTRL_PER_GPU_HOUR = ROBUSTRL_NODE_DAY / (8 * 24)
RATES = {"llama3": LLAMA3_PER_GPU_HOUR, "robustrl": ROBUSTRL_PER_GPU_HOUR}
# Llama 3 (arXiv 2407.21783, 3.3.4, Table 5): root causes of the 419 unexpected interruptions.
# 'Software bug' (12.9%) and 'NCCL watchdog timeouts' (1.7%) are faults of a process that a restart
# on the same GPUs clears; the hardware categories (faulty GPU 30.1%, GPU HBM3 memory 17.2%, network
# switch and cable 8.4%, ...) need the node or the GPU replaced and stay node losses. The share
# splits the rate above into the two kinds; the total is unchanged.
LLAMA3_SOFTWARE_BUG, LLAMA3_NCCL_WATCHDOG = 0.129, 0.017
LLAMA3_PROCESS_SHARE = LLAMA3_SOFTWARE_BUG + LLAMA3_NCCL_WATCHDOG
# RobustRL gives no split of its injected failures: Llama 3's share, an assumption.
ROBUSTRL_PROCESS_SHARE = LLAMA3_PROCESS_SHARE
PROCESS_SHARES = {"llama3": LLAMA3_PROCESS_SHARE, "robustrl": ROBUSTRL_PROCESS_SHARE}
# Miles's health check (radixark/miles 31f1ca96, arguments.py add_fault_tolerance_arguments): its
# flags and defaults, read from the plan's driver argv where a recipe's extra_args sets them.
HEALTH_CHECK_INTERVAL = ("--rollout-health-check-interval", 30.0)
NO_CAP = 10**6  # lifecycle.max_replacements high enough never to be reached


@dataclass(frozen=True)
class Shape:
    """One run size: the recipe's topology and batch at that size, and the phase costs it pays.
    ``prompts`` keeps the seed's 64 samples a data-parallel rank (TP 4 x PP 4, 8 responses a
    prompt), which Miles's layout check requires to divide evenly."""

    name: str
    trainer_nodes: int
    rollout_nodes: int
    prompts: int
    bringup_s: float  # segment start -> first rollout (held)
    queue_s: float  # waiting in the queue before a resubmitted segment or a replacement starts (not held)
    replace_s: float  # a rollout node lost -> its replacement serving


# The seed's dedicated configuration (recipes/dedicated.yaml): 8 trainer + 4 rollout nodes of 8
# GPUs, SGLang engines of 16 GPUs. Larger runs keep the engine size and about its 2:1 split, in
# trainer groups of whole 8-node blocks (expert_parallel 16 x pipeline_parallel 4 = 64 GPUs must
# divide the trainer's GPUs: the product's Miles layout check refuses 86 trainer nodes).
SHAPES = (
    Shape("96 GPUs (seed)", 8, 4, 32, bringup_s=15 * 60, queue_s=5 * 60, replace_s=15 * 60),
    Shape("1,024 GPUs", 88, 40, 352, bringup_s=22 * 60, queue_s=10 * 60, replace_s=15 * 60),
    Shape("8,192 GPUs", 680, 344, 2720, bringup_s=30 * 60, queue_s=20 * 60, replace_s=20 * 60),
)


@dataclass(frozen=True)
class Config:
    """One simulated configuration: the product's plan and the phase costs of its size."""

    name: str
    plan: Plan
    bringup_s: float
    queue_s: float
    replace_s: float

    @property
    def recipe(self) -> Any:
        return self.plan.recipe

    @property
    def rollout(self) -> GroupPlan | None:
        """The group whose engines set the step (None: colocated, the trainer generates)."""
        return next((g for g in self.plan.groups if g.roles == ("rollout",)), None)

    def engines_of(self, node: int) -> list[int]:
        """The engines rollout node ``node`` carries a part of."""
        g, topo = self.rollout, self.recipe.topology.rollout
        per_node = max(1, g.gpus_per_node) if g else 1
        per_engine = topo.gpus_per_engine if topo else per_node
        if per_engine >= per_node:
            return [node // (per_engine // per_node)]
        return [node * (per_node // per_engine) + k for k in range(per_node // per_engine)]

    @property
    def engines(self) -> int:
        g = self.rollout
        return 0 if g is None else self.engines_of(g.nodes - 1)[-1] + 1


def config_for(shape: Shape, backend: str, *overrides: str) -> Config:
    """``recipes/dedicated.yaml`` at ``shape``'s size with ``backend``, through the product's
    ``plan_for`` (InputError where the product refuses the recipe, as ``submit`` would)."""
    recipe = load_recipe(RECIPE, [f"backend={backend}", f"topology.trainer.nodes={shape.trainer_nodes}",
                                  f"topology.rollout.nodes={shape.rollout_nodes}", f"batch.prompts={shape.prompts}",
                                  *overrides])
    plan = plan_for(recipe, load_site(SITE))
    return Config(f"{shape.name}, {backend}", plan, shape.bringup_s, shape.queue_s, shape.replace_s)


@dataclass(frozen=True)
class Costs:
    """Phase costs the recipe does not hold (the checkpoint interval, walltime, lead and segment
    cap are the plan's)."""

    step_s: float = 600.0
    save_s: float = 300.0
    detect_s: float = 60.0
    operator_s: float = 3600.0
    per_gpu_hour: float = LLAMA3_PER_GPU_HOUR  # interruptions of both kinds (the split is process_share)
    horizon: float = 10.0  # give a run up after this many times its failure-free length
    process_share: float = LLAMA3_PROCESS_SHARE  # of the interruptions, process faults on a live node
    # A Miles engine started again before the weight update (the update waits for it): an estimate
    # at the seed's scale. A new SGLang engine of 16 GPUs over 2 nodes loads the 501B model (~1 TB
    # in bf16, ~500 GB a node) and captures its CUDA graphs; at a few GB/s a node from shared
    # storage that is 3-5 minutes, then the update carries the current weights to it.
    engine_restart_s: float = 300.0
    # A reference rollout worker started again in the slot of one whose process died (unit_service
    # _restart_in_place): the same estimate, as it loads the same model at the seed's scale (a new
    # actor, model from shared storage, then the recent versions' weights handed over directly).
    # Its death is seen at once (the unit in flight fails with RayActorError), so no detect_s.
    worker_restart_s: float = 300.0
    # A Miles run's replacement node (SAVE_FIRST): from its one-node job's start (queue_s after the
    # ask, the config's) to its Ray node's join of the segment's cluster (the node step's report says
    # ray_started, beam_hpc.elastic.ray_replacement.joined): the image's start and `ray start`. The
    # local Slurm cluster's head saw 2-8 nodes join in 9-17 s after their containers started
    # (benchmarks/results/miles-preflight-2026-12-03.md); 60 s at scale for the image's start too,
    # an assumption. Miles's restart of the lost engine on it (engine_restart_s) comes after.
    ray_join_s: float = 60.0


SOURCES = {
    "per-GPU interruption rate, llama3": f"{LLAMA3_PER_GPU_HOUR:.3g} per GPU-hour = 466 interruptions / (16,384 GPUs x "
                                         "54 days x 24 h): Llama 3 (arXiv 2407.21783, 3.3.4); each taken as one node lost",
    "per-GPU interruption rate, robustrl": f"{ROBUSTRL_PER_GPU_HOUR:.3g} per GPU-hour: RobustRL's '10% failure injection "
                                          "frequency' (arXiv 2512.22492, 256 GPUs) read as each 8-GPU node lost with "
                                          "probability 10% a day (assumption: the abstract gives no unit)",
    "lost node: goes on, saves first, or ends": "the product's rule: beam_hpc.plan.node_loss.on_node_loss(plan, "
                                                "group), then beam_hpc.elastic.replace.on_node_lost(survives=GO_ON, "
                                                "others_up, replacements, cap=lifecycle.max_replacements) on the "
                                                "plan made by plan_for (SAVE_FIRST: and may_replace's call, "
                                                "on_node_lost(survives=True, others_up=1, ...)); full restart: the "
                                                "same on the recipe with lifecycle.rollout_node_loss=restart",
    "save first (Miles)": "the rollout in flight finishes on the engines left and one save keeps it, then the "
                          "replacement wait; too late (the loss within detect_s of the step's boundary, detect_s / "
                          "step_s): the step trained, no save, no wait, ends after min(stall timeout, "
                          "lifecycle.save_timeout_s) from the last checkpoint (Stopping.save_for_lost_node)",
    "replacement wait (Miles)": "beam_hpc.job.runner._waits_for_replacement / _check_replacement: after the save, "
                                "within lifecycle.max_replacements (default 2 a run, the wait's ask counted) and "
                                "with lifecycle.replacement_wait_s > 0 (default 600 s), a one-node job joins the "
                                "segment's Ray cluster queue_s + ray_join_s after the ask (5 / 10 / 20 min + 60 s), "
                                "the allocation idle; joined within the wait: engine_restart_s more, then the "
                                "segment trains on; else it ends as node-failure after the whole wait",
    "Ray join 60 s": "assumption: the replacement's image start and `ray start` (the local Slurm cluster's head saw "
                     "2-8 nodes join in 9-17 s after their containers started, miles-preflight-2026-12-03.md)",
    "after a segment": "the product's rule book: beam_hpc.lifecycle.decide.decide",
    "topology": "recipes/dedicated.yaml: 8 trainer + 4 rollout nodes, 16-GPU engines; 88 + 40 and 680 + 344 nodes at "
                "scale (whole 64-GPU expert blocks), batch.prompts 32 / 352 / 2,720 (64 samples a data-parallel rank)",
    "checkpoint interval, walltime, lead, max_segments, max_replacements": "the plan (recipes/dedicated.yaml: 20, "
                                                                           "24 h, 900 s, 50, default 2)",
    "stall timeout": "beam_hpc.lifecycle.stall.timeouts: 4 x (step + save), at least 20 min",
    "step_s 600": "assumption: the seed recipe's lead floor (900 s) covers one 4,096-token rollout and a 501B save",
    "save_s 300": "assumption within the lead floor; Qwen3-30B-A3B saves in GRPO take 6-8 min (NeMo-RL #1208)",
    "bring-up 15 / 22 / 30 min": "verl 3.7 min before Ray (verl #384), NeMo-RL 20-30 min set-up (NeMo-RL #3596), "
                                 "~22 min to re-initialise DeepSeek-V3 at 1k GPUs (Megatron-LM PR #5325); the local "
                                 "cluster's 16 s to the first rollout (issue 42) is the tiny model's",
    "queue 5 / 10 / 20 min": "assumption (a resubmission of the same shape, the failed node excluded)",
    "replacement 15 / 15 / 20 min": "assumption: one rollout node through `rollout add --nodes 1 --exclude NODE` "
                                    "(queue, Ray, engine load, weights)",
    "detect 60 s": "assumption; the local cluster notices a dead node step in ~5 s "
                   "(benchmarks/results/faults-2026-12-04.md)",
    "operator 1 h": "assumption: a chain that decide() stopped is resubmitted by a person",
    "process faults 14.6% of interruptions": "Llama 3 Table 5 (arXiv 2407.21783, 3.3.4): 'software bug' 12.9% + "
                                             "'NCCL watchdog timeouts' 1.7% of 419 unexpected interruptions; the rate "
                                             "is split, not raised; the same share at RobustRL's rate (assumption)",
    "process fault: goes on or ends": "the product's drivers: a trainer process's fault fails the driver (error, no "
                                      "node excluded); Miles (--use-fault-tolerance in the plan's argv) restarts a "
                                      "dead engine before the next weight update; reference starts a new worker in "
                                      "the dead one's slot while the others serve (unit_service.UnitService."
                                      "_restart_in_place, _joined), every row; with weight_sync nccl it ends",
    "engine restart 300 s": "estimate: a 16-GPU SGLang engine of the 501B model loads ~500 GB a node and captures "
                            "CUDA graphs; the weight update waits for it (Miles's ServerGroup.recover)",
    "worker restart 300 s": "estimate, as the engine restart: a new reference worker loads the same model, then "
                            "gets the recent versions' weights directly (RolloutWorker.hold_weights); the others "
                            "serve meanwhile; MAX_RESTARTS (3 a worker a segment) not modelled",
    "weight update fails: death within 30 s of it": "Miles's health check every 30 s "
                                                    "(--rollout-health-check-interval): a death after the last check "
                                                    "before the update (within one interval of it) is not seen, the "
                                                    "update goes to the dead engine and the driver exits 1",
}


# -- the policy seam ------------------------------------------------------------------------------
@dataclass(frozen=True)
class NodeLost:
    """What a policy is told when a node is lost mid-segment: what the job knows."""

    group: str  # the plan's group name: "trainer" | "rollout"
    others_up: int  # the segment's own nodes of that group still up (replacement jobs are not its nodes)
    replacements: int  # replacements the run has asked for so far


@dataclass(frozen=True)
class ProcessFault:
    """What a policy is told when a process dies on a node that stays up (its node is not lost)."""

    group: str  # the plan's group name of the process: "trainer" | "rollout"
    workers_left: int  # rollout workers still serving without the dead one: the segment's own and replacements


@dataclass(frozen=True)
class Reaction:
    """End the segment (the chain goes on as decide() says), or go on and get a replacement
    ``replace_after_s`` later (None: no replacement), or (``restart``) have the dead engine started
    again in place before the next weight update. ``save_first`` with ``end_segment``: the job
    outlives the lost node and the segment asks for a save at the next rollout boundary
    (``NodeLossAction.SAVE_FIRST``), so the rollout in flight is kept; then, with
    ``replacement_wait_s`` > 0, it asks for a replacement that joins its Ray cluster and waits up to
    that long for it (going on if it joins in time), else it ends once the save is in."""

    end_segment: bool
    replace_after_s: float | None = None
    restart: bool = False
    save_first: bool = False
    replacement_wait_s: float = 0.0


class Policy(Protocol):
    name: str

    def on_node_lost(self, lost: NodeLost) -> Reaction: ...

    def on_process_fault(self, fault: ProcessFault) -> Reaction: ...


def _flag(plan: Plan, flag: tuple[str, float]) -> float:
    """A numeric flag's value in the plan's driver argv (``--f v`` or ``--f=v``), else its default."""
    name, default = flag
    argv = list(plan.driver_argv)
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            return float(argv[i + 1])
        if a.startswith(name + "="):
            return float(a.split("=", 1)[1])
    return default


def restarts_dead_engines(plan: Plan) -> bool:
    """Whether the run's driver restarts a rollout engine whose process died, in place, and goes on:
    a Miles driver with ``--use-fault-tolerance``, which ``beam_hpc.backends.miles.args._outputs``
    puts on every Miles run (its health monitor kills an engine that fails a check, and
    ``ServerGroup.recover`` starts it again on the same bundle before the next weight update; the
    contract is recorded in tests/support/standins/miles_standin/miles/utils/health_monitor.py).
    Read off the plan's argv, so a plan without the flag would end its segment instead. The product
    has no predicate of its own for this: the behaviour is Miles's, switched on by that flag."""
    return plan.recipe.backend == "miles" and "--use-fault-tolerance" in plan.driver_argv


def restarts_dead_workers(plan: Plan) -> bool:
    """Whether the run's driver starts a new rollout worker in the slot of one whose process died on
    a live node, and goes on with the rest meanwhile: the reference driver's
    ``UnitService._worker_lost`` -> ``_restart_in_place`` (a new actor from ``Loop.new_worker``),
    swapped in by ``_joined`` once it has loaded the model (beam_hpc.backends.reference.rollouts.unit_service).
    Not with ``backend_options.weight_sync: nccl`` (the worker was a rank of the trainer's broadcast
    group, which takes no new rank: the segment ends), read through the driver's own
    ``LoopOptions``. It does not read ``lifecycle.rollout_node_loss``: the full-restart recipe
    restarts the worker too. ``MAX_RESTARTS`` (3 a worker a segment) is not modelled."""
    return plan.recipe.backend == "reference" and LoopOptions.of(plan.recipe).weight_sync != "nccl"


def update_window_s(plan: Plan) -> float:
    """How long before a weight update a Miles engine's death goes unseen, so that the update goes
    to the dead engine and fails (the driver exits 1; lifecycle guide, "With Miles: a dead engine is
    restarted, a lost node ends the segment"). The monitor checks every engine each
    ``--rollout-health-check-interval`` and pauses at the update: a death after the last check
    before it is missed. That gap is between 0 and the interval (half of it on average); a hung
    engine's check takes up to ``--rollout-health-check-timeout`` more to fail, and a death during
    the update itself (monitor paused) fails it too. The whole interval is taken, between the mean
    gap (interval / 2) and the worst case (interval + timeout, 30 s more by default): 30 s by
    Miles's defaults, a 5% chance at 600 s steps."""
    return _flag(plan, HEALTH_CHECK_INTERVAL)


@dataclass(frozen=True)
class ProductRule:
    """beam-hpc's own answer for ``config``'s plan: the calls the job makes when a node step ends."""

    config: Config
    name: str = "product"

    def on_node_lost(self, lost: NodeLost) -> Reaction:
        """The job's two calls when a node step ends (``beam_hpc.job.runner``): the plan's answer
        (``on_node_loss``), then the replacement rule on whether it goes on. A ``SAVE_FIRST``
        answer saves on request first, unless ``lifecycle.save_on_request`` is false
        (``Stopping.save_for_lost_node`` then saves nothing, no replacement is waited for, and the
        loss costs what a revoked job's does). After the save the job waits for a replacement
        (``JobRunner._waits_for_replacement``) where ``lifecycle.replacement_wait_s`` > 0 and
        ``beam_hpc.elastic.replace.may_replace`` allows one more: its own call of ``on_node_lost``
        with the run's replacements so far and ``lifecycle.max_replacements``, made here with the
        simulated run's count (the same until the save is in: nothing else asks meanwhile)."""
        plan = self.config.plan
        lc = plan.recipe.lifecycle
        action = on_node_loss(plan, plan.group(lost.group))
        react = on_node_lost(survives=action is NodeLossAction.GO_ON, others_up=lost.others_up,
                             replacements=lost.replacements, cap=lc.max_replacements)
        save_first = action is NodeLossAction.SAVE_FIRST and lc.save_on_request
        wait_s = 0.0
        if save_first and lc.replacement_wait_s > 0 and on_node_lost(
                survives=True, others_up=1, replacements=lost.replacements, cap=lc.max_replacements).replace:
            wait_s = float(lc.replacement_wait_s)
        return Reaction(end_segment=not react.goes_on,
                        replace_after_s=self.config.replace_s if react.replace else None,
                        save_first=save_first, replacement_wait_s=wait_s)

    def on_process_fault(self, fault: ProcessFault) -> Reaction:
        """A process died on a live node: the trainer's (or a colocated group's) fails the driver;
        a rollout engine's is restarted in place before the next weight update (Miles, ``restart``),
        or a new worker is started in its slot while the others serve (reference: the segment goes
        on even if it was the last worker, as the restart counts as capacity coming,
        ``UnitService._check_capacity``; the simulator models the restart); any other driver fails."""
        plan = self.config.plan
        if plan.group(fault.group).roles != ("rollout",):
            return Reaction(end_segment=True)
        if restarts_dead_engines(plan):
            return Reaction(end_segment=False, restart=True)
        if restarts_dead_workers(plan):
            return Reaction(end_segment=False)
        return Reaction(end_segment=True)


# -- one simulated run ----------------------------------------------------------------------------
@dataclass
class RunResult:
    ettr: float
    ettr_full_speed: float
    span_ettr: float
    segments: int
    node_losses: int
    restarts: int  # segments ended by a node failure
    saved_first: int  # of those, a Miles rollout node's loss whose segment saved the rollout in flight first
    save_too_late: int  # of those, a loss that came too late for that save (the wait ran to its bound)
    replaced_in_segment: int  # Miles losses saved first whose replacement joined in time: the segment went on
    waited_out: int  # Miles losses saved first whose replacement did not join within the wait (in saved_first)
    process_faults: int  # processes that died on a live node
    fault_ends: int  # segments a process fault ended (error): a trainer's, a failed weight update, no worker left
    engine_restarts: int  # Miles engines restarted in place, the segment going on
    workers_restarted: int  # reference workers started again in place, the segment going on
    stalls: int  # segments that went on without whole engines and were stopped by the stall watchdog
    went_on: int  # node losses the segment went on without
    replacements: int
    chain_stops: int  # decide() said none before the run was done (either reason below)
    stops_no_progress: int  # two segments in a row failed without a new checkpoint
    stops_max_segments: int  # lifecycle.max_segments reached
    replacement_gpu_h: float
    unfinished: int  # 1: given up at the horizon
    days: float


@dataclass
class _Capacity:
    """The segment's rollout engines: how many of each engine's nodes are down."""

    config: Config
    down: dict[int, int] = field(default_factory=dict)  # rollout node -> 1 while down (lost, or its worker restarting)
    back: list[tuple[float, int]] = field(default_factory=list)  # (when its replacement serves, node)
    dead: set[int] = field(default_factory=set)  # Miles engines whose process died, until the next weight update
    restarting: dict[int, float] = field(default_factory=dict)  # rollout node (up) whose reference worker died -> when its new one serves
    serving_from: list[float] = field(default_factory=list)  # when each replacement of the segment serves

    def whole(self) -> int:
        broken = {e for n in self.down for e in self.config.engines_of(n)} | self.dead
        return self.config.engines - len(broken)

    def workers(self, own_up: int, t: float) -> int:
        """Rollout workers serving at ``t``: the segment's own on nodes up whose worker lives, and
        the replacements that have joined (outside workers to the driver's unit service)."""
        return own_up - sum(1 for at in self.restarting.values() if at > t) + sum(1 for at in self.serving_from if at <= t)

    def next_back(self) -> float | None:
        """When capacity next comes back: the first replacement or restarted worker (None: none coming)."""
        times = [b for b, _ in self.back] + list(self.restarting.values())
        return min(times) if times else None

    def arrive(self, t: float) -> None:
        """Replacements and restarted workers that serve by ``t`` make their engines whole again."""
        self.back.sort()
        while self.back and self.back[0][0] <= t:
            self.down.pop(self.back.pop(0)[1], None)
        for node, at in list(self.restarting.items()):
            if at <= t:
                del self.restarting[node]
                self.down.pop(node, None)


@dataclass(frozen=True)
class LostNodeEnd:
    """How a segment that a lost node ends, ends: when, and what becomes of the step in flight."""

    at: float  # the end line's time
    trained: bool  # the step in flight was trained (a rollout step run, in the ledger's rollouts_run)
    step_s: float  # its seconds, when trained
    kept: bool  # and its rollout is in the checkpoint the next segment resumes from
    too_late: bool  # a save was asked for, but came too late (or could not come)


def lost_node_end(*, at: float, step_start: float, step_s: float, step_end: float, save_due: bool,
                  save_first: bool, costs: Costs, wait_s: float, walltime_end: float) -> LostNodeEnd:
    """The end of a segment that a node lost at ``at`` ends, during the step that started at
    ``step_start`` and was to take ``step_s`` (and a periodic save after it if ``save_due``).

    Without ``save_first`` (``NodeLossAction.END``: Slurm revokes the job) the segment ends
    ``detect_s`` later, the step in flight untrained, and the next one resumes from the last
    checkpoint.

    With it (``SAVE_FIRST``) the segment asks for a save once it notices the loss, ``detect_s``
    later. Miles looks for the save sentinel at the step's boundary, after its training and before
    its weight update. A request in time: the step runs to its end on the engines left
    (``step_end``, reduced capacity from the loss on), one save (``save_s``, the periodic one when
    it was due anyway) takes the rollout in flight, and (``at``) the save is in: then the
    replacement wait (:func:`replacement_wait`) or the segment's end. A request after the
    boundary (the loss within ``detect_s`` of it, or during the step's save or engine restart):
    the step is trained on schedule (and saved, if its periodic save was due), then Miles waits in
    its weight update for an engine that has no node to start on; no save comes, and
    ``Stopping.save_for_lost_node`` gives up after ``wait_s`` (the stall timeout, or
    ``lifecycle.save_timeout_s`` if shorter). For a loss uniform over a step without a save that is
    a chance of ``detect_s / step_s`` (60 / 600 = 10% at the default costs); the step's boundary is
    taken where it stood before the loss. Either way the end comes by the walltime at the latest."""
    if not save_first:
        return LostNodeEnd(at + costs.detect_s, trained=False, step_s=0.0, kept=False, too_late=False)
    boundary = step_start + step_s
    if at + costs.detect_s < boundary:
        end = step_end + costs.save_s
        return LostNodeEnd(min(end, walltime_end), trained=True, step_s=step_end - step_start,
                           kept=end <= walltime_end, too_late=False)
    end = min(at + costs.detect_s + wait_s, walltime_end)
    periodic = save_due and boundary + costs.save_s <= end
    return LostNodeEnd(end, trained=boundary <= end, step_s=step_s, kept=periodic, too_late=True)


@dataclass(frozen=True)
class ReplacementWait:
    """What became of a Miles segment's wait for a lost node's replacement."""

    joined: bool  # its Ray node joined within the wait: the segment trains on
    at: float  # joined: when training resumes (the lost engine restarted on it); else the end line's time


def replacement_wait(*, saved_at: float, join_s: float, wait_s: float, engine_restart_s: float,
                     walltime_end: float) -> ReplacementWait:
    """After a lost Miles rollout node's save (in at ``saved_at``), the replacement asked for then
    (``beam_hpc.job.runner._waits_for_replacement``, deadline ``saved_at + wait_s``). Its Ray node
    joins ``join_s`` after the ask; ``_check_replacement`` goes on when it has joined by the
    deadline and ends the segment when the deadline passes first, so the deadline bounds the join
    and not the engine's restart after it. Joined: Miles's weight update, which waited for the
    lost engine, returns once the engine has started on the new node (``engine_restart_s``), and
    the next step starts then. Not joined: the segment ends at the deadline. The walltime ends
    either sooner."""
    join_at = saved_at + join_s
    if join_s <= wait_s and join_at < walltime_end:
        return ReplacementWait(True, min(join_at + engine_restart_s, walltime_end))
    return ReplacementWait(False, min(saved_at + wait_s, walltime_end))


def _failed(group: GroupPlan, node: int, why: str) -> dict[str, str]:
    """A failed_nodes entry of the end line: the node the next segment excludes (by its group and
    index here; a real end line names the Slurm host)."""
    return {"node": f"{group.name}-{node}" if node >= 0 else group.name, "why": f"node {why}"}


def _gap(rng: random.Random, rate: float) -> float:
    """Held seconds to the next node loss (never, at rate 0)."""
    return rng.expovariate(rate) if rate > 0 else float("inf")


def simulate(config: Config, costs: Costs, policy: Policy, num_rollout: int, rng: random.Random) -> RunResult:
    """One run to ``num_rollout`` rollouts; its ETTR read from the ledger it leaves."""
    plan, lc = config.plan, config.recipe.lifecycle
    interval, walltime_s, lead_s = config.recipe.checkpoint.interval, float(plan.walltime_s), float(plan.lead_s)
    stall_s = stall.timeouts(lc.stall_timeout_s, lc.startup_timeout_s, slowest_step_s=costs.step_s,
                             last_save_s=costs.save_s).stall_s
    # a save asked for a lost node is waited for up to the stall timeout, or lifecycle.save_timeout_s
    # if shorter (beam_hpc.lifecycle.stopping.Stopping.save_for_lost_node)
    save_wait_s = float(min(lc.save_timeout_s, stall_s) if stall_s > 0 else lc.save_timeout_s)
    groups = plan.groups
    node_rate_s = plan.total_gpus * costs.per_gpu_hour / 3600.0  # interruptions (both kinds) per held second
    window_s, worker_restarts = update_window_s(plan), restarts_dead_workers(plan)
    rollout = config.rollout
    lines: list[dict[str, Any]] = []
    history: list[dict[str, Any]] = []  # decide()'s: the segments since the chain (re)started
    now, saved, job = 0.0, 0, 0
    n = dict(losses=0, restarts=0, stalls=0, went_on=0, replacements=0, stops=0, no_progress=0, too_many=0,
             faults=0, fault_ends=0, engine_restarts=0, worker_restarts=0, saved_first=0, too_late=0,
             replaced=0, waited_out=0)
    replacement_gpu_s = 0.0
    give_up = costs.horizon * num_rollout * costs.step_s
    next_loss = now + _gap(rng, node_rate_s)

    def is_process_fault() -> bool:
        """The interruption's kind: drawn only where both kinds occur, so that a share of 0 (or 1)
        leaves the draws, and the projection, as they were."""
        share = costs.process_share
        return share >= 1 or (share > 0 and rng.random() < share)

    def draw(cap: _Capacity, process: bool) -> tuple[GroupPlan, int]:
        """The failed node's group (by size) and, for the rollout group, which of its nodes: one up
        for a node loss, one whose worker lives for a process fault (-1: none)."""
        pick = rng.random() * plan.total_nodes
        for g in groups:
            if pick < g.nodes:
                break
            pick -= g.nodes
        gone = set(cap.down) if process else set(cap.down) - set(cap.restarting)
        up = [i for i in range(g.nodes) if i not in gone] if g is rollout else []
        return g, (rng.choice(up) if up else -1)

    while saved < num_rollout and now < give_up:
        job += 1
        start = ledger.start_record(job_id=str(job), restart=0, host="sim", rollouts_at_start=saved,
                                    num_rollout=num_rollout, resume=saved > 0, walltime_s=int(walltime_s),
                                    lead_s=int(lead_s), now=now)
        t0, at_start = now, saved
        deadline = t0 + walltime_s - lead_s
        if next_loss < now:  # failures happen while held: their clock runs in held time only
            next_loss = now + _gap(rng, node_rate_s)
        cap = _Capacity(config)
        own_up = {g.name: g.nodes for g in groups}  # the segment's own nodes of each group still up
        done, steps, step_time = saved, 0, 0.0
        reason: Reason | None = None
        t = t0 + config.bringup_s
        joined: list[float] = []  # when each replacement job of this segment started holding its node
        failed: list[dict[str, str]] = []  # the end line's failed_nodes: the node lost, excluded next time
        if next_loss < t:  # before the driver runs (a node lost, or a process that fails its start): it ends
            process = is_process_fault()
            n["faults" if process else "losses"] += 1
            g, node = draw(cap, process)
            failed = [] if process else [_failed(g, node, "lost during bring-up")]
            t, reason = next_loss + costs.detect_s, Reason.ERROR if process else Reason.NODE_FAILURE
            n["fault_ends"] += process
            next_loss += _gap(rng, node_rate_s)
        while reason is None:
            cap.arrive(t)
            whole = cap.whole()
            if config.engines and whole == 0:  # the product went on, but no engine can serve
                back = cap.next_back()
                if back is not None:  # the rollouts wait for the first replacement or restarted worker
                    t = max(t, back)
                    continue
                t, reason = t + stall_s, Reason.STALLED  # the stall watchdog stops the segment
                break
            step = costs.step_s * (config.engines / whole if config.engines else 1.0)
            save = costs.save_s if (done + 1) % interval == 0 or done + 1 == num_rollout else 0.0
            # dead Miles engines are started again before the weight update that ends the step: it waits
            restart_s = costs.engine_restart_s if cap.dead else 0.0
            if t + step + save + restart_s > deadline:  # the walltime lead: save on request, stop
                if done > saved:
                    t, saved = t + costs.save_s, done
                reason = Reason.WALLTIME
                break
            if next_loss < t + step + save + restart_s:
                at = next_loss
                next_loss = at + _gap(rng, node_rate_s)
                process = is_process_fault()
                g, node = draw(cap, process)
                if process:
                    n["faults"] += 1
                    if g is rollout and node < 0:  # it falls on a node whose worker is already gone
                        continue
                    r = policy.on_process_fault(ProcessFault(g.name, cap.workers(own_up[g.name], at) - 1))
                    update_at = t + step + save  # the weight update the step in flight ends with
                    if r.end_segment:
                        t, reason = at + costs.detect_s, Reason.ERROR
                    elif r.restart and at > update_at - window_s:
                        # unseen by the health check: the step is trained (and saved, if due), then the
                        # update to the dead engine fails and the driver exits 1
                        t, step_time, steps, done = max(at, update_at) + costs.detect_s, step_time + step, steps + 1, done + 1
                        saved = done if save else saved
                        reason = Reason.COMPLETED if done >= num_rollout else Reason.ERROR
                    elif r.restart:  # seen and shut down; the step in flight goes on without it, slower
                        engines = config.engines_of(node)
                        cap.dead.add(rng.choice(engines) if len(engines) > 1 else engines[0])
                        n["engine_restarts"] += 1
                        if cap.whole() == 0:  # no engine serves: Miles's retries fail the rollout
                            t, reason = at + costs.detect_s, Reason.ERROR
                    else:  # reference: its units go back to the queue, a new worker starts in its slot
                        cap.down[node] = 1
                        cap.restarting[node] = at + costs.worker_restart_s
                        n["worker_restarts"] += 1
                    n["fault_ends"] += reason == Reason.ERROR
                    continue
                n["losses"] += 1
                r = policy.on_node_lost(NodeLost(g.name, own_up[g.name] - 1, n["replacements"]))
                if r.end_segment:
                    before = cap.whole()
                    if g is rollout:
                        cap.down[node] = 1
                    after = cap.whole()  # 0: no engine left to finish the rollout in flight, so no save
                    step_end = at + max(0.0, t + step - at) * before / after if after else float("inf")
                    end = lost_node_end(at=at, step_start=t, step_s=step, step_end=step_end, save_due=save > 0,
                                        save_first=r.save_first and after > 0, costs=costs, wait_s=save_wait_s,
                                        walltime_end=t0 + walltime_s)
                    if end.trained:
                        step_time, steps, done = step_time + end.step_s, steps + 1, done + 1
                    saved = done if end.kept else saved
                    in_time = r.save_first and after > 0 and not end.too_late
                    what = ("lost; the rollout in flight saved first" if in_time else
                            "lost; no save came (too late for the rollout in flight)" if r.save_first else "lost")
                    t_end = end.at
                    if (in_time and end.kept and r.replacement_wait_s > 0 and done < num_rollout
                            and end.at <= deadline):
                        # saved, and no stop under way (the walltime lead not come: the runner waits
                        # only then): a replacement asked for (counted against the cap whether or not
                        # it comes), its job holding its node from its start (queue_s) on
                        n["replacements"] += 1
                        joined.append(end.at + config.queue_s)
                        wait = replacement_wait(saved_at=end.at, join_s=config.queue_s + costs.ray_join_s,
                                                wait_s=r.replacement_wait_s, engine_restart_s=costs.engine_restart_s,
                                                walltime_end=t0 + walltime_s)
                        if wait.joined:  # in the lost node's place: its engine whole again, the run goes on
                            n["replaced"] += 1
                            cap.down.pop(node, None)
                            cap.dead.clear()  # dead engines restarted too, before the same weight update
                            t = wait.at
                            if next_loss < t:  # not drawn during the wait and the engine's restart
                                next_loss = t + _gap(rng, node_rate_s)
                            continue
                        n["waited_out"] += 1
                        what += f"; no replacement joined within lifecycle.replacement_wait_s={r.replacement_wait_s:g}"
                        t_end = wait.at
                    n["saved_first"] += in_time
                    n["too_late"] += r.save_first and not in_time
                    t, reason, failed = t_end, Reason.NODE_FAILURE, [_failed(g, node, what)]
                    break
                n["went_on"] += 1
                own_up[g.name] -= 1
                if g is rollout:  # the step in flight goes on, slower: its units go back to the queue
                    cap.down[node] = 1
                    cap.restarting.pop(node, None)  # a node whose worker was restarting is now lost itself
                if r.replace_after_s is not None:
                    n["replacements"] += 1
                    cap.back.append((at + r.replace_after_s, node))
                    cap.serving_from.append(at + r.replace_after_s)
                    joined.append(at + config.queue_s)
                if (worker_restarts and g is rollout and cap.workers(own_up[g.name], at) == 0
                        and not any(b > at for b in cap.restarting.values())):
                    # the lost node's worker was the last one serving and none is starting: the
                    # driver's _check_capacity ends the segment
                    t, reason = at + costs.detect_s, Reason.ERROR
                    n["fault_ends"] += 1
                continue
            t += step + save + restart_s
            cap.dead.clear()  # started again before this step's weight update
            step_time += step
            steps += 1
            done += 1
            if save:
                saved = done
            if done >= num_rollout:
                reason = Reason.COMPLETED
        if reason == Reason.NODE_FAILURE:
            n["restarts"] += 1
        n["stalls"] += reason == Reason.STALLED
        # a replacement (one node, `rollout add --nodes 1`) holds its node from its start to this
        # segment's end (the next segment starts whole, the lost nodes excluded)
        per_node = rollout.gpus_per_node if rollout else 0
        replacement_gpu_s += sum(per_node * max(0.0, t - j) for j in joined)
        end = ledger.end_record(job_id=str(job), restart=0, rollouts_at_end=saved, reason=reason, detail="",
                                next_action="none", next_job_id=None,
                                rollout_s=step_time / steps if steps else None, save_s=costs.save_s,
                                ready_s=config.bringup_s, rollouts_run=steps, failed_nodes=failed or None, now=t)
        outcome = Outcome(reason=reason, rollouts_at_start=at_start, rollouts_at_end=saved, num_rollout=num_rollout,
                          rollouts_run=steps)
        decision = decide(outcome, history=history, max_segments=lc.max_segments, cancelled=False,
                          requeue_on_preemption=lc.requeue_on_preemption)
        end["next"] = {"action": decision.action.value, "job_id": None}
        seg = {"segment": start["segment"], "start": start, "end": end}
        lines.append(seg)
        history.append(seg)
        now = t
        if decision.action == Action.NONE and saved < num_rollout:  # stopped: a person resubmits
            n["stops"] += 1
            n["no_progress"] += "failed without progress too" in decision.detail
            n["too_many"] += "max_segments" in decision.detail
            history = []
            now += costs.operator_s
        elif decision.action != Action.NONE:
            now += config.queue_s
    e = ettr(lines, now=now)
    full_speed = e.rollouts_kept * costs.step_s
    return RunResult(ettr=e.ratio or 0.0, ettr_full_speed=full_speed / e.held_s if e.held_s else 0.0,
                     span_ettr=e.span_ratio or 0.0, segments=len(lines), node_losses=n["losses"],
                     restarts=n["restarts"], saved_first=n["saved_first"], save_too_late=n["too_late"],
                     replaced_in_segment=n["replaced"], waited_out=n["waited_out"],
                     process_faults=n["faults"], fault_ends=n["fault_ends"],
                     engine_restarts=n["engine_restarts"], workers_restarted=n["worker_restarts"],
                     stalls=n["stalls"], went_on=n["went_on"], replacements=n["replacements"],
                     chain_stops=n["stops"], stops_no_progress=n["no_progress"], stops_max_segments=n["too_many"],
                     replacement_gpu_h=replacement_gpu_s / 3600.0, unfinished=int(saved < num_rollout),
                     days=now / 86400.0)


# -- the projection -------------------------------------------------------------------------------
def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def variants(shape: Shape, *overrides: str) -> list[tuple[str, Config, Policy]]:
    """The rows of one size, each the product's rule on its own plan: full restart (the reference
    recipe with ``lifecycle.rollout_node_loss: restart``), (a) the seed's Miles recipe as it is, and
    (b) the recipe on the reference backend (in place), with the recipe's replacement cap and none."""
    configs = [("full restart", config_for(shape, "reference", *overrides, "lifecycle.rollout_node_loss=restart")),
               ("(a) product, miles recipe", config_for(shape, "miles", *overrides))]
    ref = config_for(shape, "reference", *overrides)
    configs += [(f"(b) product, reference, cap {ref.recipe.lifecycle.max_replacements}", ref),
                ("(b) product, reference, no cap",
                 config_for(shape, "reference", *overrides, f"lifecycle.max_replacements={NO_CAP}"))]
    return [(label, c, ProductRule(c)) for label, c in configs]


def project(runs: int, seed: int, days: float, costs: Costs = Costs(), overrides: tuple[str, ...] = (),
            shapes: tuple[Shape, ...] = SHAPES) -> list[dict[str, Any]]:
    """Each size under each policy, ``runs`` runs each with the same failure seeds for every policy."""
    num_rollout = int(days * 86400 / costs.step_s)
    rows = []
    for shape in shapes:
        for label, config, policy in variants(shape, *overrides):
            results = [simulate(config, costs, policy, num_rollout, random.Random(f"{seed}:{shape.name}:{i}"))
                       for i in range(runs)]
            col = {k: [getattr(r, k) for r in results] for k in asdict(results[0])}
            rollout = config.rollout
            rows.append({
                "scale": shape.name, "gpus": config.plan.total_gpus, "trainer_nodes": config.plan.group("trainer").nodes,
                "rollout_nodes": rollout.nodes if rollout else 0, "engines": config.engines, "policy": label,
                "backend": config.recipe.backend,
                "survives": {g.name: survives_node_loss(config.plan, g) for g in config.plan.groups},
                "on_node_loss": {g.name: on_node_loss(config.plan, g).name for g in config.plan.groups},
                "max_replacements": config.recipe.lifecycle.max_replacements,
                "replacement_wait_s": config.recipe.lifecycle.replacement_wait_s,
                "replacement_join_s": config.queue_s + costs.ray_join_s,
                "interval": config.recipe.checkpoint.interval,
                "per_gpu_hour": costs.per_gpu_hour, "process_share": costs.process_share,
                "interruptions_per_day": config.plan.total_gpus * costs.per_gpu_hour * 24,
                "node_losses_per_day": config.plan.total_gpus * costs.per_gpu_hour * 24 * (1 - costs.process_share),
                "process_faults_per_day": config.plan.total_gpus * costs.per_gpu_hour * 24 * costs.process_share,
                **{f"{k}_mean": statistics.fmean(v) for k, v in col.items()},
                "ettr_p10": _pct(col["ettr"], 0.1), "ettr_p90": _pct(col["ettr"], 0.9),
            })
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    head = ("| run | GPUs (trainer + rollout nodes; engines) | node losses + process faults / day | policy | "
            "ETTR mean (p10-p90) | ETTR at full speed | ETTR over wall span | segments | "
            "restarts (saved first / too late) | Miles replacement waits: joined / not in time | went on | "
            "process faults: ended / engine restarted / worker restarted | replacements | "
            "chain stops (no progress / max segments) | replacement GPU-h | unfinished | days |")
    out = [head, "|" + "---|" * 17]
    for r in rows:
        out.append(f"| {r['scale']} | {r['gpus']} ({r['trainer_nodes']} + {r['rollout_nodes']}; {r['engines']}) | "
                   f"{r['node_losses_per_day']:.2f} + {r['process_faults_per_day']:.2f} | {r['policy']} | "
                   f"{r['ettr_mean']:.3f} ({r['ettr_p10']:.3f}-{r['ettr_p90']:.3f}) | {r['ettr_full_speed_mean']:.3f} | "
                   f"{r['span_ettr_mean']:.3f} | {r['segments_mean']:.1f} | {r['restarts_mean']:.1f} "
                   f"({r['saved_first_mean']:.2f} / {r['save_too_late_mean']:.2f}) | "
                   f"{r['replaced_in_segment_mean']:.2f} / {r['waited_out_mean']:.2f} | "
                   f"{r['went_on_mean']:.1f} | {r['fault_ends_mean']:.2f} / {r['engine_restarts_mean']:.2f} / "
                   f"{r['workers_restarted_mean']:.2f} | {r['replacements_mean']:.1f} | "
                   f"{r['chain_stops_mean']:.2f} ({r['stops_no_progress_mean']:.2f} / {r['stops_max_segments_mean']:.2f}) | "
                   f"{r['replacement_gpu_h_mean']:.0f} | {r['unfinished_mean']:.2f} | {r['days_mean']:.1f} |")
    return "\n".join(out)


def _rates(text: str) -> dict[str, float] | None:
    """``--rate``'s rates by name (None: not one the script knows)."""
    if text == "both":
        return dict(RATES)
    if text in RATES:
        return {text: RATES[text]}
    try:
        rate = float(text)
    except ValueError:
        return None
    return {f"{rate:g}": rate} if rate > 0 else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=40, help="simulated runs per size and policy (default 40)")
    p.add_argument("--seed", type=int, default=1, help="failure draws (the same for every policy)")
    p.add_argument("--days", type=float, default=7.0, help="training a run needs at full speed, in days (default 7)")
    p.add_argument("--interval", type=int, help="checkpoint.interval for every recipe (default: the recipe's, 20)")
    p.add_argument("--rate", default="both",
                   help="per-GPU-hour interruption rate: llama3 (Llama 3's), robustrl (RobustRL's 10%% injection as "
                        "read here), both (default), or a number (a sensitivity run)")
    p.add_argument("--process-share", type=float,
                   help="of the interruptions, process faults on a live node (default: Llama 3's Table 5, "
                        f"{LLAMA3_PROCESS_SHARE:.3f}, at every rate); 0 gives the node-loss-only projection")
    p.add_argument("--replacement-wait", type=int, metavar="S",
                   help="lifecycle.replacement_wait_s for every recipe (default: the recipe's, 600; only a Miles "
                        "run's lost rollout node reads it); 0 gives the save-then-end rule")
    p.add_argument("--json", type=Path, help="also write the rows here")
    args = p.parse_args(argv)
    problems = [f"--{name}: {value}; give a number above 0" for name, value in
                (("runs", args.runs), ("days", args.days), ("interval", args.interval))
                if value is not None and value <= 0]
    if args.replacement_wait is not None and args.replacement_wait < 0:
        problems.append(f"--replacement-wait: {args.replacement_wait}; give seconds from 0 up")
    if args.process_share is not None and not 0 <= args.process_share <= 1:
        problems.append(f"--process-share: {args.process_share}; give a share from 0 to 1")
    rates = _rates(args.rate)
    if rates is None:
        problems.append(f"--rate: {args.rate!r}; give llama3, robustrl, both or a number of node losses per GPU-hour "
                        "above 0, e.g. 4.4e-5")
    if problems:
        print("\n".join(problems), file=sys.stderr)
        return 2
    overrides = (() if args.interval is None else (f"checkpoint.interval={args.interval}",)) + (
        () if args.replacement_wait is None else (f"lifecycle.replacement_wait_s={args.replacement_wait}",))
    out: dict[str, Any] = {"runs": args.runs, "seed": args.seed, "days": args.days, "overrides": list(overrides),
                           "sources": SOURCES, "shapes": [asdict(s) for s in SHAPES], "tables": {}}
    try:
        for name, rate in rates.items():
            share = args.process_share if args.process_share is not None else PROCESS_SHARES.get(name, LLAMA3_PROCESS_SHARE)
            costs = Costs(per_gpu_hour=rate, process_share=share)
            rows = project(args.runs, args.seed, args.days, costs, overrides)
            print(f"## rate {name}: {costs.per_gpu_hour:.3g} interruptions per GPU-hour, {share:.3f} of them process "
                  f"faults on a live node; {args.runs} runs per row, "
                  f"seed {args.seed}, {args.days:g} days of training at full speed "
                  f"({int(args.days * 86400 / costs.step_s)} rollouts), a checkpoint every {rows[0]['interval']} "
                  f"rollouts; a Miles lost rollout node's replacement waited for up to "
                  f"{rows[0]['replacement_wait_s']} s (its Ray node joins queue_s + {costs.ray_join_s:g} s after "
                  f"the ask)\n")
            print(table(rows) + "\n")
            out["tables"][name] = {"costs": asdict(costs), "rows": rows}
    except InputError as err:  # a recipe the product refuses (an --interval it rejects)
        print(str(err), file=sys.stderr)
        return 2
    print("inputs:\n" + "\n".join(f"- {k}: {v}" for k, v in SOURCES.items()))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
