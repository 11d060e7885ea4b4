"""The training side: a Ray actor on a trainer-group node that owns the policy, AdamW and the LR
schedule, and turns one scored rollout into ``batch.updates_per_rollout`` optimizer updates.

Plain Python; the driver wraps it with ``ray.remote`` and the ``beam_trainer`` resource.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

from beam_hpc.backends.reference.loop import algorithm
from beam_hpc.backends.reference.loop.offload import OptimizerOffload
from beam_hpc.backends.reference.model import policy
from beam_hpc.backends.reference.rollouts.rollout_worker import where_am_i
from beam_hpc.config.recipe import Recipe

MODEL_FILE = "model.pt"
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
TRAINER_RNG_FILE = "rng_trainer.pt"


class Trainer:
    def __init__(self, recipe: dict[str, Any], model_path: str) -> None:
        import torch

        from beam_hpc.backends.reference.loop.optimizer import AdamW  # torch's, minus its compiler import

        self.recipe = r = Recipe.model_validate(recipe)
        policy.setup_process(policy.threads_of(r))
        self.device = policy.device_of(r)
        self.pad_id = policy.load_tokenizer(model_path).pad_token_id
        self.model = policy.load_policy(r, model_path)
        self.model.train()
        # Seeded after the build: anything stochastic in training (LoRA dropout) draws from these,
        # and their states go into every checkpoint (unseeded, Python's would differ per process).
        import numpy as np

        torch.manual_seed(policy.derive_seed(r.seed, "trainer"))
        random.seed(policy.derive_seed(r.seed, "trainer-python"))
        np.random.seed(policy.derive_seed(r.seed, "trainer-numpy") % 2**32)
        opt = r.training.optimizer
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = AdamW(
            params, lr=opt.lr, betas=(opt.adam_beta1, opt.adam_beta2), weight_decay=opt.weight_decay
        )
        warmup = opt.warmup_rollouts * r.batch.updates_per_rollout
        # DAPO (arXiv 2503.14476, section 4.1): constant LR after a linear warm-up.
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup else 1.0
        )
        self.offload = OptimizerOffload(self.optimizer, r.training.offload.target, self.device)
        self.ref_model = None
        if r.training.kl_coef > 0 and r.training.mode == "full":
            self.ref_model = policy.load_policy(r, model_path).eval()
        self.version = 0  # rollouts trained on so far
        self.sender: Any = None  # weight_sync's sender, made by connect_weights

    def free_port(self, ip: str) -> int:
        """A TCP port free now on this node: the weight group's rendezvous outside a Slurm job."""
        import socket

        with socket.socket() as s:
            s.bind((ip, 0))
            return int(s.getsockname()[1])

    def connect_weights(self, kind: str, rendezvous: Any) -> None:
        """Make the sender; with a rendezvous (nccl) join the weight group as rank 0, which
        returns once every worker has joined too."""
        from beam_hpc.backends.reference.rollouts.weight_sync import make_sender

        self.sender = make_sender(kind, rendezvous=rendezvous, device=self.device)
        if rendezvous is not None:
            self.sender.connect()

    def send_weights(self, version: int, state: dict[str, Any] | None = None) -> Any:
        """Send the live trainable weights (or ``state``: a resumed run's behaviour weights) as
        ``version``; returns the Delivery the driver hands to every worker's ``receive_weights``."""
        if state is None:  # the parameters themselves: the sender copies them (no host copy for nccl)
            state = {n: p.detach() for n, p in self.model.named_parameters() if p.requires_grad}
        return self.sender.send(state, version)

    def where(self) -> dict[str, Any]:
        return where_am_i("trainer", 0)

    def weights(self) -> dict[str, Any]:
        return policy.trainable_state(self.model)

    def _ref_logp(self, batch: Any) -> Any:
        import torch

        if self.recipe.training.kl_coef <= 0:
            return None
        with torch.no_grad():
            if self.ref_model is not None:
                return policy.token_logprobs(policy.response_logits(self.ref_model, batch), batch)
            with self.model.disable_adapter():  # LoRA: the base model is the reference
                return policy.token_logprobs(policy.response_logits(self.model, batch), batch)

    def train(self, rollout: dict[str, Any]) -> tuple[dict[str, float], dict[str, Any]]:
        """Update on one rollout; returns (metrics, the new trainable weights: the behaviour
        weights an async checkpoint holds; the push itself goes through ``send_weights``)."""
        import torch

        t0 = time.perf_counter()
        r = self.recipe
        n = len(rollout["response_ids"])
        per_update = n // r.batch.updates_per_rollout
        adv_all = torch.tensor(rollout["advantages"], dtype=torch.float32)
        sums: dict[str, float] = {"loss": 0.0, "clip_fraction": 0.0, "approx_kl": 0.0, "kl_ref": 0.0, "grad_norm": 0.0}
        entropy = 0.0
        tokens = 0
        for u in range(r.batch.updates_per_rollout):
            sl = slice(u * per_update, (u + 1) * per_update)
            batch = policy.make_batch(rollout["prompt_ids"][sl], rollout["response_ids"][sl], self.pad_id, self.device)
            old = make_batch_values(rollout["old_logp"][sl], batch.response_mask.shape, self.device)
            logits = policy.response_logits(self.model, batch)
            logp = policy.token_logprobs(logits, batch)
            loss, stats = algorithm.policy_loss(
                logp,
                old,
                adv_all[sl].to(self.device),
                batch.response_mask,
                eps_low=r.training.eps_clip,
                eps_high=r.training.eps_clip_high,
                per_token=r.training.per_token_loss,
                ref_logp=self._ref_logp(batch),
                kl_coef=r.training.kl_coef,
            )
            if u == 0:
                entropy = algorithm.token_entropy(logits.detach(), batch.response_mask)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            params = [p for p in self.model.parameters() if p.requires_grad]
            grad_norm = torch.nn.utils.clip_grad_norm_(params, r.training.optimizer.grad_clip)
            self.offload.bring_in()
            self.optimizer.step()
            self.offload.send_out()
            self.scheduler.step()
            for k in ("loss", "clip_fraction", "approx_kl", "kl_ref"):
                sums[k] += getattr(stats, k)
            sums["grad_norm"] += float(grad_norm)
            tokens += stats.tokens
        self.version += 1
        u_count = r.batch.updates_per_rollout
        files, nbytes = self.offload.disk_usage()
        metrics = {k: v / u_count for k, v in sums.items()}
        metrics.update(
            entropy=entropy,
            tokens=float(tokens),
            lr=float(self.scheduler.get_last_lr()[0]),
            train_time_s=time.perf_counter() - t0,
            offload_files=float(files),
            offload_bytes=float(nbytes),
        )
        return metrics, policy.trainable_state(self.model)

    # -- checkpoint ---------------------------------------------------------------------------

    def save(self, directory: str) -> None:
        """Write model, optimizer, scheduler and RNG states into ``directory`` (a checkpoint's
        temporary iteration dir; the driver publishes it)."""
        import numpy as np
        import torch

        d = Path(directory)
        torch.save(policy.trainable_state(self.model), d / MODEL_FILE)
        torch.save(self.offload.state_dict(), d / OPTIMIZER_FILE)
        torch.save(self.scheduler.state_dict(), d / SCHEDULER_FILE)
        torch.save(
            {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state(), "version": self.version},
            d / TRAINER_RNG_FILE,
        )

    def load(self, directory: str) -> int:
        import numpy as np
        import torch

        d = Path(directory)
        policy.load_trainable_state(self.model, torch.load(d / MODEL_FILE, weights_only=True))
        self.offload.load_state_dict(torch.load(d / OPTIMIZER_FILE, weights_only=True))
        self.scheduler.load_state_dict(torch.load(d / SCHEDULER_FILE, weights_only=True))
        rng = torch.load(d / TRAINER_RNG_FILE, weights_only=False)
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        self.version = int(rng["version"])
        return self.version

    def close(self) -> None:
        try:
            if self.sender is not None:
                self.sender.close()
        finally:
            self.offload.close()


def make_batch_values(rows: list[list[float]], shape: Any, device: str) -> Any:
    """Right-pad per-token values (behaviour log-probs) to the batch's ``[B, T]`` response layout."""
    import torch

    out = torch.zeros(tuple(shape), dtype=torch.float32)
    for i, row in enumerate(rows):
        if row:
            out[i, : len(row)] = torch.tensor(row, dtype=torch.float32)
    return out.to(device)
