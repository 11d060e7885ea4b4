"""beam-hpc against real Miles code (``miles-rl`` 0.0.2 from PyPI), wherever it runs on a CPU.

What runs for real here: Miles's argument parser with all its validation (``parse_args``: Megatron's
parser with Miles's and SGLang's arguments, ``hf_validate_args``, Miles's and Megatron's
``validate_args``), its reward dispatch (``miles.rollout.rm_hub.async_rm`` / ``batched_async_rm``
with real ``Sample`` objects), and its prompt dataset (``miles.utils.data.Dataset``) on the JSONL
``beam-hpc prepare`` writes, with a real tokenizer. What needs GPUs (training steps, SGLang
engines) stays with ``tests/support/standins/miles_standin/``.

Where this older Miles differs from the version the flag table targets (radixark/miles main,
31f1ca96): it lacks ``--save-trigger-sentinel``, ``--stream-optimizer-state-to-disk``,
``--offload-train-disk-dir`` and ``--offload-train-target`` (they reached Miles main in July 2026),
which is exactly what the pre-Ray check must catch; the reward and dataset interfaces used here are
the same in both.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from miles_facts import PRACTICE, QWEN3_30B_A3B
from real_miles import require_miles

from beam_hpc.backends import registry
from beam_hpc.backends.miles import args as miles_args
from beam_hpc.backends.miles import preflight
from beam_hpc.backends.miles.flags import SOURCES
from beam_hpc.backends.miles.reward import score_sample
from beam_hpc.config.recipe import load_recipe
from beam_hpc.config.site import Site

ROOT = Path(__file__).resolve().parents[3]
FIXTURES = Path(__file__).resolve().parents[3] / "tests" / "support" / "fixtures"
TINY_TOKENIZER = ROOT / "beam_hpc" / "backends" / "reference" / "model" / "tiny_shipped"
MISSING_IN_0_0_2 = ("--save-trigger-sentinel", "--stream-optimizer-state-to-disk", "--offload-train-disk-dir",
                    "--offload-train-target")


@pytest.fixture(autouse=True)
def _miles() -> None:
    require_miles()


def plan_for(tmp: Path, name: str, *overrides: str):  # type: ignore[no-untyped-def]
    model = tmp / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    r = load_recipe(ROOT / "recipes" / f"{name}.yaml",
                    ["model.miles_model_script=null", f"model.path={model}", f"output_dir={tmp}/run", *overrides])
    return registry.plan_for(r, Site(name="t", container={"runtime": "host"}, python=sys.executable))


@pytest.fixture
def importable_beam_hpc(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check process imports this checkout's beam_hpc (as the image imports its own)."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))


@pytest.mark.slow  # imports Miles, Megatron and SGLang: 20-40 s on a loaded 2-core machine
def test_real_miles_refuses_the_flags_it_lacks(tmp_path: Path, importable_beam_hpc: None) -> None:
    """The colocated seed configuration (NVMe offload of the trainer, the save sentinel) on miles-rl
    0.0.2: the in-job check refuses within seconds, naming each flag and the setting behind it."""
    msg = preflight.check_in_job(plan_for(tmp_path, "colocated"))
    assert msg is not None and "unrecognized arguments" in msg
    for flag in MISSING_IN_0_0_2:
        assert f"  {flag}: from {SOURCES[flag]}" in msg, (flag, msg)
    assert "lifecycle.save_on_request: false" in msg and "training.offload.target: cpu" in msg


@pytest.mark.slow
def test_real_miles_accepts_the_command_without_them(tmp_path: Path, importable_beam_hpc: None) -> None:
    """With the remedies the refusal names, the older Miles's whole validation passes: the
    architecture flags, from a Miles-main-style Qwen3-30B-A3B ``.py`` model script run through its
    loader, satisfy its hf_validate_args, and Miles's launcher practice (dropout 0, fp32, flash
    attention, recompute, dynamic batch size, SGLang memory fraction, data balancing) parses."""
    script = FIXTURES / "miles_main" / "scripts" / "models" / "qwen3-30B-A3B.py"
    plan = plan_for(tmp_path, "dedicated", "training.offload.target=cpu", "lifecycle.save_on_request=false",
                    f"model.miles_model_script={script}", "tracking.wandb.project=beam", "tracking.wandb.mode=offline")
    assert "--use-wandb" in plan.driver_argv and "--disable-wandb-random-suffix" in plan.driver_argv  # W&B parses too
    assert "--model-script" not in plan.driver_argv and "--num-experts" in plan.driver_argv  # read at submit
    assert set(PRACTICE) <= set(plan.driver_argv)
    verdict = preflight.check_plan(plan)
    assert verdict.ok, verdict.refusal()
    assert verdict.detail["capability_patched"] is True  # this machine has no CUDA


def test_reward_through_miles_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Miles's own rm_hub loads --custom-rm-path and awaits it, single and batched."""
    from miles.rollout.rm_hub import async_rm, batched_async_rm
    from miles.utils.types import Sample

    monkeypatch.setenv(miles_args.ENV_OVERLONG_BUFFER, "1024")
    monkeypatch.setenv(miles_args.ENV_OVERLONG_FACTOR, "1.0")
    args = SimpleNamespace(custom_rm_path=miles_args.REWARD_FUNCTION, rollout_max_response_len=4096,
                           reward_key="reward", eval_reward_key="acc", rm_type=None)
    right = Sample(prompt="p", response="so \\boxed{42}", label="42", response_length=100)
    wrong = Sample(prompt="p", response="\\boxed{41}", label="42", response_length=3900)
    one = asyncio.run(async_rm(args, right))
    assert one == score_sample(args, right) and one["reward"] == 1.0 and one["acc"] == 1.0
    both = asyncio.run(batched_async_rm(args, [right, wrong]))
    assert both == [score_sample(args, right), score_sample(args, wrong)]
    assert both[1]["acc"] == 0.0 and both[1]["reward"] < -1.0  # wrong and inside the overlong window
    right.reward = one
    assert right.get_reward_value(args) == 1.0  # what training reads (--reward-key reward)


def test_prepared_jsonl_through_miles_prompt_dataset(tmp_path: Path) -> None:
    """The JSONL `beam-hpc prepare` writes, read by Miles's Dataset as the flags configure it
    (--input-key prompt --label-key label --apply-chat-template), with a real tokenizer."""
    from miles.utils.data import Dataset
    from transformers import AutoTokenizer

    from beam_hpc.data.prepare import TRAIN_FILE, prepare

    prepare(tmp_path, from_local=[FIXTURES / "dapo-math-17k-sample.parquet"], progress=False)
    path = tmp_path / TRAIN_FILE
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    tokenizer = AutoTokenizer.from_pretrained(str(TINY_TOKENIZER))
    ds = Dataset(str(path), tokenizer=tokenizer, processor=None, max_length=1024, prompt_key="prompt",
                 label_key="label", apply_chat_template=True)
    assert [s.label for s in ds.origin_samples] == [r["label"] for r in rows]
    for sample, row in zip(ds.origin_samples, rows, strict=True):
        want = tokenizer.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
        assert sample.prompt == want and row["prompt"][0]["content"] in sample.prompt
