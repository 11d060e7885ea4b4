"""`beam-hpc submit` on the real local Slurm cluster, through both ways in.

- `--smoke --via sbatch`: the real rendered hetjob brings Ray up on both groups and writes
  smoke.json (every task on its own group's nodes), touching no lock, ledger or checkpoint;
- through submitit (`beam_hpc.submit`, whose Job handle's state / done() / result() work without
  sacct, and whose run completes with its checkpoint): launch 4 of
  tests/submission/test_submission_launch_parity.py, which runs that job beside the other ways in;
- the dry run is the request: for sbatch and submitit alike, the batch script Slurm stored
  (`scontrol write batch_script`) is the one `--dry-run` printed, and every component's
  ExcNodeList is the exclusion it printed (the site's quarantine); the jobs are held, never run.
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


def test_the_dry_run_is_what_slurm_receives(tmp_path: Path, slurm_cluster) -> None:  # type: ignore[no-untyped-def]
    """Cheap: each job is submitted held (the site's ``sbatch_extra: [--hold]``) and cancelled once
    Slurm has shown it; nothing is allocated."""
    import beam_hpc
    from beam_hpc.config.recipe import load_yaml
    from beam_hpc.config.site import site_from_dict
    from beam_hpc.lifecycle import quarantine
    from beam_hpc.slurm.client import parse_key_values
    from beam_hpc.submission.submit import describe

    bad = slurm_cluster.spec.node_names[-1]
    qfile = tmp_path / "quarantine.json"
    quarantine.record(qfile, [{"node": bad, "why": "test"}], run="other", run_dir="/x", segment="1-0", days=1)
    site = site_from_dict({**load_yaml(REPO / "env" / "local.yaml"), "quarantine": str(qfile),
                           "sbatch_extra": ["--hold"]}, "test site")
    data = tmp_path / "data"
    data.mkdir()
    for name in ("dapo-math-17k.jsonl", "tiny-add.jsonl"):  # only their presence is checked before sbatch
        (data / name).write_text("")
    for via in ("sbatch", "submitit"):
        kw = {"output_dir": str(tmp_path / via), "via": via,
              "overrides": [f"data.dir={data}", f"model.path={tmp_path / 'model'}"]}
        dry = beam_hpc.submit(REPO / "recipes" / "tiny.yaml", site, dry_run=True, **kw)
        printed = describe(dry)
        sub = beam_hpc.submit(REPO / "recipes" / "tiny.yaml", site, **kw)
        try:
            stored = slurm_cluster.run("scontrol", "write", "batch_script", str(sub.job_id), "-").stdout
            shown = slurm_cluster.run("scontrol", "--oneliner", "show", "job", str(sub.job_id)).stdout
        finally:
            slurm_cluster.run("scancel", str(sub.job_id), check=False)
        assert sub.request == dry.request and dry.request.exclude == (bad,)
        script = printed.split(" would submit ---\n", 1)[1].rsplit("\n--- end ---", 1)[0]
        assert stored.rstrip() == script, via
        records = [parse_key_values(line) for line in shown.splitlines() if line.strip()]
        assert len(records) == 2 and all(r["ExcNodeList"] == bad for r in records), (via, records)
        assert all(r["JobState"] == "PENDING" and r["Reason"] == "JobHeldUser" for r in records), records
        if via == "sbatch":
            assert f"would run: sbatch --parsable --exclude={bad} --output=" in printed
            assert records[0]["StdOut"] == dry.plan.paths.batch_log(str(sub.job_id))
