"""The checkpoint check before a Miles segment resumes, on real Megatron ``torch_dist`` checkpoints.

The checkpoints are written by megatron-core's own ``dist_checkpointing.save`` on the CPU
(``tests/support/builders/miles/megatron_ckpt.py``), once per module, and copied per test before being damaged on purpose:
a shard file truncated, a format record or index missing, bytes overwritten inside a shard, the data
cursor missing. The launcher hook runs on the argv that ``miles_args.build_driver`` emits for the
dedicated recipe. Runtime: ~15-30 s, mostly importing megatron-core (twice: writer subprocess, here).
"""

from __future__ import annotations

import logging
import shutil
import sys
from pathlib import Path

import pytest
from megatron_ckpt import write_torch_dist_checkpoints

from beam_hpc.backends.miles import checkpoint as mc
from beam_hpc.backends.miles import launch as miles_launch
from beam_hpc.backends.miles.args import build_driver
from beam_hpc.config.recipe import load_recipe
from beam_hpc.config.site import Site
from beam_hpc.plan.plan import RUN_DIR
from beam_hpc.run.checkpoint_layout import dataset_state_path, iteration_dir, latest_iteration, saved_iterations

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]
ITERATIONS = [3, 7, 11]
SHARD = "__0_0.distcp"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three complete checkpoints (3, 7, 11; the pointer names 11), written by megatron-core."""
    ckpt = tmp_path_factory.mktemp("pristine") / "checkpoints"
    write_torch_dist_checkpoints(ckpt, ITERATIONS, seed=5)
    return ckpt


@pytest.fixture
def ckpt(pristine: Path, tmp_path: Path) -> Path:
    """A private copy to damage."""
    return Path(shutil.copytree(pristine, tmp_path / "run" / "checkpoints"))


def truncate(path: Path, keep: float = 0.6) -> None:
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(int(size * keep))


def test_megatron_writes_the_miles_layout(pristine: Path) -> None:
    """The helper's output is a real torch_dist checkpoint in Miles's layout, readable by megatron-core."""
    from megatron.core import dist_checkpointing

    assert saved_iterations(pristine) == ITERATIONS and latest_iteration(pristine) == 11
    it_dir = iteration_dir(pristine, 11)
    assert {"metadata.json", ".metadata", "common.pt", SHARD} <= {p.name for p in it_dir.iterdir()}
    common = dist_checkpointing.load_common_state_dict(str(it_dir))
    assert common["iteration"] == 11 and common["args"].ckpt_format == "torch_dist"
    shapes = {k: tuple(v.global_shape) for k, v in dist_checkpointing.load_tensors_metadata(str(it_dir)).items()}
    assert shapes["decoder.layers.self_attention.linear_qkv.weight"] == (2, 24, 8)
    assert all(dataset_state_path(pristine, it).is_file() for it in ITERATIONS)


def test_complete_checkpoint_passes(ckpt: Path, caplog: pytest.LogCaptureFixture) -> None:
    full = mc.check_iteration(ckpt, 11)
    assert full.ok and full.full_read and full.shard_bytes > 10_000, full
    cheap = mc.check_iteration(ckpt, 11, full_read_max_bytes=0)
    assert cheap.ok and not cheap.full_read
    with caplog.at_level(logging.WARNING, logger=mc.__name__):
        choice = mc.prepare_resume(ckpt)
    assert choice == mc.ResumeChoice(11, 11, ())
    assert latest_iteration(ckpt) == 11
    assert not [r for r in caplog.records if r.name == mc.__name__ and r.levelno >= logging.WARNING]


def test_truncated_shard_falls_back_to_the_previous_complete_one(ckpt: Path, caplog: pytest.LogCaptureFixture) -> None:
    truncate(iteration_dir(ckpt, 11) / SHARD)
    verdict = mc.check_iteration(ckpt, 11)
    assert not verdict.ok and not verdict.full_read  # found by sizes, before any full load
    assert f"{SHARD} is truncated" in verdict.reason()
    with caplog.at_level(logging.WARNING, logger=mc.__name__):
        choice = mc.prepare_resume(ckpt)
    assert choice is not None and (choice.iteration, choice.pointer, choice.fell_back) == (7, 11, True)
    assert latest_iteration(ckpt) == 7  # what Miles reads next
    text = caplog.text
    assert "iteration 11" in text and "truncated" in text and "instead of 11" in text
    assert iteration_dir(ckpt, 11).is_dir()  # left as evidence


def test_missing_metadata_walks_back_past_each_broken_iteration(ckpt: Path) -> None:
    (iteration_dir(ckpt, 11) / "metadata.json").unlink()
    (iteration_dir(ckpt, 7) / ".metadata").unlink()
    choice = mc.prepare_resume(ckpt)
    assert choice is not None and choice.iteration == 3
    reasons = {v.iteration: v.reason() for v in choice.skipped}
    assert "metadata.json is missing" in reasons[11] and ".metadata is missing" in reasons[7]
    assert latest_iteration(ckpt) == 3


def test_damage_inside_a_shard_is_found_by_the_full_load_only(ckpt: Path) -> None:
    """Same length, bytes overwritten: sizes cannot see it, megatron-core's full load does (the trade-off
    the module docstring describes for big checkpoints)."""
    shard = iteration_dir(ckpt, 11) / SHARD
    data = bytearray(shard.read_bytes())
    data[16:400] = b"\xff" * 384
    shard.write_bytes(bytes(data))
    assert mc.check_iteration(ckpt, 11, full_read_max_bytes=0).ok
    verdict = mc.check_iteration(ckpt, 11)
    assert verdict.full_read and "megatron-core cannot load it" in verdict.reason()


def test_missing_or_damaged_data_cursor_is_not_complete(ckpt: Path) -> None:
    dataset_state_path(ckpt, 11).unlink()
    truncate(dataset_state_path(ckpt, 7), keep=0.5)
    choice = mc.prepare_resume(ckpt)
    assert choice is not None and choice.iteration == 3
    reasons = {v.iteration: v.reason() for v in choice.skipped}
    assert "data cursor" in reasons[11] and "missing" in reasons[11]
    assert "data cursor" in reasons[7] and "damaged" in reasons[7]


def test_no_complete_checkpoint_is_a_clear_error(ckpt: Path) -> None:
    for it in ITERATIONS:
        truncate(iteration_dir(ckpt, it) / SHARD)
    with pytest.raises(mc.CheckpointCheckError) as err:
        mc.prepare_resume(ckpt)
    message = str(err.value)
    assert all(f"iteration {it}:" in message for it in ITERATIONS)
    assert "remove" in message and "latest_checkpointed_iteration.txt" in message and "--ref-load" in message
    assert latest_iteration(ckpt) == 11  # nothing rewritten


def test_pointer_bounds_the_choice_and_no_pointer_is_a_fresh_start(ckpt: Path, tmp_path: Path) -> None:
    (ckpt / "latest_checkpointed_iteration.txt").write_text("7\n")  # 11 above it: a save that never finished
    choice = mc.prepare_resume(ckpt)
    assert choice is not None and (choice.iteration, choice.fell_back) == (7, False)
    assert mc.prepare_resume(tmp_path / "empty") is None
    (ckpt / "latest_checkpointed_iteration.txt").write_text("garbage\n")
    with pytest.raises(mc.CheckpointCheckError, match="remove it to start from --ref-load"):
        mc.prepare_resume(ckpt)


def test_missing_megatron_is_said_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "megatron.core", None)  # what a login node without it sees
    with pytest.raises(mc.MegatronMissingError, match=r"beam-hpc\[megatron\]"):
        mc.check_iteration(".", 1)


# --- the hook in the launcher ----------------------------------------------------------------------

SITE = Site(name="t", container={"runtime": "host"})


def launcher_argv(run_dir: Path) -> list[str]:
    """The launcher part of the driver argv beam-hpc emits for the dedicated recipe (after ``-m module``)."""
    recipe = load_recipe(ROOT / "recipes" / "dedicated.yaml", [f"output_dir={run_dir}", "model.miles_model_script=null",
                                                               "model.miles_model_args=[--num-layers, '64']"])
    argv, _ = build_driver(recipe, SITE)
    # the run directory filled in, as the job does; the other placeholders stay (a test stops at Ray's address)
    return [a.replace(RUN_DIR, str(run_dir)) for a in argv[argv.index("-m") + 2:]]


def test_launcher_checks_the_argv_it_is_given(ckpt: Path) -> None:
    argv = launcher_argv(ckpt.parent)
    _, rest = miles_launch.parse_args(argv)
    truncate(iteration_dir(ckpt, 11) / SHARD)
    choice = miles_launch.check_resume(rest[1:])
    assert isinstance(choice, mc.ResumeChoice) and choice.iteration == 7 and latest_iteration(ckpt) == 7
    # --ckpt-step pins an iteration: checked as given, a broken one is an error, never replaced
    assert miles_launch.check_resume([*rest[1:], "--ckpt-step", "3"]).ok
    with pytest.raises(mc.CheckpointCheckError, match="--ckpt-step 11"):
        miles_launch.check_resume([*rest[1:], "--ckpt-step=11"])
    # not resuming / another format: nothing to check
    assert miles_launch.check_resume([*rest[1:], "--ckpt-format", "torch"]) is None
    assert miles_launch.check_resume(["--load-debug-rollout-data", str(ckpt)]) is None
    (ckpt / "latest_checkpointed_iteration.txt").unlink()
    assert miles_launch.check_resume(rest[1:]) is None


def test_launcher_main_checks_before_it_touches_ray(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``main`` runs the check before ``ray.init``: with the Plan's placeholders unfilled it gets exactly
    as far as Ray's address, after the fallback; with nothing complete it stops at the check."""
    argv = launcher_argv(ckpt.parent)
    argv[argv.index("--") :argv.index("--")] = ["--miles-dir", str(ROOT / "tests" / "support" / "standins" / "miles_standin")]
    for key in miles_launch.driver_environment("x", "x"):
        monkeypatch.setenv(key, "restored-after-the-test")
    truncate(iteration_dir(ckpt, 11) / SHARD)
    with pytest.raises(ValueError, match="ray_address"):
        miles_launch.main(argv)
    assert latest_iteration(ckpt) == 7
    for it in (3, 7):
        (iteration_dir(ckpt, it) / "metadata.json").unlink()
    with pytest.raises(mc.CheckpointCheckError, match="no complete checkpoint"):
        miles_launch.main(argv)
