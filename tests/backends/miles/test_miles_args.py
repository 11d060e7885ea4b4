"""The Miles command beam-hpc builds, checked against Miles's own contract.

Miles cannot be installed here (GPU image only), so the contract is written down:
``tests/support/fixtures/miles-megatron-flags.txt`` lists every flag name the real argparse parser of Miles's
entry points accepts (radixark/miles@31f1ca961 + its Megatron fork; see the file's header). Every
flag beam-hpc emits, for every recipe and mode, must be in it; the values must be the recipe's;
and the cross-flag rules Miles asserts at start-up (quoted in ``beam_hpc.backends.miles.checks``)
must hold on the emitted argv.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from miles_facts import PRACTICE

from beam_hpc.backends.miles import args as miles_args
from beam_hpc.backends.miles.args import ENTRY_ASYNC, ENTRY_SYNC, build_driver, entry_point
from beam_hpc.backends.miles.flags import managed_flags
from beam_hpc.backends.registry import plan_for
from beam_hpc.config.recipe import Recipe, load_recipe
from beam_hpc.config.site import Site
from beam_hpc.errors import InputError
from beam_hpc.plan.paths import RunPaths
from beam_hpc.plan.plan import PLACEHOLDERS, RUN_DIR, fill

ROOT = Path(__file__).resolve().parents[3]
FLAGS_FILE = Path(__file__).resolve().parents[3] / "tests" / "support" / "fixtures" / "miles-megatron-flags.txt"
RUN = RunPaths(RUN_DIR)  # the run directory as the driver command names it, filled in the job


# -- the written contract ---------------------------------------------------------------------


def _load_contract() -> tuple[frozenset[str], frozenset[str]]:
    """(flag names, entry points the list covers), from the file's own header and body."""
    names, entries = set(), set()
    for line in FLAGS_FILE.read_text().splitlines():
        if line.startswith("#"):
            m = re.search(r"entry points \(([^)]*)\)", line)
            if m:
                entries |= {e.strip() for e in m.group(1).split("/")}
        elif line.startswith("--"):
            names.add(line.strip())
    return frozenset(names), frozenset(entries)


FLAGS, ENTRIES = _load_contract()
_PATTERNS = (re.compile(r"^--sglang-[a-z0-9-]+$"), re.compile(r"^--eval-sglang-[a-z0-9-]+$"))


def miles_accepts(flag: str) -> bool:
    return flag in FLAGS or any(p.match(flag) for p in _PATTERNS)


def parse_flags(argv: list[str]) -> dict[str, list[str]]:
    """``--flag v1 v2 --switch`` -> {"--flag": ["v1", "v2"], "--switch": []}; a repeat is an error."""
    out: dict[str, list[str]] = {}
    current = None
    for tok in argv:
        if tok.startswith("--"):
            assert tok not in out, f"{tok} appears twice (argparse would keep only the last)"
            current = out.setdefault(tok, [])
        else:
            assert current is not None, f"value {tok!r} before any flag"
            current.append(tok)
    return out


def test_contract_file_is_the_real_parser_dump() -> None:
    assert len(FLAGS) > 2000, "the flag list looks truncated"
    assert {ENTRY_ASYNC, ENTRY_SYNC} <= ENTRIES
    assert "--save-trigger-sentinel" in FLAGS and "--offload-train-disk-dir" in FLAGS
    assert "--optimizer-disk-dir" not in FLAGS  # the seed's name is not a Miles flag
    assert not miles_accepts("--no-such-flag")


# -- recipes and modes ------------------------------------------------------------------------

SITE = Site(name="t", container={"runtime": "host"}, network={"ip_source": "interface", "interface": "ib0"})


def recipe(name: str, *overrides: str) -> Recipe:
    return load_recipe(ROOT / "recipes" / f"{name}.yaml", list(overrides))


MODES = {
    "dedicated-async": ("dedicated",),
    "dedicated-in-turn": ("dedicated", "training.async_training=false"),
    "dedicated-cpu-offload": ("dedicated", "training.offload.target=cpu"),
    "dedicated-resume": ("dedicated", "num_rollout=200"),
    "colocated": ("colocated",),
    "colocated-cpu-offload": ("colocated", "training.offload.target=cpu"),
    "lora": ("lora",),
    "lora-in-turn": ("lora", "training.async_training=false"),
    "dedicated-kl-warmup": ("dedicated", "training.kl_coef=0.001", "training.optimizer.warmup_rollouts=10"),
    "no-eval": ("dedicated", "eval.interval=0"),
    "other-eval-set": ("dedicated", "data.eval_name=tiny-add", "data.eval_label=tiny two-digit addition"),
    "wandb": ("dedicated", "tracking.wandb.project=beam", "tracking.wandb.entity=team"),
    "wandb-offline-lora": ("lora", "tracking.wandb.project=beam", "tracking.wandb.mode=offline"),
}


def test_wandb_is_one_run_per_chain_under_the_run_dir() -> None:
    """W&B beside TensorBoard: no random group suffix, the run's name as group, files under the run
    directory; the id and resume=allow reach Miles's wandb.init through the environment."""
    for mode, want in (("wandb", "online"), ("wandb-offline-lora", "offline")):
        r, _, flags = built(mode)
        assert flags["--use-wandb"] == [] and flags["--disable-wandb-random-suffix"] == []
        assert flags["--wandb-project"] == ["beam"] and flags["--wandb-group"] == [r.name]
        assert flags["--wandb-dir"] == [f"{RUN_DIR}/wandb"] and flags["--wandb-mode"] == [want]
        assert "--use-tensorboard" in flags
        _, env = build_driver(r, SITE)
        assert env["WANDB_RESUME"] == "allow" and env["WANDB_DIR"] == f"{RUN_DIR}/wandb"
    assert built("wandb")[2]["--wandb-team"] == ["team"]
    assert not any(f.startswith("--wandb") or f == "--use-wandb" for f in built("dedicated-async")[2])


def built(mode: str) -> tuple[Recipe, str, dict[str, list[str]]]:
    r = recipe(*MODES[mode])
    argv, _ = build_driver(r, SITE)
    cut = argv.index("--")
    return r, argv[cut + 1], parse_flags(argv[cut + 2:])


@pytest.mark.parametrize("mode", sorted(MODES))
def test_every_emitted_flag_is_a_miles_flag(mode: str) -> None:
    r, entry, flags = built(mode)
    assert entry in ENTRIES
    unknown = sorted(f for f in flags if not miles_accepts(f))
    assert not unknown, f"{mode}: Miles's {entry} parser does not know {unknown}"
    assert set(flags) <= set(managed_flags()), "a flag the builder emits has no recipe source in _SOURCES"


def test_every_mapped_flag_is_a_miles_flag() -> None:
    """The mapping table itself only names flags Miles has (so no branch can emit a wrong one)."""
    assert sorted(f for f in managed_flags() if not miles_accepts(f)) == []


@pytest.mark.parametrize(
    ("mode", "entry"),
    [("dedicated-async", ENTRY_ASYNC), ("lora", ENTRY_ASYNC), ("colocated", ENTRY_SYNC),
     ("dedicated-in-turn", ENTRY_SYNC), ("lora-in-turn", ENTRY_SYNC)],
)
def test_entry_point(mode: str, entry: str) -> None:
    r, got, flags = built(mode)
    assert got == entry == entry_point(r)
    if entry == ENTRY_ASYNC:
        assert "--colocate" not in flags  # train_async.py: "Colocation is not supported for async training."


@pytest.mark.parametrize("mode", ["dedicated-async", "colocated", "lora"])
def test_seed_defaults_appear_with_their_values(mode: str) -> None:
    """The seed: 32 prompts x 8 responses and one update; 1,024 + 4,096 tokens; AIME2025 every
    5 rollouts with 8 responses; a checkpoint every 20 rollouts; DAPO's clip 0.2 / 0.28."""
    _, _, f = built(mode)
    seed = {
        "--rollout-batch-size": ["32"], "--n-samples-per-prompt": ["8"], "--global-batch-size": ["256"],
        "--rollout-max-prompt-len": ["1024"], "--rollout-max-response-len": ["4096"],
        "--eval-interval": ["5"], "--n-samples-per-eval-prompt": ["8"], "--save-interval": ["20"],
        "--eps-clip": ["0.2"], "--eps-clip-high": ["0.28"], "--advantage-estimator": ["grpo"],
        "--input-key": ["prompt"], "--label-key": ["label"],
    }
    assert {k: f[k] for k in seed} == seed
    for switch in ("--calculate-per-token-loss", "--apply-chat-template", "--rollout-shuffle", "--use-fault-tolerance"):
        assert f[switch] == [], switch
    assert f["--eval-prompt-data"] == ["aime25", "/shared/data/beam/aime-2025.jsonl"]
    assert built(mode)[0].data.eval_title() == "AIME2025"


def test_the_eval_set_is_named_by_the_recipe() -> None:
    """Miles names its eval metrics after --eval-prompt-data's name: a recipe on other data than
    AIME2025 must say so there, not inherit the seed's aime25."""
    r, _, f = built("other-eval-set")
    assert f["--eval-prompt-data"] == ["tiny-add", "/shared/data/beam/aime-2025.jsonl"]
    assert r.data.eval_title() == "tiny two-digit addition"
    tiny = load_recipe(ROOT / "recipes" / "tiny.yaml")
    assert (tiny.data.eval_name, tiny.data.eval_title()) == ("tiny-add", "tiny two-digit addition (held-out)")
    assert load_recipe(ROOT / "recipes" / "smollm2.yaml").data.eval_name == "tiny-add"


@pytest.mark.parametrize("bad", ["tiny add", "eval/x", "-x", "x" * 65])
def test_an_eval_name_that_cannot_be_a_tag_or_file_name_is_refused(bad: str) -> None:
    with pytest.raises(InputError, match="data.eval_name"):
        recipe("dedicated", f"data.eval_name={bad}")


@pytest.mark.parametrize("mode", sorted(MODES))
def test_values_are_the_recipes(mode: str) -> None:
    r, _, f = built(mode)
    m, t, topo = r.model, r.training, r.topology
    ints = {
        "--actor-num-nodes": topo.trainer.nodes,
        "--actor-num-gpus-per-node": topo.trainer.gpus_per_node,
        "--tensor-model-parallel-size": m.tensor_parallel,
        "--pipeline-model-parallel-size": m.pipeline_parallel,
        "--context-parallel-size": m.context_parallel,
        "--expert-model-parallel-size": m.expert_parallel,
        "--expert-tensor-parallel-size": m.expert_tensor_parallel,
        "--rollout-batch-size": r.batch.prompts,
        "--n-samples-per-prompt": r.batch.responses_per_prompt,
        "--global-batch-size": r.batch.samples // r.batch.updates_per_rollout,
        "--rollout-max-prompt-len": r.tokens.max_prompt,
        "--rollout-max-response-len": r.tokens.max_response,
        "--save-interval": r.checkpoint.interval,
        "--seed": r.seed,
        "--rollout-seed": r.seed,
    }
    floats = {
        "--eps-clip": t.eps_clip, "--eps-clip-high": t.eps_clip_high, "--lr": t.optimizer.lr,
        "--weight-decay": t.optimizer.weight_decay, "--adam-beta1": t.optimizer.adam_beta1,
        "--adam-beta2": t.optimizer.adam_beta2, "--clip-grad": t.optimizer.grad_clip,
        "--rollout-temperature": t.temperature,
    }
    if r.eval.interval:
        ints |= {"--eval-interval": r.eval.interval, "--n-samples-per-eval-prompt": r.eval.samples_per_prompt,
                 "--eval-max-response-len": r.eval_max_response}
        floats |= {"--eval-temperature": r.eval.temperature, "--eval-top-p": r.eval.top_p}
        assert f["--eval-prompt-data"] == [r.data.eval_name, r.data.eval_path()]
    else:
        assert not [k for k in f if k.startswith("--eval-") and k != "--eval-reward-key"]
    for flag, want in ints.items():
        assert f[flag] == [str(want)], flag
    assert f["--num-rollout"] == ["{num_rollout}"]  # the segment's total, filled in the job
    for flag, want in floats.items():
        assert len(f[flag]) == 1 and float(f[flag][0]) == want, flag
    assert f["--hf-checkpoint"] == [m.path]
    assert f["--prompt-data"] == [r.data.train_path()]
    if topo.rollout is None:
        assert "--colocate" in f and "--rollout-num-gpus" not in f
        assert f["--num-gpus-per-node"] == [str(topo.trainer.gpus_per_node)]
    else:
        assert f["--rollout-num-gpus"] == [str(topo.rollout.nodes * topo.rollout.gpus_per_node)]
        assert f["--rollout-num-gpus-per-engine"] == [str(topo.rollout.gpus_per_engine)]
        assert f["--num-gpus-per-node"] == [str(topo.rollout.gpus_per_node)]
    if t.kl_coef:
        assert "--use-kl-loss" in f and float(f["--kl-loss-coef"][0]) == t.kl_coef
    else:
        assert "--use-kl-loss" not in f
    if t.optimizer.warmup_rollouts:
        assert f["--lr-warmup-iters"] == [str(t.optimizer.warmup_rollouts * r.batch.updates_per_rollout)]


@pytest.mark.parametrize("mode", sorted(MODES))
def test_checkpoints_pinned_under_the_run_dir(mode: str) -> None:
    """Miles's default run id is a timestamp; a fixed --load/--save is what makes resume work. The
    run directory is the job's {run_dir}: a plan whose output_dir was edited saves there."""
    r, _, f = built(mode)
    assert f["--save"] == f["--load"] == [RUN.checkpoints]
    assert f["--save-trigger-sentinel"] == [RUN.sentinel]
    assert f["--dump-details"] == [RUN.dumps]
    assert "--use-tensorboard" in f
    assert fill(f["--save"][0], run_dir=r.output_dir) == RunPaths(r.output_dir).checkpoints


def test_the_rollout_total_is_completed_in_the_job_not_baked() -> None:
    """A resume may change the total (the seed's semantics): the Plan's command carries a placeholder
    the segment fills with its own total, so the same plan.json runs to whatever the segment is given."""
    from beam_hpc.plan.plan import fill

    fresh = build_driver(recipe("dedicated"), SITE)[0]
    resumed = build_driver(recipe("dedicated", "num_rollout=200"), SITE)[0]
    assert fresh == resumed
    i = resumed.index("--num-rollout") + 1
    assert fill(resumed[i], num_rollout="200") == "200"


@pytest.mark.parametrize("mode", sorted(MODES))
def test_miles_startup_rules_hold(mode: str) -> None:
    """The cross-flag assertions of miles/utils/arguments.py, checked on the emitted argv."""
    r, entry, f = built(mode)
    if "--offload-train-target" in f:  # "--offload-train-target=disk requires --offload-train"
        assert f["--offload-train-target"] == ["disk"] and "--colocate" in f
    if "--stream-optimizer-state-to-disk" in f:
        assert "--offload-train-target" in f or "--colocate" not in f
        for excluded in ("--optimizer-cpu-offload", "--use-precision-aware-optimizer", "--lora-rank"):
            assert excluded not in f, excluded
        assert f["--optimizer"] == ["adam"] and "--use-distributed-optimizer" in f
    for needs_save in ("--save-interval", "--save-trigger-sentinel"):
        assert needs_save not in f or "--save" in f
    if "--eval-interval" in f:  # "Evaluation datasets must be configured when eval_interval is set."
        assert len(f["--eval-prompt-data"]) == 2
    if "--lora-rank" in f:  # "'--target-modules' is required when LoRA is enabled."
        assert f["--target-modules"] and f["--megatron-to-hf-mode"] == ["bridge"]
    assert int(f["--global-batch-size"][0]) * r.batch.updates_per_rollout == (
        int(f["--rollout-batch-size"][0]) * int(f["--n-samples-per-prompt"][0])
    )


def test_nvme_offload_maps_the_seeds_optimizer_disk_dir() -> None:
    _, _, ded = built("dedicated-async")
    assert "--stream-optimizer-state-to-disk" in ded and ded["--offload-train-disk-dir"] == ["{nvme_dir}"]
    assert "--offload-train-target" not in ded  # a dedicated trainer is never offloaded
    _, _, col = built("colocated")
    assert col["--offload-train-target"] == ["disk"] and "--stream-optimizer-state-to-disk" in col
    assert col["--offload-train-disk-dir"] == ["{nvme_dir}"]


@pytest.mark.parametrize("mode", ["dedicated-cpu-offload", "colocated-cpu-offload"])
def test_cpu_offload_uses_megatrons_flags(mode: str) -> None:
    _, _, f = built(mode)
    for flag in ("--optimizer-cpu-offload", "--overlap-cpu-optimizer-d2h-h2d", "--use-precision-aware-optimizer"):
        assert f[flag] == []
    assert not {"--stream-optimizer-state-to-disk", "--offload-train-disk-dir", "--offload-train-target"} & set(f)


def test_lora_flags_and_no_nvme() -> None:
    r, _, f = built("lora")
    lora = r.training.lora
    assert lora is not None
    assert f["--lora-rank"] == [str(lora.rank)] and f["--lora-alpha"] == [str(lora.alpha)]
    assert float(f["--lora-dropout"][0]) == lora.dropout
    assert f["--target-modules"] == [",".join(lora.target_modules)]
    assert "--ref-load" not in f  # Megatron-Bridge loads the HF checkpoint
    assert not [k for k in f if "offload" in k or "disk" in k or k == "--stream-optimizer-state-to-disk"]


def test_reward_is_beam_hpcs_and_eval_reads_accuracy() -> None:
    _, _, f = built("dedicated-async")
    assert f["--custom-rm-path"] == [miles_args.REWARD_FUNCTION]
    assert f["--reward-key"] == ["reward"] and f["--eval-reward-key"] == ["acc"]
    assert "--rm-type" not in f


# -- the driver command and the Plan ------------------------------------------------------------


def test_driver_command_shape_and_placeholders() -> None:
    r = recipe("dedicated")
    argv, env = build_driver(r, SITE)
    cut = argv.index("--")
    launcher = parse_flags(argv[3:cut])
    assert argv[:3] == [SITE.python, "-m", "beam_hpc.backends.miles.launch"]
    assert launcher["--plan"] == [RUN.plan] and launcher["--ray-address"] == ["{ray_address}"]
    assert launcher["--head-ip"] == ["{head_ip}"] and launcher["--ifname"] == ["ib0"]
    assert launcher["--group-label"] == ["beam-group"]
    values = dict.fromkeys(PLACEHOLDERS, "X")
    filled = [fill(a, **values) for a in argv] + [fill(v, **values) for v in env.values()]
    assert not [a for a in filled if "{" in a]
    assert env["TENSORBOARD_DIR"] == RUN.tensorboard
    assert env[miles_args.ENV_OVERLONG_BUFFER] == str(r.reward.overlong_buffer)
    assert float(env[miles_args.ENV_OVERLONG_FACTOR]) == r.reward.overlong_factor
    no_iface = Site(name="t", container={"runtime": "host"})
    assert "--ifname" not in build_driver(r, no_iface)[0]


def test_make_plan_stores_the_miles_command() -> None:
    r = recipe("lora")
    plan = plan_for(r, SITE)
    assert list(plan.driver_argv) == build_driver(r, SITE)[0]
    assert plan.driver_env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"


def test_passthrough_flags_are_appended() -> None:
    """The README's example: any other Miles flag through backend_options.extra_args, verbatim."""
    r = recipe("dedicated", "model.miles_model_args=[--num-layers, '4', --num-experts, '64']",
               "backend_options={extra_args: [--rollout-stop-token-ids, '151329', '151336', --use-tis]}")
    argv = build_driver(r, SITE)[0]
    assert argv[-8:] == ["--num-layers", "4", "--num-experts", "64", "--rollout-stop-token-ids", "151329",
                         "151336", "--use-tis"]
    assert all(miles_accepts(a) for a in argv[-8:] if a.startswith("--"))


OWNED_CASES = [
    ("--save", "remove it and set output_dir (pinned: <output>/checkpoints) instead"),
    ("--num-rollout", "remove it and set num_rollout instead"),
    ("--actor-num-nodes", "remove it and set topology.trainer.nodes instead"),
    ("--prompt-data", "remove it and set data.dir + data.train instead"),
    ("--max-tokens-per-gpu", "remove it and set performance.max_tokens_per_gpu"),
    ("--start-rollout-id", "set num_rollout instead"),
    ("--ckpt-step", "every segment resumes from the latest checkpoint"),
    ("--exit-duration-in-mins", "set lifecycle.walltime instead"),
    ("--offload-train", "set training.colocated"),
]


def test_extra_args_refuses_what_beam_hpc_owns_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    """Through the CLI, as a user meets it: exit 2 and one line per owned flag, naming the recipe
    field to use instead; nothing printed as a plan."""
    from beam_hpc.cli.app import main as cli_main

    extra = json.dumps([f"{flag}=1" if i % 2 else flag for i, (flag, _) in enumerate(OWNED_CASES)] + ["--use-tis"])
    code = cli_main(["submit", str(ROOT / "recipes" / "dedicated.yaml"), "--site", str(ROOT / "env" / "example-site.yaml"),
                     "--dry-run", "--set", f"backend_options={{extra_args: {extra}}}"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    lines = [line for line in err.splitlines() if "backend_options.extra_args:" in line]
    assert len(lines) == len(OWNED_CASES)
    for (flag, fix), line in zip(OWNED_CASES, lines, strict=False):
        assert f"backend_options.extra_args: {flag} belongs to beam-hpc" in line and fix in line, line
    assert all(f in managed_flags() and miles_accepts(f) for f, _ in OWNED_CASES)


def test_colocated_engine_size_option() -> None:
    _, _, f = built("colocated")
    assert f["--rollout-num-gpus-per-engine"] == ["16"]  # colocated.yaml: one engine spans 2 nodes
    r = recipe("colocated", "backend_options={rollout_gpus_per_engine: 8}")
    argv = build_driver(r, SITE)[0]
    assert argv[argv.index("--rollout-num-gpus-per-engine") + 1] == "8"


# -- the checks Miles would make, made first -----------------------------------------------------

BAD = [
    (("dedicated", "model.tensor_parallel=3"), "model.tensor_parallel x pipeline_parallel x context_parallel"),
    (("dedicated", "model.context_parallel=3"), "does not divide the trainer group's 64 GPUs"),
    (("dedicated", "model.expert_parallel=32"), "model.expert_tensor_parallel x expert_parallel"),
    (("dedicated", "model.miles_model_args=[--num-experts, '24']"), "model.expert_parallel: 16 does not divide"),
    (("dedicated", "model.miles_model_args=['--num-experts=24']"), "model.expert_parallel: 16 does not divide the model's 24"),
    (("dedicated", "batch.prompts=3", "batch.responses_per_prompt=2"), "do not split over 4 data-parallel"),
    (("dedicated", "topology.rollout={nodes: 3, gpus_per_node: 8, gpus_per_engine: 12}"), "straddle"),
    (("dedicated", "topology.trainer={nodes: 1, gpus_per_node: 4}", "model.tensor_parallel=1",
      "model.pipeline_parallel=1", "model.expert_parallel=1"), "not whole nodes of 8 GPUs"),
    (("dedicated", "topology.trainer.gpus_per_node=0"), "topology.trainer.gpus_per_node"),
    (("dedicated", "data.eval=''"), "data.eval: eval.interval is set"),
    (("dedicated", "model.ref_load=null"), "model.ref_load"),
    (("lora", "training.kl_coef=0.01"), "training.kl_coef"),
    (("dedicated", "model.miles_model_args=[--save, /tmp/x]"), "--save belongs to beam-hpc"),
    (("dedicated", "backend_options={extra_args: ['--load=/x']}"), "--load belongs to beam-hpc"),
    (("dedicated", "backend_options={rollout_gpus_per_engine: 8}"), "dedicated recipes set topology.rollout"),
    (("dedicated", "backend_options={nope: 1}"), "backend_options: nope unknown"),
    (("colocated", "backend_options={rollout_gpus_per_engine: 6}"), "does not divide the 64 GPUs"),
    (("dedicated", "backend=reference"), "set backend: miles"),
]


@pytest.mark.parametrize(("spec", "message"), BAD, ids=[b[1][:40] for b in BAD])
def test_checks_raise_clear_errors(spec: tuple[str, ...], message: str) -> None:
    r = recipe(*spec)
    with pytest.raises(InputError, match=re.escape(message)):
        build_driver(r, SITE)


def test_bad_parallelism_fails_in_make_plan_before_any_allocation() -> None:
    with pytest.raises(InputError, match="choose sizes whose product divides it"):
        plan_for(recipe("lora", "model.pipeline_parallel=3"), SITE)


# -- Miles's launchers' practice as recipe fields ----------------------------------------------------



@pytest.mark.parametrize("mode", ["dedicated-async", "colocated", "lora"])
def test_seed_recipes_run_as_miles_launchers_do(mode: str) -> None:
    """Each seed recipe carries Miles's launcher practice (radixark/miles 31f1ca96 scripts/run_*.py)."""
    _, _, f = built(mode)
    assert {k: f.get(k) for k in PRACTICE} == PRACTICE


def test_practice_fields_change_the_flags() -> None:
    r = recipe("dedicated", "training.dropout=0.1", "training.fp32_softmax=false", "training.fp32_grad_allreduce=false",
               "performance={attention_backend: null, recompute: selective, dynamic_batch_size: false, "
               "sglang_mem_fraction: 0.8, balance_data: false}")
    argv = build_driver(r, SITE)[0]
    f = parse_flags(argv[argv.index("--") + 2:])
    assert f["--attention-dropout"] == f["--hidden-dropout"] == ["0.1"]
    assert f["--recompute-granularity"] == ["selective"] and "--recompute-method" not in f
    assert f["--sglang-mem-fraction-static"] == ["0.8"]
    for gone in ("--attention-softmax-in-fp32", "--accumulate-allreduce-grads-in-fp32", "--attention-backend",
                 "--use-dynamic-batch-size", "--max-tokens-per-gpu", "--balance-data"):
        assert gone not in f, gone
    none = build_driver(recipe("dedicated", "performance.recompute=none"), SITE)[0]
    assert not any(k.startswith("--recompute") for k in none)


def test_token_budget_follows_tokens_and_context_parallel() -> None:
    assert recipe("dedicated").max_tokens_per_gpu == 2 * (1024 + 4096)
    assert recipe("dedicated", "tokens.max_response=8192", "model.context_parallel=2",
                  "model.expert_parallel=8").max_tokens_per_gpu == (1024 + 8192)
    assert recipe("dedicated", "performance.max_tokens_per_gpu=16384").max_tokens_per_gpu == 16384
    with pytest.raises(InputError, match="performance.sglang_mem_fraction"):
        recipe("dedicated", "performance.sglang_mem_fraction=1.5")
    with pytest.raises(InputError, match="performance.attention_backend"):
        recipe("dedicated", "performance.attention_backend=fast")


def test_model_flags_may_repeat_practice_flags_with_the_same_value() -> None:
    """Miles's MLA scripts carry --attention-softmax-in-fp32 and some carry dropout 0: the same
    value is taken once; a different one names the recipe field. MLA refuses flash attention."""
    same = ["--num-layers", "4", "--attention-softmax-in-fp32", "--hidden-dropout", "0.0"]
    r = recipe("dedicated", f"model.miles_model_args={json.dumps(same)}")
    argv = build_driver(r, SITE)[0]
    f = parse_flags(argv[argv.index("--") + 2:])  # parse_flags fails on a repeated flag
    assert "--attention-softmax-in-fp32" in f and f["--hidden-dropout"] == ["0.0"]
    with pytest.raises(InputError, match=r"training.dropout: the model's architecture flags set --hidden-dropout 0.1 "
                                         r"but the recipe gives --hidden-dropout 0.0"):
        build_driver(recipe("dedicated", "model.miles_model_args=[--hidden-dropout, '0.1']"), SITE)
    with pytest.raises(InputError, match="training.fp32_softmax: .* but the recipe gives off"):
        build_driver(recipe("dedicated", "training.fp32_softmax=false",
                            "model.miles_model_args=[--attention-softmax-in-fp32]"), SITE)
    with pytest.raises(InputError, match="performance.attention_backend: flash does not run the model's multi-latent"):
        build_driver(recipe("dedicated", "model.miles_model_args=[--multi-latent-attention]"), SITE)
    build_driver(recipe("dedicated", "model.miles_model_args=[--multi-latent-attention]",
                        "performance.attention_backend=null"), SITE)


# -- launcher parity: beam-hpc's command next to Miles's own launchers' --------------------------------

LAUNCHERS = json.loads((ROOT / "tests" / "support" / "fixtures" / "miles_launchers_31f1ca96.json").read_text())
MILES_MAIN_MODELS = ROOT / "tests" / "support" / "fixtures" / "miles_main" / "scripts" / "models"

# Why beam-hpc's command differs from Miles's launcher, flag by flag. The test fails on any
# difference missing here and on any entry here that is no longer a difference.
LIFECYCLE = "beam-hpc's lifecycle: checkpoints pinned to <output>/checkpoints, resumed every segment"
PATHS = "a path: the site's shared storage instead of the launcher's /root"
SEED_BATCH = "the seed's batch: 32 prompts x 8 responses, one update per rollout"
WHY: dict[str, str] = {
    # added by beam-hpc's lifecycle and observation
    "--save": LIFECYCLE, "--load": LIFECYCLE, "--save-interval": LIFECYCLE + ", every checkpoint.interval (20)",
    "--save-trigger-sentinel": "beam-hpc's lifecycle: save now before the walltime or a preemption",
    "--use-tensorboard": "beam-hpc reads metrics from <output>/tensorboard (status, plot)",
    "--dump-details": "beam-hpc keeps Miles's dumps in <output>/dumps",
    "--use-fault-tolerance": "rollout engine health checks, so one dead engine does not hang a segment",
    "--save-retain-interval": "Miles's launcher prunes off-grid checkpoints; beam-hpc also saves on the walltime lead "
                              "and on preemption, and resumes from those",
    # the seed's algorithm, reward and data, which differ on purpose
    "--custom-rm-path": "the seed's reward: boxed answer +1/-1 with DAPO's overlong penalty (beam-hpc's reward "
                        "adapter), not Miles's deepscaler",
    "--rm-type": "see --custom-rm-path",
    "--reward-key": "the training reward includes the overlong penalty",
    "--eval-reward-key": "eval accuracy is correctness alone, as the seed reports it",
    "--log-reward-category": "eval also logs Miles's own checker's verdict (reward field miles_math), beside "
                             "beam-hpc's, so a curve compares with the seed's",
    "--advantage-estimator": "the seed is GRPO; Miles's 8-node GLM launcher runs GSPO",
    "--eps-clip": "DAPO's clip 0.2 / 0.28 (the seed) instead of GSPO's 1e-4 / 2e-4",
    "--eps-clip-high": "see --eps-clip",
    "--use-tis": "GSPO's truncated importance sampling: not in the seed (extra_args can add it)",
    "--over-sampling-batch-size": "DAPO's dynamic sampling: not in the seed (extra_args can add it)",
    "--dynamic-sampling-filter-path": "see --over-sampling-batch-size",
    "--kl-coef": "Miles's own default (0) spelled out by the launcher; beam-hpc leaves it",
    "--entropy-coef": "Miles's own default (0) spelled out by the launcher; beam-hpc leaves it",
    "--use-kl-loss": "training.kl_coef 0 (the seed): beam-hpc turns the KL loss off rather than weighting it by 0",
    "--kl-loss-coef": "see --use-kl-loss (inert at 0 in the launchers)",
    "--kl-loss-type": "see --use-kl-loss (inert at 0 in the launchers)",
    "--calculate-per-token-loss": "DAPO's token-level loss (the seed)",
    "--seed": "the recipe's seed, for both Megatron and the rollout order", "--rollout-seed": "see --seed",
    "--rollout-max-prompt-len": "the seed's 1,024-token prompt budget",
    "--eval-max-prompt-len": "the seed's 1,024-token prompt budget",
    "--rollout-max-response-len": "the seed's 4,096-token responses",
    "--eval-max-response-len": "the seed evaluates at its 4,096-token response budget",
    "--max-tokens-per-gpu": "sized from the seed's token budget: 2 x (1,024 + 4,096) / context_parallel",
    "--num-rollout": "the seed's 100 rollouts (resume with a larger value)",
    "--rollout-batch-size": SEED_BATCH,
    "--global-batch-size": SEED_BATCH + " (beam-hpc gives the step size; Miles derives it from --num-steps-per-rollout)",
    "--num-steps-per-rollout": SEED_BATCH,
    "--eval-interval": "the seed evaluates every 5 rollouts",
    "--n-samples-per-eval-prompt": "the seed: 8 responses per AIME problem",
    "--eval-temperature": "eval.temperature, given explicitly (the seed samples at 1.0)",
    "--eval-prompt-data": "the seed's AIME2025 set (aime25), not AIME2024",
    "--prompt-data": PATHS, "--hf-checkpoint": PATHS, "--ref-load": PATHS,
    # optimizer and memory
    "--use-distributed-optimizer": "always on: NVMe streaming of optimizer state needs it",
    "--clip-grad": "training.optimizer.grad_clip, given explicitly (Megatron's default 1.0)",
    "--optimizer-cpu-offload": "the seed keeps optimizer state on node-local NVMe (training.offload.target: nvme; "
                               "cpu gives these three flags)",
    "--overlap-cpu-optimizer-d2h-h2d": "see --optimizer-cpu-offload",
    "--use-precision-aware-optimizer": "see --optimizer-cpu-offload",
    "--stream-optimizer-state-to-disk": "see --optimizer-cpu-offload",
    "--offload-train-disk-dir": "see --optimizer-cpu-offload",
    "--offload-train-target": "colocated on NVMe: the trainer is parked on disk while SGLang generates",
}
# Per launcher: the equivalent beam-hpc recipe (the seed's colocated recipe with the launcher's
# model, nodes and parallel layout; the model- and hardware-specific serving and dispatch flags
# through backend_options.extra_args, the documented way) and the flags that differ.
PARITY = {
    "run_glm45_355b_a32b_8node": (
        ["topology.trainer={nodes: 8, gpus_per_node: 8}", "model.tensor_parallel=8", "model.pipeline_parallel=4",
         "model.context_parallel=2", "model.expert_parallel=16",
         f"model.miles_model_script={MILES_MAIN_MODELS / 'glm4.5-355B-A32B.py'}",
         "backend_options={rollout_gpus_per_engine: 32, extra_args: [--rollout-stop-token-ids, '151329', '151336', "
         "'151338', --sglang-enable-dp-attention, --sglang-dp-size, '4', --sglang-ep-size, '32', "
         "--sglang-enable-dp-lm-head, --sglang-moe-dense-tp-size, '1', --sglang-speculative-algorithm, EAGLE, "
         "--sglang-speculative-num-steps, '1', --sglang-speculative-eagle-topk, '1', "
         "--sglang-speculative-num-draft-tokens, '2', --sglang-enable-draft-weights-cpu-backup, "
         "--moe-token-dispatcher-type, flex, --moe-enable-deepep]}"],
        {"--save", "--load", "--save-interval", "--save-trigger-sentinel", "--use-tensorboard", "--dump-details",
         "--use-fault-tolerance", "--custom-rm-path", "--rm-type", "--reward-key", "--eval-reward-key", "--log-reward-category",
         "--advantage-estimator", "--eps-clip", "--eps-clip-high", "--use-tis", "--over-sampling-batch-size",
         "--dynamic-sampling-filter-path", "--kl-coef", "--entropy-coef", "--kl-loss-coef", "--kl-loss-type",
         "--calculate-per-token-loss", "--seed", "--rollout-seed", "--rollout-max-prompt-len", "--eval-max-prompt-len",
         "--rollout-max-response-len", "--eval-max-response-len", "--max-tokens-per-gpu", "--num-rollout",
         "--rollout-batch-size", "--global-batch-size", "--num-steps-per-rollout", "--eval-interval",
         "--eval-temperature", "--eval-prompt-data", "--prompt-data", "--hf-checkpoint", "--ref-load",
         "--use-distributed-optimizer", "--clip-grad", "--optimizer-cpu-offload", "--overlap-cpu-optimizer-d2h-h2d",
         "--use-precision-aware-optimizer", "--stream-optimizer-state-to-disk", "--offload-train-disk-dir",
         "--offload-train-target"},
    ),
    "run_qwen3_30b_a3b": (
        ["topology.trainer={nodes: 1, gpus_per_node: 8}", "model.tensor_parallel=4", "model.pipeline_parallel=1",
         "model.expert_parallel=8", f"model.miles_model_script={MILES_MAIN_MODELS / 'qwen3-30B-A3B.py'}",
         "backend_options={rollout_gpus_per_engine: 8, extra_args: [--sglang-cuda-graph-max-bs, '512']}"],
        {"--save", "--load", "--save-retain-interval", "--save-trigger-sentinel", "--use-tensorboard",
         "--dump-details", "--custom-rm-path", "--rm-type", "--reward-key", "--eval-reward-key", "--log-reward-category",
         "--use-kl-loss", "--kl-loss-coef", "--kl-loss-type", "--entropy-coef", "--calculate-per-token-loss",
         "--seed", "--rollout-seed", "--rollout-max-prompt-len", "--eval-max-prompt-len", "--rollout-max-response-len",
         "--eval-max-response-len", "--max-tokens-per-gpu", "--num-rollout", "--eval-interval",
         "--n-samples-per-eval-prompt", "--eval-temperature", "--eval-prompt-data", "--prompt-data", "--hf-checkpoint",
         "--ref-load", "--use-distributed-optimizer", "--clip-grad", "--optimizer-cpu-offload",
         "--overlap-cpu-optimizer-d2h-h2d", "--use-precision-aware-optimizer", "--stream-optimizer-state-to-disk",
         "--offload-train-disk-dir", "--offload-train-target"},
    ),
}


def last_wins(argv: list[str]) -> dict[str, tuple[str, ...]]:
    """What argparse keeps: ``--flag v...`` -> values, a repeated flag's last occurrence."""
    out: dict[str, tuple[str, ...]] = {}
    flag = None
    for tok in argv:
        if tok.startswith("--"):
            flag = tok
            out[flag] = ()
        else:
            assert flag is not None, tok
            out[flag] += (tok,)
    return out


def _same(a: tuple[str, ...], b: tuple[str, ...]) -> bool:
    def norm(v: str) -> object:
        try:
            return float(v)
        except ValueError:
            return v
    return len(a) == len(b) and all(norm(x) == norm(y) for x, y in zip(a, b, strict=False))


@pytest.mark.parametrize("launcher", sorted(PARITY))
def test_command_matches_miless_own_launcher(launcher: str) -> None:
    """beam-hpc's command for the equivalent recipe equals the flags Miles's launcher passes
    (tests/support/fixtures/miles_launchers_31f1ca96.json, with the model script's flags first, as Miles's
    load_model_args puts them), apart from the differences WHY explains, no more and no fewer."""
    facts = LAUNCHERS["launchers"][launcher]
    overrides, expected = PARITY[launcher]
    script = MILES_MAIN_MODELS / Path(facts["model_script"]).name
    from beam_hpc.backends.miles.model_script import read_model_script

    miles = last_wins([*read_model_script(str(script)), *facts["argv"]])
    r = recipe("colocated", *overrides)
    argv, _ = build_driver(r, SITE)
    cut = argv.index("--")
    assert argv[cut + 1] == facts["entry"]
    ours = last_wins(argv[cut + 2:])
    differ = {f for f in set(miles) | set(ours) if f not in miles or f not in ours or not _same(miles[f], ours[f])}
    assert differ == expected, (f"not explained: {sorted(differ - expected)}; no longer differ: "
                                f"{sorted(expected - differ)}")
    assert expected <= set(WHY), sorted(expected - set(WHY))
    practice = set(PRACTICE) - {"--max-tokens-per-gpu"}
    assert {f: miles[f] for f in practice} == {f: ours[f] for f in practice}  # Miles's practice, as Miles sets it


def test_every_written_difference_is_a_difference_somewhere() -> None:
    used = set().union(*(expected for _, expected in PARITY.values()))
    assert set(WHY) == used, f"reasons for flags no launcher differs on: {sorted(set(WHY) - used)}"
    assert LAUNCHERS["commit"].startswith("31f1ca96")  # the commit the flag table targets
