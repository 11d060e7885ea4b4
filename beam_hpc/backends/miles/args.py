"""Recipe + site -> the Miles driver command: ``train_async.py`` / ``train.py`` and every flag.

Why a builder with no Miles import: Miles cannot run outside its GPU image, so this path must be
right by construction. Every flag is checked by the tests against the names Miles's own argparse
parser accepts (``tests/support/fixtures/miles-megatron-flags.txt``, dumped from
radixark/miles@31f1ca961 with its Megatron fork) and every value against the recipe. The mapping,
recipe field -> Miles flag, is the table ``flags.SOURCES``; the rule behind each group of flags (from
Miles's source, read for facts only) is written beside the function that adds it.

Architecture flags (``--num-layers``, ...) come from ``architecture.resolve``: the recipe's
``model.miles_model_args``, a Miles model script, or the model's ``config.json`` (read here when
readable; a script only the image can read travels to the launcher as ``--model-script``). Values
that exist only inside the allocation are Plan placeholders (``{run_dir}``, ``{nvme_dir}``,
``{ray_address}``, ...) that the job fills.
"""

from __future__ import annotations

from beam_hpc.backends.miles import architecture
from beam_hpc.backends.miles.checks import OPTION_EXTRA_ARGS, MilesLayout, check
from beam_hpc.backends.miles.flags import SOURCES
from beam_hpc.config.recipe import Recipe
from beam_hpc.config.site import Site
from beam_hpc.plan.paths import RunPaths
from beam_hpc.plan.plan import RUN_DIR
from beam_hpc.plan.ray_labels import GROUP_LABEL_KEY
from beam_hpc.run import tracking
from beam_hpc.run.metric_names import MILES_CHECK_KEY

# The run directory's files as the driver names them: under the {run_dir} placeholder the job fills
RUN = RunPaths(RUN_DIR)
ENTRY_ASYNC = "train_async.py"
ENTRY_SYNC = "train.py"
LAUNCHER_MODULE = "beam_hpc.backends.miles.launch"
REWARD_FUNCTION = "beam_hpc.backends.miles.reward.reward"
TRAIN_REWARD_KEY = "reward"
EVAL_REWARD_KEY = "acc"
# The reward adapter reads the penalty window from these (the Miles args carry only the length).
ENV_OVERLONG_BUFFER = "BEAM_REWARD_OVERLONG_BUFFER"
ENV_OVERLONG_FACTOR = "BEAM_REWARD_OVERLONG_FACTOR"
# Driver environment that every Ray worker of the job also needs (the launcher forwards these
# through the job's runtime_env). Per-node values (MILES_HOST_IP) are not here: each node step
# sets its own before `ray start`, and Ray workers inherit the raylet's environment.
WORKER_ENV = (
    "TENSORBOARD_DIR",
    "PYTHONUNBUFFERED",
    "CUDA_DEVICE_MAX_CONNECTIONS",
    "NCCL_SOCKET_IFNAME",
    "GLOO_SOCKET_IFNAME",
    "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME",
    ENV_OVERLONG_BUFFER,
    ENV_OVERLONG_FACTOR,
)

def entry_point(recipe: Recipe) -> str:
    """``train_async.py`` for dedicated pools trained asynchronously (the seed's dedicated and LoRA
    configurations), ``train.py`` for colocated runs and ``async_training: false`` (Miles's
    ``train_async.py`` asserts ``not args.colocate``)."""
    t = recipe.training
    return ENTRY_ASYNC if t.async_training and not t.colocated else ENTRY_SYNC


def miles_args(recipe: Recipe, site: Site) -> list[str]:
    """The Miles flags (without the entry point) for this recipe; checks run first."""
    return _miles_args(recipe, site, architecture.resolve(recipe.model), tracking.settings_for(recipe, site))


def _miles_args(recipe: Recipe, site: Site, arch: architecture.Architecture,
                wb: tracking.WandbSettings | None) -> list[str]:
    """The Miles flags with the architecture flags ``arch`` and the W&B settings ``wb`` (each
    resolved once by the caller)."""
    layout = check(recipe, site, model_args=list(arch.args))
    out = _Argv()
    _topology(out, recipe, layout)
    _model(out, recipe)
    _data(out, recipe)
    _batch(out, recipe, layout)
    _reward(out)
    _eval(out, recipe)
    _loss(out, recipe)
    _optimizer(out, recipe)
    _offload(out, recipe)
    _numerics(out, recipe)
    _performance(out, recipe)
    _lora(out, recipe)
    _outputs(out, recipe)
    _wandb(out, wb)
    own = architecture.reconcile(out.argv, list(arch.args))  # a model script may repeat a practice flag
    return own + list(arch.args) + list(recipe.backend_options.get(OPTION_EXTRA_ARGS, []))


def driver_env(recipe: Recipe, wb: tracking.WandbSettings | None) -> dict[str, str]:
    """The driver's environment (the launcher adds the address and interface variables, and
    ``WANDB_RUN_ID`` from the run directory when W&B is on)."""
    return {
        "TENSORBOARD_DIR": RUN.tensorboard,
        "PYTHONUNBUFFERED": "1",
        "CUDA_DEVICE_MAX_CONNECTIONS": "1",  # what Miles's own launcher sets for Megatron
        "RAY_ADDRESS": "{ray_address}",
        ENV_OVERLONG_BUFFER: str(recipe.reward.overlong_buffer),
        ENV_OVERLONG_FACTOR: _num(recipe.reward.overlong_factor),
        **(tracking.wandb_env(wb, RUN_DIR) if wb is not None else {}),  # no name in common with the above
    }


def build_driver(recipe: Recipe, site: Site) -> tuple[list[str], dict[str, str]]:
    """:func:`driver_with` the recipe's W&B settings resolved here (``backends.registry.plan_for``
    resolves them once per plan and calls :func:`driver_with` itself)."""
    return driver_with(recipe, site, tracking.settings_for(recipe, site))


def driver_with(recipe: Recipe, site: Site, wb: tracking.WandbSettings | None) -> tuple[list[str], dict[str, str]]:
    """argv and environment of the driver process on the head node (Plan placeholders unfilled).

    ``python -m beam_hpc.backends.miles.launch [launcher options] -- <entry> <Miles flags>``:
    the launcher pins trainer bundles to trainer nodes and then runs Miles's entry point in
    its own process (it never stops Ray or kills anything). The plan's path is passed so the
    launcher can name the run in its errors. ``wb``: the run's W&B settings, resolved once by the
    caller, so that the flags and the environment say the same.
    """
    launcher = [site.node_python, "-m", LAUNCHER_MODULE, "--plan", RUN.plan, "--ray-address", "{ray_address}",
                "--head-ip", "{head_ip}", "--group-label", GROUP_LABEL_KEY]
    if site.network.interface:
        launcher += ["--ifname", site.network.interface]
    arch = architecture.resolve(recipe.model)
    launcher += architecture.launcher_options(arch)  # a model script only the image can read
    return [*launcher, "--", entry_point(recipe), *_miles_args(recipe, site, arch, wb)], driver_env(recipe, wb)


class _Argv:
    """An argv under construction; only flags listed in ``flags.SOURCES`` may be added."""

    def __init__(self) -> None:
        self.argv: list[str] = []

    def add(self, flag: str, *values: object) -> None:
        if flag not in SOURCES:
            raise KeyError(f"{flag} is not in backends.miles.flags.SOURCES; add it with the recipe field it maps")
        self.argv += [flag, *(v if isinstance(v, str) else _num(v) for v in values)]

    def switch(self, flag: str, on: bool) -> None:
        if on:
            self.add(flag)


def _num(value: object) -> str:
    """Numbers as Python writes them (``1e-06``, ``0.28``, ``8``), which argparse reads back exactly."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"not a number: {value!r}")
    return repr(value)


def _topology(out: _Argv, recipe: Recipe, layout: MilesLayout) -> None:
    out.add("--actor-num-nodes", layout.trainer_nodes)
    out.add("--actor-num-gpus-per-node", layout.trainer_gpus_per_node)
    out.add("--num-gpus-per-node", layout.num_gpus_per_node)
    if recipe.training.colocated:
        out.add("--colocate")
    else:
        out.add("--rollout-num-gpus", layout.rollout_gpus)
    out.add("--rollout-num-gpus-per-engine", layout.gpus_per_engine)


def _model(out: _Argv, recipe: Recipe) -> None:
    m = recipe.model
    out.add("--hf-checkpoint", m.path)
    if recipe.training.mode == "full":
        out.add("--ref-load", m.ref_load)  # presence checked in backends.miles.checks
    out.add("--tensor-model-parallel-size", m.tensor_parallel)
    # Megatron warns "When using expert parallelism and tensor parallelism for training, sequence
    # parallelism must be used", and turns it off by itself at TP 1.
    out.switch("--sequence-parallel", m.tensor_parallel > 1)
    out.add("--pipeline-model-parallel-size", m.pipeline_parallel)
    out.add("--context-parallel-size", m.context_parallel)
    out.add("--expert-model-parallel-size", m.expert_parallel)
    out.add("--expert-tensor-parallel-size", m.expert_tensor_parallel)
    out.add("--seed", recipe.seed)
    out.add("--rollout-seed", recipe.seed)


def _data(out: _Argv, recipe: Recipe) -> None:
    out.add("--prompt-data", recipe.data.train_path())
    out.add("--input-key", "prompt")
    out.add("--label-key", "label")
    out.add("--apply-chat-template")
    out.switch("--rollout-shuffle", recipe.data.shuffle)


def _batch(out: _Argv, recipe: Recipe, layout: MilesLayout) -> None:
    out.add("--num-rollout", "{num_rollout}")  # the segment's total, filled in the job (plan.PLACEHOLDERS)
    out.add("--rollout-batch-size", recipe.batch.prompts)
    out.add("--n-samples-per-prompt", recipe.batch.responses_per_prompt)
    out.add("--global-batch-size", layout.global_batch)
    out.add("--rollout-max-prompt-len", recipe.tokens.max_prompt)
    out.add("--rollout-max-response-len", recipe.tokens.max_response)
    out.add("--rollout-temperature", recipe.training.temperature)


def _reward(out: _Argv) -> None:
    """beam-hpc's reward returns a dict: training reads ``reward`` (correctness + overlong penalty),
    evaluation ``acc`` (1/0 correctness: the logged mean is accuracy without the penalty, as the seed
    reports it); ``miles_math`` is Miles's own checker's verdict, logged beside it."""
    out.add("--custom-rm-path", REWARD_FUNCTION)
    out.add("--reward-key", TRAIN_REWARD_KEY)
    out.add("--eval-reward-key", EVAL_REWARD_KEY)
    out.add("--log-reward-category", MILES_CHECK_KEY)  # Miles's checker beside ours (backends.miles.reward)


def _eval(out: _Argv, recipe: Recipe) -> None:
    e = recipe.eval
    if e.interval == 0:
        return
    out.add("--eval-interval", e.interval)
    out.add("--eval-prompt-data", recipe.data.eval_name, recipe.data.eval_path())
    out.add("--n-samples-per-eval-prompt", e.samples_per_prompt)
    out.add("--eval-max-prompt-len", recipe.tokens.max_prompt)
    out.add("--eval-max-response-len", recipe.eval_max_response)
    out.add("--eval-temperature", e.temperature)
    out.add("--eval-top-p", e.top_p)


def _loss(out: _Argv, recipe: Recipe) -> None:
    t = recipe.training
    out.add("--advantage-estimator", t.advantage_estimator)
    out.add("--eps-clip", t.eps_clip)
    out.add("--eps-clip-high", t.eps_clip_high)
    out.switch("--calculate-per-token-loss", t.per_token_loss)
    if t.kl_coef > 0:  # DAPO drops the KL term; the seed keeps it at 0
        out.add("--use-kl-loss")
        out.add("--kl-loss-coef", t.kl_coef)
        out.add("--kl-loss-type", "low_var_kl")


def _optimizer(out: _Argv, recipe: Recipe) -> None:
    o = recipe.training.optimizer
    out.add("--optimizer", "adam")
    out.add("--use-distributed-optimizer")
    out.add("--lr", o.lr)
    out.add("--lr-decay-style", "constant")
    if o.warmup_rollouts:
        out.add("--lr-warmup-iters", o.warmup_rollouts * recipe.batch.updates_per_rollout)
    out.add("--weight-decay", o.weight_decay)
    out.add("--adam-beta1", o.adam_beta1)
    out.add("--adam-beta2", o.adam_beta2)
    out.add("--clip-grad", o.grad_clip)


def _offload(out: _Argv, recipe: Recipe) -> None:
    """Optimizer state on node-local NVMe (the seed's ``--optimizer-disk-dir``) is streamed to the
    staged ``{nvme_dir}``, plus ``--offload-train-target disk`` when the trainer is offloaded between
    steps (``--colocate`` turns ``--offload-train`` on). Miles asserts "--offload-train-target=disk
    requires --offload-train", so dedicated pools must not pass it; streaming also needs the
    distributed optimizer and Adam and excludes the CPU-offload flags. ``cpu``: Megatron's own
    host-RAM optimizer offload."""
    target = recipe.training.offload.target
    if target == "nvme":
        if recipe.training.colocated:  # --colocate turns --offload-train on; park it on NVMe too
            out.add("--offload-train-target", "disk")
        out.add("--stream-optimizer-state-to-disk")
        out.add("--offload-train-disk-dir", "{nvme_dir}")
    elif target == "cpu":
        out.add("--optimizer-cpu-offload")
        out.add("--overlap-cpu-optimizer-d2h-h2d")
        out.add("--use-precision-aware-optimizer")


def _numerics(out: _Argv, recipe: Recipe) -> None:
    """Dropout and fp32 accumulation as Miles's launchers set them (Megatron's dropout default is 0.1)."""
    t = recipe.training
    for where in ("attention", "hidden"):  # one recipe field for both of Megatron's dropouts
        out.add(f"--{where}-dropout", t.dropout)
    out.switch("--accumulate-allreduce-grads-in-fp32", t.fp32_grad_allreduce)
    out.switch("--attention-softmax-in-fp32", t.fp32_softmax)


def _performance(out: _Argv, recipe: Recipe) -> None:
    """Attention kernels, activation recompute, token-budget micro-batches, SGLang's memory share
    and data balancing: the ``performance`` section, Miles's launchers' values by default."""
    p = recipe.performance
    if p.attention_backend is not None:
        out.add("--attention-backend", p.attention_backend)
    if p.recompute != "none":
        out.add("--recompute-granularity", p.recompute)
        if p.recompute == "full":  # Megatron: method and layer count apply to full recompute only
            out.add("--recompute-method", p.recompute_method)
            out.add("--recompute-num-layers", p.recompute_num_layers)
    if p.dynamic_batch_size:
        out.add("--use-dynamic-batch-size")
        out.add("--max-tokens-per-gpu", recipe.max_tokens_per_gpu)
    out.add("--sglang-mem-fraction-static", p.sglang_mem_fraction)
    out.switch("--balance-data", p.balance_data)


def _lora(out: _Argv, recipe: Recipe) -> None:
    """Adapters through Megatron-Bridge (``bridge`` mode loads the HF checkpoint itself: no ``--ref-load``)."""
    lora = recipe.training.lora
    if recipe.training.mode != "lora" or lora is None:
        return
    out.add("--lora-rank", lora.rank)
    out.add("--lora-alpha", lora.alpha)
    out.add("--lora-dropout", lora.dropout)
    out.add("--target-modules", ",".join(lora.target_modules))
    out.add("--megatron-to-hf-mode", "bridge")


def _outputs(out: _Argv, recipe: Recipe) -> None:
    """``--save`` and ``--load`` are both pinned to ``<run>/checkpoints``: Miles's launch scripts
    default to a timestamped run id, which would start every resumed segment from scratch; with a
    fixed ``--load`` Miles resumes from ``latest_checkpointed_iteration.txt`` and the saved data
    cursor, and on the first segment falls back to ``--ref-load``. The lifecycle creates the
    ``--save-trigger-sentinel`` file; Miles saves at the next rollout boundary and deletes it.
    TensorBoard's directory reaches Miles only as ``TENSORBOARD_DIR`` (:func:`driver_env`).
    ``--use-fault-tolerance`` on every Miles run, colocated too (radixark/miles 31f1ca96; its own
    launchers pass it by default): alone it means rollout fault tolerance only, a health monitor that
    kills an SGLang engine failing ``/health_generate`` and a restart on the same GPUs before the next
    weight update, so a dead engine on a live node no longer ends the segment; it costs one health
    request per engine per ``--rollout-health-check-interval`` (30 s) while engines are onloaded.
    ``--ft-components`` is refused (flags.OWNED_NOT_EMITTED). Facts and lines: the Miles double's
    ``miles/utils/health_monitor.py`` under tests/support/standins/miles_standin."""
    paths = RUN
    out.add("--save", paths.checkpoints)
    out.add("--load", paths.checkpoints)
    out.add("--save-interval", recipe.checkpoint.interval)
    # lifecycle.save_on_request: false is how an image whose Miles lacks the flag still runs
    # (saves only at checkpoint.interval); the preflight check names this setting.
    if recipe.lifecycle.save_on_request:
        out.add("--save-trigger-sentinel", paths.sentinel)
    out.add("--dump-details", paths.dumps)
    out.add("--use-tensorboard")
    out.add("--use-fault-tolerance")


def _wandb(out: _Argv, wb: tracking.WandbSettings | None) -> None:
    """W&B beside TensorBoard. Miles's ``init_wandb_primary`` (miles-rl 0.0.2 and radixark/miles
    main, e.g. 14aca060) passes ``wandb.init`` no id and no resume setting and, unless told
    otherwise, suffixes the group randomly: the suffix goes, and the id and ``resume=allow`` reach
    wandb through the environment (``WANDB_RUN_ID`` set by the launcher, ``WANDB_RESUME`` here)."""
    if wb is None:
        return
    out.add("--use-wandb")
    out.add("--wandb-project", wb.project)
    if wb.entity:
        out.add("--wandb-team", wb.entity)
    out.add("--wandb-group", wb.group)
    out.add("--disable-wandb-random-suffix")
    out.add("--wandb-dir", str(tracking.wandb_dir(RUN_DIR)))
    out.add("--wandb-mode", wb.mode)
