"""The run's ledger: ``<output>/ledger.jsonl``, one start line and one end line per segment.

Why a ledger and why this shape (contract: /work/notes/ledger.md): a run outlives any one job,
so the only record of what each job did (and why the chain went on or stopped) is a file on
shared storage that every segment appends to. It is append-only JSONL so that a segment killed
at any instant leaves at worst a start line without an end line (readers treat that as "killed
hard"), never a corrupted history: each line is written with a single ``write`` on an
``O_APPEND`` descriptor and fsync'ed before the segment goes on, so concurrent readers
(``beam-hpc status`` on a login node) see whole lines or nothing of them.

Readers merge the lines by ``segment`` (``"<job_id>-<restart>"``): a requeued job keeps its job
id, so the restart count is what tells its segments apart.
"""

from __future__ import annotations

from beam_hpc.errors import InputError

import json
import os
import time
from pathlib import Path
from typing import Any

REASONS = ("completed", "walltime", "preempted", "node-failure", "error", "cancelled")
ACTIONS = ("resubmit", "requeue", "none")


class LedgerError(InputError):
    """A record that would break the ledger contract (a bug in the caller, not bad user input)."""


def segment_id(job_id: str, restart: int) -> str:
    return f"{job_id}-{restart}"


def append(path: str | Path, record: dict[str, Any]) -> None:
    """Append one record as one line, durably. ``O_APPEND`` makes the write land at the end even
    when another process appends at the same time; one ``os.write`` of the whole line keeps it
    whole; ``fsync`` makes it survive the node dying right after."""
    line = (json.dumps(record, sort_keys=True) + "\n").encode()
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(p, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        written = os.write(fd, line)
        if written != len(line):  # a short write on a regular file means the disk is full
            raise OSError(f"{p}: only {written} of {len(line)} bytes of a ledger line were written")
        os.fsync(fd)
    finally:
        os.close(fd)


def _head(event: str, job_id: str, restart: int, now: float | None) -> dict[str, Any]:
    return {"event": event, "segment": segment_id(job_id, restart), "job_id": str(job_id),
            "restart": int(restart), "time": time.time() if now is None else now}


def start_record(
    *,
    job_id: str,
    restart: int,
    host: str,
    rollouts_at_start: int,
    num_rollout: int,
    resume: bool,
    walltime_s: int,
    lead_s: int,
    now: float | None = None,
) -> dict[str, Any]:
    return {
        **_head("start", job_id, restart, now),
        "host": host,
        "rollouts_at_start": int(rollouts_at_start),
        "num_rollout": int(num_rollout),
        "resume": bool(resume),
        "walltime_s": int(walltime_s),
        "lead_s": int(lead_s),
    }


def end_record(
    *,
    job_id: str,
    restart: int,
    rollouts_at_end: int,
    reason: str,
    detail: str,
    next_action: str,
    next_job_id: str | None,
    rollout_s: float | None,
    save_s: float | None,
    ready_s: float | None = None,
    rollouts_run: int | None = None,
    last_save_at: float | None = None,
    failed_nodes: list[dict[str, str]] | None = None,
    now: float | None = None,
) -> dict[str, Any]:
    """The segment's end line. Besides what happened and what comes next, it records what
    beam_hpc.run.accounting needs to say where the segment's GPU-hours went: seconds until Ray
    was ready, rollout steps run (kept or not), and when the last checkpoint landed; and the
    nodes the segment failed because of (``[{"node", "why"}]``), which later segments exclude
    (beam_hpc.lifecycle.exclusions)."""
    if reason not in REASONS:
        raise LedgerError(f"reason {reason!r} is not one of {', '.join(REASONS)}")
    if next_action not in ACTIONS:
        raise LedgerError(f"next action {next_action!r} is not one of {', '.join(ACTIONS)}")
    return {
        **_head("end", job_id, restart, now),
        "rollouts_at_end": int(rollouts_at_end),
        "reason": reason,
        "detail": detail,
        "next": {"action": next_action, "job_id": None if next_job_id is None else str(next_job_id)},
        "timings": {"rollout_s": rollout_s, "save_s": save_s},
        "ready_s": ready_s,
        "rollouts_run": rollouts_run,
        "last_save_at": last_save_at,
        "failed_nodes": [{"node": str(f["node"]), "why": str(f.get("why", ""))} for f in failed_nodes or []],
    }


def read_ledger(path: str | Path) -> tuple[list[dict[str, Any]], list[str]]:
    """Segments in order of first appearance, each ``{"segment": id, "start": line, "end": line}``
    (either key absent when that line is missing), plus warnings for lines that could not be read.

    A torn or foreign line (only possible when a writer died mid-append on a file system without
    atomic appends) is skipped and reported, never fatal: the other lines are still true.
    """
    p = Path(path)
    merged: dict[str, dict[str, Any]] = {}
    warnings: list[str] = []
    try:
        text = p.read_text(errors="replace")
    except FileNotFoundError:
        return [], warnings
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            key, event = str(record["segment"]), record["event"]
        except (json.JSONDecodeError, KeyError, TypeError):
            warnings.append(f"{p}:{number}: unreadable ledger line skipped")
            continue
        if event not in ("start", "end"):
            warnings.append(f"{p}:{number}: unknown ledger event {event!r} skipped")
            continue
        merged.setdefault(key, {"segment": key})[event] = record
    return list(merged.values()), warnings


def measured_timings(segments: list[dict[str, Any]], last: int = 3) -> dict[str, float] | None:
    """Rollout and save seconds measured by the most recent segments that measured them, for
    :func:`beam_hpc.plan.plan.compute_lead_s`. The slowest of the last ``last`` is taken: the lead must
    cover a slow rollout, not an average one."""
    rollout: list[float] = []
    save: list[float] = []
    for seg in reversed(segments):
        timings = (seg.get("end") or {}).get("timings") or {}
        if timings.get("rollout_s") is not None and len(rollout) < last:
            rollout.append(float(timings["rollout_s"]))
        if timings.get("save_s") is not None and len(save) < last:
            save.append(float(timings["save_s"]))
    if not rollout and not save:
        return None
    out: dict[str, float] = {}
    if rollout:
        out["rollout_s"] = max(rollout)
    if save:
        out["save_s"] = max(save)
    return out
