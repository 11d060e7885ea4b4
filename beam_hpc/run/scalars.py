"""The scalar series a run recorded, read back: TensorBoard events, else dumps/metrics.jsonl.

Owns one concern: turning what a backend wrote (Miles's TensorBoard events, or the reference
backend's events and its metrics.jsonl mirror) into series by tag, under the current names of
:mod:`beam_hpc.run.metric_names` (an old run's tags are renamed on reading). `status`, `plot` and
the lifecycle (:mod:`beam_hpc.lifecycle.segment_metrics`) all read through here, so a run written
by Miles and one written by the reference backend are read alike.

Nothing read is trusted: unreadable TensorBoard files give way to dumps/metrics.jsonl with a
warning, a torn or hand-edited metrics line is skipped.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

from beam_hpc.errors import shorten
from beam_hpc.plan.paths import RunPaths
from beam_hpc.run import metric_names

_NON_TAG_KEYS = frozenset({"kind", "rollout_id", "step", "time", "wall_time"})


@dataclass(frozen=True)
class Point:
    step: int  # the rollout id
    value: float
    wall_time: float | None


@dataclass
class Scalars:
    """Scalar series by tag, one point per step (the last one written wins: a rollout redone after
    a kill replaces its lost first attempt), sorted by step."""

    source: str | None  # "tensorboard", "metrics.jsonl" or None when neither exists
    series: dict[str, list[Point]] = field(default_factory=dict)

    def last(self, tag: str) -> Point | None:
        pts = self.series.get(tag)
        return pts[-1] if pts else None

    def by_step(self, tag: str) -> dict[int, Point]:
        return {p.step: p for p in self.series.get(tag, [])}

    def since(self, wall_time: float) -> Scalars:
        """Only the points written at or after ``wall_time`` (a segment's own); points without a
        wall time (old metrics lines) are left out."""
        kept = {tag: [p for p in pts if p.wall_time is not None and p.wall_time >= wall_time]
                for tag, pts in self.series.items()}
        return Scalars(self.source, {tag: pts for tag, pts in kept.items() if pts})

    def miles_checker_accuracy(self, eval_name: str) -> tuple[list[Point], bool]:
        """Accuracy on ``eval_name`` as Miles's own math checker scored it, from the verdict
        categories Miles logs (metric_names.MILES_CHECK_KEY): per step, the "correct" fraction, or
        0 where only "wrong" was logged (no sample correct). The flag says whether the run said the
        checker was unavailable where it scored (Miles not importable there)."""
        correct = self.by_step(metric_names.eval_miles_verdict_tag(eval_name, metric_names.MILES_CORRECT))
        wrong = self.by_step(metric_names.eval_miles_verdict_tag(eval_name, metric_names.MILES_WRONG))
        unavailable = bool(self.series.get(metric_names.eval_miles_verdict_tag(eval_name, metric_names.MILES_UNAVAILABLE)))
        pts = [correct[s] if s in correct else Point(s, 0.0, wrong[s].wall_time) for s in sorted(set(correct) | set(wrong))]
        return pts, unavailable


def read_scalars(run_dir: str | Path, warnings: list[str] | None = None) -> Scalars:
    """TensorBoard events under <run>/tensorboard if any, else <run>/dumps/metrics.jsonl. When the
    event files cannot be read (corrupt, truncated, unreadable), the metrics file stands in and a
    line saying so goes to ``warnings``: the numbers are the same, only the source differs."""
    paths = RunPaths(str(run_dir))
    event_files = sorted(Path(paths.tensorboard).rglob("events.out.tfevents.*"))
    metrics = Path(paths.dumps) / metric_names.METRICS_FILE
    if event_files:
        try:
            series = _from_tensorboard(sorted({f.parent for f in event_files}))
        except Exception as err:  # noqa: BLE001 - tensorboard raises many types for a damaged file
            problem = f"{paths.tensorboard}: TensorBoard events unreadable ({type(err).__name__}: {shorten(str(err), 120)})"
        else:
            if series or not metrics.is_file():
                return Scalars("tensorboard", series)
            problem = f"{paths.tensorboard}: the TensorBoard event files hold no readable scalar"
        if warnings is not None:
            warnings.append(problem + (f"; read {metrics} instead" if metrics.is_file() else ""))
    if metrics.is_file():
        return Scalars("metrics.jsonl", _from_metrics_jsonl(metrics))
    return Scalars(None, {})


def _merge(points: dict[tuple[str, int], Point], tag: str, pt: Point) -> None:
    tag = metric_names.canonical_tag(tag)
    old = points.get((tag, pt.step))
    if old is None or (pt.wall_time or 0.0) >= (old.wall_time or 0.0):
        points[(tag, pt.step)] = pt


def _sorted_series(points: dict[tuple[str, int], Point]) -> dict[str, list[Point]]:
    series: dict[str, list[Point]] = {}
    for (tag, _), pt in sorted(points.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        series.setdefault(tag, []).append(pt)
    return series


def _from_tensorboard(dirs: list[Path]) -> dict[str, list[Point]]:
    """Each directory through EventAccumulator (which already drops events orphaned by a restart
    within one directory); across directories the later wall time of a (tag, step) wins."""
    from tensorboard.backend.event_processing import event_accumulator as ea
    from tensorboard.util import tensor_util

    # TensorBoard's own INFO lines ("No path found after ..." at every read of a finished file)
    # would land in the segment's log at each stall check; its warnings still get through.
    logging.getLogger("tensorboard").setLevel(logging.WARNING)
    points: dict[tuple[str, int], Point] = {}
    for d in dirs:
        acc = ea.EventAccumulator(str(d), size_guidance={ea.SCALARS: 0, ea.TENSORS: 0})
        acc.Reload()
        tags = acc.Tags()
        for tag in tags.get(ea.SCALARS, []):
            for ev in acc.Scalars(tag):
                _merge(points, tag, Point(int(ev.step), float(ev.value), float(ev.wall_time)))
        for tag in tags.get(ea.TENSORS, []):  # new-style scalar summaries arrive as tensors
            for ev in acc.Tensors(tag):
                arr = tensor_util.make_ndarray(ev.tensor_proto)
                if arr.size == 1 and arr.dtype.kind in "fiu":
                    _merge(points, tag, Point(int(ev.step), float(arr.reshape(-1)[0]), float(ev.wall_time)))
    return _sorted_series(points)


def _from_metrics_jsonl(path: Path) -> dict[str, list[Point]]:
    points: dict[tuple[str, int], Point] = {}
    for line in path.read_text(errors="replace").splitlines():
        try:
            rec = json.loads(line)
            step = int(rec["rollout_id"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError, OverflowError, RecursionError):
            continue  # a torn last line while the backend appends
        wall = rec.get("time", rec.get("wall_time"))
        if isinstance(wall, bool) or not isinstance(wall, (int, float)) or not math.isfinite(wall):
            wall = None
        for key, value in rec.items():
            if key in _NON_TAG_KEYS or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if isinstance(value, int) and abs(value) > 2 ** 53:
                continue  # not a metric a float holds: a hand edit
            _merge(points, key, Point(step, float(value), float(wall) if wall is not None else None))
    return _sorted_series(points)
