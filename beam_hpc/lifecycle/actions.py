"""Acting on a decision from inside the job: submit the next segment, or requeue this one.

Both go through :mod:`beam_hpc.slurm.client` with the job's SLURM_* variables removed
(:func:`beam_hpc.slurm.client.slurm_env_free`): a resubmitted job would otherwise inherit e.g.
SLURM_RESTART_COUNT and take itself for a requeue.
"""

from __future__ import annotations

from beam_hpc.slurm import client


def resubmit_command(script: str, *, lead_s: int, resume: bool, dependency: str,
                     num_rollout: int | None = None) -> list[str]:
    """sbatch line for the next segment: the same script, after this job (``afterany:<this job>``),
    with the walltime warning at the current lead (options on the command line override the
    script's #SBATCH lines). Not ``singleton``: on a heterogeneous job (Slurm 22.05) each
    component waits for the other, which has the same name, and the job pends forever.
    ``num_rollout``: a total this segment was given with ``--num-rollout`` (plan.json is never
    rewritten in the job, so the next segment is told again)."""
    cmd = client.sbatch_argv([f"--dependency={dependency}", f"--signal=B:USR1@{int(lead_s)}", script])
    if resume:
        cmd.append("--resume")
    if num_rollout is not None:
        cmd += ["--num-rollout", str(int(num_rollout))]
    return cmd


def resubmit(script: str, *, lead_s: int, resume: bool, dependency: str, num_rollout: int | None = None) -> str:
    """Submit the next segment; returns its job id. Raises SlurmError (a RuntimeError) with
    sbatch's words."""
    cmd = resubmit_command(script, lead_s=lead_s, resume=resume, dependency=dependency, num_rollout=num_rollout)
    return client.sbatch(cmd[1:], env=client.slurm_env_free(), timeout=60)


def requeue_self(job_id: str) -> None:
    """Requeue this job (same id, restart count + 1). Needed after a graceful save during a
    preemption grace time: a job that ends by itself then is COMPLETED and never requeued.
    Raises SlurmError (a RuntimeError) with Slurm's words."""
    client.requeue(job_id, env=client.slurm_env_free(), timeout=60)
