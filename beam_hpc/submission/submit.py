"""Submit a run: write its plan and script into the run directory, then hand it to Slurm.

One request (:class:`beam_hpc.submission.request.SubmitRequest`), two schedulers here:
``via="sbatch"`` submits the rendered script (exactly what a user would ``sbatch`` by hand);
``via="submitit"`` submits the same heterogeneous job through beam-hpc's submitit executor
(``beam_hpc.slurm.submitit_het``) and returns a submitit Job handle (``beam-hpc execute`` runs
the same request on this machine). Everything here happens on the login node; nothing in the
allocation imports this module.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from beam_hpc.backends.registry import plan_for
from beam_hpc.config.recipe import Recipe, apply_overrides, load_yaml, recipe_from_dict, resolve_relative_paths
from beam_hpc.config.site import Site, find_site, site_from_dict
from beam_hpc.errors import InputError, RuntimeFailure
from beam_hpc.lifecycle import exclusions, quarantine
from beam_hpc.plan.plan import Plan
from beam_hpc.plan.segment_args import SegmentArgs
from beam_hpc.run import accounting, checkpoint_layout, ledger
from beam_hpc.run.accounting import Estimate
from beam_hpc.slurm import client as slurm_client
from beam_hpc.slurm.script import extra_parameters
from beam_hpc.submission import tmp_disk
from beam_hpc.submission.request import SubmitRequest, Via
from beam_hpc.submission.run_guard import check_submission


class SubmitError(RuntimeFailure):
    """Slurm refused the submission (the message carries Slurm's own words)."""


@dataclass
class Submission:
    """What a submission did: its request, and Slurm's job id (plus the submitit Job handle when
    it went through submitit)."""

    request: SubmitRequest
    job_id: str | None = None
    job: Any = None  # submitit Job when via="submitit"
    estimate: Estimate | None = None  # GPU-hours the run will hold

    @property
    def plan(self) -> Plan:
        return self.request.plan

    @property
    def script(self) -> Path:
        return self.request.script

    @property
    def command(self) -> list[str]:
        return self.request.command()


def build_recipe(
    recipe_path: str | Path,
    *,
    overrides: list[str] | None = None,
    output_dir: str | None = None,
    num_rollout: int | None = None,
    no_async_training: bool = False,
    base_dir: Path | None = None,
) -> Recipe:
    """Recipe file + ``--set`` overrides + the seed's own flags, validated. With ``base_dir``
    (``beam-hpc execute`` on one machine) relative paths are taken from it; for Slurm they must be
    absolute, and the plan says so."""
    data = load_yaml(recipe_path)
    ov = list(overrides or [])
    if output_dir is not None:
        ov.append(f"output_dir={output_dir}")
    if num_rollout is not None:
        ov.append(f"num_rollout={num_rollout}")
    if no_async_training:
        ov.append("training.async_training=false")
    apply_overrides(data, ov)
    if base_dir is not None:
        resolve_relative_paths(data, base_dir)
    return recipe_from_dict(data, str(recipe_path))


def build_site(site: str | Path | None, *, search_dir: Path | None = None) -> Site:
    """A site by name (env/<name>.yaml) or path; ``python: auto`` becomes this interpreter (in
    site_from_dict), so the batch script runs the same beam-hpc install that submitted it."""
    path = find_site(str(site or "local"), search_dir)
    return site_from_dict(load_yaml(path, kind="site profile"), str(path))


def prepare_run(request: SubmitRequest) -> Path:
    """Write the request's plan.json and batch script into the run directory; returns the script.
    logs/ must exist before sbatch: Slurm opens --output before the script runs, and a job whose
    output directory is missing dies at once with no output at all."""
    from beam_hpc.files import write_atomic

    plan = request.plan
    plan.write()
    Path(plan.paths.logs).mkdir(parents=True, exist_ok=True)
    script = Path(plan.paths.script)
    write_atomic(script, request.script_text())
    script.chmod(0o755)
    return script


def run_sbatch(cmd: list[str], env: dict[str, str] | None = None) -> str:
    """Run an ``sbatch`` line (:meth:`SubmitRequest.sbatch_argv`) through the Slurm client, return the job
    id; Slurm's own message on refusal."""
    try:
        return slurm_client.sbatch(cmd[1:], env={**os.environ, **(env or {})}, timeout=None)
    except slurm_client.NoJobId as err:
        raise SubmitError(f"could not read a job id from sbatch's output: {err.stdout!r}") from err
    except slurm_client.SlurmUnavailable:
        raise  # not a refusal: the CLI names the controller and what to retry
    except slurm_client.SlurmError as err:
        raise SubmitError(f"sbatch refused the job: {err.detail}") from err


def submit(
    recipe: str | Path | Recipe,
    site: str | Path | Site | None = None,
    *,
    overrides: list[str] | None = None,
    output_dir: str | None = None,
    resume: bool = False,
    num_rollout: int | None = None,
    no_async_training: bool = False,
    via: Via | str = Via.SUBMITIT,
    dry_run: bool = False,
    dependency: str | None = None,
    smoke: bool = False,
    include_nodes: list[str] | None = None,
) -> Submission:
    """Submit a recipe to Slurm. Returns a :class:`Submission` (``.job`` is a submitit Job when
    ``via="submitit"``). Invalid input raises InputError before anything is written or submitted.
    Resuming, the run's failed nodes stay excluded (beam_hpc.lifecycle.exclusions) except those
    in ``include_nodes`` (``all``: every one), whose clearing is recorded in the run directory."""
    try:
        how = Via(via)
    except ValueError:
        raise InputError(f"--via: {via!r} is not a way to submit; use submitit or sbatch") from None
    if how is Via.LOCAL:
        raise InputError("--via: local runs on this machine: use `beam-hpc execute RECIPE`")
    if isinstance(recipe, Recipe):
        rec, source = recipe, recipe.name
    else:
        rec = build_recipe(
            recipe, overrides=overrides, output_dir=output_dir, num_rollout=num_rollout,
            no_async_training=no_async_training,
        )
        source = Path(recipe).name
    st = site if isinstance(site, Site) else build_site(site)
    source = f"{source} + site {st.name}"
    # --num-rollout is the recipe's total for a new plan and, as a segment argument, what the job
    # runs to and passes on to its resubmissions (plan.json is never rewritten in the job)
    declared = tmp_disk.declared_tmp_disk(rec, st)  # a --tmp Slurm can place
    plan = plan_for(rec, st, tmp_disk=declared)
    extra_parameters(st)  # the site's sbatch_extra must be sbatch options submitit can take too
    if include_nodes and not resume:
        raise InputError("--include-node: only a resumed run has excluded nodes; add --resume")
    segment = SegmentArgs(resume=resume, num_rollout=num_rollout, smoke=smoke)  # the flags agree
    # what the real submission would refuse about the inputs and the run directory, a dry run
    # refuses too (less the inputs' existence and the lock, which a dry run may not judge)
    check_submission(rec, st, resume=resume, dry_run=dry_run, smoke=smoke)
    # the nodes the job must not get, decided before the dry run returns: it prints the request
    # that is then submitted (a --include-node clearing is recorded only when it is submitted)
    exclude = excluded_nodes(plan, st, resume=resume, include=include_nodes or [])
    request = SubmitRequest(plan=plan, segment=segment, via=how, dependency=dependency, source=source, exclude=tuple(exclude))
    cost = gpu_hours_estimate(request.plan, resume=resume)
    if dry_run:
        return Submission(request=request, estimate=cost)
    if include_nodes:
        exclusions.record_cleared(plan.output_dir, include_nodes)
    sub = schedule(request)
    sub.estimate = cost
    return sub


def excluded_nodes(plan: Plan, site: Site, *, resume: bool, include: list[str]) -> list[str]:
    """What the submission excludes: resuming, the run's failed nodes (but those ``include``
    clears: a name, or ``all``), then the site's quarantine. Reads the run directory and the
    quarantine, writes nothing (the clearing is recorded at submission); a name in ``include``
    that is not excluded is refused, so that a typo does not pass silently."""
    exclude: list[str] = []
    if resume:
        current = exclusions.for_submission(plan.output_dir)  # no clearing given: nothing recorded
        unknown = [n for n in include if n != "all" and n not in current]
        if unknown:
            raise InputError(f"--include-node: {', '.join(unknown)} not excluded in this run "
                             f"(excluded now: {', '.join(current) or 'none'})")
        exclude = [] if "all" in include else [n for n in current if n not in include]
    return quarantine.for_submission(site, plan.groups, exclude)  # the site's bad nodes, every run


def lift_cancel(plan: Plan) -> None:
    """``beam-hpc execute``: running a run again on this machine is the user's own intent, and lifts
    an earlier ``beam-hpc cancel`` (a local segment has no Slurm SubmitTime to compare the flag with).
    Not for Slurm submissions: a cancelled segment still in Slurm's KillWait reads the flag to end as
    cancelled; removing it under that segment would let it resubmit itself. There the segment lifts
    the flag itself when its job was submitted after it (beam_hpc.job.segment)."""
    Path(plan.paths.cancel_flag).unlink(missing_ok=True)


def gpu_hours_estimate(plan: Plan, *, resume: bool) -> Estimate:
    """What the run (or, resuming, the rest of it) will hold: the per-rollout and bring-up times
    the run's own ledger measured when resuming, else the recipe's estimates. Reads the run
    directory, never writes it."""
    recipe = plan.recipe
    done, rollout_s, bringup_s = 0, recipe.lifecycle.rollout_s_estimate, recipe.lifecycle.bringup_s_estimate
    basis = "the recipe's lifecycle.rollout_s_estimate"
    if resume:
        done = checkpoint_layout.rollouts_done(plan.paths.checkpoints)
        history, _ = ledger.read_ledger(plan.paths.ledger)
        measured = ledger.measured_timings(history) or {}
        if measured.get("rollout_s"):
            rollout_s, basis = measured["rollout_s"], "measured by the run's last segments"
        ready = [float(e["ready_s"]) for s in history if isinstance((e := s.get("end") or {}).get("ready_s"), (int, float))]
        if ready:
            bringup_s = max(ready[-3:])
    return accounting.estimate(gpus=plan.total_gpus, rollouts_left=max(0, recipe.num_rollout - done),
                               walltime_s=plan.walltime_s, lead_s=plan.lead_s, rollout_s=rollout_s,
                               basis=basis, bringup_s=bringup_s)


def schedule(request: SubmitRequest) -> Submission:
    """Write the request's plan and script into the run directory, then hand it to its scheduler
    (sbatch or submitit; ``beam-hpc execute`` runs local requests itself), exactly as its dry run
    printed it: the excluded nodes are ``--exclude`` on the sbatch line, and through submitit an
    ``--exclude`` line in every component of the script. A controller that does not answer is
    found before anything is written (SlurmUnavailable)."""
    if request.uses_sbatch or request.via is Via.SUBMITIT:
        slurm_client.ping(timeout=10)
    prepare_run(request)
    if request.uses_sbatch:
        return Submission(request=request, job_id=run_sbatch(request.sbatch_argv()))
    if request.via is Via.SUBMITIT:
        from beam_hpc.submission.via_submitit import submit_request

        job = submit_request(request)
        return Submission(request=request, job_id=str(job.job_id), job=job)
    raise InputError(f"--via: {request.via.value!r} cannot be scheduled by submit; use `beam-hpc execute`")


def batch_script(request: SubmitRequest) -> str:
    """The exact batch script the request's scheduler gets: the rendered script for sbatch, the
    submission script submitit writes for submitit."""
    if request.uses_sbatch:
        return request.script_text()
    from beam_hpc.submission.via_submitit import submission_text

    return submission_text(request)


def describe(sub: Submission) -> str:
    """What a dry run prints: the plan in one paragraph, the GPU-hours it will hold, the command,
    then the exact batch script that would be submitted."""
    text = "\n".join([sub.request.describe(), *tmp_disk.describe(sub.plan)])
    if sub.estimate is not None:
        text = f"{text}\n{sub.estimate.describe()}"
    how = "sbatch" if sub.request.uses_sbatch else "submitit"
    return f"{text}\n--- the batch script {how} would submit ---\n{batch_script(sub.request).rstrip()}\n--- end ---"
