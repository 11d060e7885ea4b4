"""Effective training time ratio (ETTR), read from a run's ledger.

ETTR is the time spent training on work that is kept, over the wall time held (issue 42; the measure
Llama 3, ByteRobust and RobustRL report). Read from the ledger so that it can be had for any run,
from any login node, after any failure, with nothing but ``ledger.jsonl``, like the GPU-hours of
:mod:`beam_hpc.run.accounting`:

- training on kept work: each rollout the run's checkpoints finally hold, counted once, at the mean
  rollout-step seconds (``timings.rollout_s``: one rollout's generation and training) of the last
  segment that trained it. A segment that starts from checkpoint ``s`` throws away whatever was
  trained from ``s`` on (the rollouts after a lost segment's last save, or those of a checkpoint
  found damaged): those count as held, never as training. Bring-up, saves, evaluation, stalls and
  walltime tails are held time, not training.
- wall time held: each finished segment's seconds from its start line to its end line (a segment
  killed without an end line: until the next one started, at most its time limit), the same wall
  time :mod:`beam_hpc.run.accounting` counts. Queue waits between segments are not held; ``span_s``
  (first start to last end) includes them, for a reader who wants the user's view.

A running segment is left out of both sides until it ends: its kept work is not known before.
Where a line lacks ``rollout_s`` (an older beam-hpc, or a segment killed without an end line that
still saved progress) its rollouts are timed at the run's mean over the lines that have it, and
the result says it is ``partial``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from beam_hpc.plan.paths import LEDGER_FILE
from beam_hpc.run.accounting import as_number, segment_time
from beam_hpc.run.ledger import read_ledger


@dataclass(frozen=True)
class Ettr:
    """A run's effective training time, as its ledger shows it (seconds)."""

    training_s: float  # rollout-step seconds of the rollouts the run keeps, each counted once
    held_s: float  # wall seconds held by the finished segments
    span_s: float | None  # from the first segment's start to the last one's end (queue waits included)
    rollouts_kept: int
    segments: int  # finished segments counted
    running: bool = False  # the last segment is still running (left out)
    partial: bool = False  # some rollouts were timed at the run's mean step (see the module doc)

    @property
    def ratio(self) -> float | None:
        """ETTR: training on kept work over wall time held (None before a segment ended)."""
        return self.training_s / self.held_s if self.held_s > 0 else None

    @property
    def span_ratio(self) -> float | None:
        """Training on kept work over the chain's wall span, queue waits included."""
        return self.training_s / self.span_s if self.span_s else None




class _Kept:
    """The rollouts a run keeps as ``[lo, hi)`` ranges, each with its step seconds (None: unknown).
    A segment resuming from ``s`` truncates at ``s``; what it saves is appended: ranges stay ordered."""

    def __init__(self) -> None:
        self.ranges: list[tuple[int, int, float | None]] = []

    def resume_from(self, at: int) -> None:
        while self.ranges and self.ranges[-1][0] >= at:
            self.ranges.pop()
        if self.ranges and self.ranges[-1][1] > at:
            lo, _, step = self.ranges.pop()
            self.ranges.append((lo, at, step))

    def keep(self, lo: int, hi: int, step_s: float | None) -> None:
        if hi > lo:
            self.resume_from(lo)
            self.ranges.append((lo, hi, step_s))


def ettr(segments: list[dict[str, Any]], *, now: float | None = None) -> Ettr:
    """ETTR of the merged ledger ``segments`` (:func:`beam_hpc.run.ledger.read_ledger`) at ``now``."""
    now = time.time() if now is None else now
    kept = _Kept()
    held = 0.0
    counted = 0
    running = False
    first: float | None = None
    last: float | None = None
    starts = [s.get("start") for s in segments]
    for i, seg in enumerate(segments):
        start, end = seg.get("start") or {}, seg.get("end")
        following = next((st for st in starts[i + 1:] if st), None)
        t = segment_time(seg, next_start=following, now=now)
        if t is None:
            continue
        if t.running:
            running = True
            continue
        t0 = as_number(start.get("time"))
        at_start = int(as_number(start.get("rollouts_at_start")) or 0)
        if end is not None:
            at_end = int(as_number(end.get("rollouts_at_end")) or 0)
            step_s = as_number((end.get("timings") or {}).get("rollout_s"))
            t1 = as_number(end.get("time"))
        else:  # killed without an end line: what it saved shows in the next start line
            at_end = int(as_number((following or {}).get("rollouts_at_start")) or 0)
            step_s, t1 = None, (t0 or 0.0) + t.wall_s
        kept.resume_from(at_start)
        kept.keep(at_start, at_end, step_s)
        held += t.wall_s
        counted += 1
        first = t0 if first is None else first
        last = t1 if t1 is not None else last
    timed = [(hi - lo, s) for lo, hi, s in kept.ranges if s is not None]
    mean = sum(n * s for n, s in timed) / sum(n for n, _ in timed) if timed else 0.0
    untimed = any(s is None for _, _, s in kept.ranges)
    training = sum((hi - lo) * (mean if s is None else s) for lo, hi, s in kept.ranges)
    return Ettr(training_s=training, held_s=held,
                span_s=(last - first) if first is not None and last is not None and last > first else None,
                rollouts_kept=sum(hi - lo for lo, hi, _ in kept.ranges), segments=counted, running=running,
                partial=untimed)


def read_ettr(run_dir: str | Path, *, now: float | None = None) -> tuple[Ettr, list[str]]:
    """ETTR of the run in ``run_dir``, and the ledger lines that could not be read (warnings)."""
    segments, warnings = read_ledger(Path(run_dir) / LEDGER_FILE)
    return ettr(segments, now=now), warnings
