"""Submit a run: write its plan and script into the run directory, then hand it to Slurm.

Two ways in, one result: ``via="sbatch"`` submits the rendered script (exactly what a user would
``sbatch`` by hand); ``via="submitit"`` submits the same heterogeneous job through beam-hpc's
submitit executor (``beam_hpc.slurm.submitit_het``) and returns a submitit Job handle. Everything here
happens on the login node; nothing in the allocation imports this module.
"""

from __future__ import annotations

from beam_hpc.errors import InputError

from beam_hpc.errors import RuntimeFailure

import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from beam_hpc.plan.plan import Plan, make_plan
from beam_hpc.config.recipe import Recipe, apply_overrides, load_yaml, recipe_from_dict
from beam_hpc.slurm import client as slurm_client
from beam_hpc.slurm.script import write_script
from beam_hpc.config.site import Site, find_site

Via = Literal["submitit", "sbatch"]


class SubmitError(RuntimeFailure):
    """Slurm refused the submission (the message carries Slurm's own words)."""


@dataclass
class Submission:
    plan: Plan
    script: Path
    command: list[str]
    job_id: str | None = None
    job: Any = None  # submitit Job when via="submitit"
    extra: dict[str, Any] = field(default_factory=dict)


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
    absolute, and make_plan says so."""
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


def resolve_relative_paths(data: dict[str, Any], base: Path) -> None:
    """Relative ``output_dir``, ``data.dir`` and ``model.path`` are relative to ``base``; inside
    the allocation every path must be absolute, so this is resolved once, here."""

    def absolute(value: Any) -> Any:
        if isinstance(value, str) and value and not value.startswith("/") and "://" not in value:
            return str((base / value).resolve())
        return value

    if "output_dir" in data:
        data["output_dir"] = absolute(data["output_dir"])
    for section, key in (("data", "dir"), ("model", "path")):
        if isinstance(data.get(section), dict) and key in data[section]:
            data[section][key] = absolute(data[section][key])


def build_site(site: str | Path | None, *, search_dir: Path | None = None) -> Site:
    """A site by name (env/<name>.yaml) or path; ``python: auto`` becomes this interpreter, so the
    batch script runs the same beam-hpc install that submitted it."""
    import sys

    path = find_site(str(site or "local"), search_dir)
    data = load_yaml(path)
    if data.get("python") == "auto":
        data["python"] = sys.executable
    from beam_hpc.config.site import site_from_dict

    return site_from_dict(data, str(path))


def prepare_run(plan: Plan, *, source: str = "") -> Path:
    """Write plan.json and the sbatch script into the run directory; returns the script.
    logs/ must exist before sbatch: Slurm opens --output before the script runs, and a job whose
    output directory is missing dies at once with no output at all."""
    plan.write()
    Path(plan.paths.logs).mkdir(parents=True, exist_ok=True)
    return write_script(plan, Path(plan.output_dir, "job.sbatch"), source=source)


def check_paths(recipe: Recipe, site: Site) -> None:
    """Paths that must exist before a job is worth queueing (checked on the login node, which sees
    the same shared storage as the nodes). A model that the backend makes itself (the tiny model,
    or SmolLM2 materialised from its wheel) is exempt."""
    need = [("data.dir", recipe.data.train_path()), ("data.dir", recipe.data.eval_path())]
    if not (recipe.backend_options.get("tiny_model") or recipe.backend_options.get("smollm2_model")):
        need.append(("model.path", recipe.model.path))
    if site.container.runtime == "apptainer" and site.container.image:
        need.append(("container.image", site.container.image))
    for field_name, path in need:
        if not Path(path).exists():
            hint = {
                "data.dir": "run `beam-hpc prepare --data-dir DIR` or set data.dir",
                "model.path": "run `beam-hpc prepare --model ID` or set model.path",
                "container.image": "run `beam-hpc image build` or fix container.image in the site",
            }[field_name]
            raise InputError(f"{field_name}: {path} does not exist; {hint}")


def sbatch_command(script: Path, *, resume: bool = False, dependency: str | None = None,
                   smoke: bool = False) -> list[str]:
    """The ``sbatch --parsable`` line that submits the rendered script (what a dry run prints)."""
    cmd = slurm_client.sbatch_argv([f"--dependency={dependency}"] if dependency else [])
    cmd.append(str(script))
    if resume:
        cmd.append("--resume")
    if smoke:
        cmd.append("--smoke")
    return cmd


def run_sbatch(cmd: list[str], env: dict[str, str] | None = None) -> str:
    """Run an ``sbatch`` line of :func:`sbatch_command` through the Slurm client, return the job
    id; Slurm's own message on refusal."""
    try:
        return slurm_client.sbatch(cmd[1:], env={**os.environ, **(env or {})}, timeout=None)
    except slurm_client.NoJobId as err:
        raise SubmitError(f"could not read a job id from sbatch's output: {err.stdout!r}") from err
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
    via: Via = "submitit",
    dry_run: bool = False,
    dependency: str | None = None,
    smoke: bool = False,
) -> Submission:
    """Submit a recipe to Slurm. Returns a :class:`Submission` (``.job`` is a submitit Job when
    ``via="submitit"``). Invalid input raises InputError before anything is submitted."""
    if isinstance(recipe, Recipe):
        rec, source = recipe, recipe.name
    else:
        rec = build_recipe(
            recipe, overrides=overrides, output_dir=output_dir, num_rollout=num_rollout,
            no_async_training=no_async_training,
        )
        source = str(recipe)
    st = site if isinstance(site, Site) else build_site(site)
    if dry_run:
        plan = make_plan(rec, st)
        return Submission(plan=plan, script=Path(plan.output_dir, "job.sbatch"),
                          command=sbatch_command(Path(plan.output_dir, "job.sbatch"), resume=resume,
                                                 dependency=dependency, smoke=smoke))
    from beam_hpc.submission.run_guard import check_before_submit  # refuses a live run / incompatible resume

    plan = make_plan(rec, st)
    check_paths(rec, st)
    if not smoke:  # a smoke run touches no checkpoint, lock or ledger
        check_before_submit(rec, resume=resume)
    script = prepare_run(plan, source=source)
    if via == "sbatch" or smoke:
        cmd = sbatch_command(script, resume=resume, dependency=dependency, smoke=smoke)
        return Submission(plan=plan, script=script, command=cmd, job_id=run_sbatch(cmd))
    if via == "submitit":
        from beam_hpc.submission.via_submitit import submit_plan

        job = submit_plan(plan, resume=resume, dependency=dependency)
        return Submission(plan=plan, script=script, command=["submitit"], job_id=str(job.job_id), job=job)
    raise InputError(f"--via: {via!r} is not a way to submit; use submitit or sbatch")


def describe(sub: Submission) -> str:
    """What a dry run prints: the plan in one paragraph and the exact command."""
    p = sub.plan
    groups = ", ".join(f"{g.name}: {g.nodes} nodes x {g.gpus_per_node} GPUs ({'+'.join(g.roles)})" for g in p.groups)
    return (
        f"run {p.run_id} ({p.job_name}) -> {p.output_dir}\n"
        f"groups: {groups}\n"
        f"walltime {p.walltime_s} s, final save starts {p.lead_s} s before it\n"
        f"driver: {shlex.join(p.driver_argv)}\n"
        + (f"Ray: the site's running cluster at {p.site['ray_address']} (the job starts none)\n"
           if p.site.get("ray_address") else "")
        + f"would run: {shlex.join(sub.command)}"
    )
