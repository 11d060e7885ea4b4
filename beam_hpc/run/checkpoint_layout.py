"""The checkpoint layout both backends write and the lifecycle reads.

It is Miles's (Megatron's) layout, so that one piece of lifecycle code serves both backends:

    <output>/checkpoints/
        latest_checkpointed_iteration.txt          last *complete* checkpoint: a rollout id (0-based)
        iter_0000019/ ...                          the checkpoint of rollout 19 (backend-specific files)
        rollout/global_dataset_state_dict_19.pt    the data cursor saved with it (Miles's name)

A checkpoint counts only once ``latest_checkpointed_iteration.txt`` names it; the backend writes the
iteration directory first (to a temporary name, then renamed) and the pointer file last, each
atomically, so a kill at any instant leaves the previous checkpoint intact and named.
Rollouts done after checkpoint ``k`` is ``k + 1`` (Miles resumes at ``start_rollout_id = k + 1``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from beam_hpc.errors import InputError, shorten
from beam_hpc.files import (
    sha256_file,
    write_atomic,  # re-exported: callers that write layout files use it from here
)

LATEST_FILE = "latest_checkpointed_iteration.txt"
# In an iteration directory: {file name: [size, sha256]} of every file it was published with. The
# reference backend writes one (beam_hpc.backends.reference.loop.checkpoint); Miles does not, and a
# checkpoint without one is taken as complete (the layout's rules are all that can be checked).
MANIFEST_FILE = "manifest.json"


def iteration_dir(ckpt_dir: str | Path, iteration: int) -> Path:
    return Path(ckpt_dir) / f"iter_{iteration:07d}"


def dataset_state_path(ckpt_dir: str | Path, iteration: int) -> Path:
    return Path(ckpt_dir) / "rollout" / f"global_dataset_state_dict_{iteration}.pt"


def saved_iterations(ckpt_dir: str | Path) -> list[int]:
    """The iterations that have an ``iter_NNNNNNN`` directory, complete or not, oldest first (the
    pointer says which one counts; a resume check walks back from it)."""
    found = []
    for p in Path(ckpt_dir).glob("iter_*"):
        digits = p.name[len("iter_"):]
        if digits.isdigit() and p.is_dir():
            found.append(int(digits))
    return sorted(found)


class CheckpointPointerError(InputError):
    """The checkpoint pointer holds something other than a rollout id (exit 2: the message says how
    to repair it). Still a ValueError, as the pointer's problems always were."""


def latest_iteration(ckpt_dir: str | Path) -> int | None:
    """The last complete checkpoint's rollout id, or None when there is none yet. A pointer that is
    not a number (a hand edit, a foreign writer) raises :class:`CheckpointPointerError` naming the
    file and the repair: the backend writes it atomically, so it is never torn by a kill."""
    p = Path(ckpt_dir) / LATEST_FILE
    try:
        text = p.read_bytes().decode("ascii").strip()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as err:
        text = f"<unreadable: {type(err).__name__}>"
    if not (text.isascii() and text.isdigit()):
        have = ", ".join(f"iter_{i:07d}" for i in saved_iterations(ckpt_dir)[-3:]) or "no iter_* directory"
        raise CheckpointPointerError(
            f"{p}: expected a rollout id, found {shorten(text)}; the checkpoint pointer is corrupt. Write the "
            f"number of the last complete checkpoint directory into it (have: {have}), or move checkpoints/ "
            "away to start over")
    return int(text)


def rollouts_done(ckpt_dir: str | Path) -> int:
    it = latest_iteration(ckpt_dir)
    return 0 if it is None else it + 1


def mark_latest(ckpt_dir: str | Path, iteration: int) -> None:
    """Publish ``iteration`` as the latest complete checkpoint (call after its files are in place)."""
    write_atomic(Path(ckpt_dir) / LATEST_FILE, f"{iteration}\n")


def resume_problems(ckpt_dir: str | Path) -> list[str]:
    """Why a resume from ``ckpt_dir`` cannot work (empty when it can). The seed: resume requires
    both the checkpoint and its saved dataset state."""
    it = latest_iteration(ckpt_dir)
    if it is None:
        return [f"no checkpoint: {Path(ckpt_dir) / LATEST_FILE} does not exist"]
    problems = []
    if not iteration_dir(ckpt_dir, it).is_dir():
        problems.append(f"checkpoint {it}: {iteration_dir(ckpt_dir, it)} is missing")
    if not dataset_state_path(ckpt_dir, it).is_file():
        problems.append(f"checkpoint {it}: its dataset state {dataset_state_path(ckpt_dir, it)} is missing")
    return problems


def file_digest(path: str | Path) -> list[Any]:
    """What a manifest records of one file: ``[size, sha256]``."""
    return [Path(path).stat().st_size, sha256_file(path)]


def manifest_problem(it_dir: str | Path) -> str | None:
    """Why the files of the iteration directory ``it_dir`` do not match its manifest (a file
    truncated, changed or missing since it was published), or None when they do or when there is
    no manifest to check them against."""
    path = Path(it_dir) / MANIFEST_FILE
    if not path.exists():
        return None
    try:
        manifest = json.loads(path.read_text())
        wanted = [(str(name), list(want)) for name, want in manifest.items()]
    except (OSError, ValueError, TypeError, AttributeError) as err:
        return f"{path} unreadable ({type(err).__name__}: {err})"
    for name, want in wanted:
        f = Path(it_dir) / name
        if not f.is_file():
            return f"{f} is missing"
        if file_digest(f) != want:
            return f"{f} does not match its manifest (truncated or changed)"
    return None


def newest_complete(ckpt_dir: str | Path) -> tuple[int | None, list[dict[str, Any]]]:
    """The newest checkpoint at or below the pointer that can be resumed from (its directory and
    dataset state are there and its files match their manifest), and the newer ones passed over
    on the way as ``[{"iteration", "why"}]``, newest first. ``(None, [])`` without a pointer;
    ``(None, [...])`` when the pointer names something but no checkpoint is complete.

    Why walk back rather than refuse: the pointer is written last and atomically, so a checkpoint
    it names was complete once; damage found later (a truncated copy, a disk) costs the rollouts
    since the previous checkpoint, not the run."""
    latest = latest_iteration(ckpt_dir)
    if latest is None:
        return None, []
    passed: list[dict[str, Any]] = []
    for it in sorted({i for i in saved_iterations(ckpt_dir) if i <= latest} | {latest}, reverse=True):
        it_dir = iteration_dir(ckpt_dir, it)
        if not it_dir.is_dir():
            why: str | None = f"{it_dir} is missing"
        elif not dataset_state_path(ckpt_dir, it).is_file():
            why = f"its dataset state {dataset_state_path(ckpt_dir, it)} is missing"
        else:
            why = manifest_problem(it_dir)
        if why is None:
            return it, passed
        passed.append({"iteration": it, "why": why})
    return None, passed


# What the lifecycle writes into the save sentinel to ask for an exit after the save (a beam-hpc
# extension; Miles looks only at whether the file exists). Written and read through this pair.
THEN_STOP = {"then": "stop"}


def save_request_says_stop(path: str) -> bool:
    """Whether a save sentinel asks the backend to exit after the save. A file that is empty,
    not JSON or without ``"then": "stop"`` (a user's ``touch SAVE_NOW``) means: save and go on."""
    try:
        body = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(body, dict) and THEN_STOP.items() <= body.items()
