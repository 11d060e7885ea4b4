"""Checks on the login node before a run is (re)submitted: is this a fresh run, a valid resume?

The seed's rules: resuming keeps the same model, data, output directory and topology (num_rollout,
walltime and partitions may change), and needs both the checkpoint and its dataset state. A fresh
submission onto an output directory that already holds checkpoints is refused, so that a typo
cannot silently continue (or clobber) someone else's run. What the checkpoints were made with is
compared by :func:`beam_hpc.run.identity.check_identity`; both live in :mod:`beam_hpc.run.resume`,
the same check a segment makes in the job.
"""

from __future__ import annotations

from pathlib import Path

from beam_hpc.config.recipe import Recipe
from beam_hpc.config.site import Site
from beam_hpc.errors import InputError
from beam_hpc.node import container
from beam_hpc.plan.paths import RunPaths
from beam_hpc.run import checkpoint_layout
from beam_hpc.run.resume import check_resume

_MAKE_IT = {
    "data.dir": "run `beam-hpc prepare --data-dir DIR` or set data.dir",
    "model.path": "run `beam-hpc prepare --model ID` or set model.path",
    "container.image": "run `beam-hpc image build` or fix container.image in the site",
}


def check_submission(recipe: Recipe, site: Site, *, resume: bool, dry_run: bool, smoke: bool) -> None:
    """Every check on the run's inputs and directory before a submission, in one place, so that
    a dry run refuses what the real submission would: the inputs exist (not judged by a dry run,
    which may be prepared before the data is), the run directory's plan.json is sound, no live
    segment holds the directory (a dry run may not judge a lock), and the seed's resume rules. A
    dry run for a directory without checkpoints only shows the command (a resume line can be
    prepared in advance); a smoke run touches no checkpoint, lock or ledger."""
    if not dry_run:
        check_inputs_exist(recipe, site)
    check_run_dir(recipe.output_dir)
    if smoke:
        return
    if not dry_run:
        check_not_in_use(recipe.output_dir)
    if not dry_run or checkpoint_layout.latest_iteration(RunPaths(recipe.output_dir).checkpoints) is not None:
        check_resume(recipe, resume=resume)


def check_inputs_exist(recipe: Recipe, site: Site) -> None:
    """Paths that must exist before a job is worth queueing (checked on the login node, which sees
    the same shared storage as the nodes). A model that the backend makes itself (the tiny model,
    or SmolLM2 materialised from its wheel) is exempt."""
    made_by_backend = recipe.backend_options.get("tiny_model") or recipe.backend_options.get("smollm2_model")
    image = container.image_file(site)  # an Apptainer .sif or a pyxis squashfs (not a registry URI)
    need = [("data.dir", recipe.data.train_path()), ("data.dir", recipe.data.eval_path()),
            *([] if made_by_backend else [("model.path", recipe.model.path)]),
            *([("container.image", image)] if image else [])]
    container.check_pyxis_srun(site)  # pyxis: this srun must take its options (exit 2 before sbatch)
    for field_name, path in need:
        if not Path(path).exists():
            raise InputError(f"{field_name}: {path} does not exist; {_MAKE_IT[field_name]}")


def check_run_dir(output_dir: str) -> None:
    """A run directory whose plan.json is damaged (torn, or edited into something invalid) is bad
    input: InputError naming the file, before anything is written (submit, execute and the
    segment answer it alike; beam_hpc.plan.plan.load_plan)."""
    from beam_hpc.plan.plan import load_plan

    plan = RunPaths(output_dir).plan
    if Path(plan).exists():
        load_plan(plan)


def check_before_submit(recipe: Recipe, *, resume: bool) -> None:
    """The run directory's checks of a real submission without the inputs' (``beam-hpc execute``
    makes its own data and model on this machine)."""
    check_run_dir(recipe.output_dir)
    check_not_in_use(recipe.output_dir)
    check_resume(recipe, resume=resume)


def check_not_in_use(output_dir: str) -> None:
    """Refuse a submission onto a run directory that a live segment holds (its run.lock names a
    job that Slurm still runs); a lock left by a killed job does not count (beam_hpc.run.lock)."""
    from beam_hpc.run.lock import RunLockError, check_free

    try:
        check_free(RunPaths(output_dir).lock)
    except RunLockError as err:  # not bad input: the directory is busy now (exit 1, try later)
        raise RunLockError(f"output_dir: {err}") from err
