"""The policy model as both sides hold it, and the one batch layout they score it with.

The rollout workers and the trainer must build the *same* module (full model, or base + the same
LoRA adapters) so that the trainer can push exactly its trainable tensors and nothing else, and
they must compute log-probabilities through the same function on the same layout, so that in
sync mode the importance ratio starts at 1 (up to batch-composition rounding).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from beam_hpc.backends.reference.model.chat_tokenizer import ChatTokenizer
    from beam_hpc.config.recipe import Recipe


def derive_seed(*parts: object) -> int:
    """A 63-bit seed from the parts, identical in every process (Python's ``hash`` is salted per
    process, so it must never be used for this: a resumed process would draw other numbers)."""
    text = ":".join(str(p) for p in parts)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") & ((1 << 63) - 1)


def setup_process(threads: int, *, runs_the_model: bool = True) -> None:
    """Fix what makes float results differ between processes: the intra-op thread count (backward
    weight-gradients depend on it) and non-deterministic kernels. Also register the stack-dump
    signal, in the driver and every actor alike (each calls this first).

    ``runs_the_model=False`` (the driver, whose torch work is a few small reductions: advantages)
    leaves the kernels as they are."""
    import torch

    from beam_hpc.node import stacks

    stacks.register()  # a stalled segment can read where this process hung (beam_hpc.node.stacks)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.set_num_threads(threads)
    if runs_the_model:
        deterministic_kernels()


def deterministic_kernels() -> None:
    """``torch.use_deterministic_algorithms(True)`` without the import it makes of
    ``torch._inductor.config`` (about 0.9 CPU-s per process: most of torch's compiler) only to copy
    the flag there for compiled code; nothing here is compiled. Should torch drop the private
    setter, the public call is made instead (slower, the same effect)."""
    import torch

    setter = getattr(torch._C, "_set_deterministic_algorithms", None)
    if setter is None:
        torch.use_deterministic_algorithms(True)
    else:
        setter(True)


def threads_of(recipe: Recipe) -> int:
    return int(recipe.backend_options.get("threads", 1))


def device_of(recipe: Recipe) -> str:
    return str(recipe.backend_options.get("device", "cpu"))


def load_tokenizer(model_path: str) -> ChatTokenizer:
    from beam_hpc.backends.reference.model.chat_tokenizer import ChatTokenizer

    return ChatTokenizer(model_path)


def load_policy(recipe: Recipe, model_path: str | None = None) -> Any:
    """The policy module (:mod:`beam_hpc.backends.reference.model.causal_lm`) in fp32, with LoRA
    adapters in LoRA mode.

    Adapter initialisation draws from the global torch RNG, so it is seeded from the run seed
    first: every process that builds the policy gets the same adapters before any weights arrive.
    """
    import torch

    from beam_hpc.backends.reference.model import causal_lm, lora

    path = model_path or recipe.model.path
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(
            f"model.path: {path} holds no HF model (config.json missing); build the tiny model with "
            "backend_options.tiny_model: true (SmolLM2: smollm2_model: true) or run `beam-hpc prepare --model ...`"
        )
    model = causal_lm.load(path, dtype=torch.float32)
    if recipe.training.mode == "lora":
        spec = recipe.training.lora
        assert spec is not None  # the recipe validator guarantees it
        torch.manual_seed(derive_seed(recipe.seed, "lora-init"))
        model = lora.add_adapters(model, rank=spec.rank, alpha=spec.alpha, dropout=spec.dropout,
                                  targets=list(spec.target_modules))
    return model.to(device_of(recipe))


def trainable_state(model: Any) -> dict[str, torch.Tensor]:
    """The tensors the trainer changes (all weights, or only the adapters), detached CPU copies:
    what is pushed to the rollout workers and what a checkpoint must hold."""
    return {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters() if p.requires_grad}


def load_trainable_state(model: Any, state: dict[str, torch.Tensor]) -> None:
    """Copy pushed/checkpointed tensors in place; a name that does not exist is a bug, not a skip."""
    import torch

    params = dict(model.named_parameters())
    unknown = sorted(set(state) - set(params))
    if unknown:
        raise KeyError(f"weights for unknown parameters {unknown[:3]}...: policy structures differ")
    with torch.no_grad():
        for name, tensor in state.items():
            params[name].copy_(tensor.to(params[name].device))


@dataclass
class Batch:
    """Prompts left-padded to ``P`` columns, responses right-padded to ``T`` columns after them."""

    input_ids: torch.Tensor  # [B, P + T]
    attention_mask: torch.Tensor  # [B, P + T]
    response_mask: torch.Tensor  # [B, T]
    prompt_width: int


def make_batch(prompts: list[list[int]], responses: list[list[int]], pad_id: int, device: str = "cpu") -> Batch:
    import torch

    P = max(len(p) for p in prompts)
    T = max(1, max(len(r) for r in responses))
    B = len(prompts)
    ids = torch.full((B, P + T), pad_id, dtype=torch.long)
    attn = torch.zeros((B, P + T), dtype=torch.long)
    rmask = torch.zeros((B, T), dtype=torch.float32)
    for i, (p, r) in enumerate(zip(prompts, responses, strict=False)):
        ids[i, P - len(p) : P] = torch.tensor(p, dtype=torch.long)
        attn[i, P - len(p) : P] = 1
        if r:
            ids[i, P : P + len(r)] = torch.tensor(r, dtype=torch.long)
            attn[i, P : P + len(r)] = 1
            rmask[i, : len(r)] = 1.0
    return Batch(ids.to(device), attn.to(device), rmask.to(device), P)


def response_logits(model: Any, batch: Batch) -> torch.Tensor:
    """Logits that predict each response token, ``[B, T, V]`` (position ids skip the left pad)."""

    pos = (batch.attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=pos, use_cache=False)
    P = batch.prompt_width
    return out.logits[:, P - 1 : -1, :].float()


def token_logprobs(logits: torch.Tensor, batch: Batch) -> torch.Tensor:
    import torch

    targets = batch.input_ids[:, batch.prompt_width :]
    return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
