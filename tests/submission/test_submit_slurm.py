"""`beam-hpc submit` on the real local Slurm cluster, through both ways in.

- `--smoke --via sbatch`: the real rendered hetjob brings Ray up on both groups and writes
  smoke.json (every task on its own group's nodes), touching no lock, ledger or checkpoint;
- through submitit (`beam_hpc.submit`, whose Job handle's state / done() / result() work without
  sacct, and whose run completes with its checkpoint): launch 4 of
  tests/submission/test_submission_launch_parity.py, which runs that job beside the other ways in.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from beam_hpc.cli.app import main

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
