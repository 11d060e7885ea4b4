"""The trainer's AdamW (``beam_hpc.backends.reference.loop.optimizer``) is torch's AdamW bit for bit, and a
trainer process that trains and checkpoints with it never imports torch's compiler."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[3]


def _train(optimizer_class: type, steps: int = 6) -> tuple[list, dict, list[float]]:
    """A small net trained with ``optimizer_class``, weight decay and the trainer's warm-up schedule."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    opt = optimizer_class(net.parameters(), lr=1e-2, betas=(0.9, 0.98), weight_decay=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 3))
    lrs = []
    for _ in range(steps):
        net(torch.randn(5, 8)).pow(2).mean().backward()
        opt.step()
        schedule.step()
        opt.zero_grad(set_to_none=True)
        lrs.append(opt.param_groups[0]["lr"])
    return [p.detach().clone() for p in net.parameters()], opt.state_dict(), lrs


def test_it_computes_what_torchs_adamw_computes_and_their_states_load_into_each_other() -> None:
    from beam_hpc.backends.reference.loop.optimizer import AdamW

    ours, our_state, our_lrs = _train(AdamW)
    theirs, their_state, their_lrs = _train(torch.optim.AdamW)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
    assert our_lrs == their_lrs and our_lrs[0] < our_lrs[-1]
    assert our_state["param_groups"] == their_state["param_groups"]
    for key, state in our_state["state"].items():
        assert set(state) == set(their_state["state"][key]) == {"step", "exp_avg", "exp_avg_sq"}
        assert all(torch.equal(state[name], their_state["state"][key][name]) for name in state)
    # a checkpoint of either loads into the other (the trainer's optimizer.pt is torch's format)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    plain = torch.optim.AdamW(net.parameters(), lr=1e-2, betas=(0.9, 0.98), weight_decay=0.1)
    plain.load_state_dict(our_state)
    mine = AdamW(net.parameters(), lr=1e-2)
    mine.load_state_dict(their_state)
    assert torch.equal(mine.state_dict()["state"][0]["exp_avg"], their_state["state"][0]["exp_avg"])


@pytest.mark.slow
def test_a_trainer_process_trains_and_saves_without_importing_torchs_compiler(tmp_path, tiny_assets) -> None:
    """The trainer actor's class, in a fresh process as Ray would start it: build, one update, a
    checkpoint and its load. ``torch._dynamo`` (about 0.8 CPU-s, a third of a small run's trainer)
    stays out of it; then, in the same process, constructing ``torch.optim.AdamW`` brings it in (the
    check can fail)."""
    model_dir = str(tiny_assets.model_dir)
    script = f"""
import sys, torch
from beam_hpc.backends.reference.model.policy import load_tokenizer
from beam_hpc.backends.reference.loop.trainer import Trainer
from beam_hpc.config.recipe import load_recipe
recipe = load_recipe("recipes/tiny.yaml", ["output_dir={tmp_path}", "model.path={model_dir}"])
t = Trainer(recipe.model_dump(mode="json"), "{model_dir}")
tok = load_tokenizer("{model_dir}")
responses = [[5 + i] * (i + 2) + [tok.eos_token_id] for i in range(8)]
roll = {{"prompt_ids": [tok.encode("What is 12 + 30?")] * 8, "response_ids": responses,
        "old_logp": [[-3.0] * len(r) for r in responses], "advantages": [1.0, -1.0] * 4}}
metrics, _ = t.train(roll)
t.save("{tmp_path}/ckpt")
print(metrics["grad_norm"] > 0, t.load("{tmp_path}/ckpt"), "torch._dynamo" in sys.modules)
torch.optim.AdamW(t.model.parameters())
print("torch._dynamo" in sys.modules)
"""
    (tmp_path / "ckpt").mkdir()
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["True", "1", "False", "True"], out.stdout
