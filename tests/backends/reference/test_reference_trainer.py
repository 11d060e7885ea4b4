"""The trainer actor's class in-process: save then load gives equal weights, optimizer, schedule
and RNG, and the next update after a load equals the update without one (no Ray needed: the
actor classes are plain Python)."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from reference_harness import TINY_RECIPE, assert_bitwise_equal  # noqa: E402

pytestmark = pytest.mark.slow


def _recipe(tmp_path: Path, tiny_assets, extra: list[str]) -> dict:
    from beam_hpc.config.recipe import load_recipe

    r = load_recipe(TINY_RECIPE, [f"output_dir={tmp_path}", f"model.path={tiny_assets.model_dir}", *extra])
    return r.model_dump(mode="json")


def _rollout(model_dir: Path) -> dict:
    from beam_hpc.backends.reference.model.policy import load_tokenizer

    tok = load_tokenizer(str(model_dir))
    g = torch.Generator().manual_seed(0)
    prompts = [tok.encode("What is 12 + 30?") for _ in range(8)]
    responses = [torch.randint(3, tok.vocab_size, (n,), generator=g).tolist() + [tok.eos_token_id] for n in (3, 5, 7, 9, 2, 4, 6, 8)]
    return {
        "prompt_ids": prompts,
        "response_ids": responses,
        "old_logp": [[-3.0] * len(r) for r in responses],
        "advantages": [1.0, -1.0, 0.5, -0.5, 1.0, -1.0, 0.0, 0.0],
    }


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_save_then_load_is_exact_and_training_continues_identically(tmp_path, tiny_assets, mode) -> None:
    from beam_hpc.backends.reference.loop.trainer import Trainer

    extra = ["training.mode=lora", "training.lora={rank: 4, alpha: 8}", "training.offload.target=none"] if mode == "lora" else []
    recipe = _recipe(tmp_path, tiny_assets, [*extra, "training.optimizer.warmup_rollouts=3"])
    roll = _rollout(tiny_assets.model_dir)
    a = Trainer(recipe, str(tiny_assets.model_dir))
    metrics, w1 = a.train(roll)
    assert metrics["tokens"] == sum(len(r) for r in roll["response_ids"]) and metrics["grad_norm"] > 0
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    a.save(str(ckpt))
    b = Trainer(recipe, str(tiny_assets.model_dir))
    assert b.load(str(ckpt)) == 1
    assert assert_bitwise_equal(a.weights(), b.weights()) == len(w1) > 0
    assert assert_bitwise_equal(a.optimizer.state_dict(), b.optimizer.state_dict()) >= 2 * len(w1)
    assert a.scheduler.state_dict() == b.scheduler.state_dict()
    _, wa = a.train(roll)
    _, wb = b.train(roll)
    assert_bitwise_equal(wa, wb)
    assert any(not torch.equal(w1[k], wa[k]) for k in w1)  # it did move
    if mode == "lora":
        assert all("lora_" in k for k in w1)
