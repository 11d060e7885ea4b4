"""The start of a segment: where it starts from, its time limit and lead, the ledger's start line,
and the checks that may refuse to run the job.

The time limit is the job's as Slurm has it (``TimeLimit`` of ``scontrol show job``): what the
script's ``#SBATCH --time`` says, a hand edit included, or what ``scontrol update`` made of it.
The plan's ``walltime_s`` (the recipe's) stands in only outside Slurm (``beam-hpc execute``) or
when Slurm cannot say. The start line records it, the computed lead is capped by it, and the
GPU-hour accounting reads it back from the start line (:mod:`beam_hpc.run.accounting`).
A refusal (the run was cancelled, is complete, has run ``max_segments``, or its checkpoints
refuse the resume) is a :class:`Refusal`, which the segment ends with (:mod:`beam_hpc.lifecycle.end`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from beam_hpc.config.recipe import Recipe
from beam_hpc.errors import InputError
from beam_hpc.lifecycle import save
from beam_hpc.plan.plan import Plan, compute_lead_s
from beam_hpc.run import checkpoint_layout, ledger
from beam_hpc.run.identity import IdentityError, record_identity
from beam_hpc.run.ledger import Reason
from beam_hpc.run.resume import check_resume
from beam_hpc.slurm.client import JobInfo

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Start:
    """Where a segment starts: the facts of its start line."""

    rollouts_at_start: int
    has_ckpt: bool
    resume: bool  # --resume, or a requeued job (SLURM_RESTART_COUNT > 0) with a checkpoint
    requeued: bool  # Slurm requeued the job (no --resume asked): it resumes by itself
    history: list[dict[str, Any]]  # the ledger's segments before this one
    walltime_s: int  # the job's time limit (Slurm's; the plan's outside Slurm)
    lead_s: int
    damaged: list[dict[str, Any]]  # the damaged checkpoints passed over


@dataclass(frozen=True)
class Refusal:
    """Why the segment does not run the job: its end line's reason and detail. ``bad_input``: the
    run's checkpoints refuse the resume (exit 2, as the CLI's bad input)."""

    reason: Reason
    detail: str
    bad_input: bool = False


def with_num_rollout(plan: Plan, n: int) -> Plan:
    """``--num-rollout N`` on a resubmission: the seed lets it change (total, done included).
    plan.json stays as submitted (the job never writes it): the new total holds for this
    segment, is recorded in its ledger start line, and is passed on to the segment it resubmits."""
    if n < 1:
        raise InputError(f"--num-rollout: {n} is not a positive number of rollouts")
    if n == plan.recipe.num_rollout:
        return plan
    log.info("num_rollout %d -> %d (from --num-rollout; passed on to resubmissions)", plan.recipe.num_rollout, n)
    return plan.with_num_rollout(n)


def lead_s(recipe: Recipe, history: list[dict[str, Any]], walltime_s: int) -> int:
    """The recipe's lead, or one computed from what earlier segments measured (with a floor),
    never more than half the walltime (a lead that eats the segment leaves no progress)."""
    if recipe.lifecycle.lead_s is not None:
        return recipe.lifecycle.lead_s
    return min(compute_lead_s(recipe, ledger.measured_timings(history)), walltime_s // 2)


def survey(plan: Plan, *, restart: int, want_resume: bool, time_limit_s: int | None) -> Start:
    """Where the segment starts, damaged checkpoints passed over first. ``time_limit_s``: the
    job's time limit from Slurm (None: the plan's walltime stands in)."""
    ckpt = plan.paths.checkpoints
    damaged = pass_over_damaged_checkpoints(ckpt)
    has_ckpt = checkpoint_layout.latest_iteration(ckpt) is not None
    history, warnings = ledger.read_ledger(plan.paths.ledger)
    for w in warnings:
        log.warning("%s", w)
    walltime_s = plan.walltime_s if time_limit_s is None else time_limit_s
    lead = lead_s(plan.recipe, history, walltime_s)
    log.info("time limit %d s (%s), lead %d s", walltime_s,
             "the plan's: no time limit from Slurm" if time_limit_s is None else "the job's, from Slurm", lead)
    return Start(rollouts_at_start=checkpoint_layout.rollouts_done(ckpt), has_ckpt=has_ckpt,
                 resume=want_resume or (restart > 0 and has_ckpt), requeued=restart > 0 and not want_resume,
                 history=history, walltime_s=walltime_s,
                 lead_s=lead, damaged=damaged)


def pass_over_damaged_checkpoints(ckpt: str) -> list[dict[str, Any]]:
    """The newest checkpoints that fail their manifest (a file truncated or changed since it was
    published), passed over: the pointer is moved back to the newest complete checkpoint, with
    the run lock held, before anything counts progress from it. Why here and not only in the
    backend (which walks back too): the start line's rollouts, the decision after the segment
    (progress is the pointer's) and ``status`` all read the pointer, and a pointer that names a
    damaged checkpoint would count rollouts the run no longer has. Returns what was passed over
    (the start line records it). With no complete checkpoint at all, the pointer is left as it
    is and the resume is refused with the reasons."""
    complete, damaged = checkpoint_layout.newest_complete(ckpt)
    if not damaged:
        return []
    why = "; ".join(f"checkpoint {d['iteration']}: {d['why']}" for d in damaged)
    if complete is None:
        log.error("no complete checkpoint to resume from: %s", why)
        return damaged
    checkpoint_layout.mark_latest(ckpt, complete)
    log.warning("passed over damaged checkpoint(s) for complete checkpoint %d (the pointer now names it; "
                "rollouts %d-%d are trained again): %s", complete, complete + 1, damaged[0]["iteration"], why)
    return damaged


def write_start_line(plan: Plan, start: Start, *, job_id: str, restart: int, host: str) -> None:
    """The ledger's start line; then a save request a killed segment left is removed (it no longer
    applies)."""
    ledger.append(plan.paths.ledger, ledger.start_record(
        job_id=job_id, restart=restart, host=host, rollouts_at_start=start.rollouts_at_start,
        num_rollout=plan.recipe.num_rollout, resume=start.resume, walltime_s=start.walltime_s,
        lead_s=start.lead_s, damaged_checkpoints=start.damaged))
    save.clear_save_request(plan.paths)


def check(plan: Plan, start: Start, *, segment: str, restart: int, job_info: JobInfo | None) -> Refusal | None:
    """The checks after the start line: the cancel flag, ``num_rollout`` reached, ``max_segments``,
    and the seed's resume rules with the checkpoints' identity (:func:`beam_hpc.run.resume.check_resume`:
    plan.json or the script may have changed since the submission). When the job may run, the
    identity it makes checkpoints with is recorded. ``job_info``: this job as Slurm had it at the start
    (None outside Slurm, or when Slurm did not answer)."""
    recipe = plan.recipe
    if cancelled(plan.paths.cancel_flag, job_info):
        return Refusal(Reason.CANCELLED, "the run was cancelled (beam-hpc cancel); not starting")
    if start.rollouts_at_start >= recipe.num_rollout:
        return Refusal(Reason.COMPLETED, f"{start.rollouts_at_start} rollouts already done of {recipe.num_rollout}")
    if len(start.history) + 1 > recipe.lifecycle.max_segments:
        return Refusal(Reason.ERROR, f"lifecycle.max_segments ({recipe.lifecycle.max_segments}) reached "
                                     "before this segment; raise it and resubmit with --resume")
    try:
        check_resume(recipe, resume=start.resume)  # with checkpoints, also what they were made with
    except (IdentityError, InputError) as err:  # IdentityError: a changed plan.json or a hand-edited script
        return Refusal(Reason.ERROR, str(err), bad_input=True)
    record_identity(plan.paths, recipe.identity(), segment, has_ckpt=start.has_ckpt)
    if start.requeued:
        log.info("requeued segment (restart %d): %s", restart,
                 f"resuming from checkpoint {checkpoint_layout.latest_iteration(plan.paths.checkpoints)}"
                 if start.has_ckpt else "no checkpoint yet, starting from the beginning")
    return None


def cancelled(flag_path: str, info: JobInfo | None) -> bool:
    """The cancel flag applies to jobs submitted before it; a later submission (the user resumed
    the run on purpose) clears it."""
    flag = Path(flag_path)
    try:
        flagged_at = flag.stat().st_mtime
    except FileNotFoundError:
        return False
    if info is not None and info.submit_time is not None and info.submit_time > flagged_at + 1:
        log.info("cancel flag older than this submission: cleared (the run was resumed)")
        flag.unlink(missing_ok=True)
        return False
    return True
