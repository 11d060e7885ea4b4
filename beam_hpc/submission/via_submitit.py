"""Submit a request through submitit, as a heterogeneous job, and get a submitit Job handle back.

The job is the same one the rendered sbatch script describes (same components, walltime signal,
requeue, name), but submitit owns the batch script: it runs one task, on the first node of the
trainer group, which runs beam_hpc.job.segment exactly as the sbatch path does; the segment then
starts the node steps of every group with ``srun --het-group=i --overlap``. The Job handle
follows the first segment (``job.task(0).result()`` is the segment's exit status; submitit counts
one task per node, of which only task 0 runs); later segments are in the ledger.

The site reaches this job through submitit's own parameters rather than by editing its text
(:func:`executor_parameters`). :func:`submission_text` is the exact script the executor submits
(``--dry-run`` prints it; tests/submission/golden/ holds the seed recipes').
"""

from __future__ import annotations

import shlex
from typing import Any

from beam_hpc.job.segment import run_segment
from beam_hpc.slurm.script import Component, component, extra_parameters, site_lines
from beam_hpc.submission.request import SubmitRequest


def _component_parameters(c: Component, extra_site: dict[str, Any]) -> dict[str, Any]:
    """One component's submitit parameters, from its values (submitit names the common ones;
    the rest go to ``additional_parameters`` as sbatch flags)."""
    out: dict[str, Any] = {"nodes": c.nodes, "ntasks_per_node": 1}
    for key in ("partition", "account", "mem", "constraint"):
        value = getattr(c, key)
        if value is not None:
            out[key] = value
    if c.cpus_per_task is not None:
        out["cpus_per_task"] = c.cpus_per_task
    extra = {key: getattr(c, key) for key in ("qos", "gres", "tmp") if getattr(c, key) is not None}
    if c.exclusive:
        extra["exclusive"] = True
    extra.update(extra_site)  # the site's sbatch_extra, in every component as the rendered script has it
    out["additional_parameters"] = extra
    return out


def executor_parameters(request: SubmitRequest) -> dict[str, Any]:
    """submitit parameters (prefix-free) for the same job the rendered sbatch script describes.

    The walltime warning goes to the task (``--signal=USR1@<lead>``, no ``B:``: the Python runs in
    the srun step, not in the batch shell), replacing submitit's own USR2 checkpoint signal, so
    that beam-hpc's lifecycle, not submitit's, decides between resubmit and requeue. The site's
    shell lines (:func:`beam_hpc.slurm.script.site_lines`: environment, setup, module loads) are
    submitit's ``setup``, its ``sbatch_extra`` the ``additional_parameters`` of every component,
    and its ``python`` runs submitit's task (:func:`make_executor`).
    """
    plan = request.plan
    site_extra = extra_parameters(plan.site)
    first, *rest = [_component_parameters(component(plan, g), site_extra) for g in plan.groups]
    extra = dict(first.pop("additional_parameters"))
    extra.update({
        "signal": f"USR1@{plan.lead_s}",
        "requeue" if plan.recipe.lifecycle.requeue_on_preemption else "no_requeue": True,
    })
    if request.dependency:
        extra["dependency"] = request.dependency
    params: dict[str, Any] = {
        "job_name": plan.job_name,
        "time": max(1, plan.walltime_s // 60),
        "additional_parameters": extra,
        # one task on the first node of the trainer group; it starts the node steps itself
        "srun_args": ["--het-group=0", "--nodes=1", "--ntasks=1", "--overlap"] if rest else ["--nodes=1", "--ntasks=1", "--overlap"],
        "setup": site_lines(plan.site),
        **first,
    }
    if rest:
        params["het_components"] = rest
    return params


def make_executor(request: SubmitRequest):  # type: ignore[no-untyped-def]
    """beam-hpc's submitit executor for this request, configured and not yet used (nothing is
    written): the one place both the submission and its dry run get the executor from."""
    from beam_hpc.slurm.submitit_het import HetSlurmExecutor

    executor = HetSlurmExecutor(folder=request.plan.paths.submitit, python=shlex.quote(request.plan.site.python))
    executor.update_parameters(**executor_parameters(request))
    return executor


def submission_text(request: SubmitRequest) -> str:
    """The exact batch script submitit submits for this request (its own writer, our parameters)."""
    executor = make_executor(request)
    return executor._make_submission_file_text(executor._submitit_command_str, uid="dry-run")


def submit_request(request: SubmitRequest):  # type: ignore[no-untyped-def]
    """Submit through beam-hpc's submitit executor; returns the submitit Job. The task is
    :func:`beam_hpc.job.segment.run_segment` with the request's own SegmentArgs (pickled by
    reference: the job imports beam_hpc.job, never this module)."""
    return make_executor(request).submit(run_segment, request.plan.paths.plan, request.segment)
