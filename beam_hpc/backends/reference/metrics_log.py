"""Scalars to TensorBoard and to ``dumps/metrics.jsonl``, and the per-rollout dump files.

Tag names shared with the readers (`beam-hpc status`, plots) come from
:mod:`beam_hpc.run.metric_names`; the extra diagnostics below are the reference backend's own.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from beam_hpc.run import metric_names as names
from beam_hpc.run.checkpoint_layout import write_atomic
from beam_hpc.run.files import write_json_atomic

# Diagnostics the reference backend adds (the list: clip fraction, entropy, tokens/s).
TRAIN_LOSS = "train/loss"
TRAIN_CLIP_FRACTION = "train/clip_fraction"
TRAIN_ENTROPY = "train/entropy"
TRAIN_APPROX_KL = "train/approx_kl"
TRAIN_GRAD_NORM = "train/grad_norm"
TRAIN_LR = "train/lr"
GENERATE_TIME = "perf/generate_time_s"  # the rollout workers' own generation time
WAIT_TIME = "perf/rollout_wait_s"  # how long the driver waited for the rollout (async hides it)
TOKENS_PER_S = "perf/rollout_tokens_per_s"
OFFLOAD_BYTES = "perf/optimizer_offload_bytes"


class MetricsLog:
    """One writer per driver process; appends, so a resumed segment continues the same files."""

    def __init__(self, tensorboard_dir: str, dumps_dir: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.dumps = Path(dumps_dir)
        for sub in ("rollout", "eval", "train"):
            (self.dumps / sub).mkdir(parents=True, exist_ok=True)
        self.writer = SummaryWriter(tensorboard_dir)
        self.jsonl = open(self.dumps / names.METRICS_FILE, "a")

    def scalars(self, kind: str, rollout_id: int, values: dict[str, float]) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, rollout_id)
        self.jsonl.write(json.dumps({"kind": kind, "rollout_id": rollout_id, "time": time.time(), **values}) + "\n")
        self.jsonl.flush()
        self.writer.flush()

    def dump_samples(self, kind: str, rollout_id: int, samples: list[dict[str, Any]]) -> Path:
        path = self.dumps / kind / f"{kind}_{rollout_id:07d}.jsonl"
        write_atomic(path, "".join(json.dumps(s) + "\n" for s in samples))
        return path

    def dump_json(self, kind: str, rollout_id: int, data: dict[str, Any]) -> Path:
        path = self.dumps / kind / f"{kind}_{rollout_id:07d}.json"
        write_json_atomic(path, data, indent=2)
        return path

    def close(self) -> None:
        self.writer.close()
        self.jsonl.close()
