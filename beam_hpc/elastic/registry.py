"""The run's record of its extra rollout jobs: ``elastic/jobs/<job_id>.jsonl``, one file per job.

Why one append-only file per job: its writers are many processes on many hosts (``rollout add`` on
the login node, the job's batch shell, one program per node), and an appended line (one
``O_APPEND`` write, as the ledger's) needs no lock, so a reader on the login node never sees half a
record. The lines, in order: ``submitted`` (nodes, partition, GPUs per node), per (re)start of the
job ``start`` (its nodes), per node ``started`` then the worker's own ``joined``/``unit``/``left``
records with ``node`` added (a node's ``left`` carries the reason), and the job's ``left`` with
its reason (:class:`LeftReason`); a requeued job starts again with ``start``.
:func:`extra_jobs` reads them back for ``status``, ``plot`` and ``rollout list``.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from beam_hpc.backends.reference.rollouts.rendezvous import elastic_dir  # RUN/elastic/, spelled once there
from beam_hpc.run.ledger import append

JOBS_DIR = "jobs"  # under elastic/


class LeftReason(StrEnum):
    """Why a node or a job left the run: the ``reason`` of its ``left`` record (a ``str``, so the
    record's JSON and every reader that compares text stay as they were)."""

    REMOVED = "removed"  # rollout remove (USR2/INT), or a plain scancel before the time limit
    PREEMPTED = "preempted"  # Slurm's preemption (its grace signal, then TERM)
    WALLTIME = "walltime"  # the job's own time limit (the USR1 lead, or TERM at the limit)
    RUN_ENDED = "run-ended"  # the run is over: its chain stopped and Slurm holds no job of it
    SEGMENT_ENDED = "segment-ended"  # a Miles run's replacement node: the segment whose Ray cluster it joined ended
    FAILED = "failed"  # the node program failed, or ended without leaving cleanly


def jobs_dir(run_dir: str | Path) -> Path:
    return elastic_dir(run_dir) / JOBS_DIR


def events_path(run_dir: str | Path, job_id: str) -> Path:
    return jobs_dir(run_dir) / f"{job_id}.jsonl"


def logs_dir(run_dir: str | Path) -> Path:
    """The extra jobs' batch logs (``slurm-<job>.out``) and node logs (``node-<job>-<restart>-<i>.log``)."""
    return elastic_dir(run_dir) / "logs"


def script_path(run_dir: str | Path, stamp: str) -> Path:
    """Where ``rollout add`` writes the batch script of one extra job (``stamp``: when it was made)."""
    return elastic_dir(run_dir) / f"rollout-{stamp}.sbatch"


def record(run_dir: str | Path, job_id: str, event: dict[str, Any]) -> None:
    """Append one event of job ``job_id`` (``time`` added when missing)."""
    append(events_path(run_dir, job_id), {"time": time.time(), **event})


def read_events(path: str | Path) -> list[dict[str, Any]]:
    """The file's whole lines as records; a line being written (no newline yet) or not a JSON object
    is left out (a reader must never fail on a writer's half line)."""
    try:
        text = Path(path).read_text()
    except (FileNotFoundError, NotADirectoryError):
        return []
    out = []
    for line in text.splitlines(keepends=True):
        if not line.endswith("\n"):
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("event"), str):
            out.append(rec)
    return out


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


@dataclass
class ExtraJob:
    """What one extra job did, from its events."""

    job_id: str
    nodes: int = 0
    partition: str | None = None
    gpus_per_node: int = 0
    submitted_at: float | None = None
    events: list[dict[str, Any]] = field(default_factory=list)

    def _job_events(self) -> list[dict[str, Any]]:
        return [e for e in self.events if "node" not in e]

    def _units(self) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == "unit" and "node" in e]

    @property
    def state(self) -> str:
        """pending (submitted, not started), running, or left (the job's last word was ``left``)."""
        last = next((e for e in reversed(self._job_events()) if e["event"] in ("submitted", "start", "left")), None)
        if last is None or last["event"] == "submitted":
            return "pending"
        return "running" if last["event"] == "start" else "left"

    @property
    def reason(self) -> LeftReason | None:
        """Why the job last left (None while it has not; a reason this beam-hpc does not know, or
        none recorded, reads as failed)."""
        last = next((e for e in reversed(self._job_events()) if e["event"] in ("start", "left")), None)
        if last is None or last["event"] != "left":
            return None
        try:
            return LeftReason(str(last.get("reason")))
        except ValueError:
            return LeftReason.FAILED

    @property
    def units_served(self) -> int:
        return len(self._units())

    def _train_units(self) -> list[dict[str, Any]]:
        return [e for e in self._units() if e.get("purpose", "train") == "train"]

    @property
    def samples(self) -> int:
        """Training samples served (an eval unit's are not rollout samples)."""
        return int(sum(_num(e.get("samples")) or 0 for e in self._train_units()))

    @property
    def rollouts(self) -> list[int]:
        """Training rollouts it served a unit of."""
        return sorted({int(e["rollout"]) for e in self._train_units() if _num(e.get("rollout")) is not None})

    @property
    def versions(self) -> list[int]:
        return sorted({int(e["version"]) for e in self._units() if _num(e.get("version")) is not None})

    @property
    def joined_at(self) -> list[float]:
        """When a node joined a segment (its worker's ``joined`` events), in order."""
        return sorted(t for e in self.events if e["event"] == "joined" and "node" in e
                      if (t := _num(e.get("time"))) is not None)

    @property
    def left_at(self) -> list[float]:
        """When a node left (its ``left`` events), in order."""
        return sorted(t for e in self.events if e["event"] == "left" and "node" in e
                      if (t := _num(e.get("time"))) is not None)

    def node_seconds(self, *, now: float | None = None) -> float:
        """Seconds the job's nodes were held: per node, from each ``started`` to the next ``left``
        of that node (or the job's own ``left``, or ``now`` while it runs)."""
        at = time.time() if now is None else now
        total, open_since = 0.0, {}
        for e in self.events:
            t = _num(e.get("time"))
            if t is None:
                continue
            node = e.get("node")
            if e["event"] == "started" and node is not None:
                open_since.setdefault(node, t)
            elif e["event"] == "left" and node is not None and node in open_since:
                total += max(0.0, t - open_since.pop(node))
            elif e["event"] == "left" and node is None:  # the job ended: every node still open ends here
                total += sum(max(0.0, t - s) for s in open_since.values())
                open_since.clear()
        if self.state == "running":
            total += sum(max(0.0, at - s) for s in open_since.values())
        return total

    def gpu_hours(self, *, now: float | None = None) -> float:
        return self.node_seconds(now=now) * self.gpus_per_node / 3600.0


def extra_job(run_dir: str | Path, job_id: str) -> ExtraJob:
    """One job's record (an empty one when it has no file)."""
    events = read_events(events_path(run_dir, job_id))
    job = ExtraJob(job_id=str(job_id), events=events)
    sub = next((e for e in events if e["event"] == "submitted"), None)
    if sub is not None:
        job.nodes = int(_num(sub.get("nodes")) or 0)
        job.partition = sub.get("partition") if isinstance(sub.get("partition"), str) else None
        job.gpus_per_node = int(_num(sub.get("gpus_per_node")) or 0)
        job.submitted_at = _num(sub.get("time"))
    else:  # submitted by hand (sbatch of the written script): what its first start saw
        first = next((e for e in events if e["event"] == "start" and "node" not in e), None)
        if first is not None:
            job.nodes = len(first.get("nodes") or [])
            job.gpus_per_node = int(_num(first.get("gpus_per_node")) or 0)
            job.submitted_at = _num(first.get("time"))
    return job


def extra_jobs(run_dir: str | Path) -> list[ExtraJob]:
    """Every extra job of the run, in the order they were submitted."""
    d = jobs_dir(run_dir)
    if not d.is_dir():
        return []
    jobs = [extra_job(run_dir, p.stem) for p in d.glob("*.jsonl")]
    return sorted(jobs, key=lambda j: (j.submitted_at or 0.0, j.job_id))


def capacity_changes(jobs: list[ExtraJob]) -> list[tuple[int, str, str]]:
    """``(rollout, "joined"|"left", job_id)`` where the run's rollout capacity changed, in rollout
    order: a node joined at the rollout of its first unit after joining, and left at the rollout of
    its last unit before leaving (a node that served nothing changed nothing). ``plot`` draws them."""
    out: set[tuple[int, str, str]] = set()
    for j in jobs:
        current: dict[str, list[int]] = {}  # node -> rollouts served since it joined
        for e in j.events:
            node, kind = e.get("node"), e["event"]
            if node is None:
                continue
            if kind == "joined":
                current[node] = []
            elif kind == "unit" and _num(e.get("rollout")) is not None:
                served = current.setdefault(node, [])
                if not served:
                    out.add((int(e["rollout"]), "joined", j.job_id))
                served.append(int(e["rollout"]))
            elif kind == "left" and current.get(node):
                out.add((current.pop(node)[-1], "left", j.job_id))
    return sorted(out)
