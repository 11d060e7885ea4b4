"""Step time and rollout speed of the reference backend, alone and side by side with TRL's GRPOTrainer.

Two parts, each optional:

1. Backend runs (``--modes``): ``recipes/tiny.yaml`` (32 prompts x 8 responses, 32 new tokens,
   eval every 5 rollouts on 30 held-out sums x 8 samples) as its own backend process on a private
   local Ray, one run per mode; from ``dumps/metrics.jsonl`` it prints median step / generate /
   train / wait seconds over the rollouts after the first (warm-up), rollout tokens per second,
   the first and last training reward and the eval accuracy curve::

       python benchmarks/reference_step.py --work /tmp/bench --modes async sync colocated --num-rollout 20

2. Reference against TRL (``--vs-trl``, needs the ``bench`` extra): the same model, batch
   (prompts x responses), prompt and response lengths and one optimizer update per rollout, in
   one process, one side after the other; each side's generation, rollout, train and step clocks
   are taken the same way (benchmarks/trl_grpo.py says how) and one table gives reference / TRL.

   - ``--device cpu`` (default): the tiny recipe as the backend runs it: its 0.8M Qwen2 and
     tokenizer, its training prompts (chat-formatted), 32 x 8 x 32 tokens, the real boxed reward,
     one thread. The reference side is the backend's own ``RolloutWorker`` and ``Trainer``
     classes, colocated in turn (generate, advantages, train, load the new weights into the
     rollout model), without Ray.
   - ``--device cuda``: a random-initialised Qwen2 of ``--shape`` (0.5b: Qwen2.5-0.5B's geometry)
     with random ~128-token prompts, the seed's 32 x 8, 1,024-token responses, random 0/1
     rewards. The reference side is benchmarks/two_gpu.py's colocated roles, the backend's loop
     pieces fitted to one GPU (bf16 rollout copy with Gumbel noise drawn on the GPU, fp32 trainer
     with bf16 autocast and 8-sequence micro-batches): the backend's CPU classes would score
     256 x 1,152 x 152k fp32 logits at once and draw the noise on the host.

   ``--force-length`` (default on) makes both sides generate every response to the full budget
   (EOS masked until then), so both produce the same tokens. The first step of each side pays
   one-off costs; the table gives the steady steps (every step after the first) and the first.
   The reference side runs first; ``--trl-first`` turns the order round (the first side of a
   process also pays the process's one-off GPU costs). On CPU the table adds each span's CPU
   seconds (``time.process_time``), which other work on a shared machine does not inflate.
   Results go to ``<out-dir>/reference_step-<date>-<machine>.md`` (and ``.json``), rewritten after
   every step so that a run cut short keeps what it measured::

       python benchmarks/reference_step.py --work /tmp/bench --vs-trl --steps 3
       python3 benchmarks/reference_step.py --work /tmp/bench --vs-trl --device cuda --shape 0.5b --steps 2

   On the device machine (torch and transformers there, no TRL, datasets or pydantic), wheels
   travel with the working tree: ``python benchmarks/reference_step.py --prepare-wheels .whl/bench``;
   the exact device commands are in benchmarks/results/reference_step-2026-12-02-nvidia-h200.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent
for p in (REPO, BENCH):  # run as a script from a checkout that is not installed
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

MODES = {
    "async": [],
    "sync": ["training.async_training=false"],
    "colocated": ["training.colocated=true", "training.async_training=false", "topology.rollout=null"],
}
# What the device machine lacks for --vs-trl (its image has torch, transformers, accelerate, pandas,
# pyarrow, xxhash, huggingface-hub): TRL, datasets and theirs, and pydantic for beam_hpc.config.recipe.
DEVICE_WHEELS = ("trl", "datasets", "dill", "multiprocess", "pydantic", "pydantic-core", "annotated-types",
                 "typing-inspection")
MEASURES = (  # (key, label); CPU-second rows only where the device is the CPU
    ("tokens_per_s", "rollout tokens/s (generate)"),
    ("generate_s", "generate s"),
    ("rollout_s", "rollout s (generate + score [+ behaviour log-probs])"),
    ("train_s", "train step s (step - rollout)"),
    ("step_s", "step s (one optimizer update)"),
)
CPU_MEASURES = (
    ("tokens_per_cpu_s", "rollout tokens per CPU s (generate)"),
    ("generate_cpu_s", "generate CPU s"),
    ("rollout_cpu_s", "rollout CPU s"),
    ("train_cpu_s", "train step CPU s"),
    ("step_cpu_s", "step CPU s"),
)


# -- part 1: backend runs -------------------------------------------------------------------------


def prepare_assets(work: Path) -> tuple[Path, Path]:
    from beam_hpc.backends.reference.model import tiny_model
    from beam_hpc.data.prepare import prepare
    from beam_hpc.data.tiny import write_tiny_sources

    data = work / "data"
    if not (data / "aime-2025.jsonl").is_file():
        prepare(data, from_local=write_tiny_sources(work / "src"), progress=False)
    texts = {json.loads(x)["prompt"][0]["content"] for x in (data / "aime-2025.jsonl").read_text().splitlines()}
    return data, tiny_model.build(work / "model", seed=0, exclude_texts=texts)


def run_mode(work: Path, mode: str, num_rollout: int, data: Path, model: Path, extra: list[str]) -> dict:
    from beam_hpc.backends.registry import plan_for
    from beam_hpc.config.recipe import load_recipe
    from beam_hpc.config.site import Site
    from beam_hpc.run import metric_names

    run_dir = work / f"run-{mode}"
    overrides = [f"output_dir={run_dir}", f"model.path={model}", f"data.dir={data}", f"num_rollout={num_rollout}",
                 f"checkpoint.interval={num_rollout}", *MODES[mode], *extra]
    recipe = load_recipe(REPO / "recipes" / "tiny.yaml", overrides)
    plan = plan_for(recipe, Site(name="bench", container={"runtime": "host"})).write()
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "beam_hpc.backends.reference", "--plan", str(plan), "--ray-address", "local"],
                   check=True, env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    wall = time.perf_counter() - t0
    rows = [json.loads(x) for x in (run_dir / "dumps" / "metrics.jsonl").read_text().splitlines()]
    roll = [r for r in rows if r["kind"] == "rollout"]
    steady = roll[1:] or roll

    eval_tag = metric_names.eval_accuracy_tag(recipe.data.eval_name)
    eval_len_tag = metric_names.eval_response_len_tag(recipe.data.eval_name)

    def med(tag: str) -> float:
        return round(statistics.median(r[tag] for r in steady), 3)

    return {
        "mode": mode,
        "wall_s": round(wall, 1),
        "step_s": med(metric_names.ROLLOUT_TIME),
        "generate_s": med("perf/generate_time_s"),
        "train_s": med(metric_names.TRAIN_TIME),
        "wait_s": med("perf/rollout_wait_s"),
        "rollout_tokens_per_s": med("perf/rollout_tokens_per_s"),
        "reward": [round(r[metric_names.ROLLOUT_REWARD], 3) for r in roll],
        "correct": [round(r[metric_names.ROLLOUT_CORRECT], 3) for r in roll],
        "eval": {r["rollout_id"]: r[eval_tag] for r in rows if r["kind"] == "eval"},
        "eval_len": {r["rollout_id"]: round(r[eval_len_tag], 1) for r in rows if r["kind"] == "eval"},
    }


# -- part 2: reference against TRL ------------------------------------------------------------------


class Comparison:
    """The side-by-side run: both sides' steps, the settings, and the report written after each step."""

    def __init__(self, args: argparse.Namespace, settings: dict[str, Any]) -> None:
        self.args = args
        self.settings = settings
        self.sides: dict[str, list[dict[str, float]]] = {"reference": [], "trl": []}
        self.notes: list[str] = []
        self.t_start = time.perf_counter()

    def say(self, msg: str) -> None:
        print(f"[{time.perf_counter() - self.t_start:7.1f}s] {msg}", flush=True)

    def left_s(self) -> float:
        return self.args.time_budget_s - (time.perf_counter() - self.t_start)

    def record(self, side: str, st: Any) -> None:
        row = asdict(st)
        row["tokens_per_s"] = row["tokens"] / row["generate_s"] if row["generate_s"] > 0 else 0.0
        row["tokens_per_cpu_s"] = row["tokens"] / row["generate_cpu_s"] if row["generate_cpu_s"] > 0 else 0.0
        self.sides[side].append(row)
        self.say(f"{side} step {len(self.sides[side])}: " + ", ".join(f"{k} {v:.3f}" for k, v in row.items()))
        self.write()

    def fits(self, side: str) -> bool:
        """Whether one more step of ``side`` fits the budget."""
        return next_step_s([st["step_s"] for st in self.sides[side]]) < self.left_s()

    def write(self) -> Path:
        from beam_hpc.files import write_atomic, write_json_atomic

        out = Path(self.args.out_dir) / f"reference_step-{dt.date.today().isoformat()}-{self.args.machine}.md"
        write_atomic(out, render(self))
        write_json_atomic(out.with_suffix(".json"), {"settings": self.settings, "steps": self.sides, "notes": self.notes})
        return out


def next_step_s(done: list[float]) -> float:
    """What the next step should take: 0 before any, 3/4 of the first after one (a first step pays
    one-off costs: about 2x on the H200 in two_gpu.py's runs), else the last one plus 10%."""
    if not done:
        return 0.0
    return 0.75 * done[0] if len(done) == 1 else 1.1 * done[-1]


def summary(steps: list[dict[str, float]], which: str) -> dict[str, float] | None:
    """``steady``: means over the steps after the first; ``first``: the first step."""
    if not steps:
        return None
    if which == "first":
        return steps[0]
    rest = steps[1:]
    if not rest:
        return None
    return {k: statistics.fmean(s[k] for s in rest) for k in rest[0]}


def render(c: Comparison) -> str:
    s = c.settings
    lines = [
        f"# Reference backend vs TRL GRPOTrainer ({dt.date.today().isoformat()}, {c.args.machine})",
        "",
        f"Command: `{s['command']}`  ",
        f"Versions: torch {s['torch']}, transformers {s['transformers']}, trl {s['trl']}; device {s['device_name']}  ",
        f"Model: {s['model']}  ",
        f"Batch: {s['batch']}  ",
        f"Loss and optimizer: {s['loss']}  ",
        "",
        ("Steady = mean over every step after the first (each side's first step pays one-off costs); first = that first "
        "step. Ratio = reference / TRL: above 1 for tokens/s and below 1 for seconds mean the reference is faster. "
        "CPU s: this process's CPU time over the same span (all threads), which other work on a shared machine does "
        "not inflate, unlike the wall-clock seconds."),
        "",
        "| measure | reference steady | TRL steady | ratio steady | reference first | TRL first | ratio first |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    ref = {w: summary(c.sides["reference"], w) for w in ("steady", "first")}
    trl = {w: summary(c.sides["trl"], w) for w in ("steady", "first")}
    for key, label in MEASURES + (CPU_MEASURES if c.args.device == "cpu" else ()):
        cells = []
        for w in ("steady", "first"):
            a = ref[w][key] if ref[w] else None
            b = trl[w][key] if trl[w] else None
            cells += [_num(a), _num(b), f"{a / b:.2f}" if a and b else "—"]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    tok = {side: [int(st["tokens"]) for st in steps] for side, steps in c.sides.items()}
    lines += ["", (f"Steps measured: reference {len(c.sides['reference'])}, TRL {len(c.sides['trl'])}; "
              f"response tokens per step: reference {tok['reference']}, TRL {tok['trl']}."), "",
              "Every step (s): " + "; ".join(f"{side}: " + ", ".join(f"{st['step_s']:.3g}" for st in steps)
                                             for side, steps in c.sides.items()), "",
              "What differs between the two sides (as close as TRL allows):", ""]
    lines += [f"- {d}" for d in s["differences"]]
    lines += [f"- {n}" for n in c.notes]
    return "\n".join(lines) + "\n"


def _num(x: float | None) -> str:
    if x is None:
        return "—"
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


COMMON_DIFFERENCES = [
    ("Loss: both the clipped token-level surrogate, eps 0.2 / 0.28 (TRL `loss_type='dapo'`, `epsilon=0.2`, "
    "`epsilon_high=0.28`), `beta=0` (no KL, no reference model), group-normalised advantages (`scale_rewards='group'`), "
    "one optimizer update per rollout (`num_iterations=1`, `gradient_accumulation_steps` x `per_device_train_batch_size` "
    "= the rollout), no gradient checkpointing, no vLLM (the reference generates with its own KV-cached loop, TRL with transformers' `generate`), constant LR."),
    ("Behaviour log-probs: the reference rollout computes them (a no-grad forward over the batch, part of its rollout s): "
    "its trainer may be a version behind (async). TRL, on-policy with `num_iterations=1`, skips that forward and uses "
    "the trained forward's detached log-probs."),
    ("Sampling: the reference draws Gumbel-max noise from a generator seeded per rollout (history-free); TRL samples "
    "with `do_sample=True` (multinomial). Both at temperature 1, top-p 1, no top-k."),
    ("Copies: the reference holds a rollout copy and a trainer copy and loads the new weights into the rollout copy "
    "after each update (part of its step s); TRL trains and generates with one model."),
    ("TRL's step also logs per-token entropy and other metrics and checks the loss for NaN every micro-batch "
    "(a device sync); those are part of its train step s."),
]


def _settings(args: argparse.Namespace, model_desc: str, batch: str, loss: str, differences: list[str]) -> dict[str, Any]:
    import torch
    import transformers
    import trl

    dev = torch.cuda.get_device_name(0) if args.device == "cuda" else f"CPU, {torch.get_num_threads()} thread(s)"
    return {"command": " ".join(["python", "benchmarks/reference_step.py", *sys.argv[1:]]), "torch": torch.__version__,
            "transformers": transformers.__version__, "trl": trl.__version__, "device_name": dev, "model": model_desc,
            "batch": batch, "loss": loss, "differences": differences + COMMON_DIFFERENCES}


def compare_cpu(args: argparse.Namespace, data: Path, model_path: Path) -> Comparison:
    """The tiny recipe: the backend's RolloutWorker and Trainer in turn, then TRL, on its model and prompts."""
    import torch
    from transformers import AutoModelForCausalLM
    from trl_grpo import SamplerMeter, StepTiming, Workload, run_trl

    from beam_hpc.backends.reference.loop.algorithm import group_advantages
    from beam_hpc.backends.reference.loop.prompt_source import encode_prompts, read_rows
    from beam_hpc.backends.reference.loop.trainer import Trainer
    from beam_hpc.backends.reference.model.policy import load_tokenizer, load_trainable_state
    from beam_hpc.backends.reference.rollouts.rollout_worker import RolloutWorker
    from beam_hpc.config.recipe import load_recipe
    from beam_hpc.reward.scoring import score_response

    r = load_recipe(REPO / "recipes" / "tiny.yaml", [f"model.path={model_path}", f"data.dir={data}", *args.override])
    tok = load_tokenizer(str(model_path))
    rows = read_rows(r.data.train_path())
    n = r.batch.prompts * args.steps
    prompts, _ = encode_prompts(rows, tok, r.tokens.max_prompt)
    prompts = prompts[:n]
    texts = [tok.apply_chat_template(rows[p.index]["prompt"], add_generation_prompt=True) for p in prompts]
    t, o = r.training, r.training.optimizer
    w = Workload(prompt_texts=texts, prompt_ids=[p.ids for p in prompts], labels=[p.label for p in prompts],
                 prompts_per_step=r.batch.prompts, responses=r.batch.responses_per_prompt, max_new=r.tokens.max_response,
                 micro_batch=r.batch.prompts * r.batch.responses_per_prompt // r.batch.updates_per_rollout, steps=args.steps,
                 force_length=args.force_length, device="cpu", temperature=t.temperature, eps_low=t.eps_clip,
                 eps_high=t.eps_clip_high, lr=o.lr, betas=(o.adam_beta1, o.adam_beta2), weight_decay=o.weight_decay,
                 grad_clip=o.grad_clip, seed=r.seed)
    params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(str(model_path)).parameters())
    c = Comparison(args, _settings(
        args, f"the tiny recipe's Qwen2 ({params / 1e6:.2f}M parameters, {model_path}), fp32 on both sides",
        f"{w.prompts_per_step} prompts x {w.responses} responses (the tiny recipe's training prompts, chat-formatted, "
        f"{min(map(len, w.prompt_ids))}-{max(map(len, w.prompt_ids))} tokens), {w.max_new}-token responses"
        + (" forced to full length" if w.force_length else "") + f"; one update on all {w.samples} samples at once",
        f"eps {w.eps_low}/{w.eps_high}, token-level, no KL; AdamW lr {w.lr}, betas {w.betas}, weight decay {w.weight_decay}, "
        f"grad clip {w.grad_clip}; reward: beam_hpc.reward.scoring's boxed score with the overlong penalty on both sides",
        [("Reference side: the backend's own RolloutWorker and Trainer classes in one process (no Ray), in turn. Its "
         "optimizer state goes through the recipe's CPU offload path (a no-op on CPU)."),
         (f"Threads: {torch.get_num_threads()} intra-op thread(s) for both sides (the recipe's backend_options.threads), "
         "deterministic algorithms on (the backend's process setup).")]))

    def reference_side() -> None:
        c.say(f"reference: {args.steps} steps of {w.samples} samples")
        rd = r.model_dump(mode="json")
        worker, trainer = RolloutWorker(rd, 0, str(model_path)), Trainer(rd, str(model_path))
        meter = SamplerMeter("cpu", w.force_length)
        for k in range(args.steps):
            if not c.fits("reference"):
                break
            batch = prompts[k * w.prompts_per_step : (k + 1) * w.prompts_per_step]
            t0, c0 = time.perf_counter(), time.process_time()
            roll = worker.generate([p.ids for p in batch], [p.label for p in batch], purpose="train", rollout_id=k,
                                   first_sample=0, samples_per_prompt=w.responses, train=True)
            t1, c1 = time.perf_counter(), time.process_time()
            roll["advantages"] = group_advantages(torch.tensor(roll["reward"]), w.responses).tolist()
            _metrics, state = trainer.train(roll)
            load_trainable_state(worker.model, state)  # colocated: the push is a load into the rollout copy
            t2, c2 = time.perf_counter(), time.process_time()
            gen_s, tokens, gen_cpu = meter.calls[-1]
            c.record("reference", StepTiming(gen_s, tokens, t1 - t0, t2 - t1, t2 - t0, gen_cpu, c1 - c0, c2 - c1, c2 - c0))
        meter.restore()

    def boxed_reward(completions: list[str], completion_ids: list[list[int]], label: list[str], **kw: Any) -> list[float]:
        return [score_response(text, lab, len(ids), max_response_tokens=w.max_new, buffer_tokens=r.reward.overlong_buffer,
                               factor=r.reward.overlong_factor, apply_penalty=True).reward
                for text, ids, lab in zip(completions, completion_ids, label, strict=False)]

    def trl_side() -> None:
        c.say("TRL")
        model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)
        run_trl(model, tok, w, boxed_reward, Path(args.work) / "trl-out", on_step=lambda st: c.record("trl", st),
                keep_going=lambda _last: c.fits("trl"))

    run_sides(c, reference_side, trl_side)
    return c


def transformers_copy(model: Any, s: Any) -> Any:
    """TRL trains a transformers model: the same Qwen2 as the reference side's (its weights copied
    in, so both sides start equal)."""
    import two_gpu
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(**two_gpu.SHAPES[s.shape], tie_word_embeddings=True, max_position_embeddings=4 * (s.prompt_len + s.max_new),
                      bos_token_id=two_gpu.EOS_ID, eos_token_id=two_gpu.EOS_ID, pad_token_id=two_gpu.PAD_ID)
    hf = Qwen2ForCausalLM(cfg).to(next(model.parameters()).device)
    hf.load_state_dict(model.state_dict(), strict=False)
    return hf


def id_tokenizer(vocab: int, pad_id: int, eos_id: int) -> Any:
    """A tokenizer for a random model fed random token ids: token ``i`` is the word ``t<i>``, so a
    prompt written as ``"t5 t17 t300"`` tokenizes to exactly ``[5, 17, 300]`` (TRL takes text)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"t{i}": i for i in range(vocab)}
    words["<pad>"], words["<eos>"] = pad_id, eos_id
    for i in (pad_id, eos_id):
        del words[f"t{i}"]
    core = Tokenizer(models.WordLevel(words, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", padding_side="left")


def compare_random(args: argparse.Namespace) -> Comparison:
    """A random-initialised Qwen2 (benchmarks/two_gpu.py's shapes): two_gpu's colocated roles, then TRL."""
    import torch
    import two_gpu
    from trl_grpo import SamplerMeter, StepTiming, Workload, run_trl, seeded_bits

    dev = "cuda:0" if args.device == "cuda" else "cpu"
    ns = argparse.Namespace(prompts=args.prompts, responses=args.responses, max_new=args.max_new, prompt_len=args.prompt_len,
                            micro_batch=args.micro_batch, sampler="device", bucket_mb=256)
    s = two_gpu.settings_from(ns, args.shape)
    vocab = two_gpu.SHAPES[s.shape]["vocab_size"]
    prompts = two_gpu.make_prompts(s, vocab) * args.steps  # two_gpu's rollouts reuse the same prompts every step
    w = Workload(prompt_texts=[" ".join(f"t{i}" for i in p) for p in prompts], prompt_ids=prompts,
                 labels=["0"] * len(prompts), prompts_per_step=s.prompts, responses=s.responses, max_new=s.max_new,
                 micro_batch=s.micro_batch, steps=args.steps, force_length=args.force_length, device=args.device,
                 temperature=s.temperature, eps_low=s.eps_low, eps_high=s.eps_high, lr=s.lr, betas=s.betas,
                 weight_decay=s.weight_decay, grad_clip=s.grad_clip, seed=s.seed)
    on_gpu = args.device == "cuda"
    c = Comparison(args, _settings(
        args, f"random-initialised Qwen2 '{s.shape}' ({two_gpu.SHAPES[s.shape]}, tied embeddings), same init on both sides",
        f"{s.prompts} prompts x {s.responses} responses (random ~{s.prompt_len}-token prompts, the same every step), "
        f"{s.max_new}-token responses" + (" forced to full length" if w.force_length else "")
        + f"; micro-batches of {s.micro_batch} sequences for the loss",
        f"eps {s.eps_low}/{s.eps_high}, token-level, no KL; AdamW lr {s.lr}, betas {s.betas}, weight decay {s.weight_decay}, "
        f"grad clip {s.grad_clip} (the seed recipe's); rewards: random 0/1 bits on both sides",
        ["Reference side: benchmarks/two_gpu.py's colocated roles (the backend's sampling, policy and algorithm "
         "functions): generation on a " + ("bf16" if on_gpu else "fp32") + " rollout copy with the Gumbel noise "
         "drawn on the device, training on fp32 weights" + (" with bf16 autocast" if on_gpu else "")
         + (", fused AdamW" if on_gpu else "") + ".",
         "TRL side: one fp32 model" + (" with `bf16=True` (mixed precision), unfused AdamW (HF Trainer's default "
                                        "`adamw_torch`)" if on_gpu else "") + "; it generates with that model."]))
    def reference_side() -> None:
        c.say(f"reference ({s.shape} on {dev}): building the two roles")
        trainer, rollout = two_gpu.TrainerRole(s, dev), two_gpu.RolloutRole(s, dev)
        meter = SamplerMeter(dev, w.force_length)
        for k in range(args.steps):
            if not c.fits("reference"):
                break
            t0, c0 = time.perf_counter(), time.process_time()
            _timing, roll = rollout.generate(k)
            two_gpu.sync_device(dev)
            t1, c1 = time.perf_counter(), time.process_time()
            trainer.train(roll)
            rollout.load(trainer.weights())
            two_gpu.sync_device(dev)
            t2, c2 = time.perf_counter(), time.process_time()
            gen_s, tokens, gen_cpu = meter.calls[-1]
            c.record("reference", StepTiming(gen_s, tokens, t1 - t0, t2 - t1, t2 - t0, gen_cpu, c1 - c0, c2 - c1, c2 - c0))
        meter.restore()
        # the models go; the allocator keeps its blocks, so the next side's first step need not grow it again

    def trl_side() -> None:
        c.say("TRL: building the model")
        model = transformers_copy(two_gpu.build_model(s, dev, torch.float32), s)
        tok = id_tokenizer(vocab, two_gpu.PAD_ID, two_gpu.EOS_ID)
        run_trl(model, tok, w, seeded_bits(s.seed), Path(args.work) / "trl-out", on_step=lambda st: c.record("trl", st),
                keep_going=lambda _last: c.fits("trl"))

    run_sides(c, reference_side, trl_side)
    return c


def run_sides(c: Comparison, reference_side: Callable[[], None], trl_side: Callable[[], None]) -> None:
    """Both sides, in the order asked for (``--trl-first`` checks that order does not decide the
    result); a side that stopped early (time budget) is noted in the table."""
    sides = {"reference": reference_side, "trl": trl_side}
    order = ["trl", "reference"] if c.args.trl_first else ["reference", "trl"]
    c.notes.append(f"Order: {' then '.join(order)}, in one process.")
    try:
        for name in order:
            sides[name]()
    finally:
        for name in order:
            if len(c.sides[name]) < c.args.steps:
                c.notes.append(f"{name}: {len(c.sides[name])} of {c.args.steps} steps measured (time budget)")
        c.write()


# -- device wheels ----------------------------------------------------------------------------------


def prepare_wheels(dest: Path) -> list[Path]:
    """Download cp312 wheels, at this environment's versions, of what --vs-trl needs and the device
    image lacks (its torch, transformers and accelerate are used as they are)."""
    from importlib.metadata import version

    dest.mkdir(parents=True, exist_ok=True)
    plats = [f"--platform={p}" for p in ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
                                          "manylinux2014_x86_64", "manylinux1_x86_64")]
    pins = [f"{name}=={version(name)}" for name in DEVICE_WHEELS]
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version=3.12",
                    "--implementation=cp", *plats, "-d", str(dest), *pins], check=True)
    return sorted(dest.glob("*.whl"))


# -- main -------------------------------------------------------------------------------------------


def machine_name(device: str) -> str:
    import torch

    if device == "cpu":
        return "cpu"
    return torch.cuda.get_device_name(0).lower().replace(" ", "-")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, help="run directories go here")
    ap.add_argument("--assets", type=Path, help="where the tiny data/ and model/ are (built if missing); default --work")
    ap.add_argument("--modes", nargs="*", default=None, choices=sorted(MODES),
                    help="backend runs (default: async sync, or none with --vs-trl)")
    ap.add_argument("--num-rollout", type=int, default=20)
    ap.add_argument("--override", action="append", default=[], help="extra recipe override, key=value")
    ap.add_argument("--json", type=Path, help="write the backend runs' numbers here")
    ap.add_argument("--vs-trl", action="store_true", help="run the reference / TRL comparison")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--shape", default="", help="random Qwen2 shape (tiny, 0.5b, 1.5b) instead of the tiny recipe's model; "
                                                "implied 0.5b with --device cuda")
    ap.add_argument("--steps", type=int, default=3, help="optimizer updates per side, the first included (default 3)")
    ap.add_argument("--prompts", type=int, default=0, help="random model: prompts per step (default: the seed's 32)")
    ap.add_argument("--responses", type=int, default=0, help="random model: responses per prompt (default: the seed's 8)")
    ap.add_argument("--max-new", type=int, default=1024, help="random model: response budget (default 1024)")
    ap.add_argument("--prompt-len", type=int, default=128, help="random model: mean prompt length (default 128)")
    ap.add_argument("--micro-batch", type=int, default=8, help="random model: sequences per loss chunk (default 8)")
    ap.add_argument("--force-length", action=argparse.BooleanOptionalAction, default=True,
                    help="generate every response to the full budget on both sides (default on)")
    ap.add_argument("--trl-first", action="store_true", help="run the TRL side first (default: the reference first)")
    ap.add_argument("--time-budget-s", type=float, default=1e9, help="skip steps that would end past this (seconds)")
    ap.add_argument("--machine", default="", help="name in the results file (default: cpu, or the GPU's name)")
    ap.add_argument("--out-dir", default=str(REPO / "benchmarks" / "results"))
    ap.add_argument("--prepare-wheels", metavar="DIR", help="only download the device machine's wheels into DIR, then exit")
    args = ap.parse_args()
    if args.prepare_wheels:
        for whl in prepare_wheels(Path(args.prepare_wheels)):
            print(whl)
        return
    if args.work is None:
        ap.error("--work is required (run directories go there)")
    if args.steps < 1:
        ap.error("--steps: at least 1")
    if args.device == "cuda" and not args.shape:
        args.shape = "0.5b"
    args.machine = args.machine or machine_name(args.device)
    modes = args.modes if args.modes is not None else ([] if args.vs_trl else ["async", "sync"])
    args.work.mkdir(parents=True, exist_ok=True)
    if args.device == "cpu":
        import torch

        torch.set_num_threads(1)
    if modes or (args.vs_trl and not args.shape):
        data, model = prepare_assets(args.assets or args.work)
    results = [run_mode(args.work, m, args.num_rollout, data, model, args.override) for m in modes]
    for r in results:
        print(json.dumps(r))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    if args.vs_trl:
        c = compare_random(args) if args.shape else compare_cpu(args, data, model)
        print(c.write().read_text(), flush=True)


if __name__ == "__main__":
    main()
