"""Publishing and reading the reference backend's checkpoints, in the shared layout.

The layout is :mod:`beam_hpc.run.checkpoint_layout` (Miles's): the iteration directory is filled
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
import logging
import shutil
from pathlib import Path
from typing import Any

from beam_hpc import files
from beam_hpc.files import write_json_atomic
from beam_hpc.run import checkpoint_layout as layout

DRIVER_FILE = "driver.pt"
META_FILE = "meta.json"
MANIFEST_FILE = layout.MANIFEST_FILE  # size + sha256 of every file: how a truncated checkpoint is told

log = logging.getLogger(__name__)


def verify(it_dir: Path) -> str | None:
    """Why the checkpoint in ``it_dir`` is not complete, or None when every file it was published
    with is there with its size and sha256 (this backend always writes the manifest, so a
    checkpoint of its without one is not complete)."""
    if not (it_dir / MANIFEST_FILE).exists():
        return f"{it_dir / MANIFEST_FILE} unreadable (missing)"
    return layout.manifest_problem(it_dir)


def staging_dir(ckpt_dir: str, iteration: int) -> Path:
    """A fresh temporary directory beside the final iteration dir (same filesystem: rename is atomic)."""
    return files.staging_dir(layout.iteration_dir(ckpt_dir, iteration))


def torch_bytes(obj: Any) -> bytes:
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def publish(ckpt_dir: str, iteration: int, staged: Path, dataset_state: dict[str, Any], keep_last: int | None) -> Path:
    """Make ``staged`` checkpoint ``iteration``: rename, dataset state, pointer (in that order)."""
    final = layout.iteration_dir(ckpt_dir, iteration)
    manifest = {f.name: layout.file_digest(f) for f in sorted(staged.iterdir()) if f.is_file()}
    write_json_atomic(staged / MANIFEST_FILE, manifest)
    # Renamed whole (the trainer's files fsync'ed first: it wrote them from another process); a
    # directory already at ``final`` was left by a save that died before its pointer was written.
    files.publish_dir(staged, final)
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
    """(iteration, its dir, dataset state) of the newest *complete* checkpoint, or None for a fresh
    run. A checkpoint that is named but damaged (a file truncated or missing, its dataset state
    unreadable) is skipped, with a warning, for the previous complete one; when the pointer names
    something but no checkpoint is complete, resuming is refused with the reasons."""
    import torch

    latest = layout.latest_iteration(ckpt_dir)
    if latest is None:
        return None
    its = sorted((int(p.name[5:]) for p in Path(ckpt_dir).glob("iter_*") if p.name[5:].isdigit()), reverse=True)
    reasons = []
    for it in [i for i in its if i <= latest]:
        it_dir = layout.iteration_dir(ckpt_dir, it)
        problem = verify(it_dir)
        if problem is None:
            try:
                state = torch.load(layout.dataset_state_path(ckpt_dir, it), weights_only=True)
            except (OSError, RuntimeError, EOFError) as err:
                problem = f"dataset state {layout.dataset_state_path(ckpt_dir, it)} unreadable ({err})"
        if problem is None:
            if reasons:
                log.warning("checkpoint %d skipped for complete checkpoint %d: %s", latest, it, "; ".join(reasons))
            return it, it_dir, state
        reasons.append(f"checkpoint {it}: {problem}")
    raise RuntimeError("cannot resume: no complete checkpoint: " + "; ".join(reasons or layout.resume_problems(ckpt_dir)))
