"""Find the right log of a run without hunting through directories (`beam-hpc logs`).

One directory per segment, ``logs/<jobid>-<restart>/``, as the job writes it; every name comes from
beam_hpc.plan.paths (RunPaths, SegmentPaths), the same as the writers use:

    <run>/logs/slurm-<jobid>.out                 the batch shell (and the driver's output where it
                                                 has no file of its own)
    <run>/logs/<jobid>-<restart>/driver.log      the driver's own file
    <run>/logs/<jobid>-<restart>/node-<group>-<i>.log   one node step (node index within its group)
    <run>/logs/<jobid>-<restart>/srun-<group>.log, readiness.log, ray-logs/  (listed by --list)

Segments are ordered by (job id, restart), the order Slurm gives them: requeues bump the restart
count of one job, resubmissions get a higher job id.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from beam_hpc.errors import InputError, shorten
from beam_hpc.observe.run_dir import check_run_dir
from beam_hpc.plan import paths as run_paths
from beam_hpc.plan.paths import RunPaths

GROUPS = ("trainer", "rollout")
# A Slurm segment's directory (plan.paths.SEGMENT_DIR_RE: <jobid>-<restart>) or a local one, made by
# `beam-hpc execute`, whose ledger job id is "l<pid>" (beam_hpc.job.segment).
_SEGMENT_RE = re.compile(r"^(l?)(\d+)-(\d+)$")


class LogNotFoundError(InputError, FileNotFoundError):
    """No log matches; the message lists what does exist."""


class SegmentNotFound(LogNotFoundError):
    """``--segment`` names no segment of the run: bad input (exit 2), unlike a log not written yet."""


def node_log_name(group: str, node_index: int) -> str:
    """File name of one node step's log inside its segment directory (ray_node's name for it)."""
    if group not in GROUPS:
        raise InputError(f"--group {shorten(group)}: expected one of {', '.join(GROUPS)}")
    return run_paths.node_log_name(group, node_index)


def batch_log(run_dir: str | Path, job_id: str) -> Path:
    return Path(RunPaths(str(run_dir)).batch_log(job_id))


def segments(run_dir: str | Path) -> list[str]:
    """Segment ids with a log directory, oldest first: Slurm segments by (job id, restart), the
    order Slurm gives them; local ones (``l<pid>-<restart>``: pids do not grow with time) by when
    their directory was made, after the Slurm ones."""
    logs = Path(RunPaths(str(run_dir)).logs)
    found = [d for d in logs.iterdir() if d.is_dir() and _SEGMENT_RE.match(d.name)] if logs.is_dir() else []

    def order(d: Path) -> tuple[int, float, int, int]:
        local, job, restart = _SEGMENT_RE.match(d.name).groups()  # type: ignore[union-attr]
        return (1, _made_at(d), int(job), int(restart)) if local else (0, 0.0, int(job), int(restart))

    return [d.name for d in sorted(found, key=order)]


def _made_at(d: Path) -> float:
    """When a segment directory was made: its segment.log's mtime at the earliest (written first),
    else the directory's own."""
    try:
        return min(p.stat().st_mtime for p in (d, *d.iterdir()) if p.exists())
    except (OSError, ValueError):
        return 0.0


def resolve_segment(run_dir: str | Path, segment: str | int | None) -> str:
    """``None`` -> the latest; an int -> that position (0 first, -1 latest); "JOB-RESTART" -> itself."""
    check_run_dir(run_dir)
    segs = segments(run_dir)
    if not segs:
        raise LogNotFoundError(f"{RunPaths(str(run_dir)).logs}: no segment log directory yet "
                               "(has the job started? `beam-hpc status` shows whether it is pending)")
    if segment is None:
        return segs[-1]
    text = str(segment) if len(str(segment)) <= 200 else shorten(str(segment))
    if _SEGMENT_RE.match(text):
        if text not in segs:
            raise SegmentNotFound(f"--segment {text}: no such segment; have {', '.join(segs)}")
        return text
    try:
        return segs[int(text)]
    except (ValueError, IndexError):
        raise SegmentNotFound(f"--segment {text}: give a position (0 = first, -1 = latest; there are "
                               f"{len(segs)}) or an id JOBID-RESTART from: {', '.join(segs)}") from None


def available(run_dir: str | Path, segment: str) -> list[Path]:
    """Every log file of one segment, its batch log first."""
    seg_dir = Path(RunPaths(str(run_dir)).segment_named(segment).root)
    files = sorted(p for p in seg_dir.iterdir() if p.is_file()) if seg_dir.is_dir() else []
    batch = batch_log(run_dir, segment.split("-")[0])
    return ([batch] if batch.exists() else []) + files


def find_log(run_dir: str | Path, *, group: str | None = None, node: int | None = None,
             segment: str | int | None = None) -> Path:
    """The log asked for: a node step's (``group``/``node``, node 0 and group trainer by default
    once either is given), else the driver's, else the segment's batch log."""
    seg = resolve_segment(run_dir, segment)
    seg_paths = RunPaths(str(run_dir)).segment_named(seg)
    if group is not None or node is not None:
        node_log_name(group or "trainer", node or 0)  # checks the group
        candidates = [seg_paths.node_log(group or "trainer", node or 0)]
    else:
        candidates = [seg_paths.driver_log, batch_log(run_dir, seg.split("-")[0])]
    for c in candidates:
        if c.is_file():
            return c
    have = ", ".join(p.name for p in available(run_dir, seg)) or "nothing"
    raise LogNotFoundError(f"segment {seg}: no {candidates[0].name}; it has: {have}")


def check_lines(lines: int | None) -> int | None:
    """``--lines``: a count of lines, 0 or more (bad input otherwise, exit 2)."""
    if lines is not None and lines < 0:
        raise InputError(f"--lines: {lines} is negative; give how many of the last lines to print (0 or more)")
    return lines


def read_tail(path: Path, lines: int | None) -> str:
    """The whole file, or its last ``lines`` lines."""
    check_lines(lines)
    text = path.read_text(errors="replace")
    if lines is None:
        return text
    kept = text.splitlines(keepends=True)[-lines:] if lines > 0 else []
    return "".join(kept)


def follow(run_dir: str | Path, path: Path, *, switch_segments: bool, poll_s: float = 0.5,
           stop: Callable[[], bool] | None = None, start_at_end: bool = True) -> Iterator[str]:
    """Yield complete lines appended to ``path`` until ``stop()`` is true (forever by default).

    With ``switch_segments`` (the user did not pin a segment), when a newer segment's directory
    gets the same file (a requeue or a resubmission started), announce it and follow that one:
    a long run is watched with one command.
    """
    fh = open(path, errors="replace")
    if start_at_end:
        fh.seek(0, 2)
    partial = ""
    try:
        while stop is None or not stop():
            chunk = fh.read()
            if chunk:
                partial += chunk
                *complete, partial = partial.split("\n")
                for line in complete:
                    yield line + "\n"
                continue
            newer = _newer_same_log(run_dir, path) if switch_segments else None
            if newer is not None:
                rest = partial + fh.read()  # what was written between the last read and the switch
                for line in rest.splitlines():
                    yield line + "\n"
                partial = ""
                fh.close()
                path = newer
                fh = open(path, errors="replace")
                yield f"==> {path} <==\n"
                continue
            time.sleep(poll_s)
    finally:
        fh.close()


def _newer_same_log(run_dir: str | Path, path: Path) -> Path | None:
    if not _SEGMENT_RE.match(path.parent.name):
        return None  # a batch log: one per job, nothing to switch to
    segs = segments(run_dir)
    if path.parent.name not in segs:
        return None
    for seg in segs[segs.index(path.parent.name) + 1:]:
        cand = Path(RunPaths(str(run_dir)).segment_named(seg).root, path.name)
        if cand.is_file():
            return cand
    return None
