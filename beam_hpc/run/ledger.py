"""The run's ledger: ``<output>/ledger.jsonl``, one start line and one end line per segment.

Why a ledger and why this shape: a run outlives any one job,
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

import json
import math
import os
import time
from enum import StrEnum
from pathlib import Path
from typing import Any

from beam_hpc.errors import InputError, shorten


class Reason(StrEnum):
    """Why a segment ended: the end line's ``reason`` (the values are the strings the ledger holds)."""

    COMPLETED = "completed"  # num_rollout reached
    WALLTIME = "walltime"  # the walltime lead or the time limit itself
    PREEMPTED = "preempted"  # preempted (saved in the grace time, or requeued by Slurm at once)
    NODE_FAILURE = "node-failure"  # a node step died, or a node never joined
    ERROR = "error"  # the driver failed, or the segment refused to run
    CANCELLED = "cancelled"  # scancel or beam-hpc cancel
    STALLED = "stalled"  # no rollout finished within the stall timeout


class Action(StrEnum):
    """What follows a segment: the end line's ``next.action`` (beam_hpc.lifecycle.decide chooses it)."""

    RESUBMIT = "resubmit"  # a new job, after this one, with --resume
    REQUEUE = "requeue"  # the same job id again (preemption)
    NONE = "none"  # the chain ends here


REASONS = tuple(r.value for r in Reason)
ACTIONS = tuple(a.value for a in Action)


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
    damaged_checkpoints: list[dict[str, Any]] | None = None,
    now: float | None = None,
) -> dict[str, Any]:
    """The segment's start line. ``damaged_checkpoints`` (``[{"iteration", "why"}]``): the newest
    checkpoints this segment found damaged and passed over, moving the pointer back to the one it
    resumes from (``rollouts_at_start``); the rollouts between are trained again
    (beam_hpc.run.accounting counts them)."""
    return {
        **_head("start", job_id, restart, now),
        "host": host,
        "rollouts_at_start": int(rollouts_at_start),
        "num_rollout": int(num_rollout),
        "resume": bool(resume),
        "walltime_s": int(walltime_s),
        "lead_s": int(lead_s),
        "damaged_checkpoints": [{"iteration": int(d["iteration"]), "why": str(d.get("why", ""))}
                                for d in damaged_checkpoints or []],
    }


def end_record(
    *,
    job_id: str,
    restart: int,
    rollouts_at_end: int,
    reason: Reason | str,
    detail: str,
    next_action: str,
    next_job_id: str | None,
    rollout_s: float | None,
    save_s: float | None,
    ready_s: float | None = None,
    rollouts_run: int | None = None,
    last_save_at: float | None = None,
    failed_nodes: list[dict[str, str]] | None = None,
    stall: dict[str, Any] | None = None,
    resubmission_pending: dict[str, str] | None = None,
    now: float | None = None,
) -> dict[str, Any]:
    """The segment's end line. Besides what happened and what comes next, it records what
    beam_hpc.run.accounting needs to say where the segment's GPU-hours went: seconds until Ray
    was ready, rollout steps run (kept or not), and when the last checkpoint landed; and the
    nodes the segment failed because of (``[{"node", "why"}]``), which later segments exclude
    (beam_hpc.lifecycle.exclusions). A ``stalled`` segment also records its ``stall``: the rollout
    that never finished, since when nothing finished, the timeout, and the stack dumps
    (beam_hpc.lifecycle.stall, beam_hpc.node.stacks)."""
    if reason not in REASONS:
        raise LedgerError(f"reason {reason!r} is not one of {', '.join(REASONS)}")
    if next_action not in ACTIONS:
        raise LedgerError(f"next action {next_action!r} is not one of {', '.join(ACTIONS)}")
    return {
        **_head("end", job_id, restart, now),
        "rollouts_at_end": int(rollouts_at_end),
        "reason": Reason(reason).value,
        "detail": detail,
        "next": {"action": Action(next_action).value, "job_id": None if next_job_id is None else str(next_job_id)},
        "timings": {"rollout_s": rollout_s, "save_s": save_s},
        "ready_s": ready_s,
        "rollouts_run": rollouts_run,
        "last_save_at": last_save_at,
        # lost_at: a rollout node the segment went on without (beam_hpc.job.runner), and when
        "failed_nodes": [{"node": str(f["node"]), "why": str(f.get("why", "")),
                          **({"lost_at": float(f["lost_at"])} if f.get("lost_at") is not None else {}),
                          # a Miles run's lost node whose place a replacement took in the segment (runner)
                          **{k: str(f[k]) for k in ("replaced_by", "replaced_on") if f.get(k)}}
                         for f in failed_nodes or []],
        **({"stall": stall} if stall is not None else {}),
        # Slurm could not be reached until the job's end: {"command": what to run, "why"}
        **({"resubmission_pending": resubmission_pending} if resubmission_pending is not None else {}),
    }


# The type of every field a reader relies on, per event: a line whose field has another type (a hand
# edit, a foreign writer) is skipped like a torn one, so that no reader (status, accounting, the
# segment's decision, the resume estimate) meets a string where it does arithmetic. Absent fields
# are allowed (older ledgers lack some); ``None`` only where the writer itself may write it.
_NUM = (int, float)
_FIELDS: dict[str, dict[str, tuple[tuple[type, ...], bool]]] = {  # name -> (types, None allowed)
    "common": {"job_id": ((str,), False), "restart": ((int,), False), "time": (_NUM, False)},
    "start": {"host": ((str,), True), "rollouts_at_start": ((int,), False), "num_rollout": ((int,), False),
              "resume": ((bool,), False), "walltime_s": (_NUM, False), "lead_s": (_NUM, False)},
    "end": {"rollouts_at_end": ((int,), False), "reason": ((str,), False), "detail": ((str,), True),
            "next": ((dict,), True), "timings": ((dict,), True), "ready_s": (_NUM, True),
            "rollouts_run": ((int,), True), "last_save_at": (_NUM, True), "stall": ((dict,), True)},
    "stall": {"rollout": ((int,), False), "last_rollout": ((int,), True), "since": (_NUM, True),
              "caught_at": (_NUM, True), "timeout_s": (_NUM, True), "dumps": ((list,), True)},
    "next": {"action": ((str,), True), "job_id": ((str,), True)},
    "timings": {"rollout_s": (_NUM, True), "save_s": (_NUM, True)},
}


def _type_problem(record: dict[str, Any], kind: str) -> str | None:
    """The first field of ``record`` whose value has the wrong type for ``kind``, described."""
    for name, (types, nullable) in _FIELDS[kind].items():
        if name not in record:
            continue
        value = record[name]
        if value is None and nullable:
            continue
        ok = isinstance(value, types) and not (isinstance(value, bool) and bool not in types)
        if ok and isinstance(value, float) and not math.isfinite(value):
            ok = False
        if not ok:
            want = "number" if types == _NUM else "/".join(t.__name__ for t in types)
            return f"field {name!r} is {shorten(value, 60)}, expected {want}{' or null' if nullable else ''}"
        if isinstance(value, dict) and name in _FIELDS:
            inner = _type_problem(value, name)
            if inner is not None:
                return f"{name}: {inner}"
    return None


def check_record(record: Any) -> str | None:
    """Why one parsed ledger line cannot be used (None when it can): not an object, no segment id,
    an unknown event, or a field of the wrong type."""
    if not isinstance(record, dict):
        return f"not a JSON object ({type(record).__name__})"
    segment, event = record.get("segment"), record.get("event")
    if not isinstance(segment, str) or not segment:
        return f"field 'segment' is {shorten(segment, 60)}, expected a segment id JOBID-RESTART"
    if event not in ("start", "end"):
        return f"unknown ledger event {shorten(event, 60)}"
    return _type_problem(record, "common") or _type_problem(record, event)


def read_ledger(path: str | Path) -> tuple[list[dict[str, Any]], list[str]]:
    """Segments in order of first appearance, each ``{"segment": id, "start": line, "end": line}``
    (either key absent when that line is missing), plus warnings for lines that could not be read.

    A torn or foreign line (only possible when a writer died mid-append on a file system without
    atomic appends, or after a hand edit) is skipped and reported with its file and line number,
    never fatal: the other lines are still true. Every record returned has the types
    :func:`check_record` checks, so readers may do arithmetic on its fields without guarding.
    """
    p = Path(path)
    merged: dict[str, dict[str, Any]] = {}
    warnings: list[str] = []
    try:
        text = p.read_text(errors="replace")
    except FileNotFoundError:
        return [], warnings
    except IsADirectoryError:
        raise InputError(f"{p}: is a directory, not the run's ledger; remove or rename it") from None
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, RecursionError):
            warnings.append(f"{p}:{number}: unreadable ledger line skipped")
            continue
        problem = check_record(record)
        if problem is not None:
            warnings.append(f"{p}:{number}: ledger line skipped: {problem}")
            continue
        merged.setdefault(record["segment"], {"segment": record["segment"]})[record["event"]] = record
    return list(merged.values()), warnings


def chain_end(segments: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The end line where the run's chain stopped, or None while it goes on. The chain stops at a
    last segment whose end line starts nothing more (``next.action`` none) and leaves no
    resubmission pending (that one waits for a command: the run is not over). A last segment with no
    end line is running or was killed hard: not stopped, as far as the ledger can tell."""
    if not segments:
        return None
    end = segments[-1].get("end")
    if end is None or end.get("resubmission_pending") or (end.get("next") or {}).get("action") != "none":
        return None
    return end


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
