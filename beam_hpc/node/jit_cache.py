"""Warm JIT caches: every node compiles into node-local scratch, seeded from and saved to the run's
shared cache archive (one per group).

Why: every segment of a run is a new allocation, and the JIT compilers (Triton, TorchInductor,
DeepGEMM, FlashInfer, SGLang's) default to caches under ``$HOME``, a network filesystem shared by
hundreds of ranks or, inside a container, not writable at all; a cold start costs minutes (Miles
issue 3158 on 2x8 H20: the first ``actor_train`` 639 s cold against 60 s warm). So the node step
points each compiler's cache variable at ``<scratch>/beam-jit/<run_id>/<group>/<node>/``
(:func:`cache_env`, set in ``ray start``'s environment and, under Apptainer, as ``APPTAINERENV_*``);
seeds it from ``<output>/jit-cache/<group>.tar`` before Ray starts (:func:`seed`: files it has are
kept); and when it ends, after Ray is gone, adds what the archive lacks (:func:`save`: a locked
read-merge-write published atomically, so nodes saving at once all land). Entries are keyed by
relative path: these caches name files by a hash of what was compiled.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tarfile
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from beam_hpc.files import LockTimeout, atomic_path, locked

log = logging.getLogger(__name__)

# (subdirectory, variable): the compilers' own cache variables, where each project defines them:
# TRITON_CACHE_DIR: triton python/triton/knobs.py (default $TRITON_HOME/.triton/cache);
# TORCHINDUCTOR_CACHE_DIR: torch/_inductor/runtime/cache_dir_utils.py (default /tmp/torchinductor_<user>);
# DG_JIT_CACHE_DIR: DeepGEMM's README, "JIT cache" (default $HOME/.deep_gemm);
# FLASHINFER_WORKSPACE_BASE: flashinfer/jit/env.py (cache under <base>/.cache/flashinfer, default $HOME);
# SGLang (as bundled in miles-rl 0.0.2) overrides two: deep_gemm_wrapper/compile_utils.py sets
# DG_JIT_CACHE_DIR from SGLANG_DG_CACHE_DIR, and its torch.compile path points Triton and Inductor under
# $SGLANG_CACHE_DIR/torch_compile_cache (srt/compilation/backend.py), so both SGLang variables are set too.
CACHE_VARS: tuple[tuple[str, str], ...] = (
    ("triton", "TRITON_CACHE_DIR"),
    ("inductor", "TORCHINDUCTOR_CACHE_DIR"),
    ("deepgemm", "DG_JIT_CACHE_DIR"),
    ("deepgemm", "SGLANG_DG_CACHE_DIR"),  # SGLang overwrites DG_JIT_CACHE_DIR with this on import
    ("flashinfer", "FLASHINFER_WORKSPACE_BASE"),
    ("sglang", "SGLANG_CACHE_DIR"),  # SGLang's torch.compile re-points Triton and Inductor under it
)
ROOT_NAME = "beam-jit"
LOCK_TIMEOUT_S = 600.0  # another node of the group rewriting a large archive on a slow filesystem


@dataclass(frozen=True)
class SeedResult:
    seeded: int  # files extracted from the archive
    kept: int  # files the node already had


@dataclass(frozen=True)
class SaveResult:
    added: int  # files the archive lacked
    archive_files: int  # files in the archive afterwards
    bytes: int  # the archive's size afterwards


def scratch_root(scratch: str | None) -> Path:
    """The node-local root of the caches: the site's scratch, else this node's temp dir."""
    return Path(scratch or tempfile.gettempdir(), ROOT_NAME)


def local_dir(scratch: str | None, run_id: str, group: str, node: str) -> Path:
    """This node's caches for the run's group. ``node`` names the node (and its index where
    several simulated nodes share one host, so that each has a disk of its own)."""
    return scratch_root(scratch) / run_id / group / node


def cache_env(local: str | Path) -> dict[str, str]:
    """The compilers' cache variables, each pointed at its own subdirectory of ``local``."""
    return {var: str(Path(local, sub)) for sub, var in CACHE_VARS}


def _files(root: Path) -> Iterator[str]:
    """Relative paths of the regular files under ``root`` (symlinks and hidden temporaries skipped)."""
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            p = Path(dirpath, name)
            if name.startswith(".") or p.is_symlink() or not p.is_file():
                continue
            yield p.relative_to(root).as_posix()


def seed(archive: str | Path, local: str | Path) -> SeedResult:
    """Create the cache directories under ``local`` and extract what ``archive`` has and they lack.
    A missing archive is a cold start (first segment); an unreadable one is logged and skipped:
    a cache must never fail a segment."""
    root = Path(local)
    for sub in dict.fromkeys(sub for sub, _var in CACHE_VARS):
        (root / sub).mkdir(parents=True, exist_ok=True)
    src = Path(archive)
    if not src.is_file():
        return SeedResult(0, 0)
    seeded = kept = 0
    try:
        with tarfile.open(src) as tar:
            for member in tar:
                if not member.isfile():
                    continue
                if (root / member.name).exists():
                    kept += 1
                    continue
                try:  # the data filter refuses absolute paths, '..', links out and device files
                    tar.extract(member, root, filter="data")
                except tarfile.FilterError as err:
                    log.warning("JIT cache: skipped %s from %s (%s)", member.name, src, err)
                    continue
                seeded += 1
    except (OSError, tarfile.TarError) as err:
        log.warning("JIT cache: could not seed %s from %s (%s); compiling cold", root, src, err)
    return SeedResult(seeded, kept)


def save(archive: str | Path, local: str | Path) -> SaveResult | None:
    """Add the files under ``local`` that ``archive`` lacks; None when there was nothing to add
    (the archive is then not rewritten). Locked against the group's other nodes; published
    atomically."""
    root, dest = Path(local), Path(archive)
    have = sorted(_files(root)) if root.is_dir() else []
    if not have:
        return None
    with locked(dest.with_name(dest.name + ".lock"), timeout_s=LOCK_TIMEOUT_S):
        old_names: list[str] = []
        if dest.is_file():
            try:
                with tarfile.open(dest) as old:
                    old_names = [m.name for m in old if m.isfile()]
            except tarfile.TarError as err:  # damaged (by hand: ours are published whole): start it again
                log.warning("JIT cache: %s is unreadable (%s); replacing it with this node's files", dest, err)
        known = set(old_names)
        new = [f for f in have if f not in known]
        if not new:
            return None
        with atomic_path(dest) as tmp:
            with tarfile.open(tmp, "w") as out:
                if old_names:
                    with tarfile.open(dest) as old:
                        for m in old:
                            if m.isfile():
                                out.addfile(m, old.extractfile(m))
                for name in new:
                    out.add(root / name, arcname=name, recursive=False)
        return SaveResult(len(new), len(old_names) + len(new), dest.stat().st_size)


def describe(scratch: str | None, archives: list[Path]) -> str:
    """One line for ``doctor``: where the caches go, and what the run's archives hold."""
    where = f"{', '.join(var for _sub, var in CACHE_VARS)} -> {scratch_root(scratch)}/<run>/<group>/<node>/"
    if not archives:
        return f"{where}; no shared archive yet (the first segment compiles cold)"
    parts = []
    for a in archives:
        try:
            with tarfile.open(a) as tar:
                n = sum(1 for m in tar if m.isfile())
            parts.append(f"{a.name}: {n} files, {a.stat().st_size / 1e6:.1f} MB")
        except (OSError, tarfile.TarError) as err:
            parts.append(f"{a.name}: unreadable ({err})")
    return f"{where}; archives {'; '.join(parts)}"


@contextlib.contextmanager
def warm(archive: str | Path, local: str | Path) -> Iterator[tuple[dict[str, str], SeedResult]]:
    """Seed ``local`` from ``archive``, yield (the cache variables, what was seeded), and on exit
    save what is new. Exit it only after every process that compiles has ended (the node step
    stops Ray and sweeps its workers first). Saving never raises: the segment's outcome matters
    more than its cache, and the next segment just compiles again."""
    try:
        seeded = seed(archive, local)
    except OSError as err:  # scratch unwritable: compile where the compilers default to, fail nothing
        log.warning("JIT cache: cannot use %s (%s); the compilers keep their default caches", local, err)
        yield {}, SeedResult(0, 0)
        return
    try:
        yield cache_env(local), seeded
    finally:
        try:
            saved = save(archive, local)
        except (OSError, tarfile.TarError, LockTimeout) as err:
            log.warning("JIT cache: could not save %s into %s (%s)", local, archive, err)
        else:
            if saved is not None:
                log.info("JIT cache: added %d files to %s (%d files, %.1f MB)", saved.added, archive,
                         saved.archive_files, saved.bytes / 1e6)
