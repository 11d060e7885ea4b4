"""The reference backend end to end: real Ray, real processes, real checkpoints on disk.

Each run is ``python -m beam_hpc.backends.reference`` in its own process, as the runtime starts
it; most connect to one real local Ray head shared by the session (``reference_ray``), one uses
``--ray-address local``. "Interrupted" means a run that stopped after its checkpoint at rollout k
(``backend_options.stop_after_rollout``, Miles's --debug-exit-after-rollout idea) followed by a
new process that resumes; it must end bitwise equal to a run that was never interrupted.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from job_plans import HOST_SITE, make_test_plan
from real_miles import have_miles
from reference_harness import (
    SMALL,
    assert_bitwise_equal,
    load_checkpoint,
    metrics,
    run_backend,
)

from beam_hpc.run import metric_names as names

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.e2e]


def _plan(run_dir: Path, assets, overrides: list[str]) -> Path:
    return Path(make_test_plan(run_dir, assets=assets, overrides=overrides, site=HOST_SITE).paths.plan)


def _run(tmp: Path, name: str, assets, address: str, overrides: list[str], env=None) -> tuple[Path, str]:
    run_dir = tmp / name
    plan = _plan(run_dir, assets, [*SMALL, *overrides])
    return run_dir, run_backend(plan, address, env=env).stdout


def _iter(run_dir: Path, k: int) -> Path:
    return run_dir / "checkpoints" / f"iter_{k:07d}"


def _check_a_short_async_run(run_dir: Path, out: str) -> None:
    """What a short async run (3 rollouts, eval every 2, checkpoints every 2) leaves: progress lines,
    placement on the shared head, metrics, evals with both checkers' verdicts, dumps, TensorBoard
    events and its checkpoints. The head carries both group resources and beam-group=local, as the
    backend's own `--ray-address local` cluster does (that path is the NVMe test's below)."""
    progress = [line for line in out.splitlines() if " rollout " in line and "/3 reward" in line]
    assert len(progress) == 3 and "lag 1" in progress[-1]
    placement = json.loads((run_dir / "placement.json").read_text())
    assert placement["trainer"]["group"] == "local" and placement["trainer"]["node_id"] in placement["nodes"]
    assert [w["role"] for w in placement["rollout"]] == ["rollout"]
    node = placement["nodes"][placement["trainer"]["node_id"]]
    assert node["group_resources"] == {"beam_trainer": 1000.0, "beam_rollout": 1000.0}
    rollouts = metrics(run_dir, "rollout")
    assert [m["rollout_id"] for m in rollouts] == [0, 1, 2]
    assert [m[names.POLICY_LAG] for m in rollouts] == [0.0, 1.0, 1.0]  # one-step-off, as train_async.py
    for tag in (names.ROLLOUT_REWARD, names.ROLLOUT_CORRECT, names.ROLLOUT_RESPONSE_LEN, names.ROLLOUT_TIME, names.TRAIN_TIME):
        assert all(tag in m for m in rollouts), tag
    assert all(-2.0 <= m[names.ROLLOUT_REWARD] <= 1.0 and 0 < m[names.ROLLOUT_RESPONSE_LEN] <= 20 for m in rollouts)
    evals = metrics(run_dir, "eval")
    assert [m["rollout_id"] for m in evals] == [0, 2]  # before training, then every 2 rollouts
    # the tiny recipe's eval set is named as what it is (data.eval_name), not the seed's aime25
    acc, length = names.eval_accuracy_tag("tiny-add"), names.eval_response_len_tag("tiny-add")
    assert all(0.0 <= m[acc] <= 1.0 and m[length] > 0 and names.EVAL_ACCURACY not in m for m in evals)
    # Miles's own checker beside beam-hpc's: the verdict fractions add up (where miles-rl is not
    # installed, every verdict is "unavailable", as status then shows it)
    kinds = (names.MILES_CORRECT, names.MILES_WRONG) if have_miles() else (names.MILES_UNAVAILABLE,)
    verdicts = [names.eval_miles_verdict_tag("tiny-add", v) for v in kinds]
    assert all(sum(m.get(t, 0.0) for t in verdicts) == pytest.approx(1.0) for m in evals), evals
    assert "eval after 2 rollouts: tiny-add accuracy " in out
    assert [m["rollout_id"] for m in metrics(run_dir, "save")] == [1, 2]
    samples = (run_dir / "dumps" / "rollout" / "rollout_0000001.jsonl").read_text().splitlines()
    assert len(samples) == 16 and {"response", "reward", "advantage", "correct"} <= set(json.loads(samples[0]))
    assert len((run_dir / "dumps" / "eval" / "eval_0000002.jsonl").read_text().splitlines()) == 30 * 2
    assert json.loads((run_dir / "dumps" / "train" / "train_0000002.json").read_text())["policy_lag"] == 1
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert (run_dir / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    ck = load_checkpoint(_iter(run_dir, 2))
    assert {"model.pt", "optimizer.pt", "scheduler.pt", "rng_trainer.pt", "driver.pt"} <= set(ck)
    assert ck["driver.pt"]["inflight"] is None and ck["driver.pt"]["behaviour"]  # last rollout: W_k only
    assert (run_dir / "checkpoints" / "rollout" / "global_dataset_state_dict_2.pt").is_file()


def _compare(a: Path, b: Path, k: int) -> None:
    n = assert_bitwise_equal(load_checkpoint(_iter(a, k)), load_checkpoint(_iter(b, k)), f"iter {k}")
    assert n > 50  # model, optimizer moments, RNG and behaviour weights were all compared


def test_async_resume_is_bitwise_equal(tmp_path, tiny_assets, reference_ray) -> None:
    """Interrupted with a rollout in flight, and extended after a run that ended: both end bitwise
    equal to the uninterrupted run. The extended run's first part is also the short async run
    whose files are checked (_check_a_short_async_run): one run, not two."""
    base = ["num_rollout=5", "checkpoint.interval=2", "eval.interval=2"]
    whole, _ = _run(tmp_path, "whole", tiny_assets, reference_ray, base)
    # Interrupted after the checkpoint at rollout 1, with rollout 2 in flight.
    cut, out = _run(tmp_path, "cut", tiny_assets, reference_ray, [*base, "backend_options.stop_after_rollout=1"])
    assert "/5 reward" in out and not _iter(cut, 3).exists()
    first = load_checkpoint(_iter(cut, 1))["driver.pt"]
    assert first["inflight"] is not None and first["asynchronous"]
    # The resumed half broadcasts the weights over a gloo group (nccl's code path on CPU): an
    # inexact transport would change the rollouts, and with them every trained bit.
    _, out = _run(tmp_path, "cut", tiny_assets, reference_ray, [*base, "backend_options.weight_sync=nccl"])
    assert "resumed from checkpoint 1: continuing at rollout 2" in out
    assert "weight sync: gloo group of 2 at " in out
    _compare(whole, cut, 4)
    # Extended: a run that ended at its last rollout (nothing in flight), then num_rollout raised.
    ext, out = _run(tmp_path, "ext", tiny_assets, reference_ray, ["num_rollout=3", "checkpoint.interval=2",
                                                                 "eval.interval=2"])
    _check_a_short_async_run(ext, out)
    _run(tmp_path, "ext", tiny_assets, reference_ray, base)
    _compare(whole, ext, 4)
    assert [m[names.POLICY_LAG] for m in metrics(ext, "rollout")] == [0.0, 1.0, 1.0, 1.0, 1.0]


def test_sync_resume_is_bitwise_equal_and_the_sentinel_saves(tmp_path, tiny_assets, reference_ray) -> None:
    """The save sentinel both ways: as the lifecycle writes it ("then": "stop": save at the next
    boundary and exit, so nothing is trained that nobody keeps) and as a user's ``touch`` (Miles's
    semantics: save and go on). Three processes, one run, bitwise equal to an uninterrupted one."""
    from beam_hpc.lifecycle import save
    from beam_hpc.plan.plan import Plan

    base = ["num_rollout=4", "checkpoint.interval=3", "training.async_training=false"]
    whole, _ = _run(tmp_path, "whole", tiny_assets, reference_ray, base)
    cut = tmp_path / "cut"
    save.request_save(Plan.load(_plan(cut, tiny_assets, [*SMALL, *base])).paths, "walltime")
    _, out = _run(tmp_path, "cut", tiny_assets, reference_ray, base)
    assert "save sentinel honoured at rollout 0 and removed; stopping, as it asks" in out
    assert _iter(cut, 0).is_dir() and not _iter(cut, 1).exists() and not (cut / "SAVE_NOW").exists()
    assert [m["rollout_id"] for m in metrics(cut, "rollout")] == [0]  # nothing trained after the save
    (cut / "SAVE_NOW").touch()  # a plain file: save at the next boundary, then train on
    _, out = _run(tmp_path, "cut", tiny_assets, reference_ray, [*base, "backend_options.stop_after_rollout=2"])
    assert "save sentinel honoured at rollout 1 and removed\n" in out and not (cut / "SAVE_NOW").exists()
    assert _iter(cut, 1).is_dir() and _iter(cut, 2).is_dir()  # 1: the sentinel; 2: the stop
    assert not _iter(whole, 0).exists() and not _iter(whole, 1).exists()  # interval 3 alone
    _run(tmp_path, "cut", tiny_assets, reference_ray, base)
    _compare(whole, cut, 3)
    assert load_checkpoint(_iter(cut, 1))["driver.pt"]["behaviour"] is None  # sync: nothing in flight
    assert {m[names.POLICY_LAG] for m in metrics(whole, "rollout")} == {0.0}


def test_lora_resume_restores_adapters_optimizer_and_scheduler(tmp_path, tiny_assets, reference_ray) -> None:
    lora = ["num_rollout=3", "training.mode=lora", "training.lora={rank: 4, alpha: 8}", "training.offload.target=none",
            "training.optimizer.lr=1.0e-3", "training.optimizer.warmup_rollouts=2"]
    whole, _ = _run(tmp_path, "whole", tiny_assets, reference_ray, lora)
    cut, _ = _run(tmp_path, "cut", tiny_assets, reference_ray, [*lora, "backend_options.stop_after_rollout=0"])
    _run(tmp_path, "cut", tiny_assets, reference_ray, lora)
    _compare(whole, cut, 2)
    ck = load_checkpoint(_iter(cut, 2))
    assert ck["model.pt"] and all("lora_" in k for k in ck["model.pt"])  # adapters only
    assert ck["scheduler.pt"]["last_epoch"] == 3  # warm-up position restored across the cut
    first = load_checkpoint(_iter(cut, 0))["model.pt"]
    assert any(not bool((first[k] == ck["model.pt"][k]).all()) for k in first)  # adapters trained


def _bytes_of_pt_files(root: Path) -> int:
    """What the ``.pt`` files under ``root`` hold now; 0 if the tree goes while it is walked (the
    trainer removes its scratch at the end, which a walk can meet halfway)."""
    try:
        return sum(f.stat().st_size for f in root.rglob("*.pt") if f.is_file())
    except FileNotFoundError:
        return 0


def test_nvme_offload_keeps_optimizer_files_in_the_staged_dir_only_while_training(tmp_path, tiny_assets) -> None:
    # BEAM_NVME_DIR is node environment (the runtime exports it to `ray start` on trainer nodes),
    # so this run starts its own local Ray, which inherits the variable like a node would.
    staged = tmp_path / "nvme"
    staged.mkdir()
    run_dir = tmp_path / "nvme-run"
    plan = _plan(run_dir, tiny_assets, [*SMALL, "num_rollout=4", "training.offload.target=nvme"])
    argv = [sys.executable, "-m", "beam_hpc.backends.reference", "--plan", str(plan), "--ray-address", "local"]
    env = {**__import__("os").environ, "RAY_AUTH_MODE": "disabled", "BEAM_NVME_DIR": str(staged)}
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = 0
    while proc.poll() is None:  # watch the directory from outside while it trains
        seen = max(seen, _bytes_of_pt_files(staged))
        time.sleep(0.05)
    out = proc.stdout.read()
    assert proc.returncode == 0, out[-3000:]
    # `--ray-address local`: the backend's own one-node cluster carries both groups, labelled local
    placement = json.loads((run_dir / "placement.json").read_text())
    assert {placement["trainer"]["group"]} | {w["group"] for w in placement["rollout"]} == {"local"}
    node = placement["nodes"][placement["trainer"]["node_id"]]
    assert node["group"] == "local" and node["group_resources"] == {"beam_trainer": 1000.0, "beam_rollout": 1000.0}
    assert seen > 100_000  # AdamW moments of a 0.8M-parameter model: ~6.7 MB
    assert not list(staged.rglob("*.pt"))  # scratch removed at the end
    trained = [json.loads(p.read_text()) for p in sorted((run_dir / "dumps" / "train").glob("*.json"))]
    assert all(t["offload_files"] > 0 and t["offload_bytes"] > 100_000 for t in trained)
    opt = load_checkpoint(_iter(run_dir, 3))["optimizer.pt"]  # the durable copy is complete
    assert all({"exp_avg", "exp_avg_sq", "step"} <= set(s) for s in opt["state"].values())


IN_TURN = ["training.async_training=false"]
COLOCATED = ["training.colocated=true", "training.async_training=false", "topology.rollout=null"]
COLOCATED_ROLLOUTS = 6  # five swaps between generation and training, and the eval after 5


def _learning_numbers(run_dir: Path, upto: int) -> list[dict]:
    """Every rollout, training and eval number up to rollout ``upto`` (timings, the wall-clock time
    of each row, and offload sizes, which depend on the machine and the placement, left out)."""
    return [{k: v for k, v in m.items() if not k.startswith("perf/") and k != "time"}
            for kind in ("rollout", "eval") for m in metrics(run_dir, kind) if m["rollout_id"] <= upto]


def test_colocated_computes_what_in_turn_computes_bit_for_bit(tmp_path, tiny_assets, reference_ray) -> None:  # type: ignore[no-untyped-def]
    """Colocated (one group: the policy generates, is swapped out, trains, is swapped back) computes
    exactly what in turn (``--no-async-training``, two groups) computes: the same seeded rollouts,
    rewards, losses, gradient norms and evals, bit for bit, over six rollouts of the embedded default
    (five swaps and the eval after 5; measured over 20 rollouts once: equal throughout).

    What this stands for: that both sync modes learn. A 20-rollout in-turn learning run (318 s of the
    suite) was dropped for it: the optimizer's learning is the async default's
    (tests/cli/test_execute.py, README's run), and in turn computing what colocated computes, where
    the policy that generates is the one that trains, means its weight updates reach its engine: a
    rollout worker left on stale weights would differ here from the second rollout on."""
    base = [f"num_rollout={COLOCATED_ROLLOUTS}", "checkpoint.interval=20"]
    in_turn_dir, run_dir = tmp_path / "in-turn", tmp_path / "colocated"
    run_backend(_plan(in_turn_dir, tiny_assets, [*base, *IN_TURN]), reference_ray)
    run_backend(_plan(run_dir, tiny_assets, [*base, *COLOCATED]), reference_ray)
    placement = json.loads((run_dir / "placement.json").read_text())  # one group: trainer and engine on one node
    assert placement["trainer"]["node_id"] == placement["rollout"][0]["node_id"]
    in_turn_placement = json.loads((in_turn_dir / "placement.json").read_text())
    assert [w["role"] for w in in_turn_placement["rollout"]] == ["rollout"]
    assert {m[names.POLICY_LAG] for m in metrics(run_dir, "rollout")} == {0.0}
    assert {m[names.POLICY_LAG] for m in metrics(in_turn_dir, "rollout")} == {0.0}
    last = COLOCATED_ROLLOUTS - 1
    mine, in_turn = _learning_numbers(run_dir, last), _learning_numbers(in_turn_dir, last)
    assert len(mine) == COLOCATED_ROLLOUTS + 2 and [m["rollout_id"] for m in mine if m["kind"] == "eval"] == [0, 5]
    assert mine == in_turn


@pytest.mark.slow
@pytest.mark.ray
def test_truncated_checkpoint_is_skipped_for_the_previous_complete_one(tmp_path, tiny_assets, reference_ray) -> None:
    """Checkpoints at rollouts 1 and 3; model.pt of 3 is cut in half on purpose. The resumed run
    warns, starts from checkpoint 1 (so rollouts 2-3 are trained again) and reaches the total."""
    from beam_hpc.run import checkpoint_layout as layout

    run = tmp_path / "run"
    plan = _plan(run, tiny_assets, SMALL + ["checkpoint.interval=2", "num_rollout=4"])
    run_backend(plan, reference_ray)
    assert layout.latest_iteration(run / "checkpoints") == 3
    model = layout.iteration_dir(run / "checkpoints", 3) / "model.pt"
    model.write_bytes(model.read_bytes()[: model.stat().st_size // 2])
    plan = _plan(run, tiny_assets, SMALL + ["checkpoint.interval=2", "num_rollout=6"])
    proc = run_backend(plan, reference_ray)
    assert "checkpoint 3 skipped for complete checkpoint 1" in proc.stdout + proc.stderr
    assert layout.latest_iteration(run / "checkpoints") == 5  # resumed after 1: rollouts 2.. redone
    trained = [m["rollout_id"] for m in metrics(run, "rollout")]
    assert trained.count(2) == 2 and trained[-1] == 5, trained
