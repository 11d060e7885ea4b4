"""Checks on the login node before a run is (re)submitted: is this a fresh run, a valid resume?

The seed's rules: resuming keeps the same model, data, output directory and topology (num_rollout,
walltime and partitions may change), and needs both the checkpoint and its dataset state. A fresh
submission onto an output directory that already holds checkpoints is refused, so that a typo
cannot silently continue (or clobber) someone else's run. What the checkpoints were made with is
compared by :func:`beam_hpc.run.identity.check_identity`; both live in :mod:`beam_hpc.run.resume`,
the same check a segment makes in the job.
"""

from __future__ import annotations

from beam_hpc.config.recipe import Recipe
from beam_hpc.plan.paths import RunPaths
from beam_hpc.run.resume import check_resume  # noqa: F401 (the seed's rules; re-exported)


def check_run_dir(output_dir: str) -> None:
    """A run directory whose plan.json is damaged (torn, or edited into something invalid) is bad
    input: InputError naming the file, before anything is written (submit, execute and the
    segment answer it alike; beam_hpc.plan.plan.load_plan)."""
    from pathlib import Path

    from beam_hpc.plan.plan import load_plan

    plan = RunPaths(output_dir).plan
    if Path(plan).exists():
        load_plan(plan)


def check_before_submit(recipe: Recipe, *, resume: bool) -> None:
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
