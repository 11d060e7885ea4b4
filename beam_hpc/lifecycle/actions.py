"""Acting on a decision from inside the job: submit the next segment, or requeue this one.

Both go through :mod:`beam_hpc.slurm.client` with the job's SLURM_* variables removed
(:func:`beam_hpc.slurm.client.slurm_env_free`): a resubmitted job would otherwise inherit e.g.
SLURM_RESTART_COUNT and take itself for a requeue.
"""

from __future__ import annotations

from collections.abc import Sequence

from beam_hpc.plan.segment_args import SegmentArgs
from beam_hpc.slurm import client


def resubmit_command(script: str, args: SegmentArgs, *, lead_s: int, dependency: str,
                     output: str | None = None, exclude: Sequence[str] = ()) -> list[str]:
    """sbatch line for the next segment: the same script with the next segment's arguments
    (:class:`beam_hpc.plan.segment_args.SegmentArgs`, the type every submission uses), after this
    job (``afterany:<this job>``), with the walltime warning at the current lead (options on the
    command line override the script's #SBATCH lines). Not ``singleton``: on a heterogeneous job
    (Slurm 22.05) each component waits for the other, which has the same name, and the job pends
    forever. A ``--num-rollout`` total this segment was given is in ``args`` (plan.json is never
    rewritten in the job, so the next segment is told again). ``output``: the run's batch log
    pattern (its logs/ exists by now; the script's own default is the submit directory).
    ``exclude``: the run's failed nodes (beam_hpc.lifecycle.exclusions), as ``--exclude``, which
    applies to every het component."""
    opts = [f"--dependency={dependency}", f"--signal=B:USR1@{int(lead_s)}"]
    if output:
        opts.append(f"--output={output}")
    if exclude:
        opts.append(f"--exclude={','.join(exclude)}")
    return client.sbatch_argv([*opts, script, *args.argv()])


def resubmit(script: str, args: SegmentArgs, *, lead_s: int, dependency: str, output: str | None = None,
             exclude: Sequence[str] = ()) -> str:
    """Submit the next segment; returns its job id. Raises SlurmError (a RuntimeError) with
    sbatch's words."""
    cmd = resubmit_command(script, args, lead_s=lead_s, dependency=dependency, output=output, exclude=exclude)
    return client.sbatch(cmd[1:], env=client.slurm_env_free(), timeout=60)


def requeue_self(job_id: str, exclude: Sequence[str] = ()) -> None:
    """Requeue this job (same id, restart count + 1). Needed after a graceful save during a
    preemption grace time: a job that ends by itself then is COMPLETED and never requeued.
    ``exclude``: the run's failed nodes, set as the job's ExcNodeList right after the requeue,
    while the requeued job pends (Slurm delays its eligibility; a running job's ExcNodeList
    cannot be changed, so not before). Raises SlurmError (a RuntimeError) with Slurm's words."""
    env = client.slurm_env_free()
    client.requeue(job_id, env=env, timeout=60)
    if exclude:
        client.set_excluded_nodes(job_id, exclude, env=env, timeout=60)
