#!/usr/bin/env python3
"""Dedicated trainer and rollout GPUs, asynchronous, against in turn and colocated.

What one step is, here as in the reference backend: the rollout side samples ``responses``
answers to each of ``prompts`` prompts (the seed's 32 x 8) with up to ``--max-new`` tokens
(1,024), computes their behaviour log-probabilities, and the trainer makes one AdamW update with
the GRPO/DAPO loss (``algorithm.policy_loss``, token-level, Clip-Higher) on all of them, then the
new weights go to the rollout side. The model is a random-initialised Qwen2 of the chosen shape
(0.5B, 1.5B), so answers run to the full budget (the worst case for a step) and rewards are
random bits (scoring text is CPU work outside this question).

Modes (rows of the table):
  async      trainer on GPU 0, rollout on GPU 1, generation of rollout k+1 overlapping training on
             k (the reference driver's loop); weights over the chosen transport (default nccl)
  in-turn    the same two GPUs, ``--no-async-training``: generate, train, push, in turn
  colocated  one GPU, one process: generate, train, copy the weights on the GPU
  in-turn/1  the two roles as two Ray actors sharing GPU 0, weights through the object store
             (the reference backend's own deployment squeezed onto one GPU)
  async/1    the same pair on GPU 0, overlapping (only with --async-one-gpu)
Weight sync rows time one push of the bf16 weights, trainer to rollout, loaded into the model:
the object store (D2H copy, ``ray.put``, ``ray.get``, H2D copy), NCCL (GPU to GPU broadcast of
flat buckets, ``beam_hpc.backends.reference.rollouts.weight_sync``) and a same-GPU copy (the colocated
floor). GPU busy is NVML's utilisation (share of time a kernel ran), sampled every 50 ms and
averaged over the steady steps: a process's first full-length step pays one-off costs (about 2x
on the H200), so in-turn and colocated means leave it out, and async leaves out the iteration
that fills the pipeline; the table lists every step too. Each measurement is skipped, and
marked, when its estimated time would overrun ``--time-budget-s``.

It runs what the machine allows: two or more GPUs run every row; one GPU runs colocated, the
one-GPU pair and the object-store and same-GPU sync, and marks the two-GPU rows "not run: needs
2 GPUs"; ``--device cpu`` runs every mode on CPU processes with gloo in place of NCCL (a smoke
test of the same code paths, not a measurement).

Choices that differ from the CPU reference backend, and why:
  - The trainer keeps fp32 master weights and AdamW state on its GPU and computes in bf16
    (autocast), as Megatron does; the rollout model is bf16; pushes are bf16.
  - Behaviour log-probs and the loss run in micro-batches (``--micro-batch`` sequences, the
    loss weighted so the whole batch is one token-level mean): 256 x 1,024 x 152k fp32 logits
    would not fit at once.
  - ``--sampler device`` (the default) draws the Gumbel noise of the reference sampler on the
    device. The reference draws it on the CPU so that a trajectory is the same bits on any
    machine; at a 152k vocabulary and 256 rows that costs 1.5 s per decode step on the H200 host
    (the table's "Reference sampler" line measures it), 37-49x the whole generation otherwise.
    ``--sampler reference`` uses it unchanged.

Run through the device tool. Its machines have torch and transformers but no Ray or pydantic, so
prepare wheels here once (they travel with the working tree; ``/.whl/`` is in .git/info/exclude)::

    python benchmarks/two_gpu.py --prepare-wheels .whl
    # device call, carry [".whl"]; on nvidia-h200-x2 this runs the two-GPU rows (about 7 minutes):
    set -o pipefail; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \\
      --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 3; \\
    PYTHONUNBUFFERED=1 timeout 560 python3 benchmarks/two_gpu.py --shapes 0.5b,1.5b --modes pair \\
      --time-budget-s 480 --out-dir $OUT 2>&1 | tee $OUT/log.txt

On ``nvidia-h200`` (one GPU) the same command runs the one-GPU pair; add ``colocated`` to
``--modes`` for the colocated rows (results of 2026-12-02: benchmarks/results/). Smoke test on
CPU: ``python benchmarks/two_gpu.py --device cpu --tiny --out-dir /tmp/x``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script from a checkout that is not installed
    sys.path.insert(0, str(REPO))

SHAPES: dict[str, dict[str, int]] = {  # Qwen2.5-0.5B / -1.5B geometry (tied embeddings)
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
    "0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2),
    "1.5b": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2),
}
PAD_ID, EOS_ID, FIRST_TOKEN = 0, 1, 2  # prompts draw token ids from [FIRST_TOKEN, vocab)
SEED_RECIPE = REPO / "recipes" / "dedicated.yaml"  # the seed's main configuration
NOT_TWO = "not run: needs 2 GPUs"
PLACEMENT_LABEL = {"dedicated": "GPU 0 | GPU 1", "shared": "GPU 0 shared", "cpu": "cpu (two processes)"}
PAIR_START_S = 60.0  # budget below which a new pair of actors is not started
REFERENCE_NOISE: Any = None  # the reference sampler's own noise source, once swapped out
RAY_WHEELS = ("ray", "jsonschema", "jsonschema-specifications", "referencing", "rpds-py",
              "pydantic", "pydantic-core", "annotated-types", "typing-inspection", "typing-extensions")


# -- settings -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    """Everything a role needs, picklable to the actors. Optimisation values are the seed's."""

    shape: str
    prompts: int
    responses: int
    max_new: int
    prompt_len: int
    micro_batch: int
    sampler: str
    seed: int
    eps_low: float
    eps_high: float
    per_token: bool
    lr: float
    betas: tuple[float, float]
    weight_decay: float
    grad_clip: float
    temperature: float
    bucket_mb: int

    @property
    def samples(self) -> int:
        return self.prompts * self.responses


def settings_from(args: argparse.Namespace, shape: str) -> Settings:
    from beam_hpc.config.recipe import load_recipe

    r = load_recipe(SEED_RECIPE)
    t, o = r.training, r.training.optimizer
    return Settings(
        shape=shape,
        prompts=args.prompts or r.batch.prompts,
        responses=args.responses or r.batch.responses_per_prompt,
        max_new=args.max_new,
        prompt_len=args.prompt_len,
        micro_batch=args.micro_batch,
        sampler=args.sampler,
        seed=r.seed,
        eps_low=t.eps_clip,
        eps_high=t.eps_clip_high,
        per_token=t.per_token_loss,
        lr=o.lr,
        betas=(o.adam_beta1, o.adam_beta2),
        weight_decay=o.weight_decay,
        grad_clip=o.grad_clip,
        temperature=t.temperature,
        bucket_mb=args.bucket_mb,
    )


# -- the model and the two roles ---------------------------------------------------------------------


def build_model(s: Settings, device: str, dtype: Any) -> Any:
    """The random Qwen2 as the reference backend holds it (its ``causal_lm``), initialised in fp32
    from the run seed as transformers initialises one (normal, std 0.02; so both roles start
    equal), then cast."""
    import torch

    from beam_hpc.backends.reference.model.causal_lm import CausalLM, LMConfig

    cfg = LMConfig.from_dict({"model_type": "qwen2", **SHAPES[s.shape], "tie_word_embeddings": True})
    torch.manual_seed(s.seed)
    with torch.device(device):
        model = CausalLM(cfg)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                torch.nn.init.ones_(p)
            elif name.endswith(".bias"):
                torch.nn.init.zeros_(p)
            else:
                torch.nn.init.normal_(p, std=0.02)
    return model.to(dtype)


def param_bytes(model: Any) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def where_now() -> dict[str, Any]:
    """This actor's node IP, its GPU ids (NVML numbering) and its process id."""
    import ray

    return {"ip": ray.util.get_node_ip_address(), "gpus": [str(g) for g in ray.get_gpu_ids()], "pid": os.getpid()}


def use_device_noise() -> None:
    """Swap the reference sampler's noise source for :func:`device_noise_processor`, in this
    process only (see the module docstring); the original stays reachable for its timing row."""
    from beam_hpc.backends.reference.model import sampling

    global REFERENCE_NOISE
    if sampling.noise_source is not device_noise_source:
        REFERENCE_NOISE = sampling.noise_source
        sampling.noise_source = device_noise_source


def sync_device(device: str) -> None:
    """Wait for this process's queued GPU work (timings are host clocks around synchronised work)."""
    import torch

    if device.startswith("cuda"):
        torch.cuda.current_stream().synchronize()


def device_noise_source(seed: int) -> Any:
    """The reference sampler's Gumbel noise drawn on the logits' device, from a device generator
    seeded with the CPU source's seed (still a pure function of the rollout), so the host RNG does
    not set the pace of generation."""
    import torch

    generators: dict[Any, Any] = {}

    def draw(shape: tuple[int, ...], device: Any) -> Any:
        if device not in generators:
            generators[device] = torch.Generator(device=device).manual_seed(seed)
        return -torch.empty(shape, device=device).exponential_(generator=generators[device]).log()

    return draw


def make_prompts(s: Settings, vocab: int) -> list[list[int]]:
    """``prompts`` random prompts of about ``prompt_len`` tokens (+-1/8), seeded."""
    import torch

    g = torch.Generator().manual_seed(s.seed)
    lo, hi = max(1, s.prompt_len * 7 // 8), s.prompt_len * 9 // 8 + 1
    lengths = torch.randint(lo, hi, (s.prompts,), generator=g).tolist()
    return [torch.randint(FIRST_TOKEN, vocab, (n,), generator=g).tolist() for n in lengths]


class RolloutRole:
    """The rollout side (as the backend's RolloutWorker): sample, then behaviour log-probs."""

    def __init__(self, s: Settings, device: str) -> None:
        import torch

        self.s, self.device = s, device
        if device == "cpu":
            torch.set_num_threads(1)  # two roles share the smoke run's few cores
        if s.sampler == "device":
            use_device_noise()
        self.model = build_model(s, device, torch.bfloat16 if device.startswith("cuda") else torch.float32).eval()
        self.prompts = make_prompts(s, SHAPES[s.shape]["vocab_size"])
        self.receivers: dict[str, Any] = {}

    def generate(self, rollout_id: int, max_new: int | None = None) -> tuple[dict[str, float], dict[str, Any]]:
        """Returns (timings, the rollout for the trainer)."""
        import torch

        from beam_hpc.backends.reference.model.policy import make_batch, response_logits, token_logprobs
        from beam_hpc.backends.reference.model.sampling import generate

        s = self.s
        flat = [p for p in self.prompts for _ in range(s.responses)]
        t0 = time.perf_counter()
        responses = generate(self.model, flat, seed_parts=(s.seed, "train", rollout_id, 0), max_new_tokens=max_new or s.max_new,
                             temperature=s.temperature, top_p=1.0, eos_id=EOS_ID, pad_id=PAD_ID, device=self.device)
        t1 = time.perf_counter()
        width = max(1, max(len(r) for r in responses))
        old = torch.zeros((len(flat), width), dtype=torch.float32)
        with torch.no_grad():
            for lo in range(0, len(flat), s.micro_batch):
                batch = make_batch(flat[lo : lo + s.micro_batch], responses[lo : lo + s.micro_batch], PAD_ID, self.device)
                lp = token_logprobs(response_logits(self.model, batch), batch)
                old[lo : lo + lp.shape[0], : lp.shape[1]] = lp.cpu()
        sync_device(self.device)
        t2 = time.perf_counter()
        rewards = torch.randint(0, 2, (len(flat),), generator=torch.Generator().manual_seed(rollout_id)).float()
        tokens = sum(len(r) for r in responses)
        timing = {"generate_s": t1 - t0, "logp_s": t2 - t1, "tokens": float(tokens)}
        return timing, {"prompt_ids": flat, "response_ids": responses, "old_logp": old, "rewards": rewards}

    def load(self, state: dict[str, Any]) -> None:
        from beam_hpc.backends.reference.model.policy import load_trainable_state

        load_trainable_state(self.model, state)


class TrainerRole:
    """The training side: fp32 master weights, AdamW on the same device, bf16 autocast on GPU."""

    def __init__(self, s: Settings, device: str) -> None:
        import torch

        self.s, self.device = s, device
        if device == "cpu":
            torch.set_num_threads(1)
        self.model = build_model(s, device, torch.float32).train()
        params = [p for p in self.model.parameters() if p.requires_grad]
        fused = {"fused": True} if device.startswith("cuda") else {}
        self.optimizer = torch.optim.AdamW(params, lr=s.lr, betas=s.betas, weight_decay=s.weight_decay, **fused)
        self.senders: dict[str, Any] = {}

    def train(self, roll: dict[str, Any]) -> dict[str, float]:
        """One optimizer update on the whole rollout, micro-batched; the per-token loss over the
        batch is the weighted sum of the micro-batches' (each weighted by its share of tokens)."""
        import contextlib

        import torch

        from beam_hpc.backends.reference.loop import algorithm
        from beam_hpc.backends.reference.model.policy import make_batch, response_logits, token_logprobs

        s = self.s
        t0 = time.perf_counter()
        adv = algorithm.group_advantages(roll["rewards"], s.responses)
        n = len(roll["response_ids"])
        lengths = torch.tensor([max(1, len(r)) for r in roll["response_ids"]], dtype=torch.float32)
        autocast = torch.autocast("cuda", dtype=torch.bfloat16) if self.device.startswith("cuda") else contextlib.nullcontext()
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = 0.0
        for lo in range(0, n, s.micro_batch):
            hi = min(n, lo + s.micro_batch)
            batch = make_batch(roll["prompt_ids"][lo:hi], roll["response_ids"][lo:hi], PAD_ID, self.device)
            width = batch.response_mask.shape[1]
            with autocast:
                logp = token_logprobs(response_logits(self.model, batch), batch)
            loss, stats = algorithm.policy_loss(
                logp, roll["old_logp"][lo:hi, :width].to(self.device), adv[lo:hi].to(self.device), batch.response_mask,
                eps_low=s.eps_low, eps_high=s.eps_high, per_token=s.per_token,
            )
            share = lengths[lo:hi].sum() / lengths.sum() if s.per_token else torch.tensor((hi - lo) / n)
            (loss * float(share)).backward()
            loss_sum += stats.loss * float(share)
        params = [p for p in self.model.parameters() if p.requires_grad]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, s.grad_clip)
        self.optimizer.step()
        sync_device(self.device)
        return {"train_s": time.perf_counter() - t0, "loss": loss_sum, "grad_norm": float(grad_norm)}

    def weights(self) -> dict[str, Any]:
        """The trainable tensors as they are, on the trainer's device (no copy)."""
        return {n: p.detach() for n, p in self.model.named_parameters() if p.requires_grad}


# -- Ray actors: the same roles, with the weight-sync ends -------------------------------------------


class RolloutActor(RolloutRole):
    def where(self) -> dict[str, Any]:
        return where_now()

    def nbytes(self) -> int:
        """Bytes of one push as it lands (the rollout model's dtype, bf16 on GPU)."""
        return param_bytes(self.model)

    def connect(self, kind: str, rendezvous: Any = None) -> None:
        from beam_hpc.backends.reference.rollouts.weight_sync import make_receiver

        rx = make_receiver(kind, rendezvous=rendezvous, rank=1, device=self.device)
        if kind == "nccl":
            rx.connect()
        self.receivers[kind] = rx

    def recv(self, kind: str, delivery: Any) -> float:
        """Receive a push and load it into the model; seconds, from the first byte asked for to the
        weights in place."""
        t0 = time.perf_counter()
        state, _version = self.receivers[kind].recv(delivery)
        self.load(state)
        sync_device(self.device)
        return time.perf_counter() - t0


class TrainerActor(TrainerRole):
    def where(self) -> dict[str, Any]:
        return where_now()

    def free_port(self) -> tuple[str, int]:
        """This node's IP and a port free on it now (the backend takes one of the job's port set
        instead: weight_sync.weight_sync_port)."""
        import socket

        import ray

        ip = ray.util.get_node_ip_address()
        with socket.socket() as sock:
            sock.bind((ip, 0))
            return ip, sock.getsockname()[1]

    def connect(self, kind: str, rendezvous: Any = None) -> None:
        import torch

        from beam_hpc.backends.reference.rollouts.weight_sync import make_sender

        dtype = torch.bfloat16 if self.device.startswith("cuda") else None
        tx = make_sender(kind, rendezvous=rendezvous, device=self.device, dtype=dtype, bucket_bytes=self.s.bucket_mb * 2**20)
        if kind == "nccl":
            tx.connect()
        self.senders[kind] = tx

    def send(self, kind: str, version: int) -> tuple[Any, float]:
        """Start a push; returns (the delivery for the receivers, seconds this side spent)."""
        t0 = time.perf_counter()
        delivery = self.senders[kind].send(self.weights(), version)
        sync_device(self.device)  # the packing and host copies; a pending broadcast runs on its own stream
        return delivery, time.perf_counter() - t0

    def flush(self, kind: str) -> None:
        self.senders[kind].wait()


@dataclass
class Pair:
    """The trainer and rollout actors of one placement: ``dedicated`` (a GPU each), ``shared``
    (both on GPU 0) or ``cpu``."""

    placement: str
    trainer: Any
    rollout: Any
    where: dict[str, Any]

    @classmethod
    def start(cls, s: Settings, placement: str, transports: list[str], timeout_s: float = 600.0) -> Pair:
        import ray

        from beam_hpc.backends.reference.rollouts.weight_sync import Rendezvous, backend_for
        from beam_hpc.plan.ray_labels import GROUP_RESOURCE_PREFIX

        gpus = {"dedicated": 1.0, "shared": 0.5, "cpu": 0.0}[placement]
        device = "cpu" if placement == "cpu" else "cuda"
        t = ray.remote(TrainerActor).options(num_gpus=gpus, num_cpus=0, resources={f"{GROUP_RESOURCE_PREFIX}trainer": 1})
        r = ray.remote(RolloutActor).options(num_gpus=gpus, num_cpus=0, resources={f"{GROUP_RESOURCE_PREFIX}rollout": 1})
        pair = cls(placement, t.remote(s, device), r.remote(s, device), {})
        try:
            where = ray.get([pair.trainer.where.remote(), pair.rollout.where.remote()], timeout=timeout_s)
            pair.where = dict(zip(("trainer", "rollout"), where, strict=False))
            for kind in transports:
                rv = None
                if kind == "nccl":
                    ip, port = ray.get(pair.trainer.free_port.remote(), timeout=timeout_s)
                    rv = Rendezvous(ip, port, world_size=2, backend=backend_for(device), timeout_s=600)
                ray.get([pair.trainer.connect.remote(kind, rv), pair.rollout.connect.remote(kind, rv)], timeout=timeout_s)
        except BaseException:
            pair.stop()
            raise
        return pair

    def generate(self, k: int, max_new: int | None = None) -> tuple[Any, Any]:
        return self.rollout.generate.options(num_returns=2).remote(k, max_new)

    def push(self, kind: str, version: int) -> tuple[Any, Any]:
        """Queue a push (send on the trainer, recv on the rollout, each behind its earlier calls);
        returns the refs of (send seconds, recv seconds)."""
        delivery, send_s = self.trainer.send.options(num_returns=2).remote(kind, version)
        return send_s, self.rollout.recv.remote(kind, delivery)

    def stop(self) -> None:
        import ray

        for a in (self.trainer, self.rollout):
            ray.kill(a)


def transport_label(kind: str, pair: Pair) -> str:
    return f"{kind} (gloo)" if kind == "nccl" and pair.placement == "cpu" else kind


# -- measuring --------------------------------------------------------------------------------------


class BusySampler:
    """NVML utilisation of every GPU (share of the last sample period in which a kernel ran),
    polled in a thread; ``busy(t0, t1)`` is its mean per GPU over a window of perf_counter time."""

    def __init__(self, period_s: float = 0.05) -> None:
        self.period_s = period_s
        self.samples: list[tuple[float, list[int]]] = []
        self.handles: list[Any] = []
        self._stop = threading.Event()
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nvml = pynvml
            self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        except Exception:  # no NVML (CPU machine): busy is reported as n/a
            self.handles = []
        self._thread = threading.Thread(target=self._poll, daemon=True)
        if self.handles:
            self._thread.start()

    def _poll(self) -> None:
        while not self._stop.is_set():
            now = time.perf_counter()
            self.samples.append((now, [self.nvml.nvmlDeviceGetUtilizationRates(h).gpu for h in self.handles]))
            time.sleep(self.period_s)

    def busy(self, windows: list[tuple[float, float]], gpu: int) -> float | None:
        vals = [u[gpu] for t, u in list(self.samples) if any(a <= t <= b for a, b in windows)]
        return statistics.fmean(vals) / 100.0 if vals and gpu < len(self.handles) else None

    def close(self) -> None:
        self._stop.set()


@dataclass
class Row:
    """One line of the modes table (``note`` says why a row was not run)."""

    mode: str
    placement: str
    shape: str
    steps: list[dict[str, float]] = field(default_factory=list)
    busy: dict[str, float | None] = field(default_factory=dict)
    note: str = ""
    skip_first: bool = True  # the first full-length step of a process pays one-off costs (async: iteration 0 is not recorded)

    def steady(self) -> list[dict[str, float]]:
        return self.steps[1:] if self.skip_first and len(self.steps) > 1 else self.steps

    def mean(self, key: str) -> float | None:
        vals = [st[key] for st in self.steady() if key in st]
        return statistics.fmean(vals) if vals else None


@dataclass
class SyncRow:
    transport: str
    placement: str
    shape: str
    nbytes: int = 0
    times_s: list[float] = field(default_factory=list)
    note: str = ""

    @property
    def median_s(self) -> float | None:
        return statistics.median(self.times_s) if self.times_s else None


class Bench:
    """Runs the planned measurements in order, each only if the time budget still allows it."""

    def __init__(self, args: argparse.Namespace, gpus: int) -> None:
        self.args = args
        self.gpus = gpus
        self.t_start = time.perf_counter()
        self.rows: list[Row] = []
        self.sync_rows: list[SyncRow] = []
        self.extra: list[str] = []
        self.busy = BusySampler()
        self.gpu_ids: dict[str, int] = {}  # role -> NVML index in the current placement
        self.step_cost: dict[str, float] = {}  # shape -> seconds of one in-turn step, once measured

    # -- budget ---------------------------------------------------------------------------------

    def say(self, msg: str) -> None:
        """Progress with the elapsed time, so a log shows where the time went."""
        print(f"[{time.perf_counter() - self.t_start:7.1f}s] {msg}", flush=True)

    def get(self, refs: Any) -> Any:
        """ray.get that cannot outlive the budget by much: a hung actor becomes a failed row."""
        import ray

        return ray.get(refs, timeout=max(60.0, self.left_s() + 120.0))

    def left_s(self) -> float:
        return self.args.time_budget_s - (time.perf_counter() - self.t_start)

    def affordable(self, shape: str, steps: float) -> bool:
        """False when ``steps`` more steps of ``shape`` would overrun the budget (estimated from
        the shape's first measured step, or from 0.5B's scaled by parameter count)."""
        cost = self.step_cost.get(shape)
        if cost is None and "0.5b" in self.step_cost and shape == "1.5b":
            cost = self.step_cost["0.5b"] * 2.0
        return cost is None or steps * cost < self.left_s()

    def guarded(self, fn: Callable[[], None], failed: Row) -> None:
        """Run one measurement; a failure becomes a row that says so, and the rest still runs."""
        try:
            fn()
        except Exception as err:  # the table must say what broke, not lose the rows that worked
            import traceback

            traceback.print_exc()
            first = str(err).splitlines()[0][:160] if str(err) else ""
            failed.note = f"failed: {type(err).__name__}: {first}"
            self.rows.append(failed)
        self.report()

    def report(self) -> Path:
        """Write the table (markdown) and the raw numbers (json), after every measurement, so a
        run cut short by its time limit still leaves what it measured."""
        import torch
        import transformers

        try:
            import ray

            ray_v = ray.__version__
        except ImportError:
            ray_v = "not installed"
        a = self.args
        date = dt.date.today().isoformat()
        machine = a.machine or machine_name(a.device)
        s = settings_from(a, a.shapes.split(",")[0])
        meta = {
            "date": date, "machine": machine, "command": " ".join(["python", "benchmarks/two_gpu.py", *sys.argv[1:]]),
            "gpus": f"{self.gpus} x {torch.cuda.get_device_name(0)}" if self.gpus else "CPU only",
            "torch": torch.__version__, "transformers": transformers.__version__, "ray": ray_v,
            "nvls": os.environ.get("NCCL_NVLS_ENABLE", "unset"),
            "batch": f"{s.prompts} prompts x {s.responses} responses, ~{s.prompt_len}-token prompts, {s.max_new}-token budget, "
                     f"micro-batch {s.micro_batch}, sampler {s.sampler}",
            "steps": a.steps, "sync_reps": a.sync_reps,
        }
        from beam_hpc.files import write_atomic

        out = Path(a.out_dir) / f"two_gpu-{date}-{machine}.md"
        write_atomic(out, render(self, meta))
        raw = {"meta": meta, "rows": [asdict(r) for r in self.rows], "sync": [asdict(w) for w in self.sync_rows], "notes": self.extra}
        write_atomic(out.with_suffix(".json"), json.dumps(raw, indent=1, default=str))
        return out

    # -- modes ----------------------------------------------------------------------------------

    def colocated(self, s: Settings, device: str) -> None:
        """One process, one GPU: generate, train, copy the weights on the GPU. The copy alone is
        timed first (a sync row even when the steps do not fit the budget)."""
        import torch

        if self.left_s() < PAIR_START_S:
            self.rows.append(Row("colocated", f"{device} (one process)", s.shape, note="not run: time budget"))
            return
        self.say(f"{s.shape}: colocated on {device}")
        trainer, rollout = TrainerRole(s, device), RolloutRole(s, device)
        copy = SyncRow("same-device copy", device, s.shape, param_bytes(rollout.model))
        for i in range(1 + self.args.sync_reps):
            t1 = time.perf_counter()
            rollout.load(trainer.weights())
            sync_device(device)
            if i:
                copy.times_s.append(time.perf_counter() - t1)
        self.sync_rows.append(copy)
        if device.startswith("cuda") and not self.extra:
            self._reference_noise_cost(s, device)
        self._colocated_steps(s, device, trainer, rollout)
        del trainer, rollout
        if device.startswith("cuda"):
            torch.cuda.empty_cache()

    def _colocated_steps(self, s: Settings, device: str, trainer: TrainerRole, rollout: RolloutRole) -> Row:
        row = self.new_row("colocated", f"{device} (one process)", s.shape)
        if not self.affordable(s.shape, self.args.steps + 0.3):
            row.note = "not run: time budget"
            return row
        self._warm(lambda k, n: trainer.train(rollout.generate(k, n)[1]))
        self.say("warm-up step done")
        for k in range(self.args.steps):
            t0 = time.perf_counter()
            timing, roll = rollout.generate(k)
            tm = trainer.train(roll)
            t1 = time.perf_counter()
            rollout.load(trainer.weights())
            sync_device(device)
            t2 = time.perf_counter()
            row.steps.append({"step_s": t2 - t0, "gen_s": timing["generate_s"] + timing["logp_s"], "train_s": tm["train_s"],
                              "sync_s": t2 - t1, "t0": t0, "t1": t2})
            self.step_cost[s.shape] = t2 - t0
            row.busy = {"trainer": self._busy(row, 0), "rollout": self._busy(row, 0)}
            self.report()
        self.say(f"colocated: {row.steps}")
        return row

    def _reference_noise_cost(self, s: Settings, device: str) -> None:
        """Seconds per decode step of the reference sampler's CPU noise on [samples, vocab] logits."""
        import torch

        from beam_hpc.backends.reference.model import sampling

        draw = (REFERENCE_NOISE or sampling.noise_source)(0)
        scores = torch.randn(s.samples, SHAPES[s.shape]["vocab_size"], device=device)
        times = []
        for i in range(4):
            sync_device(device)
            t0 = time.perf_counter()
            sampling._sample(scores, draw, s.temperature, 1.0)
            sync_device(device)
            if i:
                times.append(time.perf_counter() - t0)
        per = statistics.median(times)
        self.extra.append(
            f"Reference sampler (Gumbel noise drawn on the CPU), {s.samples} x {SHAPES[s.shape]['vocab_size']} logits: "
            f"{per * 1e3:.0f} ms per decode step, {per * s.max_new:.0f} s per {s.max_new}-token rollout "
            f"(the device sampler draws the same noise on the GPU)."
        )

    def pair_modes(self, s: Settings, placement: str, transport: str) -> None:
        """Sync rows, then in turn, then async, on one pair of actors (async on a shared GPU
        only with --async-one-gpu)."""
        label = PLACEMENT_LABEL[placement]
        suffix = "/1" if placement == "shared" else ""
        if self.left_s() < PAIR_START_S:
            self.rows.append(Row(f"in-turn{suffix}", label, s.shape, note="not run: time budget"))
            return
        transports = ["object_store"] + (["nccl"] if placement in ("dedicated", "cpu") else [])
        self.say(f"{s.shape}: starting the trainer and rollout actors ({placement})")
        pair = Pair.start(s, placement, transports)
        try:
            self._record_gpus(pair)
            self.say(f"actors up: {pair.where}")
            for kind in transports if self.args.sync_reps else ():
                self._time_sync(pair, s, kind)
                self.say(f"sync {kind}: {self.sync_rows[-1].times_s}")
            self.report()
            self._in_turn(pair, s, transport, f"in-turn{suffix}", label)
            self.say(f"in-turn: {self.rows[-1].steps or self.rows[-1].note}")
            self.report()
            if placement != "shared" or self.args.async_one_gpu:
                self._async(pair, s, transport, f"async{suffix}", label)
                self.say(f"async: {self.rows[-1].steps or self.rows[-1].note}")
        finally:
            pair.stop()

    def _record_gpus(self, pair: Pair) -> None:
        self.gpu_ids = {}
        for role, w in pair.where.items():
            if w["gpus"]:
                self.gpu_ids[role] = int(w["gpus"][0]) if w["gpus"][0].isdigit() else 0

    def _time_sync(self, pair: Pair, s: Settings, kind: str) -> None:
        row = SyncRow(transport_label(kind, pair), pair.placement, s.shape, self.get(pair.rollout.nbytes.remote()))
        for v in range(1 + self.args.sync_reps):
            t0 = time.perf_counter()
            self.get(list(pair.push(kind, v)))
            if v:  # the first push allocates buckets and connections
                row.times_s.append(time.perf_counter() - t0)
        self.sync_rows.append(row)

    def _in_turn(self, pair: Pair, s: Settings, kind: str, mode: str, label: str) -> Row:
        row = self.new_row(mode, label, s.shape, note=f"weights: {transport_label(kind, pair)}")
        if not self.affordable(s.shape, self.args.steps + 0.3):
            row.note = "not run: time budget"
            return row
        self._warm(lambda k, n: self.get(pair.trainer.train.remote(pair.generate(k, n)[1])))
        self.say("warm-up step done")
        for k in range(self.args.steps):
            t0 = time.perf_counter()
            timing_ref, roll_ref = pair.generate(k)
            tm = self.get(pair.trainer.train.remote(roll_ref))
            send_s, recv_s = self.get(list(pair.push(kind, k + 1)))
            t1 = time.perf_counter()
            timing = self.get(timing_ref)
            row.steps.append({"step_s": t1 - t0, "gen_s": timing["generate_s"] + timing["logp_s"], "train_s": tm["train_s"],
                              "sync_s": send_s + recv_s, "t0": t0, "t1": t1})
            self.step_cost[s.shape] = t1 - t0
            row.busy = {r: self._busy(row, self.gpu_ids.get(r, 0)) for r in ("trainer", "rollout")}
            self.report()
        return row

    def _async(self, pair: Pair, s: Settings, kind: str, mode: str, label: str) -> Row:
        """The reference driver's async loop: take rollout k, launch k+1 with the rollout's
        current weights, train on k, push W_{k+1} (queued behind k+1 on the rollout). Iteration 0
        fills the pipeline and is not counted."""
        row = self.new_row(mode, label, s.shape, skip_first=False)
        if not self.affordable(s.shape, self.args.steps + 2):
            row.note = "not run: time budget"
            return row
        pending = pair.generate(0)
        pushes = []
        for k in range(self.args.steps + 1):
            t0 = time.perf_counter()
            timing = self.get(pending[0])
            roll_ref = pending[1]
            pending = pair.generate(k + 1)
            tm = self.get(pair.trainer.train.remote(roll_ref))
            pushes.append(pair.push(kind, k + 1))
            t1 = time.perf_counter()
            if k:
                row.steps.append({"step_s": t1 - t0, "gen_s": timing["generate_s"] + timing["logp_s"],
                                  "train_s": tm["train_s"], "t0": t0, "t1": t1})
        self.get(pending[0])
        for i, (send_s, recv_s) in enumerate(pushes):
            a, b = self.get([send_s, recv_s])
            if i:
                row.steps[i - 1]["sync_s"] = a + b
        row.busy = {r: self._busy(row, self.gpu_ids.get(r, 0)) for r in ("trainer", "rollout")}
        row.note = f"weights: {transport_label(kind, pair)}; policy lag 1"
        return row

    def new_row(self, mode: str, placement: str, shape: str, **kw: Any) -> Row:
        """A row in the table from the start, so that a run cut short shows the steps it made."""
        row = Row(mode, placement, shape, **kw)
        self.rows.append(row)
        return row

    def _warm(self, step: Callable[[int, int], Any]) -> None:
        """One short step (kernels, allocator, autotuning) before anything is timed."""
        step(10_000, min(16, self.args.max_new))

    def _busy(self, row: Row, gpu: int) -> float | None:
        return self.busy.busy([(st["t0"], st["t1"]) for st in row.steady()], gpu)


# -- the report -------------------------------------------------------------------------------------


def _f(x: float | None, fmt: str = "{:.2f}") -> str:
    return "—" if x is None else fmt.format(x)


def _every(r: Row) -> str:
    return ", ".join(f"{st['step_s']:.3g}" for st in r.steps) or "—"


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.0f}%"


def render(bench: Bench, meta: dict[str, Any]) -> str:
    lines = [
        f"# Two GPUs: async vs in turn vs colocated ({meta['date']}, {meta['machine']})",
        "",
        f"Command: `{meta['command']}`  ",
        f"Machine: {meta['gpus']}; torch {meta['torch']}, transformers {meta['transformers']}, ray {meta['ray']}; "
        f"NCCL_NVLS_ENABLE={meta['nvls']}  ",
        f"Batch: {meta['batch']}; {meta['steps']} measured steps per mode after one short warm-up step. "
        "Step, generate, train, sync and busy are means over the steady steps: in turn and colocated, every measured "
        "step but the first (a process's first full-length step pays one-off costs; 'every step s' lists them all); "
        "async, every iteration after the one that fills the pipeline.",
        "",
        "| mode | placement | model | step s | generate+logp s | train s | sync s | trainer GPU busy | rollout GPU busy | every step s | note |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    for r in bench.rows:
        lines.append(
            f"| {r.mode} | {r.placement} | {r.shape} | {_f(r.mean('step_s'))} | {_f(r.mean('gen_s'))} | {_f(r.mean('train_s'))} | "
            f"{_f(r.mean('sync_s'), '{:.3f}')} | {_pct(r.busy.get('trainer')) if r.steps else '—'} | "
            f"{_pct(r.busy.get('rollout')) if r.steps else '—'} | {_every(r)} | {r.note} |"
        )
    lines += ["", "Weight sync: one push of the weights (bf16 on GPU), trainer to rollout, loaded into the rollout model "
              f"(median of --sync-reps={meta['sync_reps']} pushes after one untimed push).", "",
              "| transport | placement | model | MB | ms | GB/s | share of the in-turn step | note |",
              "| --- | --- | --- | ---: | ---: | ---: | ---: | --- |"]
    for w in bench.sync_rows:
        step = next((r.mean("step_s") for r in bench.rows if r.shape == w.shape and r.mode.startswith("in-turn") and r.steps), None)
        med = w.median_s
        gbs = w.nbytes / med / 1e9 if med else None
        share = med / step if med and step else None
        lines.append(f"| {w.transport} | {w.placement} | {w.shape} | {_f(w.nbytes / 1e6 if w.nbytes else None, '{:.1f}')} | "
                     f"{_f(med * 1e3 if med else None, '{:.1f}')} | {_f(gbs, '{:.2f}')} | {_pct(share) if share else '—'} | {w.note} |")
    lines += ["", "Targets: async step <= 0.6 x in-turn step on the same two GPUs; weight sync < 10% of the step.", ""]
    for shape in dict.fromkeys(r.shape for r in bench.rows):
        a = next((r for r in bench.rows if r.shape == shape and r.mode == "async" and r.steps), None)
        b = next((r for r in bench.rows if r.shape == shape and r.mode == "in-turn" and r.steps), None)
        if a and b:
            ratio = (a.mean("step_s") or 0) / (b.mean("step_s") or 1)
            lines.append(f"- {shape}: async / in-turn = {ratio:.2f} ({'met' if ratio <= 0.6 else 'not met'}).")
        else:
            lines.append(f"- {shape}: async / in-turn on two GPUs: not measured ({NOT_TWO.removeprefix('not run: ')}).")
    lines += [f"- {x}" for x in bench.extra]
    return "\n".join(lines) + "\n"


def machine_name(device: str) -> str:
    import torch

    if device == "cpu" or not torch.cuda.is_available():
        return f"cpu-{platform.node() or 'host'}"
    name = torch.cuda.get_device_name(0).lower().replace(" ", "-")
    n = torch.cuda.device_count()
    return name if n == 1 else f"{name}-x{n}"


# -- wheels for the device machine ------------------------------------------------------------------


def prepare_wheels(dest: Path) -> list[Path]:
    """Download cp312 manylinux wheels of Ray and pydantic (and what they need that the device
    image lacks) at this environment's versions, dropping Ray's Java jar (31 MB, unused by Python)
    so the set fits the device tool's 64 MiB working-tree limit."""
    import subprocess
    import zipfile
    from importlib.metadata import version

    dest.mkdir(parents=True, exist_ok=True)
    plats = [f"--platform={p}" for p in ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
                                          "manylinux2014_x86_64", "manylinux1_x86_64")]
    pins = [f"{name}=={version(name)}" for name in RAY_WHEELS]
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version=3.12",
                    "--implementation=cp", *plats, "-d", str(dest), *pins], check=True)
    for whl in dest.glob("ray-*.whl"):
        slim = whl.with_suffix(".slim")
        with zipfile.ZipFile(whl) as src, zipfile.ZipFile(slim, "w", zipfile.ZIP_DEFLATED) as out:
            for info in src.infolist():
                if info.filename.startswith("ray/jars/"):
                    continue
                data = src.read(info)
                if info.filename.endswith(".dist-info/RECORD"):
                    data = b"".join(ln for ln in data.splitlines(keepends=True) if not ln.startswith(b"ray/jars/"))
                out.writestr(info, data)
        os.replace(slim, whl)
    return sorted(dest.glob("*.whl"))


# -- main -------------------------------------------------------------------------------------------


def start_ray(args: argparse.Namespace, gpus: int) -> None:
    import ray

    from beam_hpc.plan.ray_labels import GROUP_RESOURCE_PREFIX

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a private cluster, or the caller's
    if args.ray_address:
        ray.init(address=args.ray_address, log_to_driver=True)
        return
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    ray.init(num_cpus=max(2, os.cpu_count() or 2), num_gpus=gpus, include_dashboard=False, log_to_driver=True,
             resources={f"{GROUP_RESOURCE_PREFIX}trainer": 1000, f"{GROUP_RESOURCE_PREFIX}rollout": 1000},
             object_store_memory=int(args.object_store_gb * 1e9))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="0.5b", help="comma list of model shapes: tiny, 0.5b, 1.5b (default 0.5b)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tiny", action="store_true", help="smoke config: tiny model, 4 x 2 samples, 8 new tokens, 2 steps")
    p.add_argument("--prompts", type=int, default=0, help="prompts per rollout (default: the seed recipe's, 32)")
    p.add_argument("--responses", type=int, default=0, help="responses per prompt (default: the seed recipe's, 8)")
    p.add_argument("--max-new", type=int, default=1024, help="response budget in tokens (default 1024)")
    p.add_argument("--prompt-len", type=int, default=128, help="mean prompt length in tokens (default 128)")
    p.add_argument("--micro-batch", type=int, default=8, help="sequences per forward/backward chunk (default 8)")
    p.add_argument("--steps", type=int, default=2, help="measured steps per mode (default 2)")
    p.add_argument("--sync-reps", type=int, default=3, help="timed pushes per transport (default 3)")
    p.add_argument("--transport", choices=("nccl", "object_store"), default="nccl", help="two-GPU modes' weight transport")
    p.add_argument("--sampler", choices=("device", "reference"), default="device", help="Gumbel noise source (default: device)")
    p.add_argument("--bucket-mb", type=int, default=256, help="NCCL bucket size in MiB (default 256)")
    p.add_argument("--modes", default="colocated,pair", help="what to run: colocated, pair (default both)")
    p.add_argument("--async-one-gpu", action="store_true", help="with one GPU, also run async with both roles on it")
    p.add_argument("--time-budget-s", type=float, default=480.0, help="skip what would not finish by then (default 480)")
    p.add_argument("--object-store-gb", type=float, default=8.0)
    p.add_argument("--ray-address", default="", help="join this Ray cluster instead of starting a private one")
    p.add_argument("--machine", default="", help="name for the results file (default: from the GPU)")
    p.add_argument("--out-dir", default=str(REPO / "benchmarks" / "results"))
    p.add_argument("--prepare-wheels", metavar="DIR", help="only download the device machine's wheels into DIR, then exit")
    args = p.parse_args(argv)
    if args.tiny:
        args.shapes, args.prompts, args.responses, args.max_new, args.prompt_len = "tiny", 4, 2, 8, 8
        args.micro_batch, args.steps, args.sync_reps, args.object_store_gb = 4, 2, 2, 0.2
    bad = [x for x in args.shapes.split(",") if x not in SHAPES]
    if bad:
        p.error(f"--shapes: unknown {bad}; choose from {', '.join(SHAPES)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.prepare_wheels:
        for w in prepare_wheels(Path(args.prepare_wheels)):
            print(w)
        return 0
    import torch

    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    if args.device == "cuda" and gpus == 0:
        raise SystemExit("--device cuda: no GPU is visible; use --device cpu for the smoke run")
    if args.device == "cpu":
        torch.set_num_threads(1)
    modes = set(args.modes.split(","))
    bench = Bench(args, gpus)
    try:
        import ray
    except ImportError:
        ray = None  # type: ignore[assignment]
    if "pair" in modes and ray is not None:
        start_ray(args, gpus)
        bench.say("ray up")
    device = "cpu" if args.device == "cpu" else "cuda:0"
    for shape in args.shapes.split(","):
        s = settings_from(args, shape)
        print(f"== {shape}: {s.prompts} x {s.responses} samples, {s.max_new} new tokens, {gpus} GPU(s)", flush=True)
        if "colocated" in modes:
            bench.guarded(lambda s=s: bench.colocated(s, device), Row("colocated", device, shape))
        if "pair" in modes:
            if ray is None:
                bench.rows.append(Row("in-turn/1", PLACEMENT_LABEL["shared"], shape, note="not run: Ray not installed"))
            elif gpus == 1:
                bench.guarded(lambda s=s: bench.pair_modes(s, "shared", "object_store"), Row("(pair)", PLACEMENT_LABEL["shared"], shape))
                bench.rows += [Row(m, PLACEMENT_LABEL["dedicated"], shape, note=NOT_TWO) for m in ("in-turn", "async")]
                bench.sync_rows.append(SyncRow("nccl", "dedicated", shape, note=NOT_TWO))
            else:
                placement = "cpu" if gpus == 0 else "dedicated"
                bench.guarded(lambda s=s, placement=placement: bench.pair_modes(s, placement, args.transport), Row("(pair)", PLACEMENT_LABEL[placement], shape))
    out = bench.report()
    print(out.read_text(), flush=True)
    bench.busy.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
