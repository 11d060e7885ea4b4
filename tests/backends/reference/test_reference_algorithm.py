"""GRPO/DAPO maths of the reference backend against values computed by hand (fast, no model)."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from beam_hpc.backends.reference.loop.algorithm import group_advantages, policy_loss, token_entropy  # noqa: E402


def test_advantages_are_normalised_within_each_group() -> None:
    rewards = torch.tensor([1.0, -1.0, -1.0, 1.0, 1.0, 1.0, 1.0, -1.0])
    adv = group_advantages(rewards, 4)
    # group 1: mean 0, unbiased std sqrt(4/3) -> +-0.8660; group 2: mean 0.5, std 1.0 -> 0.5, -1.5
    s = math.sqrt(4 / 3)
    expected = [1 / s, -1 / s, -1 / s, 1 / s, 0.5, 0.5, 0.5, -1.5]
    assert adv.tolist() == pytest.approx(expected, abs=1e-5)


def test_zero_std_group_has_exactly_zero_advantage() -> None:
    adv = group_advantages(torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0, -1.0, 0.5, -0.5, 0.5]), 3)
    assert adv[:6].tolist() == [0.0] * 6  # all-correct and all-wrong groups carry no signal
    assert adv[6:].abs().sum() > 0


def test_advantages_reject_a_ragged_batch() -> None:
    with pytest.raises(ValueError, match="divides by 4"):
        group_advantages(torch.zeros(6), 4)


def _ratio_logp(ratios: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    old = torch.zeros(len(ratios), len(ratios[0]))
    logp = torch.tensor([[math.log(r) for r in row] for row in ratios], requires_grad=True)
    return logp, old


def test_clip_is_asymmetric_eps_high_lets_a_positive_advantage_grow_further() -> None:
    # ratios 1.25 and 1.5 with A=+1: DAPO (0.2 / 0.28) keeps 1.25 (gradient flows), clips 1.5 at 1.28.
    logp, old = _ratio_logp([[1.25, 1.5]])
    mask = torch.ones(1, 2)
    loss, stats = policy_loss(logp, old, torch.tensor([1.0]), mask, eps_low=0.2, eps_high=0.28)
    assert float(loss.detach()) == pytest.approx(-(1.25 + 1.28) / 2, abs=1e-6)
    loss.backward()
    assert logp.grad[0, 0] != 0 and logp.grad[0, 1] == 0
    assert stats.clip_fraction == pytest.approx(0.5)
    # With a symmetric clip of 0.2 the 1.25 token is clipped too: no gradient at all.
    logp2, old2 = _ratio_logp([[1.25, 1.5]])
    loss2, stats2 = policy_loss(logp2, old2, torch.tensor([1.0]), mask, eps_low=0.2, eps_high=0.2)
    loss2.backward()
    assert float(loss2.detach()) == pytest.approx(-1.2, abs=1e-6)
    assert logp2.grad.abs().sum() == 0 and stats2.clip_fraction == 1.0


def test_clip_low_side_for_negative_advantages() -> None:
    # A=-1: ratio 0.5 is clipped at 0.8 (loss +0.8, no gradient); ratio 0.9 is inside (loss +0.9);
    # ratio 1.5 is not clipped for a negative advantage (min keeps the worse, unclipped term).
    logp, old = _ratio_logp([[0.5, 0.9, 1.5]])
    loss, stats = policy_loss(logp, old, torch.tensor([-1.0]), torch.ones(1, 3), eps_low=0.2, eps_high=0.28)
    assert float(loss.detach()) == pytest.approx((0.8 + 0.9 + 1.5) / 3, abs=1e-6)
    loss.backward()
    assert logp.grad[0, 0] == 0 and logp.grad[0, 1] != 0 and logp.grad[0, 2] != 0
    assert stats.clip_fraction == pytest.approx(1 / 3)


def test_token_level_versus_sample_level_normalisation() -> None:
    # Response 1 has 1 token (per-token loss -1), response 2 has 3 (each -3): ratio 1, A = 1 and 3.
    logp = torch.zeros(2, 3)
    mask = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    adv = torch.tensor([1.0, 3.0])
    tok, st = policy_loss(logp, logp.clone(), adv, mask, eps_low=0.2, eps_high=0.28, per_token=True)
    seq, _ = policy_loss(logp, logp.clone(), adv, mask, eps_low=0.2, eps_high=0.28, per_token=False)
    assert float(tok) == pytest.approx(-(1 + 3 * 3) / 4)  # every token weighs the same: -2.5
    assert float(seq) == pytest.approx(-(1 + 3) / 2)  # every response weighs the same: -2.0
    assert st.tokens == 4


def test_padding_tokens_do_not_count() -> None:
    logp = torch.tensor([[0.1, 5.0]])
    mask = torch.tensor([[1.0, 0.0]])
    loss, _ = policy_loss(logp, torch.zeros(1, 2), torch.tensor([1.0]), mask, eps_low=0.2, eps_high=0.28)
    assert float(loss.detach()) == pytest.approx(-math.exp(0.1), abs=1e-6)


def test_kl_term_is_zero_at_the_reference_and_positive_away_from_it() -> None:
    logp = torch.tensor([[-1.0, -2.0]])
    mask = torch.ones(1, 2)
    base, _ = policy_loss(logp, logp.clone(), torch.tensor([0.0]), mask, eps_low=0.2, eps_high=0.28)
    same, s1 = policy_loss(logp, logp.clone(), torch.tensor([0.0]), mask, eps_low=0.2, eps_high=0.28, ref_logp=logp.clone(), kl_coef=0.5)
    away, s2 = policy_loss(logp, logp.clone(), torch.tensor([0.0]), mask, eps_low=0.2, eps_high=0.28, ref_logp=logp - 0.5, kl_coef=0.5)
    assert float(same) == float(base) == 0.0 and s1.kl_ref == 0.0
    k3 = math.exp(-0.5) + 0.5 - 1.0
    assert s2.kl_ref == pytest.approx(k3, abs=1e-6) and float(away) == pytest.approx(0.5 * k3, abs=1e-6)
    with pytest.raises(ValueError, match="ref_logp"):
        policy_loss(logp, logp, torch.tensor([0.0]), mask, eps_low=0.2, eps_high=0.28, kl_coef=0.1)


def test_entropy_of_uniform_and_peaked_distributions() -> None:
    logits = torch.stack([torch.zeros(4), torch.tensor([100.0, 0.0, 0.0, 0.0])]).unsqueeze(0)  # [1, 2, 4]
    assert token_entropy(logits, torch.tensor([[1.0, 0.0]])) == pytest.approx(math.log(4), abs=1e-6)
    assert token_entropy(logits, torch.tensor([[0.0, 1.0]])) == pytest.approx(0.0, abs=1e-6)
