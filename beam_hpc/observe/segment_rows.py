"""The rows of `beam-hpc status`'s segment table: one per ledger segment, with its state.

A segment's row comes from its start and end lines; a segment without an end line is running (Slurm
says its job runs), open (Slurm could not be asked: it may still run) or killed (hard: no end line
was ever written), and then its end is estimated from the newest of its files. Which job carries
the run on is read off the last row. Split from :mod:`beam_hpc.observe.status`, which derives the
run's numbers from these rows.
"""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Any

from beam_hpc.lifecycle.decide import Action
from beam_hpc.observe.live_job import ACTIVE_STATES
from beam_hpc.plan.paths import RunPaths
from beam_hpc.run.scalars import Scalars


class SegmentState(StrEnum):
    """A row's ``state`` (the JSON holds these strings)."""

    ENDED = "ended"  # its end line is written
    RUNNING = "running"  # no end line, and Slurm says its job runs
    OPEN = "open"  # no end line, and Slurm was not asked or did not answer: it may still run
    KILLED = "killed"  # no end line, and its job is gone: killed hard (also the row's reason label)


def last_activity(run_dir: Path, segment: str, scalars: Scalars, start: float,
                   until: float | None) -> float:
    """Best estimate of when a segment without an end line stopped working: the newest of its
    log files' mtimes and of the metric wall times inside its window."""
    times = [start]
    seg_logs = Path(RunPaths(str(run_dir)).segment_named(segment).root)
    if seg_logs.is_dir():
        times += [f.stat().st_mtime for f in seg_logs.rglob("*") if f.is_file()]
    for pts in scalars.series.values():
        times += [p.wall_time for p in pts if p.wall_time and p.wall_time >= start
                  and (until is None or p.wall_time <= until)]
    end = max(times)
    return min(end, until) if until is not None else end


def segment_rows(run_dir: Path, records: list[dict[str, Any]], scalars: Scalars,
                  live: dict[str, Any] | None, now: float) -> list[dict[str, Any]]:
    rows = []
    for i, rec in enumerate(records):
        st, en = rec.get("start", {}), rec.get("end")
        start = st.get("time")
        nxt = records[i + 1].get("start", {}).get("time") if i + 1 < len(records) else None
        row: dict[str, Any] = {
            "segment": rec["segment"],
            "job_id": str(st.get("job_id", (en or {}).get("job_id", rec["segment"].rsplit("-", 1)[0]))),
            "restart": int(st.get("restart", (en or {}).get("restart", 0))),
            "host": st.get("host"),
            "start": start,
            "end": None, "end_estimated": False, "duration_s": None,
            "rollouts_at_start": st.get("rollouts_at_start"),
            "rollouts_at_end": None,
            "rollouts_run": None,  # rollout steps the segment finished, kept or not (from its scalars)
            "reason": None, "detail": None, "next_action": None, "next_job_id": None,
            "resubmission_pending": None,
            "timings": {},
            "state": SegmentState.ENDED,
        }
        if en is not None:
            nx = en.get("next") or {}
            row.update(end=en.get("time"), rollouts_at_end=en.get("rollouts_at_end"),
                       reason=en.get("reason"), detail=en.get("detail"),
                       next_action=nx.get("action"), next_job_id=nx.get("job_id"),
                       timings=en.get("timings") or {}, rollouts_run=en.get("rollouts_run"),
                       resubmission_pending=_pending(en.get("resubmission_pending")))
        elif start is not None:
            running = (i == len(records) - 1 and live is not None and live.get("state") in ACTIVE_STATES
                       and str(live.get("job_id")) == row["job_id"])
            unknowable = i == len(records) - 1 and (live is None or not live.get("reachable"))
            if running:
                row.update(state=SegmentState.RUNNING, end=now)
            elif unknowable:  # may still be running: Slurm was not asked or did not answer
                row.update(state=SegmentState.OPEN, end_estimated=True,
                           end=last_activity(run_dir, rec["segment"], scalars, start, nxt))
            else:
                # "killed" is the row's state and its reason label, never a ledger Reason
                row.update(state=SegmentState.KILLED, reason=SegmentState.KILLED.value, end_estimated=True,
                           detail="no end line: the segment was killed hard (end time estimated)",
                           end=last_activity(run_dir, rec["segment"], scalars, start, nxt))
        if row["start"] is not None and row["end"] is not None:
            row["duration_s"] = max(0.0, float(row["end"]) - float(row["start"]))
        rows.append(row)
    return rows


def _pending(field: Any) -> dict[str, str] | None:
    """An end line's ``resubmission_pending`` (``{"command", "why"}``: Slurm could not be reached
    until the job's end, beam_hpc.lifecycle.actions.ResubmissionPending), when well formed."""
    if not isinstance(field, dict) or not isinstance(field.get("command"), str) or not field["command"].strip():
        return None
    return {"command": field["command"], "why": str(field.get("why") or "")}


def current_job(rows: list[dict[str, Any]]) -> str | None:
    """The job that carries the run on: a resubmitted successor, the requeued job, or the job of
    a segment still open; None when the chain has stopped."""
    if not rows:
        return None
    last = rows[-1]
    if last["state"] != SegmentState.ENDED:
        return last["job_id"]
    if last["next_action"] == Action.RESUBMIT and last["next_job_id"]:
        return str(last["next_job_id"])
    if last["next_action"] == Action.REQUEUE:
        return last["job_id"]
    return None
