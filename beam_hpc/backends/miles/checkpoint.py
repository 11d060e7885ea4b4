"""Check a Miles (Megatron ``torch_dist``) checkpoint before a segment resumes from it.

Why: Miles resumes from whatever ``latest_checkpointed_iteration.txt`` under ``--load`` names, and
nothing re-checks the files after Megatron wrote that pointer. A file cut short (a full file
system, an interrupted copy, a node lost while flushing) or a save killed half-way would show only
when Megatron's loader fails on hundreds of GPUs, after the whole allocation came up, and again in
every requeue. So before the entry point runs, the driver checks the named iteration with
megatron-core's own ``dist_checkpointing`` reader (:func:`check_iteration`: cheap checks first, a
full load only for small checkpoints) and, when it is broken, points the pointer (atomically) at the
previous complete iteration, with a warning naming the broken one and why. Miles, Megatron and
beam-hpc's lifecycle then agree on where the run stands; the broken directory stays as evidence.
An iteration pinned with ``--ckpt-step`` is checked but never replaced. megatron-core is imported
lazily (the login node never needs it; the Miles image ships it); Miles itself never is.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from beam_hpc.errors import RuntimeFailure
from beam_hpc.run.checkpoint_layout import (
    LATEST_FILE,
    dataset_state_path,
    iteration_dir,
    latest_iteration,
    mark_latest,
    saved_iterations,
)

logger = logging.getLogger(__name__)

# The full load reads every byte and holds the whole state in host memory: a Qwen3-30B-A3B checkpoint
# with Adam moments and fp32 master weights is ~0.4 TB, minutes of the allocation and more RAM than the
# head node has. Steps 1-3 and 5 read only the small files and stat the big ones, which finds what goes
# wrong between segments (an unfinished save has no index; a cut file is shorter than its index says).
FULL_READ_MAX_BYTES = 1 << 30
SHARDED_BACKEND = "torch_dist"
FORMAT_FILE = "metadata.json"  # megatron-core's CheckpointingConfig
COMMON_FILE = "common.pt"
INDEX_FILE = ".metadata"  # torch.distributed.checkpoint's global metadata


class CheckpointCheckError(RuntimeFailure):
    """No checkpoint can be resumed from, or the check itself cannot run."""


class MegatronMissingError(CheckpointCheckError):
    """megatron-core is not importable in this environment."""


@dataclass(frozen=True)
class IterationCheck:
    """The verdict on one iteration: ``problems`` is empty when Miles can resume from it."""

    iteration: int
    path: Path
    problems: tuple[str, ...]
    full_read: bool  # True when step 4 (a full load) ran, False when only metadata and sizes were checked
    shard_bytes: int

    @property
    def ok(self) -> bool:
        return not self.problems

    def reason(self) -> str:
        return "; ".join(self.problems) if self.problems else "complete"


@dataclass(frozen=True)
class ResumeChoice:
    """Which iteration the segment resumes from, what the pointer said, and what was skipped."""

    iteration: int
    pointer: int
    skipped: tuple[IterationCheck, ...]

    @property
    def fell_back(self) -> bool:
        return self.iteration != self.pointer


def import_megatron() -> ModuleType:
    """``megatron.core.dist_checkpointing``, or a clear error saying where it is available."""
    try:
        from megatron.core import dist_checkpointing
    except ImportError as err:
        raise MegatronMissingError(
            f"megatron-core is not importable here ({err}); the checkpoint check needs it: it runs inside "
            "the Miles image (which ships Megatron), or install `beam-hpc[megatron]` to check on another machine"
        ) from err
    return dist_checkpointing


def check_iteration(ckpt_dir: str | Path, iteration: int, *, full_read_max_bytes: int = FULL_READ_MAX_BYTES,
                    require_dataset_state: bool = True) -> IterationCheck:
    """Check one ``iter_NNNNNNN`` directory, cheap checks first:

    1. ``metadata.json`` (megatron-core's format record, written last by ``dist_checkpointing.save``)
       parses and names the ``torch_dist`` backend;
    2. ``common.pt`` (the non-sharded state) passes its zip CRCs and loads with megatron-core; its
       ``iteration``, when present, is the directory's;
    3. ``.metadata`` (torch.distributed.checkpoint's global index, written after every rank finished)
       loads, and every shard file it references exists and is at least as long as the furthest
       byte it references (a truncated or missing ``__R_T.distcp`` is named without reading data);
    4. small checkpoints only (shard bytes <= ``full_read_max_bytes``): a full
       ``dist_checkpointing.load`` in a one-rank gloo group, which also finds damage inside a file
       of the right length;
    5. Miles's data cursor, ``rollout/global_dataset_state_dict_N.pt``, exists and passes its zip
       CRCs: without it Miles silently restarts the data (a resume needs both)."""
    dc = import_megatron()
    path = iteration_dir(ckpt_dir, iteration)
    if not path.is_dir():
        return IterationCheck(iteration, path, (f"{path} does not exist",), False, 0)
    problems = _format_problems(path)
    if not problems:  # megatron-core refuses to read common.pt of a directory without a format record
        problems += _common_problems(dc, path, iteration)
    shard_problems, shard_bytes = _shard_problems(path)
    problems += shard_problems
    full_read = False
    if not problems and shard_bytes <= full_read_max_bytes:
        full_read = True
        problems += _full_load_problems(dc, path)
    if require_dataset_state:
        problems += _dataset_state_problems(dataset_state_path(ckpt_dir, iteration))
    return IterationCheck(iteration, path, tuple(problems), full_read, shard_bytes)


def choose_resume(ckpt_dir: str | Path, *, full_read_max_bytes: int = FULL_READ_MAX_BYTES,
                  require_dataset_state: bool = True) -> ResumeChoice | None:
    """The newest complete iteration at or below the pointer; None when there is no pointer (a fresh
    start, which Miles handles through ``--ref-load``). Iterations above the pointer are never
    chosen: the pointer is written last, so they are saves that did not finish."""
    try:
        pointer = latest_iteration(ckpt_dir)
    except ValueError as err:
        raise CheckpointCheckError(f"{err}: write the iteration to resume from into it, or remove it to start "
                                   "from --ref-load") from err
    if pointer is None:
        return None
    candidates = [it for it in saved_iterations(ckpt_dir) if it <= pointer]
    if pointer not in candidates:
        candidates.insert(0, pointer)  # checked (and reported missing) like any other
    skipped: list[IterationCheck] = []
    for it in sorted(candidates, reverse=True):
        verdict = check_iteration(ckpt_dir, it, full_read_max_bytes=full_read_max_bytes,
                                  require_dataset_state=require_dataset_state)
        if verdict.ok:
            return ResumeChoice(it, pointer, tuple(skipped))
        skipped.append(verdict)
    details = "; ".join(f"iteration {v.iteration}: {v.reason()}" for v in skipped)
    raise CheckpointCheckError(
        f"cannot resume from {ckpt_dir}: no complete checkpoint at or below iteration {pointer} ({details}); "
        f"restore a checkpoint there, or remove {Path(ckpt_dir) / LATEST_FILE} to start again from --ref-load"
    )


def prepare_resume(ckpt_dir: str | Path, *, full_read_max_bytes: int = FULL_READ_MAX_BYTES,
                   require_dataset_state: bool = True) -> ResumeChoice | None:
    """Make ``ckpt_dir`` resumable by Miles: choose (see ``choose_resume``), and when the pointer named
    a broken iteration, warn and point it at the complete one (atomically)."""
    choice = choose_resume(ckpt_dir, full_read_max_bytes=full_read_max_bytes,
                           require_dataset_state=require_dataset_state)
    if choice is None:
        return None
    for broken in choice.skipped:
        logger.warning("checkpoint iteration %d in %s is not usable: %s", broken.iteration, ckpt_dir, broken.reason())
    if choice.fell_back:
        mark_latest(ckpt_dir, choice.iteration)
        logger.warning("resuming from iteration %d instead of %d: %s now names %d (the broken directories are "
                       "left in place)", choice.iteration, choice.pointer, LATEST_FILE, choice.iteration)
    else:
        logger.info("checkpoint iteration %d in %s is complete", choice.iteration, ckpt_dir)
    return choice


def check_pinned(ckpt_dir: str | Path, iteration: int, *, full_read_max_bytes: int = FULL_READ_MAX_BYTES,
                 require_dataset_state: bool = True) -> IterationCheck:
    """An iteration the user pinned (``--ckpt-step``): checked, never replaced; broken is an error."""
    verdict = check_iteration(ckpt_dir, iteration, full_read_max_bytes=full_read_max_bytes,
                              require_dataset_state=require_dataset_state)
    if not verdict.ok:
        raise CheckpointCheckError(f"--ckpt-step {iteration}: {verdict.reason()}; pick a complete iteration "
                                   f"(or drop --ckpt-step to resume from the newest complete one)")
    return verdict


# --- the steps -------------------------------------------------------------------------------------


def _short(err: BaseException) -> str:
    """One line for a log: torch's CheckpointException wraps the real error per rank; unwrap it."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = next(iter(failures.values()))
        err = inner[0] if isinstance(inner, tuple) else inner
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:300]}" if text else type(err).__name__


def _format_problems(path: Path) -> list[str]:
    f = path / FORMAT_FILE
    try:
        record = json.loads(f.read_text())
    except FileNotFoundError:
        return [f"{FORMAT_FILE} is missing (the save did not finish: megatron-core writes it last)"]
    except (OSError, ValueError) as err:
        return [f"{FORMAT_FILE} is unreadable ({_short(err)})"]
    backend = record.get("sharded_backend") if isinstance(record, dict) else None
    if backend != SHARDED_BACKEND:
        return [f"{FORMAT_FILE} names sharded_backend {backend!r}, not {SHARDED_BACKEND!r}"]
    return []


def _zip_problem(path: Path) -> str | None:
    """torch.save files are zip archives with a CRC per record: a cut or a flipped byte fails here."""
    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()
    except FileNotFoundError:
        return f"{path.name} is missing"
    except (OSError, zipfile.BadZipFile, EOFError) as err:
        return f"{path.name} is damaged ({_short(err)})"
    return f"{path.name}: record {bad} fails its CRC" if bad else None


def _common_problems(dc: ModuleType, path: Path, iteration: int) -> list[str]:
    problem = _zip_problem(path / COMMON_FILE)
    if problem:
        return [problem]
    try:
        common = dc.load_common_state_dict(str(path))
    except pickle.UnpicklingError as err:
        if "weights_only" in str(err):  # a class megatron-core does not allow-list: the bytes passed their CRCs
            logger.debug("%s: CRCs pass, its objects are not all allow-listed: %s", path / COMMON_FILE, _short(err))
            return []
        return [f"{COMMON_FILE} does not load ({_short(err)})"]
    except Exception as err:  # noqa: BLE001 - any failure to read it is the verdict
        return [f"{COMMON_FILE} does not load ({_short(err)})"]
    saved = common.get("iteration") if isinstance(common, dict) else None
    if isinstance(saved, int) and saved != iteration:
        return [f"{COMMON_FILE} says iteration {saved}, the directory is iteration {iteration}"]
    return []


def _shard_problems(path: Path) -> tuple[list[str], int]:
    """Load the global index and compare every referenced file's size with the bytes it must hold."""
    from torch.distributed.checkpoint import FileSystemReader

    if not (path / INDEX_FILE).is_file():
        return [f"{INDEX_FILE} is missing (the save did not finish: it is written after every rank's files)"], 0
    try:
        index = FileSystemReader(str(path)).read_metadata()
    except Exception as err:  # noqa: BLE001 - any failure to read it is the verdict
        return [f"{INDEX_FILE} does not load ({_short(err)})"], 0
    needed: dict[str, int] = {}
    for info in (index.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    if not needed:
        return [f"{INDEX_FILE} references no shard files"], 0
    problems = []
    for name, need in sorted(needed.items()):
        try:
            have = (path / name).stat().st_size
        except FileNotFoundError:
            problems.append(f"{name} is missing ({INDEX_FILE} references {need} bytes in it)")
            continue
        if have < need:
            problems.append(f"{name} is truncated: {have} bytes, {INDEX_FILE} references {need}")
    return problems, sum(needed.values())


LOOPBACK_IFNAME = "lo"


@contextmanager
def _one_rank_group() -> Iterator[None]:
    """A gloo group of this process alone, on an in-memory store (no port), removed afterwards.

    It binds the loopback interface: the driver's environment names the cluster interface in
    ``GLOO_SOCKET_IFNAME`` (for Miles's own groups), which a one-rank group has no use for and which
    may not exist where the check runs. A group that cannot start is an error of the check, never a
    verdict on the checkpoint (that would rewrite the pointer for nothing).
    """
    import torch.distributed as dist

    if dist.is_initialized():
        if dist.get_world_size() != 1:
            raise CheckpointCheckError("a multi-rank process group is already initialised in this process; "
                                       "check the checkpoint before starting distributed work")
        yield
        return
    saved = os.environ.get("GLOO_SOCKET_IFNAME")
    os.environ["GLOO_SOCKET_IFNAME"] = LOOPBACK_IFNAME
    try:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    except Exception as err:  # reported as the check's own failure, below
        raise CheckpointCheckError(f"cannot start the one-process gloo group the full load needs ({_short(err)}); "
                                   "pass --checkpoint-full-read-max-bytes 0 to check metadata and sizes only") from err
    finally:
        if saved is None:
            os.environ.pop("GLOO_SOCKET_IFNAME", None)
        else:
            os.environ["GLOO_SOCKET_IFNAME"] = saved
    try:
        yield
    finally:
        dist.destroy_process_group()


def _full_load_problems(dc: ModuleType, path: Path) -> list[str]:
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

    with _one_rank_group():
        try:
            dc.load(load_sharded_metadata(str(path)), str(path))
        except (Exception, CheckpointException) as err:  # noqa: BLE001 - any failure to load it is the verdict
            return [f"megatron-core cannot load it ({_short(err)})"]
    return []


def _dataset_state_problems(path: Path) -> list[str]:
    problem = _zip_problem(path)
    if problem is None:
        return []
    if not path.exists():
        return [f"Miles's data cursor {path} is missing (resuming would restart the data)"]
    return [f"Miles's data cursor {path}: {problem}"]
