"""LoRA adapters on the policy's linear layers (Hu et al. 2021, as PEFT applies them): each chosen
``nn.Linear`` W gets ``W x + (alpha / r) * B A dropout(x)``, A ([r, in]) Kaiming-uniform, B
([out, r]) zero, so the adapted model starts as the base model; only A and B train.

Written here rather than taken from PEFT because PEFT imports transformers (about a CPU-second in
every process that builds the policy) and wraps only transformers' model classes.
"""

from __future__ import annotations

import math

import torch
from torch import nn

ALL_LINEAR = "all-linear"  # every linear layer but the output head, as PEFT reads the same word


class LoraLinear(nn.Module):
    """A frozen linear layer plus its trainable low-rank update."""

    def __init__(self, base: nn.Linear, rank: int, alpha: int, dropout: float) -> None:
        super().__init__()
        self.base = base
        base.requires_grad_(False)
        self.lora_A = nn.Linear(base.in_features, rank, bias=False, device=base.weight.device)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False, device=base.weight.device)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)
        self.scaling = alpha / rank
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_B(self.lora_A(self.dropout(x))) * self.scaling


def _chosen(name: str, targets: list[str]) -> bool:
    if targets == [ALL_LINEAR]:
        return name != "lm_head"
    return any(name == t or name.endswith("." + t) for t in targets)


def add_adapters(model: nn.Module, *, rank: int, alpha: int, dropout: float, targets: list[str]) -> nn.Module:
    """Freeze ``model`` and put adapters on the linear layers ``targets`` names (module names or
    their last parts, e.g. ``q_proj``; or ``all-linear``). Draws A from the global torch RNG:
    seed it first. A target list that matches nothing is an error, not a silent full freeze."""
    model.requires_grad_(False)
    chosen = [name for name, m in model.named_modules() if isinstance(m, nn.Linear) and _chosen(name, targets)]
    if not chosen:
        raise ValueError(f"training.lora.target_modules: {targets} names no linear layer of the model")
    for name in chosen:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, LoraLinear(getattr(parent, child), rank, alpha, dropout))
    return model
