"""Stopping a running segment: the watchdog's interrupts, the save on request, and stalls.

The segment's :class:`State` lives here, because these are what move it. A walltime lead or a
preemption saves first (SAVING: the sentinel, :mod:`beam_hpc.lifecycle.save`), then stops the
driver (STOPPING); a requeue, a cancel or the time limit leaves only Slurm's KillWait, so the end
is recorded at once through the ``finish`` the segment hands in (FINISHING, then FINISHED), and
the job is torn down afterwards; a stall dumps the stacks and stops the job (STOPPING,
:mod:`beam_hpc.lifecycle.stall`). Signal handlers run this code between two bytecodes of whatever
the segment was doing, so each step looks at the state first, and the end is recorded once.
"""

from __future__ import annotations

import contextlib
import logging
import subprocess
import time
from collections.abc import Callable, Iterator
from enum import Enum
from typing import Any, Protocol

from beam_hpc.config.recipe import LifecycleSpec
from beam_hpc.lifecycle import save
from beam_hpc.lifecycle.actions import KillClock
from beam_hpc.lifecycle.stall import CaughtStall, StallWatch, dump_and_stop
from beam_hpc.lifecycle.watchdog import Interrupt, Watchdog
from beam_hpc.plan.paths import RunPaths
from beam_hpc.run import checkpoint_layout
from beam_hpc.run.ledger import Reason

log = logging.getLogger(__name__)


class State(Enum):
    """Where a segment is; it only moves forward, except that a failed end goes back to before it."""

    RUNNING = "running"  # checks, bring-up, the driver: nothing has asked the segment to stop
    SAVING = "saving"  # an interrupt's save on request is under way
    STOPPING = "stopping"  # an interrupt or a stall stops the job; the end follows its teardown
    FINISHING = "finishing"  # the end is being decided, carried out and written
    FINISHED = "finished"  # the end line is written


class RunningJob(Protocol):
    """The running job as stopping it needs it (beam_hpc.job.runner.JobRunner)."""

    driver: subprocess.Popen | None

    def request_stop(self, reason: str) -> None: ...

    def stop(self) -> float: ...

    def dump_stacks(self) -> dict[str, Any]: ...


class Stopping:
    """What asked the segment to stop (``interrupt``, ``stall``), what its save did (``saved``), and
    the segment's ``state``. ``finish(reason, detail)`` records the segment's end (the segment's
    own, which decides, acts and writes the end line)."""

    def __init__(self, lifecycle: LifecycleSpec, paths: RunPaths, watchdog: Watchdog,
                 finish: Callable[[Reason, str], object]) -> None:
        self.lifecycle, self.paths, self.watchdog, self.finish = lifecycle, paths, watchdog, finish
        self.state = State.RUNNING
        self.interrupt: Interrupt | None = None  # the interrupt acted on (a more urgent one replaces it)
        self.saved: save.SaveResult | None = None  # what the save on request did
        self.stall: CaughtStall | None = None
        # when Slurm kills this job: the deadline of the resubmission's retries (beam_hpc.lifecycle.actions)
        self.kill_clock = KillClock()
        self.job: RunningJob | None = None  # once the runtime exists
        self.stall_watch: StallWatch | None = None  # once the runtime exists

    @property
    def over(self) -> bool:
        """The end is being written or is written: nothing else may act."""
        return self.state in (State.FINISHING, State.FINISHED)

    @contextlib.contextmanager
    def finishing(self) -> Iterator[None]:
        """Around the end's decide, act and write: FINISHING while it runs (a signal then leaves it
        alone), FINISHED once it is done, the state before it if it failed."""
        before, self.state = self.state, State.FINISHING
        try:
            yield
        except BaseException:
            self.state = before
            raise
        self.state = State.FINISHED

    def attach(self, job: RunningJob, stall_watch: StallWatch) -> None:
        """The runtime exists: act on what came during the checks before it, and stop it at once if
        an interrupt already did."""
        self.job, self.stall_watch = job, stall_watch
        self.tick(job)
        if self.interrupt is not None:
            job.request_stop(self.interrupt.kind)

    # -- called by the watchdog's signal handler and by the runtime's poll loop ------------------
    def on_signal(self, name: str) -> None:
        """From the signal handler: SIGTERM leaves KillWait seconds, so act here and now (the
        ledger line first), whatever phase the runtime is in; other signals wait for a tick,
        except during bring-up, when there is no rollout to save."""
        if name == "SIGTERM":
            self.kill_clock.sigterm()  # KillWait runs from here, whatever phase the segment is in
        if self.over:
            return
        if name in ("SIGTERM", "SIGINT") or self.job is None or self.job.driver is None:
            try:
                intr = self.watchdog.check()
                if intr is not None:
                    self.on_interrupt(intr)
            except Exception:  # never let a handler break the code it interrupted
                log.exception("handling %s failed", name)

    def tick(self, job: RunningJob) -> None:
        """Called by the runtime every poll while the driver runs."""
        intr = self.watchdog.check()
        if intr is not None:
            self.on_interrupt(intr)
        self._check_stall(job)

    def on_interrupt(self, intr: Interrupt) -> None:
        if self.over:
            return
        if intr.asks_for_a_save and not self.lifecycle.save_on_request:
            log.warning("%s: lifecycle.save_on_request is false, so no save now: running on until Slurm stops "
                        "the job; the next segment resumes from the last periodic checkpoint", intr.kind)
            return
        self.interrupt = intr
        if self.state is State.RUNNING:
            self.state = State.STOPPING
        job = self.job
        if intr.asks_for_a_save and job is not None and job.driver is not None and self.stall is None:
            self._save_now(intr, job)  # (a stalled driver saves nothing: it is being stopped)
        if intr.leaves_no_time:  # record now, the runtime tears down afterwards
            self.finish(intr.reason, intr.detail)
        if job is not None:
            job.request_stop(intr.kind)
            if self.saved is not None and self.state is not State.FINISHED:
                # the checkpoint is in (or will not come): stop the driver now, before it trains
                # rollouts that nobody will keep (the runtime's stop is idempotent)
                job.stop()

    def save_for_lost_node(self, what: str) -> bool:
        """Called by the runtime when a node was lost that the run cannot train on without but can
        save before the segment ends (beam_hpc.plan.node_loss.NodeLossAction.SAVE_FIRST): save
        at the next rollout boundary (the sentinel, as for the walltime lead) and return once the
        checkpoint is in, or will not come: the driver exited, a signal ended the segment, or the
        stall timeout passed (``lifecycle.save_timeout_s`` if shorter). A save the loss came too
        late for never comes: Miles then waits in its weight update for the lost engine, which
        has no node to start on, and finishes no rollout, so the stall timeout is the wait's bound.
        True when the checkpoint is in: the runtime may then wait for a replacement node
        (:meth:`count_stall_from` puts the segment back to RUNNING); otherwise, or when none joins,
        it ends the segment as the node failure, and the end line's detail says what the save did.
        Only while RUNNING: an interrupt or a stall already being handled stops the segment anyway."""
        job = self.job
        if self.state is not State.RUNNING or job is None or job.driver is None or job.driver.poll() is not None:
            return False
        if not self.lifecycle.save_on_request:
            log.warning("%s: lifecycle.save_on_request is false, so no save before the segment ends; the next "
                        "segment resumes from the last periodic checkpoint", what)
            return False
        wait_s = float(self.lifecycle.save_timeout_s)
        stall_s = self.stall_watch.timeouts().stall_s if self.stall_watch is not None else 0
        if stall_s > 0:
            wait_s = min(wait_s, stall_s)
        self._save(job.driver, deadline=time.time() + wait_s, reason="node-lost",
                   interrupted=lambda: self.interrupt is not None or self.over)
        return self.saved is not None and self.saved.saved and self.interrupt is None and not self.over

    def count_stall_from(self, at: float) -> None:
        """The stall watch counts from ``at`` (epoch seconds): held while a Miles run waits for a lost
        node's replacement (``at`` the wait's end), and restarted once it has joined, so that the
        lost engine's restart and the next rollout get a whole stall timeout. After the save for the
        lost node the segment runs on: RUNNING again, so that a walltime lead or a preemption saves."""
        if self.state is State.STOPPING and self.interrupt is None and self.stall is None and not self.over:
            self.state = State.RUNNING
        if self.stall_watch is not None:
            self.stall_watch.start(at)

    def _save(self, driver: subprocess.Popen | None, *, deadline: float, reason: str,
              interrupted: Callable[[], bool]) -> None:
        """The save on request itself, for an interrupt or a lost node: SAVING while it waits
        (a signal then starts no second save), STOPPING after it, and ``saved`` says what it did."""
        self.state = State.SAVING
        try:
            self.saved = save.save_and_wait(
                self.paths, deadline=deadline, driver_running=lambda: driver is not None and driver.poll() is None,
                reason=reason, interrupted=interrupted)
        finally:
            if self.state is State.SAVING:
                self.state = State.STOPPING
        (log.info if self.saved.saved else log.warning)("%s (%.1f s)", self.saved.detail, self.saved.seconds)

    def _save_now(self, intr: Interrupt, job: RunningJob) -> None:
        lc = self.lifecycle
        now = time.time()
        hard_end = intr.hard_end if intr.hard_end is not None else now + lc.save_timeout_s
        deadline = min(now + lc.save_timeout_s, hard_end - save.TEARDOWN_RESERVE_S)
        driver = job.driver

        def more_urgent() -> bool:
            newer = self.watchdog.check()
            if newer is None:
                return self.state is State.FINISHED
            if newer.leaves_no_time:
                self.on_interrupt(newer)  # records the end now; the save is abandoned
                return True
            self.interrupt = newer  # e.g. preempted during a walltime save: keep saving, requeue after
            return self.state is State.FINISHED

        if deadline <= now:
            self.saved = save.SaveResult(False, checkpoint_layout.latest_iteration(self.paths.checkpoints), 0.0,
                                         "no time left to save; relying on the last checkpoint")
            log.warning("%s", self.saved.detail)
            return
        self._save(driver, deadline=deadline, reason=intr.kind, interrupted=more_urgent)

    def _check_stall(self, job: RunningJob | None) -> None:
        """The stall watchdog: when the backend has finished no rollout for the timeout, dump every
        Python process's stacks, then stop the driver and Ray; the end line says ``stalled`` and
        the next segment resumes from the last checkpoint. Only while RUNNING: an interrupt being
        handled stops the segment anyway."""
        watch = self.stall_watch
        if watch is None or job is None or job.driver is None or self.state is not State.RUNNING:
            return
        if watch.started_at is None:
            watch.start()
            return
        stall = watch.check()
        if stall is None:
            return
        # before the dumps: an interrupt that comes during them must not start a save
        self.state, self.stall = State.STOPPING, CaughtStall(stall)
        dump_and_stop(self.stall, job)
