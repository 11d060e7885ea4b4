"""The checks Miles (and Megatron under it) would make, made first, as clear recipe errors.

Why: Miles validates its arguments only once the job has its nodes, the container is up and Ray
has joined every node; an assertion there costs a queue wait and prints a Python traceback that
names Megatron's argument, not the recipe field. Here the same rules run on the login node
(``beam-hpc render`` / ``submit``) and name the recipe field and the fix: parallelism and data
parallelism, experts, batch split, rollout-engine placement, evaluation data, starting weights, and
pass-through flags that would repeat one beam-hpc sets (:func:`check` lists each rule with its
source in radixark/miles@31f1ca961 and radixark/Megatron-LM@2e64d788, read for facts). Rules the
recipe schema already enforces (``Recipe._consistent``: colocated is not async, LoRA does not stream
optimizer state to NVMe, engine and update divisibility) are not repeated.

Pure: imports only the recipe and site schemas.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from beam_hpc.backends.miles.architecture import flag_values
from beam_hpc.backends.miles.flags import ALSO_IN_MODEL_SCRIPTS, managed_flags
from beam_hpc.config.recipe import Recipe
from beam_hpc.config.site import Site
from beam_hpc.errors import InputError

# backend_options keys the Miles backend understands; anything else is a typo.
OPTION_ENGINE_GPUS = "rollout_gpus_per_engine"  # colocated runs: SGLang engine size
OPTION_EXTRA_ARGS = "extra_args"  # more Miles flags, passed through verbatim
KNOWN_OPTIONS = (OPTION_ENGINE_GPUS, OPTION_EXTRA_ARGS)


@dataclass(frozen=True)
class MilesLayout:
    """The numbers the argument builder needs, derived once and checked."""

    trainer_nodes: int
    trainer_gpus_per_node: int
    rollout_gpus: int  # 0 when colocated (Miles uses the trainer GPUs)
    gpus_per_engine: int
    num_gpus_per_node: int  # Miles's --num-gpus-per-node: GPUs per rollout node
    data_parallel: int
    global_batch: int  # samples per optimizer step

    @property
    def trainer_gpus(self) -> int:
        return self.trainer_nodes * self.trainer_gpus_per_node


def check(recipe: Recipe, site: Site, *, model_args: list[str] | None = None) -> MilesLayout:
    """Every Miles rule the recipe can break; raises InputError naming the field and the fix.

    ``model_args``: the resolved architecture flags (``architecture.resolve``), default the
    recipe's ``model.miles_model_args``. The rules and where Miles or Megatron makes them:

    - TP x PP x CP divides the trainer GPUs and TP x PP x CP x DP is exactly that count (Megatron
      ``validate_args``); ETP x EP x PP divides them (``parallel_state``), and the experts, when the
      model flags name them, are a multiple of EP (``validate_args``);
    - one optimizer step's ``prompts x responses / updates`` samples split evenly over the
      data-parallel ranks with Miles's static micro-batches of 1 (``miles/utils/dp_schedule.py``);
    - a rollout engine fits inside one node or spans whole nodes, and the trainer GPUs are whole
      rollout-sized nodes, because Miles computes an engine's first GPU as ``(actor_gpus + rank *
      gpus) % num_gpus_per_node`` (``sglang_engine.py`` ``get_base_gpu_id``);
    - ``--eval-interval`` needs an eval dataset (miles ``arguments.py``);
    - full-parameter training starts from the torch_dist copy (``--ref-load``, loaded while
      ``--load`` holds no checkpoint); LoRA loads the HF checkpoint through Megatron-Bridge, with
      no KL reference mapped;
    - pass-through flags (``model.miles_model_args``, ``backend_options.extra_args``) never repeat
      one beam-hpc sets: argparse keeps the last value, so a duplicate would silently override,
      e.g., the pinned checkpoint directory."""
    model_args = list(recipe.model.miles_model_args) if model_args is None else model_args
    if recipe.backend != "miles":
        raise InputError(f"backend: {recipe.backend!r} recipes do not build a Miles command; set backend: miles")
    _check_options(recipe.backend_options)
    trainer = recipe.topology.trainer
    if trainer.gpus_per_node < 1:
        raise InputError(
            "topology.trainer.gpus_per_node: Miles trains on GPUs; set it to the GPUs of one trainer "
            "node (the seed: 8), or use backend: reference on machines without GPUs"
        )
    dp = _data_parallel(recipe, trainer.nodes * trainer.gpus_per_node, model_args)
    global_batch = _global_batch(recipe, dp)
    gpus_per_engine, per_node, rollout_gpus = _engines(recipe)
    if (trainer.nodes * trainer.gpus_per_node) % per_node:
        raise InputError(
            f"topology.trainer: {trainer.nodes * trainer.gpus_per_node} trainer GPUs are not whole nodes of "
            f"{per_node} GPUs; Miles places rollout engines by counting GPUs after the trainer's, so give "
            "both groups the same gpus_per_node"
        )
    _check_eval(recipe)
    _check_weights(recipe)
    _check_attention(recipe, model_args)
    _check_passthrough(recipe, model_args)
    return MilesLayout(
        trainer_nodes=trainer.nodes,
        trainer_gpus_per_node=trainer.gpus_per_node,
        rollout_gpus=rollout_gpus,
        gpus_per_engine=gpus_per_engine,
        num_gpus_per_node=per_node,
        data_parallel=dp,
        global_batch=global_batch,
    )


def _check_options(options: dict[str, Any]) -> None:
    unknown = sorted(set(options) - set(KNOWN_OPTIONS))
    if unknown:
        raise InputError(
            f"backend_options: {', '.join(unknown)} unknown to the Miles backend; it understands "
            f"{', '.join(KNOWN_OPTIONS)}"
        )
    extra = options.get(OPTION_EXTRA_ARGS, [])
    if not isinstance(extra, list) or not all(isinstance(a, str) for a in extra):
        raise InputError(f"backend_options.{OPTION_EXTRA_ARGS}: a list of strings, e.g. [--use-dynamic-batch-size]")
    engine = options.get(OPTION_ENGINE_GPUS)
    if engine is not None and (not isinstance(engine, int) or isinstance(engine, bool) or engine < 1):
        raise InputError(f"backend_options.{OPTION_ENGINE_GPUS}: a positive integer, e.g. 8")


def _data_parallel(recipe: Recipe, gpus: int, model_args: list[str]) -> int:
    m = recipe.model
    model_size = _must_divide(
        gpus, {"tensor_parallel": m.tensor_parallel, "pipeline_parallel": m.pipeline_parallel,
               "context_parallel": m.context_parallel},
        "Megatron needs a whole number of data-parallel replicas: choose sizes whose product divides it",
    )
    _must_divide(
        gpus, {"expert_tensor_parallel": m.expert_tensor_parallel, "expert_parallel": m.expert_parallel,
               "pipeline_parallel": m.pipeline_parallel},
        "Megatron lays expert ranks over the same GPUs: lower model.expert_parallel",
    )
    experts = flag_values(model_args).get("--num-experts")
    if m.expert_parallel > 1 and experts is not None:
        if not experts.isdigit() or int(experts) % m.expert_parallel:
            raise InputError(
                f"model.expert_parallel: {m.expert_parallel} does not divide the model's {experts} experts "
                "(--num-experts in the architecture flags); choose a divisor of the expert count"
            )
    return gpus // model_size


def _must_divide(gpus: int, sizes: dict[str, int], fix: str) -> int:
    """The product of ``sizes`` (model.<name> fields) must divide the trainer GPUs; returns it."""
    product = math.prod(sizes.values())
    if gpus % product:
        raise InputError(
            f"model.{' x '.join(sizes)} = {' x '.join(map(str, sizes.values()))} = {product} does not divide "
            f"the trainer group's {gpus} GPUs (topology.trainer nodes x gpus_per_node); {fix}"
        )
    return product


def _global_batch(recipe: Recipe, dp: int) -> int:
    b = recipe.batch
    step = b.samples // b.updates_per_rollout
    if step % dp:
        raise InputError(
            f"batch: one update takes prompts x responses_per_prompt / updates_per_rollout = "
            f"{b.prompts} x {b.responses_per_prompt} / {b.updates_per_rollout} = {step} samples, which do not "
            f"split over {dp} data-parallel ranks (trainer GPUs / (TP x PP x CP)); change batch.prompts or "
            "batch.updates_per_rollout, or the model parallel sizes"
        )
    return step


def _engines(recipe: Recipe) -> tuple[int, int, int]:
    """(GPUs per SGLang engine, GPUs per rollout node, rollout GPUs)."""
    rollout = recipe.topology.rollout
    if rollout is None:  # colocated: the trainer's GPUs generate too
        node = recipe.topology.trainer.gpus_per_node
        engine = recipe.backend_options.get(OPTION_ENGINE_GPUS, node)
        total, field, rollout_gpus = recipe.topology.trainer.nodes * node, f"backend_options.{OPTION_ENGINE_GPUS}", 0
    else:
        if OPTION_ENGINE_GPUS in recipe.backend_options:
            raise InputError(
                f"backend_options.{OPTION_ENGINE_GPUS}: dedicated recipes set topology.rollout.gpus_per_engine; "
                "remove the option"
            )
        if rollout.gpus_per_node < 1:
            raise InputError("topology.rollout.gpus_per_node: SGLang engines need GPUs; set it (the seed: 8)")
        node, engine = rollout.gpus_per_node, rollout.gpus_per_engine
        total = rollout.nodes * node
        field, rollout_gpus = "topology.rollout.gpus_per_engine", total
    if total % engine:
        raise InputError(f"{field}: {engine} does not divide the {total} GPUs that generate")
    if (engine > node and engine % node) or (engine < node and node % engine):
        raise InputError(
            f"{field}: an engine of {engine} GPUs on nodes of {node} would straddle nodes unevenly; use a "
            f"divisor of {node} (one node) or a multiple of it (whole nodes)"
        )
    return engine, node, rollout_gpus


def _check_eval(recipe: Recipe) -> None:
    if recipe.eval.interval > 0 and not recipe.data.eval.strip():
        raise InputError(
            "data.eval: eval.interval is set but no eval dataset is named; Miles refuses --eval-interval "
            "without --eval-prompt-data. Name the file (the seed: aime-2025.jsonl) or set eval.interval: 0"
        )
    if recipe.eval.interval > 0 and not recipe.data.eval_name.strip():
        raise InputError("data.eval_name: the eval dataset needs a name for its metrics (the seed: aime25)")


def _check_weights(recipe: Recipe) -> None:
    t = recipe.training
    if t.mode == "full" and not recipe.model.ref_load:
        raise InputError(
            "model.ref_load: full-parameter Miles runs start from the model's torch_dist copy; convert it "
            "once (beam-hpc prepare --convert) and set model.ref_load to its directory"
        )
    if t.mode == "lora" and t.kl_coef > 0:
        raise InputError(
            "training.kl_coef: a KL reference is not mapped for LoRA (Megatron-Bridge loads the HF base "
            "model); set training.kl_coef: 0, as the seed does"
        )


def _check_attention(recipe: Recipe, model_args: list[str]) -> None:
    """Megatron's flash attention backend does not take multi-latent attention; Miles's launchers
    drop ``--attention-backend flash`` for MLA models ("need to comment this when using model with MLA")."""
    if "--multi-latent-attention" in model_args and recipe.performance.attention_backend == "flash":
        raise InputError(
            "performance.attention_backend: flash does not run the model's multi-latent attention "
            "(--multi-latent-attention in its architecture flags); set performance.attention_backend: null "
            "(Megatron chooses), as Miles's launchers do for MLA models"
        )


def _check_passthrough(recipe: Recipe, model_args: list[str]) -> None:
    """Pass-through flags must not override the ones beam-hpc derives from the recipe, nor the ones
    its lifecycle, checkpoints, topology and data depend on (``flags.managed_flags``): one line per
    flag, naming the recipe field to use instead."""
    owned = managed_flags()
    problems = []
    for field, args in (
        ("model.miles_model_args", model_args),
        (f"backend_options.{OPTION_EXTRA_ARGS}", recipe.backend_options.get(OPTION_EXTRA_ARGS, [])),
    ):
        for arg in args:
            name = arg.split("=", 1)[0]
            if field == "model.miles_model_args" and name in ALSO_IN_MODEL_SCRIPTS:
                continue  # Miles's own model scripts carry these; architecture.reconcile compares values
            if name in owned:
                problems.append(f"{field}: {name} belongs to beam-hpc (a second copy would silently override or "
                                f"break it); {owned[name]}")
    if problems:
        raise InputError("\n".join(problems))
