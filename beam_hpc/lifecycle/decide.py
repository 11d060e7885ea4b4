"""What follows a segment: the pure rule book (no I/O), so that every case is a fast test.

The end of a segment (:mod:`beam_hpc.lifecycle.end`) hands in what it did (:class:`Outcome`) and
the ledger's earlier segments; :func:`decide` answers with a :class:`Decision` whose ``action`` is
written to the ledger's end line as ``next.action`` (:class:`Action`, the ledger's own enum).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from beam_hpc.run.ledger import Action, Reason

# a stall is a failure too: it retries once without progress
FAILURES = (Reason.ERROR, Reason.NODE_FAILURE, Reason.STALLED)
STALLED = Reason.STALLED


@dataclass(frozen=True)
class Outcome:
    """What a segment did, as far as the decision is concerned."""

    reason: Reason
    rollouts_at_start: int
    rollouts_at_end: int
    num_rollout: int
    rollouts_run: int = 0  # rollout steps finished in this segment (0: failed before its first)
    retryable: bool = True  # False for errors that another segment would repeat (bad input)
    stall: dict[str, Any] | None = None  # a stalled segment's record (ledger end line "stall": rollout, dumps)


@dataclass(frozen=True)
class Decision:
    action: Action
    detail: str


def _failed_without_progress(seg: dict[str, Any]) -> bool:
    start, end = seg.get("start") or {}, seg.get("end")
    if end is None:  # killed hard: its successor cannot tell, so count it as a failure
        return True
    return end.get("reason") in FAILURES and end.get("rollouts_at_end", 0) <= start.get("rollouts_at_start", 0)


def _stalled_at(seg: dict[str, Any]) -> int | None:
    """The rollout a stalled segment was stuck on (None: it did not stall)."""
    end = seg.get("end") or {}
    stall = end.get("stall") if end.get("reason") == STALLED else None
    return stall.get("rollout") if isinstance(stall, dict) else None


def _name_files(files: list[str], most: int = 8) -> str:
    """The dump files, each named when few; else the first ones and the directories of the rest
    (a large job dumps hundreds of processes, and the detail is one ledger line)."""
    if not files:
        return "none could be taken"
    if len(files) <= most:
        return ", ".join(files)
    dirs = sorted({f.rsplit("/", 1)[0] for f in files[most:]})
    return f"{', '.join(files[:most])} and {len(files) - most} more in {', '.join(dirs)}"


def _dumps(seg: dict[str, Any]) -> list[str]:
    stall = (seg.get("end") or {}).get("stall") or {}
    return [str(d) for d in stall.get("dumps") or []]


def decide(
    outcome: Outcome,
    *,
    history: list[dict[str, Any]],
    max_segments: int,
    cancelled: bool,
    requeue_on_preemption: bool,
    nodes_short: str | None = None,
) -> Decision:
    """The rule book (issue 4, guards), in order:

    1. ``num_rollout`` reached -> none; cancelled -> none; not retryable -> none.
    2. ``max_segments`` segments run (this one included) -> none.
    3. preempted -> requeue (same job id), unless the recipe turned requeueing off.
       stalled, and the segment before stalled at the same rollout -> none: the hang repeats
       where it is (a third segment would hold its nodes for another timeout); the detail names
       the rollout and both segments' stack dumps. Otherwise a stall is a failure (4-6).
    4. failed (error, node-failure) without progress: retried once; two such segments in a row
       (e.g. twice before the first rollout) -> none, because a third would fail the same way.
    5. otherwise no progress (the checkpoint did not advance over a whole segment) -> none: the
       walltime is too short for one rollout and its save, so resubmitting would loop forever.
    6. walltime, or a failure after progress -> resubmit with --resume.
    7. a resubmit or requeue from 3-6 -> none when ``nodes_short`` says why the nodes left after
       the run's failed-node exclusions cannot hold the groups
       (:func:`beam_hpc.lifecycle.exclusions.shortfall`): such a job would pend forever.

    ``history`` is the ledger's segments before this one (:func:`beam_hpc.run.ledger.read_ledger`).
    """
    decision = _decide(outcome, history=history, max_segments=max_segments, cancelled=cancelled,
                       requeue_on_preemption=requeue_on_preemption)
    if nodes_short and decision.action != Action.NONE:
        return Decision(Action.NONE, f"{decision.detail}, but {nodes_short}; the chain stops here")
    return decision


def _decide(outcome: Outcome, *, history: list[dict[str, Any]], max_segments: int, cancelled: bool,
            requeue_on_preemption: bool) -> Decision:
    """Rules 1-6 of :func:`decide`."""
    o = outcome
    if o.rollouts_at_end >= o.num_rollout:
        return Decision(Action.NONE, f"num_rollout {o.num_rollout} reached")
    if cancelled or o.reason == Reason.CANCELLED:
        return Decision(Action.NONE, "the run was cancelled; no further segment")
    if not o.retryable:
        return Decision(Action.NONE, "this error would repeat in another segment; fix it and resubmit with --resume")
    run = len(history) + 1
    if run >= max_segments:
        return Decision(Action.NONE, f"lifecycle.max_segments ({max_segments}) segments have run; raise it and resubmit with --resume")
    progress = o.rollouts_at_end > o.rollouts_at_start
    if o.reason == Reason.PREEMPTED:
        if not requeue_on_preemption:
            return Decision(Action.NONE, "preempted, and lifecycle.requeue_on_preemption is false")
        return Decision(Action.REQUEUE, "preempted: the same job id is requeued and resumes from the last checkpoint")
    if o.reason == STALLED:
        repeated = _stalled_at(history[-1]) if history else None
        if o.stall is not None and repeated is not None and repeated == o.stall.get("rollout"):
            dumps = list(_dumps(history[-1])) + list(o.stall.get("dumps") or [])
            return Decision(Action.NONE, f"stalled twice in a row at rollout {repeated} (it never finished, in "
                                         f"segment {history[-1].get('segment')} and in this one): the hang repeats "
                                         f"there, so the chain stops; stack dumps: {_name_files(dumps)}")
    if o.reason in FAILURES and not progress:
        before = "before its first rollout" if o.rollouts_run == 0 else "without a new checkpoint"
        if history and _failed_without_progress(history[-1]):
            return Decision(Action.NONE, f"{o.reason} {before}, and the segment before failed without progress too; "
                                         "stopping instead of failing again (see the segment logs)")
        return Decision(Action.RESUBMIT, f"{o.reason} {before}; retrying once")
    if not progress:
        return Decision(Action.NONE, f"no progress in this segment ({o.reason} with the checkpoint still at "
                                     f"{o.rollouts_at_end} rollouts); raise lifecycle.walltime or lower the lead")
    return Decision(Action.RESUBMIT, f"{o.reason} after {o.rollouts_at_end - o.rollouts_at_start} new rollouts; "
                                     "continuing with --resume")
