"""The end of a segment: decide what follows, carry it out, write the ledger's end line, and say
the exit code.

The segment hands :func:`end_segment` what it did (an :class:`~beam_hpc.lifecycle.decide.Outcome`
and the detail for the ledger). This module records the nodes a node failure is blamed on (left out
of the run's next segments and put in the site's quarantine), asks
:func:`~beam_hpc.lifecycle.decide.decide`, and acts: it resubmits this script after this job. A
requeue is Slurm's own, except after a graceful save in a preemption's grace time; then the job
requeues itself. When Slurm requeued the job and this segment found failed nodes (a node Slurm
took from the job, which is why it was requeued), the requeued job's ExcNodeList leaves them out.
Then it logs the end and appends the end line. What must wait until the run lock is released
comes back as :attr:`Ending.after` (the requeued job takes the lock again), for
:func:`after_release`. The exit code is 0 when the segment ended as planned (completed, walltime,
preempted, cancelled) and 1 otherwise.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from beam_hpc.lifecycle import actions, cancel, exclusions, quarantine
from beam_hpc.lifecycle.decide import Action, Decision, Outcome, decide
from beam_hpc.lifecycle.save import SaveResult
from beam_hpc.lifecycle.segment_metrics import SegmentMetrics
from beam_hpc.plan.plan import Plan
from beam_hpc.plan.segment_args import SegmentArgs
from beam_hpc.run import checkpoint_layout, ledger
from beam_hpc.run.ledger import Reason

log = logging.getLogger(__name__)

EXIT_OK, EXIT_ERROR, EXIT_REFUSED = 0, 1, 2  # EXIT_REFUSED: bad input (the CLI's exit 2)
_AS_PLANNED = (Reason.COMPLETED, Reason.WALLTIME, Reason.PREEMPTED, Reason.CANCELLED)


class After(Enum):
    """What is left to do once the end line is written and the run lock released."""

    NOTHING = "nothing"
    # preempted, and saved within the grace time: a job that then ends by itself is COMPLETED, and
    # Slurm would not requeue it, so it requeues itself (beam_hpc.lifecycle.actions.requeue_self)
    REQUEUE_SELF = "requeue-self"


@dataclass(frozen=True)
class SegmentFacts:
    """What the end needs to know of the segment besides its outcome."""

    plan: Plan  # with the --num-rollout total this segment was given
    job_id: str | None  # Slurm's (None: a local run, which resubmits nothing)
    ledger_job_id: str  # the job id of its ledger lines ("l<pid>" for a local run)
    restart: int
    started_at: float  # wall time; a checkpoint published before it is an earlier segment's
    history: list[dict[str, Any]]  # the ledger's segments before this one
    lead_s: int  # the walltime lead, passed on to a resubmission's --signal
    num_rollout_arg: int | None = None  # --num-rollout, passed on to a resubmission
    # when Slurm kills the job: how long a resubmission or self-requeue may retry an unreachable controller
    kill_clock: actions.KillClock | None = None


@dataclass(frozen=True)
class Ending:
    """How the segment ended and what follows."""

    reason: Reason
    decision: Decision
    next_job_id: str | None
    after: After = After.NOTHING
    excluded: tuple[str, ...] = ()  # the run's failed nodes: a self-requeue leaves them out too
    restart: int = 0  # the job's restart count: tells whether a self-requeue whose answer was lost went through
    kill_clock: actions.KillClock | None = None  # the self-requeue's deadline

    @property
    def exit_code(self) -> int:
        return EXIT_OK if self.reason in _AS_PLANNED else EXIT_ERROR


def end_segment(outcome: Outcome, seg: SegmentFacts, *, detail: str, metrics: SegmentMetrics,
                failed_nodes: Sequence[dict[str, str]] = (), lost_nodes: Sequence[dict[str, str]] = (),
                slurm_failed: Sequence[dict[str, str]] = (), saved: SaveResult | None = None,
                ready_s: float | None = None, requeue_self: bool = False) -> Ending:
    """Decide, act, and write the end line (once per segment: the caller sees to that).
    ``failed_nodes``: the nodes a node failure is blamed on (Slurm runs only); ``saved``: what a
    save on request did; ``ready_s``: seconds until Ray was ready; ``requeue_self``: a requeue is
    this job's own to do (a graceful preemption save); ``lost_nodes``: rollout nodes lost while the
    segment went on (whatever its end): recorded like failed nodes, in the end line's
    ``failed_nodes``, the run's exclusions and the site's quarantine; ``slurm_failed``: the nodes
    of the allocation Slurm had failed when it stopped the job
    (:func:`beam_hpc.lifecycle.exclusions.failed_in_slurm`), recorded the same way, whatever the
    reason: a node lost under a job that does not go on without it ends the segment as a requeue
    (``preempted``), and this is how the end line names it."""
    plan, paths = seg.plan, seg.plan.paths
    failed = list(failed_nodes) if outcome.reason == Reason.NODE_FAILURE and seg.job_id else []
    for f in [*lost_nodes, *slurm_failed]:
        if seg.job_id and f["node"] not in {g["node"] for g in failed}:
            failed.append(f)
    if slurm_failed and seg.job_id:
        detail += f"; Slurm had node(s) {', '.join(f['node'] for f in slurm_failed)} failed"
    excluded, nodes_short = _exclusions(seg, failed)
    decision = decide(outcome, history=seg.history, max_segments=plan.recipe.lifecycle.max_segments,
                      cancelled=cancel.cancel_requested(paths),
                      requeue_on_preemption=plan.recipe.lifecycle.requeue_on_preemption, nodes_short=nodes_short)
    decision, next_job, pending = _act(decision, seg, excluded, exclude_now=bool(failed) and not requeue_self)
    after = After.REQUEUE_SELF if decision.action == Action.REQUEUE and requeue_self else After.NOTHING
    save_s = saved.seconds if saved is not None and saved.saved else metrics.save_s
    # Logged before the end line: whoever sees the end line (status, a test, the next segment)
    # then finds the segment's log complete.
    log.info("segment ended: %s (%s); rollouts %d -> %d of %d; next: %s %s", outcome.reason, detail,
             outcome.rollouts_at_start, outcome.rollouts_at_end, outcome.num_rollout, decision.action, next_job or "")
    if outcome.reason == Reason.STALLED and decision.action == Action.NONE:
        log.error("the chain stops: %s", decision.detail)
    ledger.append(paths.ledger, ledger.end_record(
        job_id=seg.ledger_job_id, restart=seg.restart, rollouts_at_end=outcome.rollouts_at_end, reason=outcome.reason,
        detail=f"{detail} -> {decision.detail}", next_action=decision.action, next_job_id=next_job,
        rollout_s=metrics.rollout_s, save_s=save_s, rollouts_run=metrics.rollouts_run,
        ready_s=None if ready_s is None else round(ready_s, 3), last_save_at=_last_save_at(seg),
        failed_nodes=failed, stall=outcome.stall, resubmission_pending=pending))
    return Ending(outcome.reason, decision, next_job, after, tuple(excluded), seg.restart, seg.kill_clock)


def after_release(ending: Ending, job_id: str | None) -> None:
    """What :attr:`Ending.after` says, once the run lock is released."""
    if ending.after is After.REQUEUE_SELF:
        try:
            actions.requeue_self(job_id or "", exclude=ending.excluded, restart=ending.restart,
                                 deadline=ending.kill_clock)
            log.info("requeued job %s", job_id)
        except (RuntimeError, OSError) as err:
            log.error("%s; Slurm requeues the job itself when the grace time ends", err)


def _exclusions(seg: SegmentFacts, failed: list[dict[str, str]]) -> tuple[list[str], str | None]:
    """The run's excluded nodes from now on (the ledger's, these, and the site's quarantine), and
    why the nodes left cannot hold the groups (None when they can, or Slurm cannot say). Slurm is
    asked only when some node is excluded; a local run excludes nothing."""
    if seg.job_id is None:
        return [], None
    plan = seg.plan
    segment = ledger.segment_id(seg.ledger_job_id, seg.restart)
    excluded = exclusions.names(exclusions.effective(plan.output_dir, seg.history, failed, segment=segment))
    quarantine.record_failures(plan.site, failed, run=plan.run_id, run_dir=plan.output_dir,
                               segment=segment)  # the site's, across runs (no-op without one)
    excluded = quarantine.excluded_in_job(plan.site, excluded)
    if failed:
        log.warning("excluding node(s) %s from the run's next segments: %s",
                    ", ".join(f["node"] for f in failed), "; ".join(f["why"] for f in failed))
    return excluded, exclusions.plan_shortfall(plan.groups, excluded)


def _act(decision: Decision, seg: SegmentFacts, excluded: list[str], *,
         exclude_now: bool = False) -> tuple[Decision, str | None, dict[str, str] | None]:
    """Carry the decision out: the decision as it stands after trying (a failed resubmission ends
    the chain, and says why), the next job's id, and, when Slurm could not be reached until the
    job's end, the resubmission that is pending (the end line's ``resubmission_pending``).
    ``exclude_now``: this segment failed nodes and Slurm requeued the job itself (no self-requeue
    follows), so a requeue sets the requeued job's ExcNodeList here, before this job ends."""
    paths = seg.plan.paths
    if decision.action == Action.RESUBMIT:
        script = Path(paths.script)
        if seg.job_id is None:
            return Decision(Action.NONE, decision.detail + " (not in Slurm: nothing to resubmit)"), None, None
        if not script.is_file():
            return Decision(Action.NONE, f"{decision.detail}, but {script} is missing; resubmit by hand"), None, None
        has_ckpt = checkpoint_layout.latest_iteration(paths.checkpoints) is not None
        try:
            job = actions.resubmit(str(script), SegmentArgs(resume=has_ckpt, num_rollout=seg.num_rollout_arg),
                                   lead_s=seg.lead_s, dependency=f"afterany:{seg.job_id}",
                                   output=paths.batch_log("%j"), exclude=excluded, deadline=seg.kill_clock)
        except actions.ResubmissionPending as pending:  # the checkpoint is safe; the next step is a command
            log.error("%s", pending)
            return (Decision(Action.NONE, f"{decision.detail}, but the resubmission is pending: {pending.why}; "
                                          f"run {pending.shell}"), None, pending.record())
        except (RuntimeError, OSError) as err:
            log.error("%s", err)
            return Decision(Action.NONE, f"{decision.detail}, but the resubmission failed: {err}"), None, None
        if cancel.cancel_requested(paths):  # cancelled while we were submitting
            cancel.withdraw(job)
            return Decision(Action.NONE, f"the run was cancelled; withdrew the resubmitted job {job}"), None, None
        log.info("resubmitted as job %s (after this one, %s)", job, "--resume" if has_ckpt else "fresh")
        return decision, job, None
    if decision.action == Action.REQUEUE:
        if exclude_now and seg.job_id is not None and excluded:
            try:
                actions.exclude_from_requeued(seg.job_id, excluded, deadline=seg.kill_clock)
                log.info("the requeued job %s leaves out node(s) %s", seg.job_id, ", ".join(excluded))
            except (RuntimeError, OSError) as err:  # the job still requeues; it may land on the node again
                log.error("%s", err)
                return Decision(Action.REQUEUE, f"{decision.detail}, but its excluded nodes could not be set: "
                                                f"{err}"), seg.job_id, None
        return decision, seg.job_id, None
    return decision, None, None


def _last_save_at(seg: SegmentFacts) -> float | None:
    """When this segment's last checkpoint was published (None if it published none)."""
    marker = Path(seg.plan.paths.checkpoints, checkpoint_layout.LATEST_FILE)
    try:
        at = marker.stat().st_mtime
    except OSError:
        return None
    return at if at >= seg.started_at else None
