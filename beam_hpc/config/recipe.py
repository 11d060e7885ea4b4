"""The recipe schema: every knob the Beam recipe names, with the seed's defaults.

A recipe says *what* to train and with what topology; a site profile (``beam_hpc.config.site``) says what
the cluster needs. Both are validated here, before any node is allocated, so that a typo costs a
second on the login node instead of an hour in the queue. Errors name the field (dotted path) and
the fix.

This module imports no Slurm, Ray, submitit or torch code: the recipe is read on a login node, and
dependencies point down the layers (docs/architecture.md).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from beam_hpc.config.strict_yaml import parse_yaml_value, read_yaml_mapping
from beam_hpc.errors import InputError, shorten

Backend = Literal["miles", "reference"]
OffloadTarget = Literal["nvme", "cpu", "none"]
# Megatron's choices (--attention-backend: its AttnBackend enum; --recompute-granularity / -method).
AttentionBackend = Literal["flash", "fused", "unfused", "local", "auto"]
Recompute = Literal["full", "selective", "none"]
TrainMode = Literal["full", "lora"]
RolloutNodeLoss = Literal["in_place", "restart"]  # lifecycle.rollout_node_loss


class _Strict(BaseModel):
    """Unknown keys are errors: a misspelt knob must not silently fall back to a default."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSpec(_Strict):
    """The policy model. ``path`` is an HF checkpoint directory on shared storage (or a Hub id for
    ``beam-hpc prepare``); ``ref_load`` is Miles's torch_dist copy used as the starting point."""

    path: str = "/shared/models/Beam-1.0-501B-A23B"
    ref_load: str | None = None
    # Megatron model parallelism (Miles backend only). The product with data parallelism must
    # equal the trainer GPU count; checked in beam_hpc.backends.miles.args.
    tensor_parallel: int = Field(1, ge=1)
    pipeline_parallel: int = Field(1, ge=1)
    expert_parallel: int = Field(1, ge=1)
    context_parallel: int = Field(1, ge=1)
    expert_tensor_parallel: int = Field(1, ge=1)
    # Architecture flags for Miles (Megatron builds the network from them), from one of: the flags
    # themselves; a Miles `scripts/models/<name>.sh` read for its MODEL_ARGS (not run), with values
    # for the variables bash would compute; or derived from the HF config.json (`hf_config`, else
    # `<path>/config.json`). Resolved and compared with config.json in backends/miles/architecture.
    miles_model_args: list[str] = Field(default_factory=list)
    miles_model_script: str | None = None
    miles_model_script_vars: dict[str, str] = Field(default_factory=dict)
    hf_config: str | None = None


class DataSpec(_Strict):
    """Training and evaluation data, in Miles JSONL format, as ``beam-hpc prepare`` writes it.

    ``eval_name`` names the evaluation set wherever its numbers appear (Miles's
    ``--eval-prompt-data`` name, the ``eval/<name>`` metric tags, plot file names), so it is a slug;
    ``eval_label`` is what people read in status and plot titles. Both say what the data *is*:
    the seed's ``aime25`` / AIME2025 is the default, a recipe on other data names its own."""

    # Labels for names whose data is known, so a recipe (or an old plan.json) naming only the slug
    # still reads well; any other name is shown as itself.
    KNOWN_EVAL_LABELS: ClassVar[dict[str, str]] = {"aime25": "AIME2025"}

    dir: str = "/shared/data/beam"
    train: str = "dapo-math-17k.jsonl"
    eval: str = "aime-2025.jsonl"
    eval_name: str = Field("aime25", pattern=r"^([A-Za-z0-9][A-Za-z0-9._-]*)?$", max_length=64)
    eval_label: str | None = None
    shuffle: bool = True

    @classmethod
    def label_for(cls, eval_name: str, eval_label: str | None = None) -> str:
        """The human name of an evaluation set: its label, else the known one, else the slug."""
        return eval_label or cls.KNOWN_EVAL_LABELS.get(eval_name, eval_name)

    def eval_title(self) -> str:
        """What status lines and plot titles call this recipe's evaluation set."""
        return self.label_for(self.eval_name, self.eval_label)

    def train_path(self) -> str:
        return _under(self.dir, self.train)

    def eval_path(self) -> str:
        return _under(self.dir, self.eval)


class BatchSpec(_Strict):
    """One rollout = ``prompts`` x ``responses_per_prompt`` samples, then ``updates_per_rollout``
    optimizer steps (the seed: 32 x 8, one update)."""

    prompts: int = Field(32, ge=1)
    responses_per_prompt: int = Field(8, ge=2)
    updates_per_rollout: int = Field(1, ge=1)

    @property
    def samples(self) -> int:
        return self.prompts * self.responses_per_prompt


class TokenSpec(_Strict):
    max_prompt: int = Field(1024, ge=8)
    max_response: int = Field(4096, ge=8)


class RewardSpec(_Strict):
    """Boxed-answer correctness (+1 / -1, as in DAPO) plus DAPO's soft overlong punishment: zero up
    to ``max_response - overlong_buffer`` tokens, then linear down to ``-overlong_factor`` at the
    limit. The seed gives no window; we take 1,024 of 4,096 tokens (DAPO used 4,096 of 20,480)."""

    type: Literal["boxed"] = "boxed"
    overlong_buffer: int = Field(1024, ge=0)
    overlong_factor: float = Field(1.0, ge=0)


class EvalSpec(_Strict):
    """AIME2025 every ``interval`` rollouts, ``samples_per_prompt`` responses per problem, reported
    without the length penalty."""

    interval: int = Field(5, ge=0)  # 0 disables evaluation
    samples_per_prompt: int = Field(8, ge=1)
    max_response: int | None = Field(None, ge=8)  # defaults to tokens.max_response
    temperature: float = Field(1.0, ge=0)  # 0 = greedy (SGLang and the reference sampler)
    top_p: float = Field(1.0, gt=0, le=1)


class OptimizerSpec(_Strict):
    """AdamW's knobs, with the ranges torch.optim.AdamW itself enforces (0 <= beta < 1, weight
    decay >= 0): checked here, a bad value costs a second on the login node, not an allocation."""

    lr: float = Field(1e-6, gt=0)
    weight_decay: float = Field(0.1, ge=0)
    adam_beta1: float = Field(0.9, ge=0, lt=1)
    adam_beta2: float = Field(0.98, ge=0, lt=1)
    warmup_rollouts: int = Field(0, ge=0)
    grad_clip: float = Field(1.0, gt=0)


class OffloadSpec(_Strict):
    """Where optimizer state lives while training. ``nvme``: node-local disk (seed default
    ``/scratch/beam-optimizer``, the seed's ``--optimizer-disk-dir``), staged per job by the node
    step; ``cpu``: host RAM; ``none``: stays on the accelerator (LoRA)."""

    target: OffloadTarget = "nvme"
    nvme_dir: str = "/scratch/beam-optimizer"
    min_free_gb: float = Field(0, ge=0)  # per trainer node; dedicated full-parameter: 2,000


class LoraSpec(_Strict):
    rank: int = Field(32, ge=1)
    alpha: int = Field(64, ge=1)
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: list[str] = Field(default_factory=lambda: ["all-linear"])


class TrainingSpec(_Strict):
    """The algorithm: GRPO with DAPO's asymmetric clip and token-level loss, no KL by default."""

    mode: TrainMode = "full"
    async_training: bool = True  # --no-async-training makes generation and training take turns
    colocated: bool = False
    advantage_estimator: Literal["grpo"] = "grpo"
    eps_clip: float = Field(0.2, gt=0)
    eps_clip_high: float = Field(0.28, gt=0)
    per_token_loss: bool = True
    kl_coef: float = Field(0.0, ge=0)
    temperature: float = Field(1.0, gt=0)
    # Numerics as every Miles launcher sets them (radixark/miles 31f1ca96, scripts/run_*.py:
    # "default dropout in megatron is 0.1"; fp32 gradient accumulation and softmax "should be good
    # for model performance"). Dropout applies to attention and hidden states alike.
    dropout: float = Field(0.0, ge=0, lt=1)
    fp32_grad_allreduce: bool = True
    fp32_softmax: bool = True
    optimizer: OptimizerSpec = Field(default_factory=OptimizerSpec)
    offload: OffloadSpec = Field(default_factory=OffloadSpec)
    lora: LoraSpec | None = None


class PerformanceSpec(_Strict):
    """How Miles runs the work, not what is learned: the practice of Miles's own launchers
    (radixark/miles 31f1ca96, ``scripts/run_glm45_355b_a32b_8node.py``, ``run_qwen3_30b_a3b.py``
    and most ``scripts/run_*.py``), each field defaulting to their value.

    ``max_tokens_per_gpu`` is the token budget of one micro-batch on one GPU with dynamic batch
    sizes (Miles packs samples up to it, ``x context_parallel`` per CP group; a longer sample
    is a micro-batch of its own). ``None`` sizes it from the recipe's token budget: two of the
    longest samples, ``2 x (tokens.max_prompt + tokens.max_response) / model.context_parallel``
    (the seed: 10,240); Miles's launchers use 2-4 responses' worth (16,384 at 32,768 tokens with
    CP 2; 32,768 at 8,192)."""

    attention_backend: AttentionBackend | None = "flash"  # None: Megatron chooses (Miles: drop it for MLA)
    recompute: Recompute = "full"  # full activation recompute: memory for compute
    recompute_method: Literal["uniform", "block"] = "uniform"
    recompute_num_layers: int = Field(1, ge=1)
    dynamic_batch_size: bool = True
    max_tokens_per_gpu: int | None = Field(None, ge=1)
    sglang_mem_fraction: float = Field(0.7, gt=0, lt=1)  # SGLang's static share of GPU memory
    balance_data: bool = True  # balance tokens over data-parallel ranks (Miles --balance-data)


class GroupSpec(_Strict):
    """One node group of the heterogeneous job."""

    nodes: int = Field(ge=1)
    gpus_per_node: int = Field(8, ge=0)
    cpus_per_node: int | None = Field(None, ge=1)


class RolloutGroupSpec(GroupSpec):
    gpus_per_engine: int = Field(8, ge=1)  # Miles --rollout-num-gpus-per-engine (SGLang TP)


class TopologySpec(_Strict):
    """Node groups. Colocated recipes have a trainer group only: it generates and trains in turn."""

    trainer: GroupSpec
    rollout: RolloutGroupSpec | None = None


class CheckpointSpec(_Strict):
    interval: int = Field(20, ge=1)
    keep_last: int | None = Field(None, ge=1)


class LifecycleSpec(_Strict):
    """Walltime handling. ``lead_s`` is how long before the walltime the job starts its final save;
    ``None`` lets beam-hpc compute it from measured rollout and save times (with a floor).

    Hangs: ``stall_timeout_s`` is how long a segment waits for the backend's next finished rollout
    before it dumps the stacks, stops and resumes in a new segment (``startup_timeout_s`` for a
    segment's first rollout, model loading included); ``None`` derives both from measured times,
    ``0`` turns them off (beam_hpc.lifecycle.stall). Miles flushes its TensorBoard events only
    about every 120 s, so on Miles a ``stall_timeout_s`` under ~150 s can fire on a healthy run."""

    walltime: str = "24:00:00"
    lead_s: int | None = Field(None, ge=30)
    lead_floor_s: int = Field(300, ge=30)
    max_segments: int = Field(100, ge=1)
    requeue_on_preemption: bool = True
    save_timeout_s: int = Field(1800, ge=10)
    # false: no save-now sentinel on the walltime lead or a preemption; the job runs until Slurm
    # stops it and resumes from the last periodic checkpoint (Miles without --save-trigger-sentinel)
    save_on_request: bool = True
    # For `submit --dry-run`'s GPU-hours before any segment has measured the run: seconds per
    # rollout step (generate + train) and per segment start (allocation to Ray ready and model
    # loaded). The run's own ledger replaces both once a segment has measured them.
    rollout_s_estimate: float | None = Field(None, gt=0)
    bringup_s_estimate: float = Field(600.0, ge=0)
    # The stall watchdog (beam_hpc.lifecycle.stall): a segment whose backend finishes no rollout
    # step (no new perf/step_time scalar) for this many seconds is stopped, its stacks dumped, and
    # resumed from the last checkpoint by a new segment. None: 4 x (the slowest measured step + the
    # last save), at least 20 minutes; 0 turns the watchdog off. Miles flushes its TensorBoard
    # events only every ~120 s, so on Miles a value under ~150 s can fire on a healthy run.
    stall_timeout_s: int | None = Field(None, ge=0)
    # The same for a segment's first rollout, which also loads the model and (Miles) starts the
    # engines. None: the stall timeout + 30 minutes; 0 turns the first rollout's watch off.
    startup_timeout_s: int | None = Field(None, ge=0)
    # A rollout node lost mid-segment (a reference run's dedicated rollout group of 2+ nodes, or a
    # Miles run's once the rollout in flight is saved) is replaced by an extra rollout job, as
    # `beam-hpc rollout add` submits one (beam_hpc.elastic.replace): at most this many over the
    # whole run, so a flapping cluster cannot make the run submit without end. 0: never replace (a
    # reference run goes on with the nodes left, a Miles run ends the segment after its save).
    max_replacements: int = Field(2, ge=0)
    # A Miles run's segment that lost a rollout node (beam_hpc.plan.node_loss SAVE_FIRST) saves, asks
    # for a replacement node to join its Ray cluster, and waits this long for it, its GPUs idle but
    # nothing unsaved, before it ends as a node failure (a full restart costs the whole job's queue
    # wait and start-up instead). 0: no wait, the segment ends once the save is in. Left out of
    # plan.json at its default, as rollout_node_loss below.
    replacement_wait_s: int = Field(600, ge=0, exclude_if=lambda v: v == 600)
    # What a lost rollout node does to the segment (beam_hpc.plan.node_loss). in_place: a dedicated
    # rollout group of 2+ nodes asks Slurm for --no-kill, one step per node; a reference run's
    # segment goes on without the node (its units served by the nodes left, a replacement asked
    # for), a Miles run's saves at the next rollout boundary, then goes on once a replacement node
    # has joined its Ray cluster, or ends with the node excluded (when a whole engine is left on
    # the other nodes). restart: no --no-kill; Slurm revokes the
    # job, which is requeued or resubmitted from the last checkpoint, as any other node failure
    # (what benchmarks/faults.py --node-loss compares).
    # Left out of plan.json and the script's digests at its default, so plans and scripts written
    # before it read the same.
    rollout_node_loss: RolloutNodeLoss = Field("in_place", exclude_if=lambda v: v == "in_place")

    @field_validator("walltime", mode="before")
    @classmethod
    def _minutes_as_text(cls, value: Any) -> Any:
        """Slurm reads a bare number as minutes; YAML reads ``walltime: 90`` as an int. Both mean the
        same time, so an int is taken as that Slurm string (``--time=90``)."""
        if isinstance(value, int) and not isinstance(value, bool):
            return str(value)
        return value


class WandbSpec(_Strict):
    """One Weights & Biases run per beam-hpc run, beside TensorBoard (beam_hpc.run.tracking).
    ``mode: offline`` writes W&B's files under the run directory for ``beam-hpc sync``; a site
    whose nodes have no internet (``site.compute_internet: false``) makes any mode offline."""

    project: str = Field(min_length=1, max_length=128)
    entity: str | None = Field(None, min_length=1)
    mode: Literal["online", "offline"] = "online"


class TrackingSpec(_Strict):
    """Experiment trackers beside TensorBoard; each is off until its section is given."""

    wandb: WandbSpec | None = None


class Recipe(_Strict):
    """A whole recipe. Load with :func:`load_recipe`; override with :func:`apply_overrides`."""

    name: str
    backend: Backend = "miles"
    # Megatron's _set_random_seed refuses a seed that is not positive; numpy's seeds stop at 2**32.
    seed: int = Field(1234, ge=1, lt=2**31)
    output_dir: str
    num_rollout: int = Field(ge=1)  # total, including rollouts already done (the seed's semantics)
    model: ModelSpec = Field(default_factory=ModelSpec)
    data: DataSpec = Field(default_factory=DataSpec)
    batch: BatchSpec = Field(default_factory=BatchSpec)
    tokens: TokenSpec = Field(default_factory=TokenSpec)
    reward: RewardSpec = Field(default_factory=RewardSpec)
    eval: EvalSpec = Field(default_factory=EvalSpec)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    training: TrainingSpec = Field(default_factory=TrainingSpec)
    topology: TopologySpec
    lifecycle: LifecycleSpec = Field(default_factory=LifecycleSpec)
    performance: PerformanceSpec = Field(default_factory=PerformanceSpec)
    tracking: TrackingSpec = Field(default_factory=TrackingSpec)
    # Free-form knobs a backend understands (e.g. the reference backend's tiny-model size).
    backend_options: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _consistent(self) -> Recipe:
        t, topo = self.training, self.topology
        if t.colocated:
            if topo.rollout is not None:
                raise ValueError(
                    "topology.rollout: a colocated recipe has one group (got a rollout group); remove topology.rollout "
                    "or set training.colocated: false"
                )
            if t.async_training:
                raise ValueError(
                    "training.async_training: true is impossible when colocated (generation and training take turns); "
                    "set training.async_training: false (Miles's train_async.py refuses colocation)"
                )
        elif topo.rollout is None:
            raise ValueError(
                "topology.rollout: dedicated (non-colocated) recipes need a rollout group; add "
                "topology.rollout or set training.colocated: true"
            )
        if t.mode == "lora" and t.lora is None:
            raise ValueError("training.lora: missing while training.mode is 'lora'; add training.lora: {rank: 32}")
        if t.mode == "full" and t.lora is not None:
            raise ValueError(f"training.lora: {t.lora.model_dump()} is only valid with training.mode: lora; remove it or set the mode")
        if t.mode == "lora" and t.offload.target == "nvme":
            raise ValueError(
                "training.offload.target: nvme is impossible with LoRA: its optimizer state stays on the GPUs (and Miles refuses "
                "NVMe streaming with LoRA); set training.offload.target: none"
            )
        if t.eps_clip_high < t.eps_clip:
            raise ValueError(f"training.eps_clip_high: {t.eps_clip_high} is below training.eps_clip {t.eps_clip}; raise it (DAPO: 0.28 >= 0.2)")
        if self.reward.overlong_buffer >= self.tokens.max_response:
            raise ValueError(
                f"reward.overlong_buffer: {self.reward.overlong_buffer} must be smaller than tokens.max_response "
                f"({self.tokens.max_response}); lower it (the seed's recipes use 1024)"
            )
        warmup = t.optimizer.warmup_rollouts
        if warmup and warmup >= self.num_rollout:
            raise ValueError(
                f"training.optimizer.warmup_rollouts: {warmup} must be below num_rollout ({self.num_rollout}): Megatron's "
                "scheduler asserts warm-up steps < decay steps; lower it or raise num_rollout"
            )
        if self.batch.samples % self.batch.updates_per_rollout:
            raise ValueError(
                f"batch.updates_per_rollout: {self.batch.updates_per_rollout} does not divide prompts x responses_per_prompt "
                f"({self.batch.samples}); pick a divisor"
            )
        if topo.rollout is not None and topo.rollout.gpus_per_node:
            total = topo.rollout.nodes * topo.rollout.gpus_per_node
            if total % topo.rollout.gpus_per_engine:
                raise ValueError(
                    f"topology.rollout.gpus_per_engine: {topo.rollout.gpus_per_engine} does not divide "
                    f"the rollout group's {total} GPUs; pick a divisor of {total}"
                )
        parse_walltime(self.lifecycle.walltime)  # raises a clear error
        return self

    @property
    def max_tokens_per_gpu(self) -> int:
        """``performance.max_tokens_per_gpu``, else two of the longest samples per GPU (see PerformanceSpec)."""
        if self.performance.max_tokens_per_gpu is not None:
            return self.performance.max_tokens_per_gpu
        per_sample = self.tokens.max_prompt + self.tokens.max_response
        return -(-2 * per_sample // self.model.context_parallel)

    @property
    def eval_max_response(self) -> int:
        return self.eval.max_response or self.tokens.max_response

    @property
    def group_names(self) -> list[str]:
        return ["trainer"] if self.topology.rollout is None else ["trainer", "rollout"]

    def identity(self) -> dict[str, Any]:
        """What must not change when a run resumes: model, data and topology (the seed: "Keep the
        same model, data, output directory, and topology"). num_rollout, walltime and partitions may."""
        return {
            "backend": self.backend,
            "model": self.model.model_dump(),
            "data": {"dir": self.data.dir, "train": self.data.train, "eval": self.data.eval},
            "topology": self.topology.model_dump(),
            "training": {
                "mode": self.training.mode,
                "colocated": self.training.colocated,
                "lora": self.training.lora.model_dump() if self.training.lora else None,
            },
            "batch": self.batch.model_dump(),
            "seed": self.seed,
        }

    def identity_sha(self) -> str:
        """A digest of :meth:`identity`, recorded in the plan (``Plan.identity_sha``)."""
        blob = json.dumps(self.identity(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def _under(base: str, name: str) -> str:
    return name if name.startswith("/") else f"{base.rstrip('/')}/{name}"


def parse_walltime(text: str) -> int:
    """Slurm time string (``MM``, ``HH:MM:SS``, ``D-HH:MM:SS``, ``D-HH``) -> seconds."""
    try:
        days, rest = (text.split("-", 1) if "-" in text else ("0", text))
        parts = [int(p) for p in rest.split(":")]
        if "-" in text:
            parts += [0] * (3 - len(parts))
            h, m, s = parts
        elif len(parts) == 1:
            h, m, s = 0, parts[0], 0
        elif len(parts) == 2:
            h, m, s = 0, parts[0], parts[1]
        elif len(parts) == 3:
            h, m, s = parts
        else:
            raise ValueError
        total = int(days) * 86400 + h * 3600 + m * 60 + s
    except ValueError:
        raise ValueError(
            f"lifecycle.walltime: {shorten(text)} is not a Slurm time; use HH:MM:SS or D-HH:MM:SS"
        ) from None
    if total <= 0:
        raise ValueError(f"lifecycle.walltime: {shorten(text)} must be positive; use HH:MM:SS or D-HH:MM:SS")
    return total


def format_walltime(seconds: int) -> str:
    d, rem = divmod(int(seconds), 86400)
    h, rem = divmod(rem, 3600)
    m, s = divmod(rem, 60)
    return f"{d}-{h:02d}:{m:02d}:{s:02d}" if d else f"{h:02d}:{m:02d}:{s:02d}"


def _format_errors(source: str, err: ValidationError, kind: str = "recipe") -> str:
    """One line per problem: ``<file>: <field>: <what is wrong> (got <value>); <fix>``."""
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        if len(loc) > 200:  # a megabyte-long key stays one readable line
            loc = shorten(loc)
        msg = e["msg"].removeprefix("Value error, ")
        got = f" (got {shorten(e['input'])})" if "input" in e and not isinstance(e["input"], dict) else ""
        if e["type"] == "extra_forbidden":
            msg, got = f"unknown field{got}; remove it or fix its spelling (see recipes/dedicated.yaml or env/example-site.yaml)", ""
        elif e["type"] == "missing":
            msg, got = f"required field is missing; add {loc}: <value> to the {kind}", ""
        elif e["type"].startswith(("greater_than", "less_than")):
            msg = msg.replace("Input should be", "must be")
        if not loc:  # model-level checks already start with the field path and carry the fix
            lines.append(f"{source}: {msg}")
        else:
            lines.append(f"{source}: {loc}: {msg}{got}")
    return "\n".join(lines)


def recipe_from_dict(data: dict[str, Any], source: str = "<recipe>") -> Recipe:
    try:
        return Recipe.model_validate(data)
    except ValidationError as err:
        raise InputError(_format_errors(source, err)) from None


def load_yaml(path: str | Path, kind: str = "recipe") -> dict[str, Any]:
    """A recipe (or, with ``kind``, a site profile) file as a mapping, read strictly
    (:mod:`beam_hpc.config.strict_yaml`: size and alias limits, no duplicate keys or tags, Slurm
    times as strings)."""
    return read_yaml_mapping(path, kind)


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> Recipe:
    """Load a recipe file and apply ``key.path=value`` overrides (values parsed as YAML)."""
    data = load_yaml(path)
    apply_overrides(data, overrides or [])
    return recipe_from_dict(data, str(path))


def resolve_relative_paths(data: dict[str, Any], base: Path) -> None:
    """Relative ``output_dir``, ``data.dir`` and ``model.path`` are relative to ``base``; inside
    the allocation every path must be absolute, so the recipe's mapping is resolved once, before it
    is validated (``beam_hpc.submission.submit.build_recipe`` with ``base_dir``)."""

    def absolute(value: Any) -> Any:
        if isinstance(value, str) and value and not value.startswith("/") and "://" not in value:
            return str((base / value).resolve())
        return value

    if "output_dir" in data:
        data["output_dir"] = absolute(data["output_dir"])
    for section, key in (("data", "dir"), ("model", "path")):
        if isinstance(data.get(section), dict) and key in data[section]:
            data[section][key] = absolute(data[section][key])


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> None:
    """``training.async_training=false`` style overrides, applied in place before validation.

    A value is read by the same strict YAML reader as a file value, so ``--set
    lifecycle.walltime=12:00:00`` means what ``walltime: 12:00:00`` means in the recipe. Every
    refusal names the override (shortened) and the fix."""
    for item in overrides:
        name = f"override {shorten(item)}"
        if "=" not in item:
            raise InputError(f"{name}: no '='; use key.path=value, e.g. --set num_rollout=200")
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        if not all(p.strip() for p in parts):
            raise InputError(
                f"{name}: the key {shorten(key.strip())} has an empty part; use a dotted field path, "
                "e.g. --set training.optimizer.lr=1e-6"
            )
        parts = [p.strip() for p in parts]
        value = parse_yaml_value(raw, name) if raw else ""
        node = data
        for part in parts[:-1]:
            nxt = node.get(part)
            if nxt is None:
                nxt = node[part] = {}
            if not isinstance(nxt, dict):
                raise InputError(f"{name}: {shorten(part)} is not a section (it holds {shorten(nxt)}); set the field itself")
            node = nxt
        node[parts[-1]] = value
