"""What a segment did, read from what the backend itself writes: rollouts run and their timings.

Why here and from those files: the decision (:mod:`beam_hpc.lifecycle.decide`) needs to know whether
a failed segment got as far as its first rollout, and the ledger records rollout and save seconds
for the next segment's walltime lead and the GPU-hour accounting. Miles writes no file for beam-hpc,
only its TensorBoard scalars (:mod:`beam_hpc.run.metric_names`) and Megatron's checkpoint tracker,
so for every backend alike: rollouts run are the ``perf/step_time`` scalars this segment wrote,
seconds per step their mean, and the last save's seconds its last ``perf/save_model_time`` (Miles
logs it with the *next* step) or, for a save no step followed, the time from the last scalar to the
tracker's mtime (an upper bound). "This segment's" is by wall time: scalars written at or after
:func:`metrics_offset`'s mark, taken before the driver starts, so rollouts re-done after a kill are
counted where they ran. Reading TensorBoard needs the ``tensorboard`` package where the segment runs
(beam-hpc's ``reference``/``viz`` extras); without it the reason is logged.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from beam_hpc.plan.paths import RunPaths
from beam_hpc.run import checkpoint_layout, metric_names
from beam_hpc.run.scalars import read_scalars

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SegmentMetrics:
    rollouts_run: int  # rollout steps this segment finished (kept or not)
    rollout_s: float | None  # mean seconds per rollout step
    save_s: float | None  # seconds of the last save


def metrics_offset(paths: RunPaths) -> float:
    """The wall-clock mark from which scalars count as this segment's (now). ``paths`` is kept for
    the caller's symmetry with :func:`segment_metrics`."""
    del paths
    return time.time()


def segment_metrics(paths: RunPaths, offset: float) -> SegmentMetrics:
    """Rollout and save timings from the scalars written since ``offset`` (0: all of them)."""
    warnings: list[str] = []
    scalars = read_scalars(paths.root, warnings).since(offset)
    for w in warnings:  # e.g. no `tensorboard` package where the segment runs: say why the counts are 0
        log.warning("segment metrics: %s", w)
    steps = scalars.series.get(metric_names.ROLLOUT_TIME, [])
    times = [p.value for p in steps]
    saves = scalars.series.get(metric_names.SAVE_TIME, [])
    save = max(saves, key=lambda p: p.wall_time or 0.0).value if saves else None
    last_wall = max((p.wall_time for pts in scalars.series.values() for p in pts if p.wall_time), default=None)
    tracker = _tracker_time(paths, offset)
    if steps and tracker is not None and last_wall is not None and tracker > last_wall:
        step_end = max(p.wall_time or 0.0 for pts in scalars.series.values() for p in pts if p.step == steps[-1].step)
        save = round(tracker - step_end, 3)
    return SegmentMetrics(len(times), sum(times) / len(times) if times else None, save)


def _tracker_time(paths: RunPaths, offset: float) -> float | None:
    """When the checkpoint tracker was last published, if within this segment."""
    try:
        at = Path(paths.checkpoints, checkpoint_layout.LATEST_FILE).stat().st_mtime
    except OSError:
        return None
    return at if at >= offset else None
