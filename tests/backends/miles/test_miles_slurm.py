"""The Miles launch path end to end on the local Slurm cluster, with a contract double of Miles.

Real parts: the user's submission (``beam_hpc.submission.submit.submit(via="sbatch")``: plan, rendered
heterogeneous script, login-node checks, sbatch), Slurm, the segment and its lifecycle watchdog,
Ray on both groups, beam-hpc's Miles launcher (``beam_hpc.backends.miles.launch``) with its
placement patch, the resubmission with ``--resume``.

The seam: Miles itself cannot run here (GPU image), so the site points the Miles directory at
``tests/support/standins/miles_standin/`` (``PYTHONPATH``/``MILES_DIR`` in the site's environment, where the image
would have Miles). Its ``train_async.py`` is a *contract double* (see
``tests/support/standins/miles_standin/standin_driver.py``): it parses the Miles flags it needs, records its argv and
environment, rolls out (short sleeps), saves in Miles's layout at the interval and when the
``--save-trigger-sentinel`` file exists (then removes the file), resumes from ``--load`` and stops at
``--num-rollout``. GPUs are Slurm's fake GPUs of the local cluster.

The walltime path is entered the way Slurm enters it: the walltime warning (USR1) to the batch
shell, sent with ``scancel --batch --signal=USR1`` once the driver runs, instead of waiting for a
real time limit (slurmctld's 30 s signal granularity would cost a minute or more).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import run_watch
from miles_run import NUM_ROLLOUT, PROMPTS, STANDIN, local_site, miles_recipe
from run_watch import chain_finished, diagnostics, segments

from beam_hpc.backends.miles import args as miles_args
from beam_hpc.backends.miles import external_engines
from beam_hpc.config.recipe import recipe_from_dict
from beam_hpc.config.site import site_from_dict
from beam_hpc.plan.plan import fill as plan_fill
from beam_hpc.run import checkpoint_layout

ROOT = Path(__file__).resolve().parents[3]
TIMEOUT_S = 300  # a shared 2-core machine; the chain takes about a minute when it is quiet


@pytest.fixture
def run_dir() -> Iterator[Path]:
    """Outside pytest's numbered temp dirs (other sessions prune those), kept short for Ray."""
    root = Path(tempfile.mkdtemp(prefix="beam-ms-", dir="/tmp"))
    yield root / "run"
    shutil.rmtree(root, ignore_errors=True)


def wait_for(what: str, predicate: Callable[[], object], run: Path, timeout: float = TIMEOUT_S) -> object:
    return run_watch.wait_for(what, predicate, run, timeout, poll_s=0.3)


def _json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


@pytest.mark.slow
@pytest.mark.slurm
@pytest.mark.ray
@pytest.mark.e2e
def test_walltime_save_at_sentinel_then_resume_with_exact_miles_flags(slurm_cluster, run_dir: Path) -> None:
    """Segment 1: the walltime warning -> sentinel -> the double saves at its next rollout and
    removes the file -> the segment stops and resubmits itself with --resume. Segment 2: the
    double loads that checkpoint from --load and finishes. Both launches got exactly the flags
    miles_args builds for the plan, and the address variables of the job's head node. An extra
    engine registered for the run before it starts (as a beam-hpc that still added engines to Miles
    runs left it) is attached to neither: Miles starts no engine it did not launch (its layout gives
    an external rollout no bundles), and each segment says so in its log and runs its own rollout group."""
    from beam_hpc.backends.registry import plan_for
    from beam_hpc.submission.submit import submit

    recipe = recipe_from_dict(miles_recipe(run_dir.parent), "miles test recipe")
    site = site_from_dict(local_site(), "local site, Miles double")
    plan = plan_for(recipe, site)
    engine = external_engines.Engine("127.0.0.1", 1, external_engines.gpus_per_engine(plan))
    external_engines.register(plan.output_dir, 4242, [engine])
    sub = submit(recipe, site, via="sbatch")
    first, plan = str(sub.job_id), sub.plan
    dumps = run_dir / "dumps"
    # the double's first record: the driver runs (so the segment saves rather than just stops), and
    # the sentinel will be there early in its loop, far from num_rollout
    wait_for("the double to start in segment 1", lambda: (dumps / "standin-0.json").exists(), run_dir)
    slurm_cluster.run("scancel", "--batch", "--signal=USR1", first)  # Slurm's walltime warning
    wait_for("the chain to finish", lambda: chain_finished(run_dir), run_dir)

    segs = segments(run_dir)
    t0 = segs[0]["start"]["time"]
    print("\nsegments (start, end) s after the first start, end detail:\n" + "\n".join(
        f"  {s['segment']}: {s['start']['time'] - t0:.1f} {s.get('end', {}).get('time', t0) - t0:.1f} "
        f"{s.get('end', {}).get('detail')}" for s in segs))
    assert [s["end"]["reason"] for s in segs] == ["walltime", "completed"], diagnostics(run_dir)
    second = segs[1]["start"]["job_id"]
    assert segs[0]["start"]["job_id"] == first and not segs[0]["start"]["resume"]
    assert segs[0]["end"]["next"] == {"action": "resubmit", "job_id": second}
    assert "saved on request" in segs[0]["end"]["detail"] and segs[1]["start"]["resume"]

    # segment 1: one save, the one the sentinel asked for, and the file is gone
    one = _json(dumps / "standin-0.json")
    (save,) = one["saves"]
    k = save["rollout_id"]
    assert save["why"] == ["sentinel"] and one["rollouts"][-1] >= k and not one.get("finished")
    assert segs[0]["end"]["rollouts_at_end"] == k + 1 == segs[1]["start"]["rollouts_at_start"]
    assert not (run_dir / "SAVE_NOW").exists()
    # what each segment ran comes from the TensorBoard scalars the double writes under Miles's names
    # (perf/step_time per rollout step): the ledger's rollouts run and step seconds, and status
    assert segs[0]["end"]["rollouts_run"] == len(one["rollouts"]) > 0, segs[0]["end"]
    assert segs[0]["end"]["timings"]["rollout_s"] >= 0.3 * 0.9  # BEAM_STANDIN_ROLLOUT_S

    # segment 2: loaded rollout k's checkpoint and data cursor from --load, finished the run
    two = _json(dumps / f"standin-{k + 1}.json")
    assert two["loaded"] == {"from": "load", "path": plan.paths.checkpoints, "iteration": k,
                             "sample_offset": (k + 1) * PROMPTS}
    assert two["rollouts"] == list(range(k + 1, NUM_ROLLOUT)) and two["finished"]
    assert two["saves"][-1]["rollout_id"] == NUM_ROLLOUT - 1 and "final" in two["saves"][-1]["why"]
    assert checkpoint_layout.latest_iteration(plan.paths.checkpoints) == NUM_ROLLOUT - 1
    assert checkpoint_layout.resume_problems(plan.paths.checkpoints) == []
    assert segs[1]["end"]["rollouts_run"] == len(two["rollouts"])
    from beam_hpc.observe.status import gather

    status = gather(run_dir, slurm=False)
    assert [r["rollouts_run"] for r in status["segments"]] == [len(one["rollouts"]), len(two["rollouts"])]
    assert status["metrics_source"] == "tensorboard" and status["reward"]["rollout"] == NUM_ROLLOUT - 1
    # the eval the double logged as Miles does, both checkers (the command has --log-reward-category)
    assert status["eval"]["accuracy"] == 0.5 and status["eval"]["miles_checker"]["accuracy"] == 0.25

    # the flags of both launches are what miles_args builds for this plan (--load on the resume too)
    # (the plan carries --num-rollout {num_rollout}, each segment filling in the total it runs to,
    # and names the run directory {run_dir}, filled from the plan's output_dir)
    expected = [plan_fill(a, num_rollout=str(NUM_ROLLOUT), run_dir=plan.output_dir)
                for a in miles_args.miles_args(recipe, site)]
    assert "{num_rollout}" in miles_args.miles_args(recipe, site)
    # neither segment attached the registered engine (no --rollout-external reached the double), and
    # each said why, naming Miles's line, in its own log
    assert one["argv"][1:] == expected and two["argv"][1:] == expected
    assert not any(a.startswith("--rollout-external") for a in one["argv"] + two["argv"])
    left_out = "1 registered engines left out: backend: miles: Miles cannot start engines it did not launch"
    logs = [p for p in run_dir.rglob("*") if p.is_file() and left_out in p.read_text(errors="replace")]
    assert {p.read_text(errors="replace").count("server_group.py:90-91") > 0 for p in logs} == {True}, \
        diagnostics(run_dir)
    assert len({p.parent for p in logs}) >= 2, [str(p) for p in logs]  # one line in each segment's logs
    for record, job in ((one, first), (two, second)):
        assert Path(record["argv"][0]) == STANDIN / miles_args.ENTRY_ASYNC
        assert record["argv"][record["argv"].index("--load") + 1] == plan.paths.checkpoints
        rt = _json(run_dir / "logs" / f"{job}-0" / "runtime.json")
        assert record["env"] == {"MASTER_ADDR": rt["head_ip"], "MILES_HOST_IP": rt["head_ip"]}
        env = record["environ"]
        assert env["TENSORBOARD_DIR"] == plan.paths.tensorboard and env["BEAM_JOB_ID"] == job
        assert env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1" and env["RAY_AUTH_MODE"] == "token"
        assert env["BEAM_REWARD_OVERLONG_BUFFER"] == "16"
        # training bundles on the trainer group's node, as the launcher's placement proof says
        assert {r["node"] for r in record["actor"]} != {r["node"] for r in record["rollout"]}
        assert all(r["gpus"] == [r["expected_gpu"]] for r in record["actor"] + record["rollout"])
    proof = _json(run_dir / "placement.json")
    assert [b["node_group"] for b in proof["bundles"]] == ["trainer", "other"]
    assert proof["bundles"][0]["node"] == two["actor"][0]["node"]
    for record, job in ((one, first), (two, second)):  # last: the one known gap (see the message)
        rt = _json(run_dir / "logs" / f"{job}-0" / "runtime.json")
        assert record["environ"]["RAY_ADDRESS"] == f"{rt['head_ip']}:{rt['gcs_port']}", (
            "RAY_ADDRESS reached the driver as the Plan's placeholder: beam_hpc.job.runner must fill the "
            "placeholders of plan.driver_env as it fills those of plan.driver_argv")


@pytest.mark.slow
def test_the_doubles_entry_points_keep_mileses_rules(tmp_path: Path) -> None:
    """The ``train.py`` double (in turn / colocated) takes ``--colocate``, saves at the sentinel and
    removes it; the ``train_async.py`` double refuses ``--colocate`` as Miles's does. Run directly,
    with no Ray cluster to place on (the launcher provides one in the test above)."""
    env = {**os.environ, "PYTHONPATH": str(STANDIN), "BEAM_STANDIN_ROLLOUT_S": "0"}
    ckpt, sentinel = tmp_path / "ckpt", tmp_path / "SAVE_NOW"
    sentinel.write_text("{}")
    flags = ["--actor-num-nodes", "1", "--actor-num-gpus-per-node", "2", "--colocate", "--dump-details",
             str(tmp_path / "dumps"), "--save", str(ckpt), "--load", str(ckpt), "--save-interval", "100",
             "--save-trigger-sentinel", str(sentinel), "--num-rollout", "1", "--rollout-batch-size", "4"]
    done = subprocess.run([sys.executable, str(STANDIN / "train.py"), *flags], env=env, capture_output=True,
                          text=True, timeout=180, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    record = _json(tmp_path / "dumps" / "standin-0.json")
    # one rollout, one save for both reasons (each save is a megatron-core process of its own; a
    # sentinel save apart from the final one: the walltime chain above)
    assert [(s["rollout_id"], s["why"]) for s in record["saves"]] == [(0, ["sentinel", "final"])]
    assert not sentinel.exists() and checkpoint_layout.latest_iteration(ckpt) == 0
    assert {".metadata", "metadata.json"} <= {p.name for p in checkpoint_layout.iteration_dir(ckpt, 0).iterdir()}
    refused = subprocess.run([sys.executable, str(STANDIN / "train_async.py"), *flags], env=env,
                             capture_output=True, text=True, timeout=180, check=False)
    assert refused.returncode != 0 and "Colocation is not supported for async training" in refused.stderr
