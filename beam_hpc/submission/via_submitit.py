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

Which submitit: 1.5.4 (``submitit/slurm/slurm.py``, ``_make_sbatch_string``). What this relies on:
it writes ``#SBATCH --<key>=<value>`` for every parameter, keys sorted, ``_`` written as ``-``,
values through ``shlex.quote``, a ``True`` value as a bare flag; ``additional_parameters`` are
merged into the same mapping last (so a key there replaces submitit's own, e.g. ``nodes``); it
always writes ``--time`` as whole minutes, and its own ``--signal`` (replaced here), ``--output``,
``--error``, ``--open-mode=append`` and ``--wckey``; ``setup`` lines come before the command.
"""

from __future__ import annotations

import math
import shlex
from typing import Any

from beam_hpc.job.segment import run_segment
from beam_hpc.slurm.script import Component, component, extra_parameters, site_lines
from beam_hpc.submission.request import SubmitRequest


def _component_options(c: Component, extra_site: dict[str, Any], exclude: tuple[str, ...]) -> dict[str, Any]:
    """One component's sbatch options as submitit's ``additional_parameters``: the rendered
    script's own (:meth:`Component.options`), then the site's ``sbatch_extra`` (in every
    component, as the rendered script has it) and the excluded nodes. Keys take submitit's
    spelling (``ntasks_per_node``), so that one replaces the same option submitit writes itself."""
    options: dict[str, Any] = {**c.options(), **extra_site}
    if exclude:
        options["exclude"] = ",".join(exclude)
    return {name.replace("-", "_"): value for name, value in options.items()}


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
    comps = [component(plan, g) for g in plan.groups]
    first, *rest = [_component_options(c, site_extra, request.exclude) for c in comps]
    extra = dict(first)
    extra.update({
        "signal": f"USR1@{plan.lead_s}",
        "requeue" if plan.recipe.lifecycle.requeue_on_preemption else "no_requeue": True,
    })
    if request.dependency:
        extra["dependency"] = request.dependency
    params: dict[str, Any] = {
        "job_name": plan.job_name,
        # submitit counts minutes: rounded up, so the job never has less time than the plan's walltime
        "time": max(1, math.ceil(plan.walltime_s / 60)),
        "nodes": comps[0].nodes,  # submitit counts the tasks from it; the option itself is the script's
        "additional_parameters": extra,
        # one task on the first node of the trainer group; it starts the node steps itself
        "srun_args": ["--het-group=0", "--nodes=1", "--ntasks=1", "--overlap"] if rest else ["--nodes=1", "--ntasks=1", "--overlap"],
        "setup": site_lines(plan.site),
    }
    if rest:
        params["het_components"] = [{"nodes": c.nodes, "additional_parameters": options}
                                    for c, options in zip(comps[1:], rest, strict=True)]
    return params


def make_executor(request: SubmitRequest):  # type: ignore[no-untyped-def]
    """beam-hpc's submitit executor for this request, configured and not yet used (nothing is
    written): the one place both the submission and its dry run get the executor from."""
    from beam_hpc.slurm.submitit_het import HetSlurmExecutor

    executor = HetSlurmExecutor(folder=request.plan.paths.submitit, python=shlex.quote(request.plan.site.python))
    executor.update_parameters(**executor_parameters(request))
    return executor


def submission_text(request: SubmitRequest) -> str:
    """The exact batch script submitit submits for this request (its own writer, our parameters),
    made without an executor, so that a dry run needs no Slurm on this machine."""
    from beam_hpc.slurm.submitit_het import submission_text as het_text

    return het_text(request.plan.paths.submitit, shlex.quote(request.plan.site.python), executor_parameters(request))


def submit_request(request: SubmitRequest):  # type: ignore[no-untyped-def]
    """Submit through beam-hpc's submitit executor; returns the submitit Job. The task is
    :func:`beam_hpc.job.segment.run_segment` with the request's own SegmentArgs (pickled by
    reference: the job imports beam_hpc.job, never this module)."""
    return make_executor(request).submit(run_segment, request.plan.paths.plan, request.segment)
