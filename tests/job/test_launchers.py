"""beam_hpc.job.launchers.for_job: the one place that picks srun or local processes (the launchers
themselves run in tests/job/test_job_slurm.py and test_job_local.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from job_plans import make_test_plan

from beam_hpc.job.context import JobError
from beam_hpc.job.launchers import LocalLauncher, SrunLauncher, for_job


def test_srun_inside_a_slurm_job_else_local_processes(tmp_path: Path) -> None:
    plan = make_test_plan(tmp_path / "run", trainer_nodes=1, rollout_nodes=1)
    ctx, launcher = for_job(plan, env={})
    assert isinstance(launcher, LocalLauncher) and ctx.job_id.startswith("l")
    ctx, launcher = for_job(plan, srun=False, env={"SLURM_JOB_ID": "5"})  # asked for local processes
    assert isinstance(launcher, LocalLauncher)


@pytest.mark.slow
@pytest.mark.slurm
def test_srun_for_a_het_job_and_a_refusal_for_a_plain_one(tmp_path: Path) -> None:
    """Inside a job the node lists are expanded by ``scontrol show hostnames``: it needs a Slurm
    configuration, so this half runs with the local cluster."""
    plan = make_test_plan(tmp_path / "run", trainer_nodes=1, rollout_nodes=1)
    het = {"SLURM_JOB_ID": "5", "SLURM_HET_SIZE": "2", "SLURM_JOB_NODELIST_HET_GROUP_0": "n1",
           "SLURM_JOB_NODELIST_HET_GROUP_1": "n2", "SLURM_JOB_ID_HET_GROUP_0": "5", "SLURM_JOB_ID_HET_GROUP_1": "6"}
    ctx, launcher = for_job(plan, env=het)
    assert isinstance(launcher, SrunLauncher) and launcher.loopback and ctx.job_id == "5"
    with pytest.raises(JobError, match="het"):  # a plain job where the plan has two groups
        for_job(plan, env={"SLURM_JOB_ID": "5"})
