"""Extra SGLang engines against the real programs: SGLang's own server-argument parser (the sglang
package the miles-rl 0.0.2 wheel ships) on the engine command, Miles's parser with all its
validation on the attached driver command, and Slurm's answer about the engine's job at segment start.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from polling import poll_until
from real_miles import require_miles
from test_external_engines import CONTRACT, STANDIN, filled, free_port, miles_plan

from beam_hpc.backends.miles import external_engines as ee
from beam_hpc.backends.miles import preflight
from beam_hpc.plan.plan import Plan
from beam_hpc.slurm import client
from beam_hpc.slurm.client import JobState

ROOT = Path(__file__).resolve().parents[3]
PARSER = ROOT / "tests" / "support" / "programs" / "sglang_server_args.py"


def sglang_parser(*args: str) -> list[dict]:
    """Run SGLang's parser program (its own process: the GPU-package stand-ins stay there)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    res = subprocess.run([sys.executable, str(PARSER), *args], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    return [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]


@pytest.mark.slow  # imports SGLang's server arguments: 15-30 s on a loaded 2-core machine
def test_the_contract_is_sglangs_parser() -> None:
    require_miles()
    live = {(",".join(r["flags"]), r["nargs"], r["dest"], json.dumps(r["default"])) for r in sglang_parser("dump")}
    written = {tuple(line.split("\t")) for line in CONTRACT.read_text().splitlines()
               if line and not line.startswith("#")}
    assert live == written


@pytest.mark.slow
def test_sglangs_parser_reads_the_engine_command(tmp_path: Path) -> None:
    require_miles()
    plan = miles_plan(tmp_path)
    argv = ee.engine_argv(plan, host="10.0.0.7", port=38001, gpu_ids=[4, 5], rank=2)
    (verdict,) = sglang_parser("parse", "--", *argv[3:])
    assert verdict["ok"], verdict
    got = verdict["args"]
    assert {k: got[k] for k in ("model_path", "tensor_parallel_size", "host", "port", "base_gpu_id", "gpu_id_step",
                                "random_seed", "trust_remote_code", "skip_server_warmup", "enable_metrics",
                                "enable_draft_weights_cpu_backup", "enable_memory_saver", "nnodes", "node_rank",
                                "data_parallel_size", "pipeline_parallel_size", "expert_parallel_size")} == {
        "model_path": plan.recipe.model.path, "tensor_parallel_size": 2, "host": "10.0.0.7", "port": 38001,
        "base_gpu_id": 4, "gpu_id_step": 1, "random_seed": plan.recipe.seed + 2, "trust_remote_code": True,
        "skip_server_warmup": True, "enable_metrics": True, "enable_draft_weights_cpu_backup": True,
        "enable_memory_saver": False, "nnodes": 1, "node_rank": 0, "data_parallel_size": 1,
        "pipeline_parallel_size": 1, "expert_parallel_size": 1}
    assert got["mem_fraction_static"] == plan.recipe.performance.sglang_mem_fraction


@pytest.mark.slow  # imports Miles, Megatron and SGLang: 20-40 s on a loaded 2-core machine
def test_miles_accepts_the_attached_driver_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The dedicated recipe with the remedies miles-rl 0.0.2 needs (test_miles_real), two engines
    attached: Miles's whole validation passes on ``--rollout-external``, the addresses,
    ``--worker-urls`` and the attached GPU count."""
    require_miles()
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    plan = miles_plan(tmp_path, "training.offload.target=cpu", "lifecycle.save_on_request=false")
    engines = [ee.Engine("10.0.0.5", 40001, 2, "12"), ee.Engine("10.0.0.6", 40001, 2, "12")]
    argv = ee.attach_argv(list(plan.driver_argv), engines)
    verdict = preflight.run_check(plan.site, argv, plan.output_dir, env=preflight._env(plan.driver_env, plan.output_dir),
                                  num_rollout=plan.recipe.num_rollout)
    # (that this check can fail, naming the flag Miles does not know, is
    # tests/backends/miles/test_miles_real.py::test_real_miles_refuses_the_flags_it_lacks: a second
    # check here would import Miles, Megatron and SGLang again for the same answer)
    assert verdict.ok, verdict.refusal()


def start_engine_job(plan: Plan, where: Path, gpu_ids: list[int]) -> tuple[str, ee.Engine]:
    """An extra job's engine as the extra job starts it: the SGLang stand-in in a Slurm job of its
    own on the local cluster, ``engine_argv`` for the run's plan, registered once it answers."""
    port = free_port()
    cmd = ee.engine_argv(plan, host="127.0.0.1", port=port, gpu_ids=gpu_ids, rank=0)
    script = where / f"engine-{port}.sh"
    script.write_text(f"#!/bin/bash\nexport PYTHONPATH={STANDIN}\nexec {sys.executable} {' '.join(cmd[1:])}\n")
    job = client.sbatch([f"--job-name=beam-engines-{os.getpid()}", "--nodes=1", "--ntasks=1", "--cpus-per-task=1",
                         "--time=00:10:00", f"--output={where}/engine-%j.out", str(script)])
    engine = ee.Engine("127.0.0.1", port, len(gpu_ids), job)
    try:
        assert poll_until(lambda: client.job_state(job) == JobState.RUNNING, 120), client.job_state(job)
        out = where / f"engine-{job}.out"
        assert poll_until(lambda: ee.healthy(engine, 0.5), 60), out.read_text() if out.exists() else "no output"
    except BaseException:
        client.cancel([job])
        raise
    ee.register(plan.output_dir, job, [engine])
    return job, engine


@pytest.mark.slow
@pytest.mark.slurm
def test_segment_start_asks_slurm_whether_the_engines_job_runs(tmp_path: Path,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    """An engine runs inside a Slurm job of the local cluster, registered under that job's id: the
    selection a segment would make (``attach_live``, once Miles starts engines it did not launch)
    keeps it while the job runs; once the job is cancelled, Slurm says so and it is left out with a
    line in the log. (A Miles chain, whose segments refuse registered engines, is in
    ``test_miles_slurm.py``.)"""
    plan = miles_plan(tmp_path, "topology.rollout.nodes=1", "topology.rollout.gpus_per_node=2")
    job, engine = start_engine_job(plan, tmp_path, [0, 1])
    try:
        with caplog.at_level(logging.INFO):
            out = ee.attach_live(plan, filled(plan), ee.registered(plan.output_dir))
        assert out[out.index("--rollout-external-engine-addrs") + 1] == engine.addr
        assert out[out.index("--rollout-num-gpus") + 1] == "2"
    finally:
        client.cancel([job])
    assert poll_until(lambda: client.job_state(job) in (JobState.CANCELLED, None), 120)
    caplog.clear()
    with caplog.at_level(logging.INFO):
        assert ee.attach_live(plan, filled(plan), ee.registered(plan.output_dir)) == filled(plan)
    assert f"engine {engine.addr} of extra job {job} left out: the job is no longer running" in caplog.text
