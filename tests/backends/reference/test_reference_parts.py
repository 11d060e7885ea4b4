"""The reference backend's pieces in one process: optimizer offload, data order, sampling,
checkpoint publishing (fast; a randomly initialised 2-layer Qwen2 stands in for the policy where
a model is needed, built in the test in well under a second)."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from beam_hpc.backends.reference.loop import checkpoint  # noqa: E402
from beam_hpc.backends.reference.loop.offload import NVME_ENV, OffloadError, OptimizerOffload  # noqa: E402
from beam_hpc.backends.reference.loop.prompt_source import Prompt, PromptOrder  # noqa: E402
from beam_hpc.run import checkpoint_layout as layout  # noqa: E402


def _train(target: str, steps: int, offload_dir: Path | None = None) -> tuple[torch.nn.Module, torch.optim.Optimizer, OptimizerOffload]:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    off = OptimizerOffload(opt, target, "cpu")
    data = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
    for _ in range(steps):
        opt.zero_grad()
        model(data).pow(2).mean().backward()
        off.bring_in()
        opt.step()
        off.send_out()
    return model, opt, off


def test_nvme_offload_keeps_state_on_disk_between_steps_and_is_bitwise(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(NVME_ENV, str(tmp_path))
    ref_model, ref_opt, _ = _train("none", 3)
    model, opt, off = _train("nvme", 3)
    files, nbytes = off.disk_usage()
    assert files == 2 and nbytes > 8 * 4 * 4 * 2  # weight and bias, exp_avg + exp_avg_sq each
    for state in opt.state.values():  # only the step counter stays in memory
        assert set(state) == {"step"}
    for a, b in zip(ref_model.parameters(), model.parameters(), strict=False):
        assert torch.equal(a, b)
    sd = off.state_dict()  # the checkpoint's copy: complete, and the offload is left as it was
    ref_sd = ref_opt.state_dict()
    for i in ref_sd["state"]:
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(sd["state"][i][k], ref_sd["state"][i][k])
    assert all(set(s) == {"step"} for s in opt.state.values())
    off.close()
    assert off.disk_usage() == (0, 0) and not any(tmp_path.rglob("*.pt"))


def test_nvme_offload_without_a_staged_dir_fails_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(NVME_ENV, raising=False)
    opt = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters())
    with pytest.raises(OffloadError, match="BEAM_NVME_DIR is not set"):
        OptimizerOffload(opt, "nvme", "cpu")


def test_data_order_is_a_pure_function_of_seed_and_cursor() -> None:
    prompts = [Prompt(i, [i], str(i)) for i in range(10)]
    a = PromptOrder(prompts, seed=7, shuffle=True)
    b = PromptOrder(prompts, seed=7, shuffle=True)
    whole = [p.index for p in a.take(0, 25)]
    assert [p.index for p in b.take(12, 8)] == whole[12:20]  # no history needed
    assert sorted(whole[:10]) == list(range(10)) and sorted(whole[10:20]) == list(range(10))
    assert whole[:10] != whole[10:20]  # each epoch has its own permutation
    assert [p.index for p in PromptOrder(prompts, seed=8, shuffle=True).take(0, 10)] != whole[:10]
    assert [p.index for p in PromptOrder(prompts, seed=7, shuffle=False).take(8, 4)] == [8, 9, 0, 1]
    assert a.state(23) == {"sample_offset": 23, "epoch_id": 2, "sample_index": 3, "dataset_size": 10}


def _random_policy() -> torch.nn.Module:
    from beam_hpc.backends.reference.model.causal_lm import CausalLM, LMConfig

    torch.manual_seed(0)
    cfg = LMConfig.from_dict({"model_type": "qwen2", "vocab_size": 40, "hidden_size": 32, "intermediate_size": 64,
                              "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
                              "tie_word_embeddings": True})
    return CausalLM(cfg).eval()


def test_sampling_depends_only_on_seed_and_rollout_id() -> None:
    from beam_hpc.backends.reference.model.sampling import generate

    model = _random_policy()
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    kw = dict(max_new_tokens=12, temperature=1.0, top_p=1.0, eos_id=1, pad_id=0)
    first = generate(model, prompts, seed_parts=(1234, "train", 3, 0), **kw)
    torch.rand(100)  # unrelated draws from the global RNG change nothing
    again = generate(model, prompts, seed_parts=(1234, "train", 3, 0), **kw)
    other = generate(model, prompts, seed_parts=(1234, "train", 4, 0), **kw)
    assert first == again and first != other
    for resp in first:
        assert 1 <= len(resp) <= 12 and (resp[-1] == 1 or len(resp) == 12) and 1 not in resp[:-1]
    greedy = generate(model, prompts, seed_parts=(0,), **{**kw, "temperature": 0.0})
    assert greedy == generate(model, prompts, seed_parts=(99,), **{**kw, "temperature": 0.0})


def test_top_p_keeps_the_smallest_nucleus() -> None:
    from beam_hpc.backends.reference.model.sampling import _top_p_mask

    scores = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = torch.isfinite(_top_p_mask(scores, 0.75))
    assert kept.tolist() == [[True, True, False, False]]
    assert torch.isfinite(_top_p_mask(scores, 0.1)).tolist() == [[True, False, False, False]]


def test_publish_writes_pointer_last_and_prunes(tmp_path: Path) -> None:
    ckpt = str(tmp_path / "checkpoints")
    for it in range(3):
        staged = checkpoint.staging_dir(ckpt, it)
        (staged / "model.pt").write_bytes(b"x")
        assert layout.latest_iteration(ckpt) == (None if it == 0 else it - 1)  # not yet published
        checkpoint.publish(ckpt, it, staged, {"sample_offset": (it + 1) * 4}, keep_last=2)
    assert layout.latest_iteration(ckpt) == 2 and layout.resume_problems(ckpt) == []
    assert sorted(p.name for p in Path(ckpt).glob("iter_*")) == ["iter_0000001", "iter_0000002"]
    assert not layout.dataset_state_path(ckpt, 0).exists()
    it, it_dir, state = checkpoint.load_latest(ckpt)
    assert (it, it_dir.name, state) == (2, "iter_0000002", {"sample_offset": 12})
    assert not list(Path(ckpt).glob(".iter_*"))  # no staging leftovers
