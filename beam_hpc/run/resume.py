"""May this run start or resume here? The seed's resume rules, in one place.

Resuming keeps the same model, data, output directory and topology (num_rollout, walltime and
partitions may change) and needs both the checkpoint and its dataset state; a fresh start onto a
directory that already holds checkpoints is refused, so a typo cannot continue (or clobber)
someone else's run. Lives in run/ because both sides of the allocation ask it: the login-node
guard before a submission and every segment before its driver starts.
"""

from __future__ import annotations

from pathlib import Path

from beam_hpc.config.recipe import Recipe
from beam_hpc.errors import InputError
from beam_hpc.plan.paths import RunPaths
from beam_hpc.run import checkpoint_layout
from beam_hpc.run.identity import check_identity


def check_resume(recipe: Recipe, *, resume: bool) -> None:
    """The seed's resume rules, identity included: checked on the login node before a submission
    (beam_hpc.submission.run_guard) and inside the job by every segment that Slurm or a
    resubmission started (beam_hpc.job.segment): one function, so both say the same."""
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
