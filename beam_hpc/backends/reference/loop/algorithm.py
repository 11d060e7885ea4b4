"""GRPO with DAPO's refinements: group-normalised advantages and the clipped policy loss.

Pure tensor functions, no model and no I/O, so that the unit tests can check them against values
computed by hand (the objective of DAPO, arXiv 2503.14476: token-level, no KL term):

    J = 1/sum_i |o_i| * sum_i sum_t min(r_it * A_i, clip(r_it, 1 - eps_low, 1 + eps_high) * A_i)

with ``r_it = exp(logp - old_logp)`` and ``A_i = (R_i - mean(R_group)) / (std(R_group) + eps)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

ADV_EPS = 1e-6  # keeps a near-constant group finite; an exactly constant group gets advantage 0


def group_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Per-response advantages, normalised within each group of ``group_size`` responses.

    ``rewards`` is flat, groups adjacent (prompt 0's responses first). The std is the unbiased one
    (as Miles/verl's GRPO use ``torch.std``). A group whose rewards are all equal carries no
    learning signal: its advantages are exactly 0 (not 0/eps noise), which is what DAPO's dynamic
    sampling would have filtered out.
    """
    import torch

    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards: expected a flat tensor whose length divides by {group_size}, got {tuple(rewards.shape)}")
    g = rewards.double().view(-1, group_size)
    mean = g.mean(dim=1, keepdim=True)
    std = g.std(dim=1, keepdim=True)
    adv = (g - mean) / (std + ADV_EPS)
    adv = torch.where(std > 0, adv, torch.zeros_like(adv))
    return adv.view(-1).to(rewards.dtype if rewards.is_floating_point() else torch.float32)


@dataclass(frozen=True)
class LossStats:
    """What one loss evaluation reports (plain floats, for metrics)."""

    loss: float
    clip_fraction: float  # share of tokens whose gradient the clip removed
    approx_kl: float  # mean (old_logp - logp): how far the policy moved from the behaviour policy
    kl_ref: float  # mean k3 KL to the reference policy (0 when kl_coef == 0)
    tokens: int


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_low: float,
    eps_high: float,
    per_token: bool = True,
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> tuple[torch.Tensor, LossStats]:
    """The clipped surrogate loss (to minimise) over a ``[batch, tokens]`` layout.

    ``advantages`` is ``[batch]`` (one value per response, broadcast over its tokens); ``mask``
    marks real response tokens. ``per_token`` is DAPO's token-level normalisation (every token of
    the batch weighs the same, so long responses are not down-weighted); without it each response
    is averaged first and the responses are averaged (GRPO's sample-level loss).
    The clip is asymmetric: ``1 - eps_low`` below, ``1 + eps_high`` above (DAPO's Clip-Higher).
    ``kl_coef > 0`` adds the k3 estimator of KL(policy || reference), as Miles's ``--use-kl-loss``.
    """
    import torch

    mask = mask.to(logp.dtype)
    adv = advantages.to(logp.dtype).unsqueeze(1)
    ratio = torch.exp(logp - old_logp)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * adv
    per_tok = -torch.minimum(unclipped, clipped)
    kl_ref = torch.zeros((), dtype=logp.dtype)
    if kl_coef > 0:
        if ref_logp is None:
            raise ValueError("policy_loss: kl_coef > 0 needs ref_logp (the reference policy's log-probs)")
        d = ref_logp - logp
        k3 = torch.exp(d) - d - 1.0
        per_tok = per_tok + kl_coef * k3
        kl_ref = _masked_mean(k3.detach(), mask)
    if per_token:
        loss = (per_tok * mask).sum() / mask.sum().clamp(min=1.0)
    else:
        per_seq = (per_tok * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)
        loss = per_seq.mean()
    with torch.no_grad():
        was_clipped = _clip_active(ratio, adv, eps_low, eps_high)
        stats = LossStats(
            loss=float(loss.detach()),
            clip_fraction=float(_masked_mean(was_clipped.to(logp.dtype), mask)),
            approx_kl=float(_masked_mean((old_logp - logp).detach(), mask)),
            kl_ref=float(kl_ref),
            tokens=int(mask.sum()),
        )
    return loss, stats


def _clip_active(ratio: torch.Tensor, adv: torch.Tensor, eps_low: float, eps_high: float) -> torch.Tensor:
    """Tokens where min() picked the clipped term and so the gradient is zero: the ratio left the
    trust region in the direction the advantage pushes it."""
    return ((ratio > 1.0 + eps_high) & (adv > 0)) | ((ratio < 1.0 - eps_low) & (adv < 0))


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def token_entropy(logits: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean entropy (nats) of the policy over response tokens: a collapse to 0 is the classic
    sign that RL has stopped exploring."""
    import torch

    with torch.no_grad():
        logp = torch.log_softmax(logits.float(), dim=-1)
        ent = -(logp.exp() * logp).sum(dim=-1)
        return float(_masked_mean(ent, mask.to(ent.dtype)))
