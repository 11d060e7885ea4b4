"""Publishing and reading the reference backend's checkpoints, in the shared layout.

The layout is :mod:`beam_hpc.checkpoint_layout` (Miles's): the iteration directory is filled
under a temporary name and renamed, then the dataset cursor is written, then the pointer file
``latest_checkpointed_iteration.txt`` (last). A kill at any instant leaves the previous checkpoint
named and intact. What goes into the iteration directory:

    model.pt, optimizer.pt, scheduler.pt, rng_trainer.pt     written by the trainer actor
    driver.pt                                                 the loop's state (see driver.py):
                                                              policy version, the in-flight rollout
                                                              and the behaviour weights (async)
    meta.json                                                 human-readable summary
"""

from __future__ import annotations

import io
import json
import os
import shutil
from pathlib import Path
from typing import Any

from beam_hpc import checkpoint_layout as layout

DRIVER_FILE = "driver.pt"
META_FILE = "meta.json"


def staging_dir(ckpt_dir: str, iteration: int) -> Path:
    """A fresh temporary directory beside the final iteration dir (same filesystem: rename is atomic)."""
    final = layout.iteration_dir(ckpt_dir, iteration)
    tmp = final.with_name(f".{final.name}.tmp{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def torch_bytes(obj: Any) -> bytes:
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def publish(ckpt_dir: str, iteration: int, staged: Path, dataset_state: dict[str, Any], keep_last: int | None) -> Path:
    """Make ``staged`` checkpoint ``iteration``: rename, dataset state, pointer (in that order)."""
    final = layout.iteration_dir(ckpt_dir, iteration)
    for f in staged.iterdir():  # the trainer wrote these from another process: make them durable
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    if final.exists():  # left by a save that died before its pointer was written: never published
        shutil.rmtree(final)
    os.replace(staged, final)
    layout.write_atomic(layout.dataset_state_path(ckpt_dir, iteration), torch_bytes(dataset_state))
    layout.mark_latest(ckpt_dir, iteration)
    if keep_last:
        prune(ckpt_dir, keep_last)
    return final


def prune(ckpt_dir: str, keep_last: int) -> list[int]:
    """Delete all but the newest ``keep_last`` published checkpoints (never the latest)."""
    latest = layout.latest_iteration(ckpt_dir)
    if latest is None:
        return []
    its = sorted(int(p.name[5:]) for p in Path(ckpt_dir).glob("iter_*") if p.name[5:].isdigit())
    gone = [i for i in its if i <= latest][:-keep_last]
    for i in gone:
        shutil.rmtree(layout.iteration_dir(ckpt_dir, i), ignore_errors=True)
        layout.dataset_state_path(ckpt_dir, i).unlink(missing_ok=True)
    return gone


def write_meta(staged: Path, meta: dict[str, Any]) -> None:
    (staged / META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True))


def load_latest(ckpt_dir: str) -> tuple[int, Path, dict[str, Any]] | None:
    """(iteration, its dir, dataset state) of the latest checkpoint, or None for a fresh run.
    Raises with the reason when the pointer names something incomplete."""
    import torch

    problems = layout.resume_problems(ckpt_dir)
    it = layout.latest_iteration(ckpt_dir)
    if it is None:
        return None
    if problems:
        raise RuntimeError("cannot resume: " + "; ".join(problems))
    state = torch.load(layout.dataset_state_path(ckpt_dir, it), weights_only=True)
    return it, layout.iteration_dir(ckpt_dir, it), state
