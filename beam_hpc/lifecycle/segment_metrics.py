"""What a segment did, read from the backend's dumps/metrics.jsonl: rollouts run and their timings.

Why here and from the file: the decision (:mod:`beam_hpc.lifecycle.decide`) needs to know whether a
failed segment got as far as its first rollout, and the ledger records rollout and save seconds for
the next segment's lead (:func:`beam_hpc.run.ledger.measured_timings`). Only this segment's own
lines count (those after :func:`metrics_offset`), so rollouts re-done after a kill are counted where
they were run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from beam_hpc.plan.paths import RunPaths
from beam_hpc.run import metric_names


@dataclass(frozen=True)
class SegmentMetrics:
    rollouts_run: int  # rollout steps this segment finished (kept or not)
    rollout_s: float | None  # mean seconds per rollout step
    save_s: float | None  # seconds of the last save


def metrics_offset(paths: RunPaths) -> int:
    """Where this segment's lines of dumps/metrics.jsonl will begin."""
    try:
        return Path(paths.dumps, metric_names.METRICS_FILE).stat().st_size
    except FileNotFoundError:
        return 0


def segment_metrics(paths: RunPaths, offset: int) -> SegmentMetrics:
    """Rollout and save timings from the metrics lines appended since ``offset`` (this segment's
    own, so rollouts re-done after a kill are counted where they were run)."""
    p = Path(paths.dumps, metric_names.METRICS_FILE)
    times: list[float] = []
    save: float | None = None
    try:
        with open(p, "rb") as fh:
            fh.seek(offset)
            data = fh.read().decode(errors="replace")
    except FileNotFoundError:
        data = ""
    for line in data.splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # a torn last line of a killed writer
        if not isinstance(rec, dict):
            continue
        if isinstance(rec.get(metric_names.ROLLOUT_TIME), (int, float)):
            times.append(float(rec[metric_names.ROLLOUT_TIME]))
        if isinstance(rec.get(metric_names.SAVE_TIME), (int, float)):
            save = float(rec[metric_names.SAVE_TIME])
    return SegmentMetrics(len(times), sum(times) / len(times) if times else None, save)
