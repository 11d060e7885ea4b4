"""Node-local NVMe staging for optimizer offload: a per-job directory that is checked, cleaned of
what killed segments left, and removed again on every exit.

Why: Miles streams optimizer state to ``--offload-train-disk-dir`` and purges only its own rank
directory at start, so a segment killed by the scheduler (SIGKILL: no atexit, no trap) leaves
hundreds of GB per rank behind and the node fills up; and a tmpfs or overlay target keeps the "disk"
in RAM, which defeats the offload and can OOM the node. So before Ray starts, on every trainer node,
the target's filesystem is checked (tmpfs/overlay refused, network filesystems warned about),
directories of the run's earlier segments are removed (a requeued job's own included), free space
is compared with the recipe's need (the error names node, path, free and needed bytes), and the
directory is created with a marker naming its segment. Simulated nodes of one job sharing a host
(the local test cluster) share the directory: staging is serialised by a lock file, and a segment
never removes a directory whose marker names another segment.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from beam_hpc.errors import RuntimeFailure
from beam_hpc.files import locked, write_atomic
from beam_hpc.node import procs

log = logging.getLogger(__name__)

GB = 10**9
REFUSED_FS = {
    "tmpfs": "tmpfs keeps files in RAM",
    "ramfs": "ramfs keeps files in RAM",
    "devtmpfs": "devtmpfs keeps files in RAM",
    "overlay": "overlay is a container's writable layer, usually in RAM or on the root disk",
    "aufs": "aufs is a container's writable layer",
    "squashfs": "squashfs is read-only",
}
NETWORK_FS = {"nfs", "nfs4", "lustre", "gpfs", "beegfs", "cifs", "smb3", "ceph", "wekafs", "fuse.sshfs"}
MARKER = ".beam-segment"
LOCK = ".beam-stage.lock"


class NvmeError(RuntimeFailure):
    """Staging is impossible on this node; the message names node, path, and what to change."""


@dataclass(frozen=True)
class Mount:
    mountpoint: str
    fstype: str


def mount_of(path: str | Path, mounts_file: str = procs.MOUNTS) -> Mount:
    """The mount that holds ``path`` (or would hold it, for a path not created yet)."""
    target = os.path.realpath(_existing_ancestor(Path(path)))
    best = Mount("/", "unknown")
    for mnt, fstype in procs.mounts(mounts_file):
        inside = target == mnt or target.startswith(mnt.rstrip("/") + "/")
        # later lines are mounted over earlier ones at the same point, so >= keeps the last
        if inside and len(mnt) >= len(best.mountpoint):
            best = Mount(mnt, fstype)
    return best


def _existing_ancestor(path: Path) -> Path:
    p = path.absolute()
    while not p.exists():
        p = p.parent
    return p


def free_bytes(path: str | Path) -> int:
    st = os.statvfs(_existing_ancestor(Path(path)))
    return st.f_bavail * st.f_frsize


def check_filesystem(path: str | Path, node: str) -> Mount:
    """Refuse RAM-backed and container-layer filesystems; warn about network filesystems."""
    m = mount_of(path)
    if m.fstype in REFUSED_FS:
        raise NvmeError(
            f"node {node}: NVMe dir {path} is on {m.fstype} ({m.mountpoint}): {REFUSED_FS[m.fstype]}, "
            "which defeats optimizer offload; point training.offload.nvme_dir at a local NVMe disk"
        )
    if m.fstype in NETWORK_FS:
        log.warning("node %s: NVMe dir %s is on network filesystem %s (%s); offload will be slow "
                    "and shared between nodes", node, path, m.fstype, m.mountpoint)
    return m


@dataclass
class StagedDir:
    """A staged per-job directory; ``remove()`` is idempotent and only removes this segment's dir."""

    path: Path
    segment: str
    mount: Mount
    free_bytes: int
    purged: list[Path] = field(default_factory=list)

    def remove(self) -> bool:
        if not self.path.parent.is_dir():
            return False
        with _locked(self.path.parent):
            # a newer segment on this node may own the directory now: leave it alone then
            mine = _marker(self.path) == self.segment
            if mine:
                shutil.rmtree(self.path, ignore_errors=True)
            _remove_run_root_if_empty(self.path.parent)
        return mine


def stage(job_dir: str | Path, *, segment: str, min_free_bytes: int, node: str | None = None) -> StagedDir:
    """Check, clean and create ``job_dir`` (``<root>/<run_id>/<job_id>``) for ``segment``."""
    node = node or socket.gethostname()
    target = Path(job_dir)
    run_root = target.parent
    m = check_filesystem(target, node)
    try:
        run_root.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise NvmeError(f"node {node}: cannot create NVMe dir {run_root}: {err.strerror}; "
                        "check training.offload.nvme_dir and its permissions") from None
    with _locked(run_root):
        purged = purge_stale(run_root, keep=target, segment=segment)
        free = free_bytes(run_root)
        if free < min_free_bytes:
            _remove_run_root_if_empty(run_root)
            raise NvmeError(
                f"node {node}: NVMe dir {target} ({m.fstype} at {m.mountpoint}) has {free} bytes free, "
                f"the recipe needs {min_free_bytes} bytes (training.offload.min_free_gb="
                f"{min_free_bytes / GB:g}); free space there, use a larger disk or lower the requirement"
            )
        target.mkdir(exist_ok=True)
        if _marker(target) != segment:
            _write_marker(target, segment)
    return StagedDir(target, segment, m, free, purged)


@contextlib.contextmanager
def staged(job_dir: str | Path, *, segment: str, min_free_bytes: int, node: str | None = None) -> Iterator[StagedDir]:
    """``stage`` then ``remove`` on the way out, whatever the exit (exceptions, SystemExit from a
    signal handler). SIGKILL cannot be caught: the next segment's ``purge_stale`` handles that."""
    d = stage(job_dir, segment=segment, min_free_bytes=min_free_bytes, node=node)
    try:
        yield d
    finally:
        d.remove()


def purge_stale(run_root: Path, *, keep: Path, segment: str) -> list[Path]:
    """Remove every entry under ``run_root`` except ``keep`` when ``keep`` belongs to ``segment``.
    Caller holds the lock."""
    purged = []
    for child in sorted(run_root.iterdir()):
        if child.name.startswith("."):
            continue
        if child == keep and _marker(child) == segment:
            continue
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child, ignore_errors=True)
        else:
            child.unlink(missing_ok=True)
        log.info("removed %s left by an earlier segment of this run", child)
        purged.append(child)
    return purged


def _marker(d: Path) -> str | None:
    try:
        return (d / MARKER).read_text().strip()
    except OSError:
        return None


def _write_marker(d: Path, segment: str) -> None:
    write_atomic(d / MARKER, segment + "\n")


def _remove_run_root_if_empty(run_root: Path) -> None:
    try:
        rest = [c for c in run_root.iterdir() if c.name != LOCK]
    except OSError:
        return
    if not rest:
        (run_root / LOCK).unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            run_root.rmdir()


@contextlib.contextmanager
def _locked(run_root: Path) -> Iterator[None]:
    """Serialise staging and removal between node steps sharing this disk."""
    with locked(run_root / LOCK, mode=0o600):
        yield
