"""Checks on the login node before a run is (re)submitted: is this a fresh run, a valid resume?

The seed's rules: resuming keeps the same model, data, output directory and topology (num_rollout,
walltime and partitions may change), and needs both the checkpoint and its dataset state. A fresh
submission onto an output directory that already holds checkpoints is refused, so that a typo
cannot silently continue (or clobber) someone else's run. What the checkpoints were made with is
compared by :func:`beam_hpc.run.identity.check_identity`, the same check a segment makes in the job.
"""

from __future__ import annotations

from beam_hpc.errors import InputError

from pathlib import Path

from beam_hpc.run import checkpoint_layout
from beam_hpc.run.identity import check_identity
from beam_hpc.plan.plan import RunPaths
from beam_hpc.config.recipe import Recipe


def check_before_submit(recipe: Recipe, *, resume: bool) -> None:
    check_not_in_use(recipe.output_dir)
    check_resume(recipe, resume=resume)


def check_not_in_use(output_dir: str) -> None:
    """Refuse a submission onto a run directory that a live segment holds (its run.lock names a
    job that Slurm still runs); a lock left by a killed job does not count (beam_hpc.run.lock)."""
    from beam_hpc.run.lock import RunLockError, check_free

    try:
        check_free(RunPaths(output_dir).lock)
    except RunLockError as err:
        raise InputError(f"output_dir: {err}") from err


def check_resume(recipe: Recipe, *, resume: bool) -> None:
    """The seed's resume rules, identity included (also checked inside the job, by
    beam_hpc.job.segment, for a segment that Slurm or a resubmission started)."""
    paths = RunPaths(recipe.output_dir)
    ckpt = Path(paths.checkpoints)
    has_ckpt = checkpoint_layout.latest_iteration(ckpt) is not None
    if not resume:
        if has_ckpt:
            raise InputError(
                f"output_dir: {recipe.output_dir} already holds checkpoints of a run; pass --resume "
                "to continue it (with a total --num-rollout), or choose a new --output-dir"
            )
        return
    problems = checkpoint_layout.resume_problems(ckpt)
    if problems:
        raise InputError(f"--resume: cannot resume from {ckpt}: {'; '.join(problems)}")
    done = checkpoint_layout.rollouts_done(ckpt)
    if recipe.num_rollout <= done:
        raise InputError(
            f"num_rollout: {recipe.num_rollout} counts all rollouts (the seed's semantics) and "
            f"{done} are already done; pass --num-rollout larger than {done}"
        )
    check_identity(paths, recipe.identity())  # the checkpoints' run_identity.json (IdentityError)
