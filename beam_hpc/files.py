"""Atomic file writes and file locks: the one implementation every module uses.

Why one: a run directory lives on shared storage and is read by other nodes, later segments and
``beam-hpc status`` while it is being written, and a node may die at any instant. Every published
file (plan.json, the checkpoint pointer, ready.json, run_identity.json, markers, staged copies) must
be seen whole or not at all and survive a crash right after the rename: a temporary file in the same
directory, write, flush + fsync, rename, fsync the directory. :func:`write_atomic` /
:func:`write_json_atomic` publish bytes, text or JSON; :func:`atomic_path` yields a temporary path
for writers that need one (published on a clean exit, removed on an error); :func:`atomic_dir` (or
:func:`staging_dir` + :func:`publish_dir`) stages a whole directory under a hidden sibling name and
renames it into place, and :func:`remove_stale_staging` clears what killed writers left;
:func:`locked` takes an exclusive ``flock``, blocking, with an optional timeout.

A leaf: it imports nothing of beam_hpc, so every layer may use it (plan.json's writer as much as
the ledger's).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any


class LockTimeout(TimeoutError):
    """The lock file stayed held by someone else for the whole timeout."""


def _tmp_name(p: Path) -> Path:
    # hidden, per-process: two writers never share a temporary; readers globbing the directory skip it
    return p.with_name(f".{p.name}.{os.getpid()}.tmp")


def fsync_dir(directory: str | Path) -> None:
    """Make a rename (or create) inside ``directory`` durable. Some file systems refuse fsync on a
    directory (EINVAL/EBADF); the rename is still atomic there, so that is not an error."""
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as err:
        if err.errno not in (errno.EINVAL, errno.EBADF, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def fsync_file(path: str | Path) -> None:
    """Flush a file that someone else wrote (e.g. through a library's ``save(path)``) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(tmp: str | Path, path: str | Path) -> None:
    """Rename a finished temporary file onto ``path`` and make the rename durable (the temporary
    must be in the same directory, or the rename is not atomic)."""
    os.replace(tmp, path)
    fsync_dir(Path(path).parent)


def write_atomic(path: str | Path, data: bytes | str, *, mode: int | None = None) -> None:
    """Write ``path`` so that readers see the old content or the new, never a torn one, and the new
    content survives a crash once this returns. ``mode`` sets the permission bits of the new file
    (e.g. 0o600 for a secret: the file is never readable by others, not even for an instant)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_name(p)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666 if mode is None else mode)
    try:
        with os.fdopen(fd, "wb") as f:
            if mode is not None:
                os.fchmod(f.fileno(), mode)  # O_CREAT's mode is masked by the umask
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        publish(tmp, p)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_json_atomic(path: str | Path, obj: Any, *, indent: int | None = 1, mode: int | None = None) -> None:
    """:func:`write_atomic` of ``obj`` as JSON (sorted keys, so that records diff cleanly)."""
    write_atomic(path, json.dumps(obj, indent=indent, sort_keys=True) + "\n", mode=mode)


@contextlib.contextmanager
def atomic_path(path: str | Path, *, durable: bool = True) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; the caller writes (and closes) it; on a clean exit it
    is fsync'ed and renamed onto ``path``, on an exception it is removed and ``path`` is untouched.
    ``durable=False`` skips the fsyncs, for scratch files that no later process needs after a
    crash (the rename still keeps a reader from seeing half a file)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_name(p)
    tmp.unlink(missing_ok=True)  # a leftover of a killed writer with our pid
    try:
        yield tmp
        if durable:
            fsync_file(tmp)
            publish(tmp, p)
        else:
            os.replace(tmp, p)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _staging_name(p: Path, pid: int | str) -> Path:
    # hidden, per-process, beside the target (same file system: the rename is atomic)
    return p.with_name(f".{p.name}.tmp{pid}")


def staging_dir(path: str | Path) -> Path:
    """A fresh, empty directory beside ``path`` (``.<name>.tmp<pid>``) to fill and then hand to
    :func:`publish_dir`. For writers whose files come from other processes (a trainer actor saving
    a checkpoint); a writer that fills it itself uses :func:`atomic_dir`."""
    p = Path(path)
    tmp = _staging_name(p, os.getpid())
    if tmp.exists():  # a leftover of a killed writer with our pid
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def publish_dir(staged: str | Path, path: str | Path, *, durable: bool = True) -> None:
    """Rename the filled ``staged`` directory onto ``path``. A directory already at ``path`` is
    moved aside first and removed after, so a reader sees the old directory, none, or the new one,
    never a mix of the two (``os.replace`` cannot replace a non-empty directory in one step).
    ``durable``: fsync every file in ``staged`` (their writers may be other processes that never
    did) and the directories, so that what is published survives a crash once this returns."""
    staged, p = Path(staged), Path(path)
    if durable:
        for f in staged.rglob("*"):
            if f.is_file() and not f.is_symlink():
                fsync_file(f)
        for d in (*(d for d in staged.rglob("*") if d.is_dir()), staged):
            fsync_dir(d)
    old = p.with_name(f".{p.name}.old{os.getpid()}")
    if p.exists():
        if old.exists():
            shutil.rmtree(old)
        os.replace(p, old)
    os.replace(staged, p)
    if durable:
        fsync_dir(p.parent)
    shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def atomic_dir(path: str | Path, *, durable: bool = True) -> Iterator[Path]:
    """Yield a fresh staging directory for ``path``; on a clean exit it is published whole onto
    ``path`` (:func:`publish_dir`), on an exception it is removed and ``path`` is untouched. Two
    writers of the same ``path`` must also hold a lock (:func:`locked`): each would publish its
    own whole copy, but the second would replace the first."""
    tmp = staging_dir(path)
    try:
        yield tmp
        publish_dir(tmp, path, durable=durable)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def remove_stale_staging(path: str | Path) -> list[Path]:
    """Remove the staging and set-aside directories of ``path`` that killed writers left behind
    (any pid). Only safe while holding the lock every writer of ``path`` takes: otherwise it would
    delete a live writer's staging directory. Returns what it removed."""
    p = Path(path)
    gone = [d for pattern in (f".{p.name}.tmp*", f".{p.name}.old*") for d in p.parent.glob(pattern)]
    for d in gone:
        if d.is_dir() and not d.is_symlink():
            shutil.rmtree(d, ignore_errors=True)
        else:
            d.unlink(missing_ok=True)
    return gone


@contextlib.contextmanager
def locked(path: str | Path, *, timeout_s: float | None = None, poll_s: float = 0.1,
           mode: int = 0o644) -> Iterator[int]:
    """Hold an exclusive ``flock`` on ``path`` (created if absent, never removed: removing a lock
    file races with a waiter that already opened it). Blocks until it is free, or raises
    :class:`LockTimeout` after ``timeout_s``. The kernel releases it when the process dies, so a
    killed holder never leaves it stuck. ``mode``: the lock file's permissions when it is created.
    Yields the lock file's descriptor."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(p, os.O_RDWR | os.O_CREAT, mode)
    try:
        if timeout_s is None:
            fcntl.flock(fd, fcntl.LOCK_EX)
        else:
            deadline = time.monotonic() + timeout_s
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise LockTimeout(f"{p} is still locked by another process after {timeout_s:g} s") from None
                    time.sleep(poll_s)
        try:
            yield fd
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    """The hex sha256 of a file, read in ``chunk``-byte blocks (images and checkpoints are large)."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(chunk), b""):
            h.update(block)
    return h.hexdigest()
