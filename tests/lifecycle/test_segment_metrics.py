"""beam_hpc.lifecycle.segment_metrics: what a segment did, from what the backend wrote."""

from __future__ import annotations

import json
import os
from pathlib import Path

from beam_hpc.lifecycle.segment_metrics import segment_metrics
from beam_hpc.plan.paths import RunPaths
from beam_hpc.run import checkpoint_layout, metric_names


def test_segment_metrics_count_only_this_segments_scalars(tmp_path: Path) -> None:
    """The reference backend's metrics mirror (no TensorBoard here): only lines written since the
    segment's mark count; a final save the tracker shows after the last logged step is timed from
    the step's last scalar to the tracker."""
    paths = RunPaths(str(tmp_path))
    metrics = Path(paths.dumps, metric_names.METRICS_FILE)
    metrics.parent.mkdir(parents=True)
    metrics.write_text(json.dumps({"kind": "rollout", "rollout_id": 0, "time": 100.0, metric_names.ROLLOUT_TIME: 50.0}) + "\n")
    mark = 150.0
    with open(metrics, "a") as fh:
        fh.writelines(json.dumps({"kind": "rollout", "rollout_id": k, "time": 200.0 + k, metric_names.ROLLOUT_TIME: t}) + "\n"
                      for k, t in ((1, 2.0), (2, 4.0)))
        fh.write(json.dumps({"kind": "save", "rollout_id": 2, "time": 203.0, metric_names.SAVE_TIME: 0.7}) + "\n")
        fh.write('{"kind": "rollout", "rollout_id": 3, "perf/ste')  # torn by a kill
    m = segment_metrics(paths, mark)
    assert (m.rollouts_run, m.rollout_s, m.save_s) == (2, 3.0, 0.7)
    assert segment_metrics(paths, 0).rollouts_run == 3
    checkpoint_layout.mark_latest(paths.checkpoints, 2)
    os.utime(Path(paths.checkpoints, checkpoint_layout.LATEST_FILE), (210.5, 210.5))
    assert segment_metrics(paths, mark).save_s == 7.5  # 210.5 - 203.0: the step's last scalar
    assert segment_metrics(RunPaths(str(tmp_path / "none")), 0).rollouts_run == 0
