"""Scalars to TensorBoard, to ``dumps/metrics.jsonl`` and (when the recipe asks) to W&B, and the
per-rollout dump files.

Tag names shared with the readers (`beam-hpc status`, plots) come from
:mod:`beam_hpc.run.metric_names`; the extra diagnostics below are the reference backend's own.
W&B gets the same tags against Miles's step metrics (``rollout/step``; ``eval/step`` for
``eval/*``), so a resumed segment may log a rollout it re-does after its checkpoint without W&B
refusing a smaller step: :class:`WandbSink` drops every (tag, step) already in the run's earlier
transaction logs, so each rollout and each evaluation appears once.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from beam_hpc.files import write_json_atomic
from beam_hpc.run import metric_names as names
from beam_hpc.run import tracking
from beam_hpc.run.checkpoint_layout import write_atomic

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


ROLLOUT_STEP = "rollout/step"  # Miles's step metrics (miles/utils/tracking_utils/wandb_utils.py)
EVAL_STEP = "eval/step"


def step_key(tag: str) -> str:
    return EVAL_STEP if tag.startswith("eval/") else ROLLOUT_STEP


def logged_steps(rows: list[dict[str, Any]]) -> dict[str, float]:
    """tag -> the last step it was logged at, over history rows read back from W&B's files."""
    last: dict[str, float] = {}
    for row in rows:
        for tag in row:
            if tag.startswith("_") or tag in (ROLLOUT_STEP, EVAL_STEP):
                continue
            step = row.get(step_key(tag))
            if step is not None:
                last[tag] = max(last.get(tag, step), step)
    return last


class WandbSink:
    """The run's one W&B run, resumed by id in every segment (beam_hpc.run.tracking)."""

    def __init__(self, settings: tracking.WandbSettings, run_dir: str, config: dict[str, Any]) -> None:
        import wandb

        self.run_id = tracking.run_id(run_dir)
        rows: list[dict[str, Any]] = []
        for d in tracking.fragment_dirs(run_dir):  # before init: the new segment's fragment is not there yet
            log = tracking.transaction_log(d)
            if log is not None:
                rows += tracking.history(log)
        self.last = logged_steps(rows)
        directory = tracking.wandb_dir(run_dir)
        self.run = wandb.init(id=self.run_id, resume="allow", project=settings.project, entity=settings.entity,
                              group=settings.group, name=settings.group, mode=settings.mode, dir=str(directory),
                              config=config, settings=wandb.Settings(silent=True))
        for key in (ROLLOUT_STEP, EVAL_STEP):
            self.run.define_metric(key)
        self.defined: set[str] = set()

    def log(self, step: int, values: dict[str, float]) -> None:
        fresh = {t: v for t, v in values.items() if self.last.get(t, -1) < step}
        if not fresh:
            return
        for key in {step_key(t) for t in fresh}:
            row = {t: v for t, v in fresh.items() if step_key(t) == key}
            for prefix in {t.split("/", 1)[0] for t in row} - self.defined:
                self.run.define_metric(f"{prefix}/*", step_metric=key)
                self.defined.add(prefix)
            self.run.log({**row, key: step})
        for t in fresh:
            self.last[t] = step

    def close(self) -> None:
        self.run.finish()


class MetricsLog:
    """One writer per driver process; appends, so a resumed segment continues the same files."""

    def __init__(self, tensorboard_dir: str, dumps_dir: str, wandb_sink: WandbSink | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.wandb = wandb_sink
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
        if self.wandb is not None:
            self.wandb.log(rollout_id, values)

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
        if self.wandb is not None:
            self.wandb.close()
