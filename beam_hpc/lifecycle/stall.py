"""The stall watchdog: is the backend still finishing rollouts, and how long may it take?

Why: an NCCL deadlock, a stuck SGLang engine or a dead Ray actor leaves the driver alive and idle,
and a hung segment would hold all its nodes until the walltime (24 h for the seed recipes); nothing
else notices. So the segment watches the one sign of progress every backend gives: one
``perf/step_time`` scalar per finished rollout step, read as ``status`` reads it
(:func:`beam_hpc.run.scalars.read_scalars`). The timeouts (:func:`timeouts`) follow the run: by
default :data:`FACTOR` x (the slowest measured step + the last save), at least :data:`FLOOR_S`, so
a slow step or a save never looks like a hang; a segment's first rollout, which also loads the model,
gets :data:`STARTUP_EXTRA_S` more. Miles flushes TensorBoard only about every 120 s, so a timeout
under ~150 s can fire on a healthy Miles run.

The segment asks :meth:`StallWatch.check` on each tick (:mod:`beam_hpc.lifecycle.stopping`); on a
stall, :func:`dump_and_stop` records the stack dumps in its :class:`CaughtStall` and stops the job;
that record is what the ledger's end line says (``stalled``, then :mod:`beam_hpc.lifecycle.decide`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from beam_hpc.plan.paths import RunPaths
from beam_hpc.run import metric_names
from beam_hpc.run.scalars import read_scalars

log = logging.getLogger(__name__)

FACTOR = 4  # x (slowest step + last save)
FLOOR_S = 1200  # 20 minutes: no computed timeout is shorter
STARTUP_EXTRA_S = 1800  # the first rollout of a segment: + model loading and engine start-up
PROBE_EVERY_S = 5.0  # the probe re-reads the scalars at most this often, and only when their files changed


@dataclass(frozen=True)
class Timeouts:
    """Seconds without a finished rollout step after which the segment acts (0: not watched)."""

    stall_s: int
    startup_s: int
    basis: str  # where stall_s came from, for the log and the ledger

    def describe(self) -> str:
        def fmt(s: int) -> str:
            return "off" if s == 0 else f"{s} s"
        return f"stall timeout {fmt(self.stall_s)} ({self.basis}), first rollout {fmt(self.startup_s)}"


def timeouts(stall_timeout_s: int | None, startup_timeout_s: int | None, *,
             slowest_step_s: float | None, last_save_s: float | None) -> Timeouts:
    """The recipe's ``lifecycle.stall_timeout_s`` / ``startup_timeout_s``, or the defaults from the
    measured step and save seconds (None: not measured yet; the floor then holds)."""
    if stall_timeout_s is not None:
        stall, basis = int(stall_timeout_s), "lifecycle.stall_timeout_s"
    elif slowest_step_s is None and last_save_s is None:
        stall, basis = FLOOR_S, "the floor: no rollout measured yet"
    else:
        step, save = slowest_step_s or 0.0, last_save_s or 0.0
        computed = int(FACTOR * (step + save) + 0.999)
        stall = max(FLOOR_S, computed)
        basis = (f"{FACTOR} x (slowest step {step:.1f} s + last save {save:.1f} s)"
                 + ("" if computed >= FLOOR_S else f", raised to the floor {FLOOR_S} s"))
    if startup_timeout_s is not None:
        startup = int(startup_timeout_s)
    else:
        startup = 0 if stall == 0 else stall + STARTUP_EXTRA_S
    return Timeouts(stall, startup, basis)


@dataclass(frozen=True)
class Stall:
    """The backend finished no rollout step for ``silent_s`` (> ``timeout_s``)."""

    phase: str  # "startup": no step yet in this segment (timed from the driver's start) | "running"
    last_rollout: int | None  # the id of the last step this segment finished (None: none)
    rollout: int  # the rollout that never finished (the one after last_rollout)
    since: float  # wall time of the last progress (the last step, or the driver's start)
    caught_at: float
    timeout_s: int
    basis: str

    @property
    def silent_s(self) -> float:
        return self.caught_at - self.since

    def describe(self) -> str:
        after = ("before the segment's first rollout (model loading included)" if self.last_rollout is None
                 else f"after rollout {self.last_rollout}")
        return (f"no rollout finished for {self.silent_s:.0f} s {after}: rollout {self.rollout} is stuck "
                f"(timeout {self.timeout_s} s: {self.basis})")

    def to_record(self) -> dict[str, Any]:
        return {"phase": self.phase, "last_rollout": self.last_rollout, "rollout": self.rollout,
                "since": round(self.since, 3), "caught_at": round(self.caught_at, 3),
                "timeout_s": self.timeout_s}


class ProgressProbe:
    """This segment's finished rollout steps, from the backend's own ``perf/step_time`` scalars
    written at or after ``offset`` (the segment's mark, taken before the driver starts)."""

    def __init__(self, paths: RunPaths, offset: float, *, every_s: float = PROBE_EVERY_S,
                 clock: Callable[[], float] = time.time) -> None:
        self.paths, self.offset, self.every_s, self._clock = paths, offset, every_s, clock
        self._next = 0.0
        self._signature: tuple | None = None
        self.steps = 0  # rollout steps seen in this segment
        self.last_rollout: int | None = None
        self.last_at: float | None = None  # wall time the last of them was written
        self.slowest_step_s: float | None = None
        self.last_save_s: float | None = None
        self.unreadable: str | None = None  # why the scalars cannot be read here (the watch is then off)

    def _files_signature(self) -> tuple:
        files = list(Path(self.paths.tensorboard).rglob("events.out.tfevents.*"))
        files.append(Path(self.paths.dumps, metric_names.METRICS_FILE))
        sig = []
        for f in sorted(files):
            try:
                st = f.stat()
            except OSError:
                continue
            sig.append((str(f), st.st_size, st.st_mtime_ns))
        return tuple(sig)

    def poll(self, *, force: bool = False) -> bool:
        """Re-read the scalars if their files changed (and the last look is ``every_s`` old);
        True when a new step showed up."""
        now = self._clock()
        if not force and now < self._next:
            return False
        self._next = now + self.every_s
        sig = self._files_signature()
        if sig == self._signature:
            return False
        self._signature = sig
        warnings: list[str] = []
        everything = read_scalars(self.paths.root, warnings)
        if everything.source is None and any(Path(f).name.startswith("events.") for f, _, _ in sig):
            # event files this process cannot read (e.g. no `tensorboard` package here, and no
            # metrics.jsonl mirror: Miles): no progress would ever show, so no stall may be claimed
            self.unreadable = "; ".join(warnings) or "the TensorBoard events cannot be read here"
            return False
        self.unreadable = None
        scalars = everything.since(self.offset)
        steps = scalars.series.get(metric_names.ROLLOUT_TIME, [])
        saves = scalars.series.get(metric_names.SAVE_TIME, [])
        if saves:
            self.last_save_s = max(saves, key=lambda p: p.wall_time or 0.0).value
        if steps:
            self.slowest_step_s = max(p.value for p in steps)
        if len(steps) <= self.steps:
            return False
        newest = max(steps, key=lambda p: p.wall_time or 0.0)
        self.steps = len(steps)
        self.last_rollout = max(p.step for p in steps)
        # the writer's clock; never later than ours (another host's clock may run ahead)
        self.last_at = min(newest.wall_time or now, now)
        return True


class StallWatch:
    """The timeouts and the probe together: :meth:`check` says when the segment is stalled.

    ``stall_timeout_s`` / ``startup_timeout_s``: the recipe's fields (None: the defaults);
    ``measured``: :func:`beam_hpc.run.ledger.measured_timings` of the earlier segments;
    ``rollouts_at_start``: rollouts in the checkpoint this segment resumed from (the id of its
    first rollout, for a stall before it)."""

    def __init__(self, paths: RunPaths, offset: float, *, stall_timeout_s: int | None,
                 startup_timeout_s: int | None, measured: dict[str, float] | None, rollouts_at_start: int,
                 clock: Callable[[], float] = time.time, probe_every_s: float = PROBE_EVERY_S) -> None:
        self._clock = clock
        self.probe = ProgressProbe(paths, offset, every_s=probe_every_s, clock=clock)
        self.stall_timeout_s, self.startup_timeout_s = stall_timeout_s, startup_timeout_s
        self.measured = measured or {}
        self.rollouts_at_start = rollouts_at_start
        self.started_at: float | None = None
        self._shown: Timeouts | None = None
        self._off_said = False

    def start(self, at: float | None = None) -> None:
        """The driver started: the first rollout's clock runs from here."""
        self.started_at = self._clock() if at is None else at
        log.info("stall watchdog: %s", self.timeouts().describe())

    def timeouts(self) -> Timeouts:
        slow = [s for s in (self.measured.get("rollout_s"), self.probe.slowest_step_s) if s is not None]
        save = self.probe.last_save_s if self.probe.last_save_s is not None else self.measured.get("save_s")
        return timeouts(self.stall_timeout_s, self.startup_timeout_s,
                        slowest_step_s=max(slow) if slow else None, last_save_s=save)

    def check(self) -> Stall | None:
        """A :class:`Stall` when the current phase's timeout has passed without a new step."""
        if self.started_at is None:
            return None
        t = self.timeouts()
        if self.probe.poll() or self.probe.unreadable:
            if self.probe.unreadable:
                if not self._off_said:
                    self._off_said = True
                    log.warning("stall watchdog off: the backend's progress cannot be read here (%s); install "
                                "beam-hpc's `viz` extra (tensorboard) where the segment runs", self.probe.unreadable)
                return None
            t = self.timeouts()
            shown = self._shown
            if shown is None or abs(t.stall_s - shown.stall_s) > 0.1 * shown.stall_s:
                self._shown = t  # the timeout follows the measurements: say so when it moves, not per step
                log.info("stall watchdog after %d rollout(s): %s", self.probe.steps, t.describe())
        now = self._clock()
        if self.probe.last_at is None:
            phase, timeout, since = "startup", t.startup_s, self.started_at
            basis = ("lifecycle.startup_timeout_s" if self.startup_timeout_s is not None
                     else f"the stall timeout + {STARTUP_EXTRA_S} s for the first rollout")
        else:
            phase, timeout, since, basis = "running", t.stall_s, max(self.probe.last_at, self.started_at), t.basis
        if timeout <= 0 or now - since <= timeout:
            return None
        if self.probe.poll(force=True) or self.probe.unreadable:  # one last fresh look before acting
            return None
        last = self.probe.last_rollout
        return Stall(phase=phase, last_rollout=last, rollout=self.rollouts_at_start if last is None else last + 1,
                     since=since, caught_at=now, timeout_s=timeout, basis=basis)



class StackDumper(Protocol):
    """The running job as a stall needs it (beam_hpc.job.runner.JobRunner)."""

    def dump_stacks(self) -> dict[str, Any]: ...

    def request_stop(self, reason: str) -> None: ...


@dataclass
class CaughtStall:
    """A stall the segment acted on, and what its stack dumps found (``dumps``: None until they are done)."""

    stall: Stall
    dumps: dict[str, Any] | None = None

    def record(self) -> dict[str, Any]:
        """The ledger end line's ``stall``: the stall, the dump files, and at most 20 skipped processes."""
        dumps = self.dumps or {}
        return {**self.stall.to_record(), **dumps, "skipped": dumps.get("skipped", [])[:20]}

    def describe(self, stacks_dir: str | Path) -> str:
        """The end line's detail: the stall, where the dumps are, and what did not answer."""
        rec = self.record()
        parts = [self.stall.describe(), f"{len(rec.get('dumps') or [])} stack dump(s) in {stacks_dir}"]
        if rec.get("skipped"):
            parts.append(f"{len(rec['skipped'])} process(es) did not answer within the dump timeout and were "
                         "killed: " + "; ".join(f"pid {x['pid']} on {x['node']} ({x['why']})" for x in rec["skipped"][:3]))
        if rec.get("silent_nodes"):
            parts.append(f"node step(s) that did not answer: {', '.join(rec['silent_nodes'])}")
        if rec.get("suspects"):
            parts.append(f"suspect node(s): {', '.join(rec['suspects'])}")
        if rec.get("error"):
            parts.append(f"dumps failed: {rec['error']}")
        return "; ".join(parts)


def dump_and_stop(caught: CaughtStall, job: StackDumper) -> None:
    """Dump every Python process's stacks (beam_hpc.node.stacks, through the job's node steps) into
    ``caught.dumps``, then ask the job to stop; a dump that fails is recorded, and the stop still comes."""
    log.error("stalled: %s; dumping the stacks of the job's Python processes, then stopping it", caught.stall.describe())
    try:
        caught.dumps = job.dump_stacks()
    except Exception as err:  # noqa: BLE001 - the stop matters more than the dumps
        log.exception("the stack dumps failed")
        caught.dumps = {"dumps": [], "skipped": [], "suspects": [], "error": f"{type(err).__name__}: {err}"}
    job.request_stop("stalled")
