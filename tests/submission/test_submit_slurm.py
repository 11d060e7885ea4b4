"""`beam-hpc submit` on the real local Slurm cluster, through both ways in.

- `--smoke --via sbatch`: the real rendered hetjob brings Ray up on both groups and writes
  smoke.json (every task on its own group's nodes), touching no lock, ledger or checkpoint;
- `beam_hpc.submission.submit.submit(..., via="submitit")`: the same heterogeneous job through beam-hpc's
  submitit executor returns a submitit Job whose state / done() / result() work without sacct,
  and the run it drives (the tiny recipe, reference backend) completes with its checkpoint.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from beam_hpc.cli.app import main
from beam_hpc.run import checkpoint_layout
from beam_hpc.submission.submit import submit

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.slurm, pytest.mark.ray]


def tiny_overrides(assets) -> list[str]:  # type: ignore[no-untyped-def]
    from reference_harness import SMALL

    return [f"model.path={assets.model_dir}", f"data.dir={assets.data_dir}",
            "topology.trainer.gpus_per_node=2", "topology.rollout.gpus_per_node=1", *SMALL]


def test_submit_smoke_via_sbatch(tmp_path: Path, tiny_assets, slurm_cluster, capsys) -> None:  # type: ignore[no-untyped-def]
    run = tmp_path / "smoke"
    args = ["submit", str(REPO / "recipes" / "tiny.yaml"), "--site", str(REPO / "env" / "local.yaml"),
            "--output-dir", str(run), "--via", "sbatch", "--smoke"]
    for item in tiny_overrides(tiny_assets):
        args += ["--set", item]
    assert main(args) == 0
    job_id = capsys.readouterr().out.split("submitted job ")[1].split()[0]
    slurm_cluster.wait_for_job(job_id, timeout=300)
    smoke = json.loads((run / "smoke.json").read_text())
    assert smoke["ok"] and not smoke["misplaced"], smoke
    assert smoke["groups"]["trainer"]["gpus"] == 2 and smoke["groups"]["rollout"]["gpus"] == 1
    trainer_nodes = set(smoke["groups"]["trainer"]["nodes"])
    assert trainer_nodes.isdisjoint(smoke["groups"]["rollout"]["nodes"])
    assert not (run / "ledger.jsonl").exists() and not (run / "checkpoints").exists()


def test_submit_via_submitit_returns_a_working_job(tmp_path: Path, tiny_assets, slurm_cluster) -> None:  # type: ignore[no-untyped-def]
    run = tmp_path / "run"
    sub = submit(REPO / "recipes" / "tiny.yaml", REPO / "env" / "local.yaml", output_dir=str(run),
                 num_rollout=2, overrides=tiny_overrides(tiny_assets), via="submitit")
    job = sub.job
    assert job is not None and str(job.job_id) == sub.job_id
    seen = set()
    deadline = time.time() + 400
    while not job.done() and time.time() < deadline:
        seen.add(job.state)
        time.sleep(1)
    assert job.done(), f"job {job.job_id} not done; states seen {seen}"
    # One task runs the segment (it starts the node steps itself); its result is the segment's
    # exit status: 0 = completed.
    assert job.task(0).result() == 0
    assert job.state == "COMPLETED"
    assert "RUNNING" in seen or "PENDING" in seen, seen
    assert checkpoint_layout.rollouts_done(run / "checkpoints") == 2
