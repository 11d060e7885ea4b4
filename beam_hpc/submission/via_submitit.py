"""Submit a Plan through submitit, as a heterogeneous job, and get a submitit Job handle back.

The job is the same one the rendered sbatch script describes (same components, walltime signal,
requeue, name), but submitit owns the batch script: it runs one task, on the first node of the
trainer group, which runs beam_hpc.job.segment exactly as the sbatch path does; the segment then
starts the node steps of every group with ``srun --het-group=i --overlap``.

Signals: the walltime warning goes to that task (``--signal=USR1@<lead>``, no ``B:`` because the
Python runs in the srun step, not in the batch shell), replacing submitit's own USR2 checkpoint
signal, so that beam-hpc's lifecycle, not submitit's, decides between resubmit and requeue.
The Job handle follows the first segment (``job.task(0).result()`` is the segment's exit status;
submitit counts one task per node, of which only task 0 runs); later segments are in the ledger.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from beam_hpc.plan.plan import Plan


def run_segment(plan_path: str, resume: bool) -> int:
    """What the submitit task runs (module-level so that it pickles by reference)."""
    from beam_hpc.job import segment

    argv = ["--plan", plan_path] + (["--resume"] if resume else [])
    return segment.main(argv)


def executor_parameters(plan: Plan, *, dependency: str | None = None) -> dict[str, Any]:
    """submitit parameters (prefix-free) mirroring beam_hpc.slurm.script's #SBATCH lines."""
    from beam_hpc.slurm.script import component_flags

    def comp(group_flags: list[str]) -> dict[str, Any]:
        # --nodes / --gres / --partition ... -> a het component dict (extra flags as they are)
        out: dict[str, Any] = {"additional_parameters": {}}
        for flag in group_flags:
            key, _, value = flag.lstrip("-").partition("=")
            key = key.replace("-", "_")
            if key in ("nodes", "ntasks_per_node", "cpus_per_task"):
                out[key] = int(value)
            elif key in ("partition", "account", "mem", "constraint"):
                out[key] = value
            else:
                out["additional_parameters"][key] = value if value else True
        return out

    first, *rest = [comp(component_flags(plan, g)) for g in plan.groups]
    lc = plan.recipe["lifecycle"]
    extra = dict(first.pop("additional_parameters"))
    extra.update({
        "signal": f"USR1@{plan.lead_s}",
        "open_mode": "append",
        "requeue" if lc["requeue_on_preemption"] else "no_requeue": True,
    })
    if dependency:
        extra["dependency"] = dependency
    params: dict[str, Any] = {
        "job_name": plan.job_name,
        "time": max(1, plan.walltime_s // 60),
        "additional_parameters": extra,
        # one task on the first node of the trainer group; it starts the node steps itself
        "srun_args": ["--het-group=0", "--nodes=1", "--ntasks=1", "--overlap"] if rest else ["--nodes=1", "--ntasks=1", "--overlap"],
        **first,
    }
    if rest:
        params["het_components"] = rest
    return params


def submit_plan(plan: Plan, *, resume: bool = False, dependency: str | None = None):
    """Submit through beam-hpc's submitit executor; returns the submitit Job."""
    import submitit

    from beam_hpc.slurm.submitit_het import CLUSTER_NAME

    folder = Path(plan.paths.logs, "submitit", "%j")
    executor = submitit.AutoExecutor(folder=folder, cluster=CLUSTER_NAME)
    params = executor_parameters(plan, dependency=dependency)
    executor.update_parameters(**{f"{CLUSTER_NAME}_{k}": v for k, v in params.items()})
    return executor.submit(run_segment, plan.paths.plan, resume)
