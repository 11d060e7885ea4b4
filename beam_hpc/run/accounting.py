"""GPU-hours: what a run will hold (before submission) and what it held and lost (from its ledger).

Why here, as pure functions over the ledger: the ledger is the one record every segment leaves
on shared storage, so `beam-hpc status` can account for a run from any login node, after any
kind of failure, with no scheduler database. A GPU-hour is the run's GPUs (all groups; a run's
topology never changes, see beam_hpc.run.identity) held for one hour of a segment's wall time,
less the GPUs of rollout nodes the segment lost and went on without, from the loss on: Slurm
excises a failed node from a ``--no-kill`` job and stops billing it then, and the held figure
should read as what the site charges (the end line's ``failed_nodes`` entries with ``lost_at``).

A segment's time is split between the lost causes of :data:`CAUSES` (each explained at its
constant, with the ledger fields it is computed from) and useful time: the rest (training that
was kept, saves, the driver's own start-up; for a running segment, nothing yet: its time is held,
not yet judged). A ledger line that lacks a field (written by an older beam-hpc) loses nothing to
that cause: the result says it is partial instead of guessing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from beam_hpc.run.ledger import Reason

# From the segment's start line until Ray was ready [end line: ``ready_s``].
BRINGUP = "bring-up and restart"
# Rollouts trained after the last checkpoint, which the next segment trains again [``rollouts_run``
# minus the checkpointed progress, times ``timings.rollout_s``].
REDONE = "rollouts re-done"
# From the last checkpoint to the end of a segment that Slurm stopped (walltime, preemption, cancel),
# less the re-done rollouts already counted [``last_save_at``].
TAIL = "walltime tail after the last save"
# Rollouts trained again, and kept, because the newest checkpoint failed its manifest when a segment
# started, which then resumed from an older one [the start line's ``damaged_checkpoints``, times
# ``timings.rollout_s``].
DAMAGED = "checkpoint found damaged"
# All of a segment that ended in an error or a node failure without saving any progress, and of one
# killed so hard that it wrote no end line and the next segment found no new checkpoint.
FAILED = "failed segments"
# Of a segment that stalled (beam_hpc.lifecycle.stall), the time from its last progress until it
# ended (the timeout, the stack dumps, the teardown) [``stall.since``], or all of it when it kept no
# new checkpoint; the rollouts it trained after its last checkpoint count as re-done.
STALLED = "stalls"
CAUSES = (BRINGUP, REDONE, TAIL, DAMAGED, FAILED, STALLED)
_STOPPED_BY_SLURM = (Reason.WALLTIME, Reason.PREEMPTED, Reason.CANCELLED)
_FAILURES = (Reason.ERROR, Reason.NODE_FAILURE)


@dataclass(frozen=True)
class SegmentTime:
    """One segment's wall seconds and where they went (seconds, not yet times GPUs)."""

    segment: str
    wall_s: float
    lost_s: dict[str, float]
    running: bool = False
    attributed: bool = True  # False: its line lacks fields, so some loss may be counted as useful
    # seconds that lost rollout nodes were out of the job, summed over the nodes (each from its
    # ``lost_at`` to the segment's end): times a node's GPUs, GPU-seconds no longer held
    released_node_s: float = 0.0

    @property
    def useful_s(self) -> float:
        return max(0.0, self.wall_s - sum(self.lost_s.values()))


@dataclass(frozen=True)
class RunHours:
    """A run's GPU-hours held, useful and lost by cause (``lost_h`` has every cause, 0 when none)."""

    gpus: int
    held_h: float
    useful_h: float
    lost_h: dict[str, float]
    segments: list[SegmentTime] = field(default_factory=list)

    @property
    def partial(self) -> bool:
        """Some ledger lines lack the fields that attribute a loss (lines from an older beam-hpc)."""
        return any(not s.attributed for s in self.segments)

    @property
    def goodput(self) -> float | None:
        """Useful GPU-hours over held GPU-hours (None before anything was held)."""
        return self.useful_h / self.held_h if self.held_h > 0 else None


def as_number(value: Any) -> float | None:
    """A ledger field's number, or None where a hand edit or a foreign writer left something else
    (a bool is not a number here). Every ledger reader in observe/ uses this one."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def segment_time(seg: dict[str, Any], *, next_start: dict[str, Any] | None, now: float) -> SegmentTime | None:
    """Where one merged ledger segment's time went; None when it has no readable start line."""
    start = seg.get("start") or {}
    end = seg.get("end")
    t0 = as_number(start.get("time"))
    if t0 is None:
        return None
    lost = {c: 0.0 for c in CAUSES}
    if end is None:
        if next_start is None:  # still running (or killed this very moment): held so far
            return SegmentTime(seg["segment"], max(0.0, now - t0), {}, running=True)
        # killed without an end line: held until the next segment started, at most the time limit its
        # start line recorded (Slurm's, so an edited --time counts as the job ran with it)
        t1 = as_number(next_start.get("time")) or t0
        walltime = as_number(start.get("walltime_s"))
        wall = max(0.0, min(t1 - t0, walltime) if walltime else t1 - t0)
        progressed = (as_number(next_start.get("rollouts_at_start")) or 0) > (as_number(start.get("rollouts_at_start")) or 0)
        if progressed:  # it saved something before it died: what it lost is not recorded
            return SegmentTime(seg["segment"], wall, lost, attributed=False)
        return SegmentTime(seg["segment"], wall, {**lost, FAILED: wall})
    t1 = as_number(end.get("time")) or t0
    wall = max(0.0, t1 - t0)
    kept = (as_number(end.get("rollouts_at_end")) or 0) - (as_number(start.get("rollouts_at_start")) or 0)
    reason = end.get("reason")
    if reason in _FAILURES and kept <= 0:
        return SegmentTime(seg["segment"], wall, {**lost, FAILED: wall})
    if reason == Reason.STALLED and kept <= 0:
        return SegmentTime(seg["segment"], wall, {**lost, STALLED: wall})
    ready_s = as_number(end.get("ready_s"))
    lost[BRINGUP] = min(wall, ready_s) if ready_s is not None else 0.0
    rollout_s = as_number((end.get("timings") or {}).get("rollout_s"))
    run = as_number(end.get("rollouts_run"))
    if rollout_s is not None and run is not None:
        lost[REDONE] = max(0.0, run - max(kept, 0)) * rollout_s
    lost[DAMAGED] = min(_damaged_rollouts(start), max(kept, 0)) * (rollout_s or 0.0)
    last_save = as_number(end.get("last_save_at"))
    if reason in _STOPPED_BY_SLURM and last_save is not None and t0 <= last_save <= t1:
        lost[TAIL] = max(0.0, (t1 - last_save) - lost[REDONE])
    stalled_since = as_number((end.get("stall") or {}).get("since")) if reason == Reason.STALLED else None
    if stalled_since is not None:
        lost[STALLED] = max(0.0, t1 - max(t0, stalled_since))
    attributed = ready_s is not None and rollout_s is not None and run is not None
    total = sum(lost.values())
    if total > wall:  # measurements overlap (e.g. a save counted in a rollout): scale to the wall time
        lost = {k: v * wall / total for k, v in lost.items()}
    return SegmentTime(seg["segment"], wall, lost, attributed=attributed, released_node_s=_released_s(end, t0, t1))


def _released_s(end: dict[str, Any], t0: float, t1: float) -> float:
    """Node-seconds the segment held no more: each rollout node it lost and went on without (a
    ``failed_nodes`` entry with a ``lost_at`` time, which only such a loss has), from then to the end."""
    out = 0.0
    for entry in end.get("failed_nodes") or []:
        at = as_number(entry.get("lost_at")) if isinstance(entry, dict) else None
        if at is not None:
            out += t1 - min(max(at, t0), t1)
    return out


def _damaged_rollouts(start: dict[str, Any]) -> int:
    """Rollouts a segment trains again because it passed over damaged checkpoints: from where it
    resumed up to the newest one it passed over (of which it counts those it kept; those it ran
    past its own last checkpoint are re-done rollouts already)."""
    passed = [as_number(d.get("iteration")) for d in start.get("damaged_checkpoints") or [] if isinstance(d, dict)]
    newest = max((p for p in passed if p is not None), default=None)
    at_start = as_number(start.get("rollouts_at_start")) or 0
    return 0 if newest is None else max(0, int(newest) + 1 - int(at_start))


def account(segments: list[dict[str, Any]], gpus: int, *, now: float, lost_node_gpus: int = 0) -> RunHours:
    """GPU-hours of the merged ledger ``segments`` (beam_hpc.run.ledger.read_ledger) for a run
    of ``gpus`` GPUs, at wall clock ``now`` (a running segment counts up to it). ``lost_node_gpus``:
    the GPUs of one rollout node, which a lost one stops holding from its loss (0: not known, every
    GPU counted for the whole segment). A loss a running segment has not written yet is counted
    once its end line is."""
    times: list[SegmentTime] = []
    starts = [s.get("start") for s in segments]
    for i, seg in enumerate(segments):
        following = next((st for st in starts[i + 1:] if st), None)
        t = segment_time(seg, next_start=following, now=now)
        if t is not None:
            times.append(t)
    per_h = gpus / 3600.0
    lost = {c: sum(t.lost_s.get(c, 0.0) for t in times) * per_h for c in CAUSES}
    released = [t.released_node_s * lost_node_gpus / 3600.0 for t in times]
    held = sum(t.wall_s * per_h - r for t, r in zip(times, released, strict=True))
    # the released GPUs were out while the rest of the segment trained on: taken from its useful time
    useful = sum(max(0.0, t.useful_s * per_h - r) for t, r in zip(times, released, strict=True) if not t.running)
    return RunHours(gpus=gpus, held_h=held, useful_h=useful, lost_h=lost, segments=times)


@dataclass(frozen=True)
class Estimate:
    """What a run (or the rest of it) will hold: ``None`` fields are unknown until a segment has
    measured a rollout, and ``basis`` says where the per-rollout time came from."""

    gpus: int
    rollouts_left: int
    rollout_s: float | None
    basis: str
    wall_s: float | None
    gpu_hours: float | None
    segments: int | None

    def describe(self) -> str:
        if self.gpu_hours is None or self.wall_s is None:
            return (f"GPU-hours: unknown until the first segment measures a rollout ({self.gpus} GPUs, "
                    f"{self.rollouts_left} rollouts to go; set lifecycle.rollout_s_estimate to estimate now)")
        return (f"GPU-hours: about {self.gpu_hours:,.1f} ({self.gpus} GPUs x {self.wall_s / 3600:,.2f} h for "
                f"{self.rollouts_left} rollouts at {self.rollout_s:.1f} s each, {self.basis}), "
                f"in about {self.segments} segment(s) at the recipe's walltime")


def estimate(*, gpus: int, rollouts_left: int, walltime_s: int, lead_s: int, rollout_s: float | None,
             basis: str, bringup_s: float) -> Estimate:
    """GPU-hours and segments for ``rollouts_left`` rollouts: each segment spends ``bringup_s``
    bringing Ray and the driver up and stops ``lead_s`` before its walltime to save."""
    if rollout_s is None or rollout_s <= 0:
        return Estimate(gpus, rollouts_left, None, basis, None, None, None)
    per_segment = max(1, math.floor(max(0.0, walltime_s - lead_s - bringup_s) / rollout_s))
    segments = max(1, math.ceil(rollouts_left / per_segment)) if rollouts_left > 0 else 0
    wall = rollouts_left * rollout_s + segments * bringup_s
    return Estimate(gpus, rollouts_left, rollout_s, basis, wall, gpus * wall / 3600.0, segments)
