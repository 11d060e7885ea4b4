"""TRL's ``GRPOTrainer`` on a given model and workload, timed the way benchmarks/reference_step.py
times the reference backend, so that the two sit side by side in one table.

Why a separate file: TRL (and its ``datasets`` import) is a benchmark-only dependency (the
``bench`` extra); nothing in ``beam_hpc`` imports it, and reference_step.py imports this module
only when the TRL column is asked for.

What is measured, identically on both sides (``GenerateMeter`` wraps TRL's model's own
``generate``, ``SamplerMeter`` the reference backend's ``sampling.generate``, so the clock covers
exactly the generation call):
  generate s     the ``model.generate`` call for the whole batch (prompts x responses)
  tokens         response tokens it produced (up to and including the first EOS)
  rollout s      prompts in, scored batch out (here: TRL's ``_generate_and_score_completions``:
                 tokenise, generate, decode, reward, advantages)
  step s         one optimizer update, from ``on_step_begin`` to ``on_step_end`` (callbacks)
  train s        step s - rollout s (loss forward/backward over the micro-batches, clip, AdamW)
and each span again in this process's CPU seconds (``time.process_time``), which other work on a
shared machine does not inflate.
With ``force_length`` the meter sets ``min_new_tokens = max_new_tokens`` on the generation config
it is handed, so both sides generate exactly the same number of tokens (EOS is masked until the
budget is spent, by transformers' ``MinNewTokensLengthLogitsProcessor``).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class StepTiming:
    """One optimizer update's clocks (seconds) and its generated tokens."""

    generate_s: float
    tokens: int
    rollout_s: float
    train_s: float
    step_s: float
    # the same spans in this process's CPU seconds (all threads): on a shared CPU machine these
    # do not grow when other work takes the cores, so their ratio is the steadier one there
    generate_cpu_s: float = 0.0
    rollout_cpu_s: float = 0.0
    train_cpu_s: float = 0.0
    step_cpu_s: float = 0.0


@dataclass(frozen=True)
class Workload:
    """What both sides run: the prompts of every step (``prompts_per_step`` x ``steps`` of them,
    in order), ``responses`` samples each, ``max_new`` tokens, one optimizer update per rollout
    over ``micro_batch``-sequence chunks, and the seed recipe's loss and optimizer values."""

    prompt_texts: Sequence[str]
    prompt_ids: Sequence[list[int]]  # what prompt_texts must tokenize to (checked)
    labels: Sequence[str]
    prompts_per_step: int
    responses: int
    max_new: int
    micro_batch: int
    steps: int
    force_length: bool
    device: str  # "cpu" or "cuda"
    temperature: float
    eps_low: float
    eps_high: float
    lr: float
    betas: tuple[float, float]
    weight_decay: float
    grad_clip: float
    seed: int

    @property
    def samples(self) -> int:
        return self.prompts_per_step * self.responses


def sync_device(device: str) -> None:
    """Wait for queued GPU work, so that host clocks around it measure it."""
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


class GenerateMeter:
    """Replaces ``model.generate`` (an instance attribute, so the class is untouched) with a
    timed call that records (seconds, response tokens) and, with ``force_length``, forbids EOS
    until the budget is spent."""

    def __init__(self, model: Any, device: str, force_length: bool) -> None:
        self.model, self.device, self.force_length = model, device, force_length
        self.original = model.generate
        self.calls: list[tuple[float, int, float]] = []  # (seconds, response tokens, CPU seconds)
        model.generate = self._generate

    def _generate(self, *args: Any, **kw: Any) -> Any:
        import torch

        cfg = kw.get("generation_config")
        if self.force_length:
            if cfg is None or cfg.max_new_tokens is None:
                raise ValueError("GenerateMeter: force_length needs a generation_config with max_new_tokens")
            cfg = copy.deepcopy(cfg)
            cfg.min_new_tokens = cfg.max_new_tokens
            kw["generation_config"] = cfg
        prompt_ids = kw["input_ids"] if "input_ids" in kw else args[0]
        sync_device(self.device)
        t0, c0 = time.perf_counter(), time.process_time()
        out = self.original(*args, **kw)
        sync_device(self.device)
        seconds, cpu_s = time.perf_counter() - t0, time.process_time() - c0
        seqs = out if isinstance(out, torch.Tensor) else out.sequences
        new = seqs[:, prompt_ids.shape[1] :]
        eos = cfg.eos_token_id if cfg is not None else self.model.generation_config.eos_token_id
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        self.calls.append((seconds, response_tokens(new, eos_ids), cpu_s))
        return out

    def restore(self) -> None:
        self.model.generate = self.original


class SamplerMeter:
    """The reference side's counterpart of :class:`GenerateMeter`: the backend samples with its own
    ``sampling.generate`` (no ``model.generate``), so that module function is replaced, in this
    process, by a timed call; ``force_length`` passes an end id no token has, so every response
    runs to the budget as TRL's do under ``min_new_tokens``."""

    def __init__(self, device: str, force_length: bool) -> None:
        from beam_hpc.backends.reference.model import sampling

        self.sampling, self.device, self.force_length = sampling, device, force_length
        self.original = sampling.generate
        self.calls: list[tuple[float, int, float]] = []  # (seconds, response tokens, CPU seconds)
        sampling.generate = self._generate

    def _generate(self, *args: Any, **kw: Any) -> list[list[int]]:
        if self.force_length:
            kw["eos_id"] = -1
        sync_device(self.device)
        t0, c0 = time.perf_counter(), time.process_time()
        out = self.original(*args, **kw)
        sync_device(self.device)
        self.calls.append((time.perf_counter() - t0, sum(len(r) for r in out), time.process_time() - c0))
        return out

    def restore(self) -> None:
        self.sampling.generate = self.original


def response_tokens(new: Any, eos_ids: list[int]) -> int:
    """Tokens of each row up to and including its first EOS (all of them when none), summed."""
    import torch

    width = new.shape[1]
    if not eos_ids or width == 0:
        return int(new.numel())
    is_eos = torch.isin(new, torch.tensor(eos_ids, device=new.device))
    first = torch.where(is_eos.any(dim=1), is_eos.int().argmax(dim=1) + 1, torch.full_like(is_eos[:, 0], width, dtype=torch.long))
    return int(first.sum())


def grpo_config(w: Workload, out_dir: Path) -> Any:
    """GRPOConfig as close to the reference's settings as TRL allows (reference_step.py's
    results list the differences that remain)."""
    from trl import GRPOConfig

    on_gpu = w.device.startswith("cuda")
    return GRPOConfig(
        output_dir=str(out_dir),
        per_device_train_batch_size=w.micro_batch,
        gradient_accumulation_steps=w.samples // w.micro_batch,  # generation batch = one optimizer update
        num_generations=w.responses,
        num_iterations=1,
        max_completion_length=w.max_new,
        temperature=w.temperature,
        top_p=1.0,
        top_k=0,
        use_vllm=False,
        loss_type="dapo",  # token-level mean over the whole update's tokens
        epsilon=w.eps_low,
        epsilon_high=w.eps_high,
        beta=0.0,
        scale_rewards="group",
        learning_rate=w.lr,
        adam_beta1=w.betas[0],
        adam_beta2=w.betas[1],
        weight_decay=w.weight_decay,
        max_grad_norm=w.grad_clip,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_steps=w.steps,
        shuffle_dataset=False,
        gradient_checkpointing=False,  # the reference keeps activations; TRL's default recomputes them
        bf16=on_gpu,  # GPU: bf16 autocast over fp32 weights (the reference trainer's setting); CPU: fp32
        use_cpu=not on_gpu,
        seed=w.seed,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        log_completions=False,
        dataloader_num_workers=0,
    )


def run_trl(
    model: Any,
    tokenizer: Any,
    w: Workload,
    reward_func: Callable[..., list[float]],
    out_dir: Path,
    on_step: Callable[[StepTiming], None] | None = None,
    keep_going: Callable[[float], bool] | None = None,
) -> list[StepTiming]:
    """Train ``model`` for ``w.steps`` GRPO updates with TRL and return each update's clocks.

    ``reward_func`` has TRL's signature (``completions``, ``completion_ids``, dataset columns such
    as ``label`` as keyword arguments). ``keep_going(last step's seconds)`` returning False stops
    training after that step (a time budget). Raises if TRL would tokenize a prompt differently from
    ``w.prompt_ids`` or if the meter missed a generation: the comparison would not be like for like.
    """
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    n_prompts = w.prompts_per_step * w.steps
    if len(w.prompt_texts) < n_prompts:
        raise ValueError(f"workload: {len(w.prompt_texts)} prompts, {n_prompts} needed ({w.steps} steps x {w.prompts_per_step})")
    for text, ids in zip(w.prompt_texts[:n_prompts], w.prompt_ids[:n_prompts], strict=False):
        got = tokenizer(text=[text])["input_ids"][0]
        if list(got) != list(ids):
            raise ValueError(f"TRL would tokenize a prompt to {list(got)[:8]}..., the reference uses {list(ids)[:8]}...")
    data = Dataset.from_dict({"prompt": list(w.prompt_texts[:n_prompts]), "label": list(w.labels[:n_prompts])})

    steps: list[StepTiming] = []
    rollouts: list[tuple[float, float]] = []  # (seconds, CPU seconds)

    class StepClock(TrainerCallback):
        t0 = c0 = 0.0

        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            sync_device(w.device)
            self.t0, self.c0 = time.perf_counter(), time.process_time()

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            sync_device(w.device)
            step_s, step_cpu = time.perf_counter() - self.t0, time.process_time() - self.c0
            if len(meter.calls) != len(steps) + 1 or len(rollouts) != len(steps) + 1:
                raise RuntimeError(f"TRL step {len(steps)}: expected one generation and one rollout per update, "
                                   f"saw {len(meter.calls)} and {len(rollouts)} so far")
            gen_s, tokens, gen_cpu = meter.calls[-1]
            roll_s, roll_cpu = rollouts[-1]
            st = StepTiming(gen_s, tokens, roll_s, step_s - roll_s, step_s, gen_cpu, roll_cpu, step_cpu - roll_cpu, step_cpu)
            steps.append(st)
            if on_step:
                on_step(st)
            if keep_going is not None and not keep_going(step_s):
                control.should_training_stop = True

    trainer = GRPOTrainer(model=model, reward_funcs=reward_func, args=grpo_config(w, out_dir), train_dataset=data,
                          processing_class=tokenizer, callbacks=[StepClock()])
    meter = GenerateMeter(trainer.model, w.device, w.force_length)
    scored = trainer._generate_and_score_completions

    def timed_rollout(inputs: Any) -> Any:
        sync_device(w.device)
        t0, c0 = time.perf_counter(), time.process_time()
        out = scored(inputs)
        sync_device(w.device)
        rollouts.append((time.perf_counter() - t0, time.process_time() - c0))
        return out

    trainer._generate_and_score_completions = timed_rollout
    try:
        trainer.train()
    finally:
        meter.restore()
    return steps


def seeded_bits(seed: int) -> Callable[..., list[float]]:
    """TRL reward function for a random model: 0/1 rewards from a generator seeded per call (the
    reference side seeds its random rewards per rollout the same way), so no text scoring enters
    the clocks."""
    calls = [0]

    def seeded_bits(completions: list[Any], **kw: Any) -> list[float]:
        import torch

        g = torch.Generator().manual_seed(seed + calls[0])
        calls[0] += 1
        return torch.randint(0, 2, (len(completions),), generator=g).float().tolist()

    return seeded_bits
