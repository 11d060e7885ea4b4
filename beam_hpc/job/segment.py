"""``python -m beam_hpc.job.segment --plan RUN/plan.json|- [--script PATH] [--resume] [--num-rollout N]``: one segment.

The batch script execs into this (beam_hpc.slurm.script), so this process is the batch shell: it receives the
walltime warning (``--signal=B:USR1@lead``) and Slurm's SIGTERM. A rendered script carries its plan
(``--plan -``: the plan's JSON on stdin, from the script's own here-document) and names itself
(``--script "$0"``), so a plain ``sbatch x.sbatch`` needs nothing else. What it does, in order:

0. checks the allocation against the plan's groups (a hand-edited ``#SBATCH --nodes``/``--gres`` is
   named with its line; exit 2 before anything is written), and a run directory's damaged plan.json
   (exit 2, nothing written); a script's plan is written to plan.json, and the script to job.sbatch,
   once the lock is held;
1. takes the run lock (a second segment on the same output directory is refused; a lock of a
   killed job is taken over, see :mod:`beam_hpc.run.lock`), and sets up ``logs/<job>-<restart>/``;
2. writes the ledger's start line, then checks that the run may go on: the cancel flag,
   ``max_segments``, and the seed's resume rules (:func:`beam_hpc.run.resume.check_resume`:
   checkpoint *and* dataset state, num_rollout counts all rollouts, and the checkpoints were made
   with this plan's model, data and topology: :mod:`beam_hpc.run.identity`, the same check as at
   submit time, since plan.json or the script may have changed); a refusal is the segment's end line and
   ends the chain. A requeued segment (SLURM_RESTART_COUNT > 0) resumes by itself;
3. runs the job (:mod:`beam_hpc.job.runner`: Ray on every node, the driver) while the
   :class:`beam_hpc.lifecycle.watchdog.Watchdog` watches for the walltime lead (USR1 or its own deadline
   from the job's EndTime), preemption (USR1 with a PreemptTime) and SIGTERM;
4. on walltime or preemption, asks the backend to save now (sentinel), waits for that checkpoint,
   stops the driver and tears down; on SIGTERM it has only Slurm's KillWait, so it writes the
   ledger end line first and relies on the last complete checkpoint;
5. while the driver runs, the stall watchdog (:mod:`beam_hpc.lifecycle.stall`) watches the rollouts
   the backend finishes; when none finishes within ``lifecycle.stall_timeout_s`` (the first one:
   ``startup_timeout_s``), the segment dumps every Python process's stacks into
   ``logs/<job>-<restart>/stacks/`` (:mod:`beam_hpc.node.stacks`), stops the driver and Ray, and
   ends as ``stalled``;
6. decides (:func:`beam_hpc.lifecycle.decide.decide`) and acts: resubmit itself with ``--resume``
   (dependency afterany on itself), requeue (same job id), or stop; writes the ledger end line;
   releases the lock.

Messages go to the segment's log and to stderr (the batch log); the exit status is 0 when the
segment ended as planned (completed, walltime, preempted, cancelled), 1 on a runtime failure
(including a lock another live segment holds), 2 on bad input (a damaged plan, an allocation that
does not match the plan, a resume the run's checkpoints refuse), as the CLI maps them.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import socket
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from beam_hpc.errors import InputError, RuntimeFailure
from beam_hpc.lifecycle import actions, cancel, exclusions, quarantine, save
from beam_hpc.lifecycle.decide import Action, Decision, Outcome, decide
from beam_hpc.lifecycle.segment_metrics import metrics_offset, segment_metrics
from beam_hpc.lifecycle.stall import Stall, StallWatch
from beam_hpc.lifecycle.watchdog import Interrupt, Watchdog
from beam_hpc.node import stacks
from beam_hpc.plan.plan import Plan, compute_lead_s, load_plan
from beam_hpc.plan.segment_args import SegmentArgs
from beam_hpc.run import checkpoint_layout, ledger
from beam_hpc.run.identity import IdentityError, record_identity
from beam_hpc.run.lock import Holder, RunLockError, acquire, release
from beam_hpc.slurm.client import JobInfo, SlurmUnavailable, show_job
from beam_hpc.slurm.environment import SlurmEnvironment

log = logging.getLogger("beam_hpc.job.segment")

EXIT_OK, EXIT_ERROR, EXIT_REFUSED = 0, 1, 2  # EXIT_REFUSED: bad input (the CLI's exit 2)
# The runtime's outcome statuses (beam_hpc.job.runner.STATUSES) as ledger reasons, when no interrupt explains them.
_STATUS_REASON = {"node-failure": "node-failure", "not-ready": "node-failure", "driver-failed": "error", "error": "error"}
_INTERRUPT_REASON = {"walltime": "walltime", "timelimit": "walltime", "preempted": "preempted",
                     "requeued": "preempted", "cancelled": "cancelled"}


class Segment:
    """One segment of a run: lock, ledger, job, watchdog, decision."""

    def __init__(
        self,
        plan: str | Plan,
        *,
        resume: bool = False,
        num_rollout: int | None = None,
        env: Mapping[str, str] | None = None,
        query: Callable[[str], JobInfo | None] = show_job,
        script: str | None = None,
    ) -> None:
        self.env = dict(os.environ if env is None else env)
        self.plan = plan if isinstance(plan, Plan) else load_plan(plan)
        self.paths = self.plan.paths
        self.want_resume = resume
        self.num_rollout_arg = num_rollout
        self.query = query
        self.script = script  # the batch script this segment runs from (a rendered script's "$0")
        self.slurm = SlurmEnvironment(self.env)
        self.job_id: str | None = self.slurm.job_id
        self.restart = self.slurm.restart_count
        self.ledger_job_id = self.job_id or f"l{os.getpid()}"
        self.me = Holder.me(self.job_id, self.restart)
        self.watchdog = Watchdog(self.job_id, self.restart, self.plan.lead_s, query=query,
                                 cancel_flag=self.paths.cancel_flag)
        self.runner = None  # beam_hpc.job.runner.JobRunner once started
        self.rollouts_at_start = 0
        self.started_at = time.time()
        self.metrics_offset = 0
        self.lead_s = self.plan.lead_s
        self.history: list[dict] = []
        self.interrupt: Interrupt | None = None
        self.save_result: save.SaveResult | None = None
        self.finished = False  # the end line is written
        self._finishing = False
        self._requeue_self = False
        self.reason: str | None = None
        self.excluded: list[str] = []  # the run's failed nodes, left out of the next segment
        self.stall_watch: StallWatch | None = None  # once the driver runs (beam_hpc.lifecycle.stall)
        self.stall: Stall | None = None
        self.stall_record: dict | None = None  # the stall and its stack dumps, for the ledger's end line

    # -- entry ------------------------------------------------------------------------------------
    def run(self) -> int:
        self.watchdog.install()  # first: a signal may come at any moment
        _log_to(None)
        handler: logging.Handler | None = None
        try:
            try:
                self._check_before_writing()
            except InputError as err:  # nothing written: no lock, no log dir, no ledger line
                log.error("cannot run a segment of %s: %s", self.plan.output_dir, err)
                return EXIT_REFUSED
            Path(self.plan.output_dir).mkdir(parents=True, exist_ok=True)
            try:
                previous = acquire(self.paths.lock, self.me, query=self.query)
            except RunLockError as err:  # another live segment holds the run: a runtime failure (exit 1)
                log.error("refused: %s", err)
                return EXIT_ERROR
            try:
                self._materialize()
            except (OSError, RuntimeFailure) as err:
                release(self.paths.lock, self.me)
                log.error("cannot write the run directory %s: %s", self.plan.output_dir, err)
                return EXIT_ERROR
            seg = self.paths.segment(self.ledger_job_id, self.restart)
            Path(seg.root).mkdir(parents=True, exist_ok=True)
            handler = _log_to(seg.segment_log)
            log.info("segment %s of run %s (%s) on %s", ledger.segment_id(self.ledger_job_id, self.restart),
                     self.plan.run_id, self.plan.output_dir, socket.gethostname())
            if previous is not None:
                log.warning("took over the run lock of %s", previous.describe())
            try:
                return self._run_locked()
            finally:
                if self._requeue_self:  # after the lock is released: the requeued job takes it again
                    self._do_requeue_self()
        finally:
            self.watchdog.uninstall()
            if handler is not None:
                logging.getLogger().removeHandler(handler)
                handler.close()

    def _check_before_writing(self) -> None:
        """Bad input that must stop the segment before it writes anything: an allocation that does not
        match the plan (a hand-edited ``#SBATCH`` line, named), a run directory whose plan.json is
        damaged (named), a bad ``--num-rollout``."""
        if self.num_rollout_arg is not None:
            SegmentArgs(num_rollout=self.num_rollout_arg)  # validates
        if self.job_id is not None:
            from beam_hpc.job.context import allocation_problems

            text = None
            if self.script:
                with contextlib.suppress(OSError):
                    text = Path(self.script).read_text(errors="replace")
            problems = allocation_problems(self.plan, self.slurm, script=self.script, script_text=text)
            if problems:
                raise InputError("; ".join(problems))
        if Path(self.paths.plan).exists():
            load_plan(self.paths.plan)  # a torn or hand-broken plan.json: exit 2 naming it, nothing written

    def _materialize(self) -> None:
        """With the lock held: the run directory as a submission leaves it. A rendered script's plan
        becomes plan.json (as ``submit`` writes it: replaced when the script's differs, and the
        resume checks below still judge the checkpoints against it), the script becomes job.sbatch
        (what the lifecycle resubmits, hand edits included), logs/ exists, and the batch log is
        linked where ``beam-hpc logs`` looks when Slurm wrote it elsewhere (the submit directory)."""
        Path(self.paths.logs).mkdir(parents=True, exist_ok=True)
        if self.script is None:
            return
        from beam_hpc.run.files import write_atomic

        if not Path(self.paths.plan).exists() or load_plan(self.paths.plan) != self.plan:
            write_atomic(Path(self.paths.plan), self.plan.to_json())
        with contextlib.suppress(OSError):
            text = Path(self.script).read_text()
            target = Path(self.paths.script)
            if Path(self.script).resolve() != target.resolve() and (
                    not target.exists() or _lines(target.read_text()) != _lines(text)):
                write_atomic(target, text)
                target.chmod(0o755)
        if self.job_id is not None:
            with contextlib.suppress(OSError):
                out = Path(os.readlink("/proc/self/fd/2"))
                link = Path(self.paths.batch_log(self.job_id))
                if out.is_absolute() and out.exists() and out != link and not link.exists():
                    link.symlink_to(out)

    def _run_locked(self) -> int:
        try:
            code = self._prepare()
            if code is not None:
                return code
            return self._run_job()
        finally:
            save.clear_save_request(self.paths)
            release(self.paths.lock, self.me)

    # -- before the job ---------------------------------------------------------------------------
    def _prepare(self) -> int | None:
        """Checks and the start line; an exit code when the segment must not run the job."""
        if self.num_rollout_arg is not None:
            self._set_num_rollout(self.num_rollout_arg)
        recipe = self.plan.recipe
        ckpt = self.paths.checkpoints
        damaged = self._pass_over_damaged_checkpoints()
        self.rollouts_at_start = checkpoint_layout.rollouts_done(ckpt)
        has_ckpt = checkpoint_layout.latest_iteration(ckpt) is not None
        resume = self.want_resume or (self.restart > 0 and has_ckpt)
        self.history, warnings = ledger.read_ledger(self.paths.ledger)
        for w in warnings:
            log.warning("%s", w)
        self.lead_s = self._lead(recipe)
        self.watchdog.lead_s = self.lead_s
        self.watchdog.on_signal = self._on_signal
        self.watchdog.refresh()
        ledger.append(self.paths.ledger, ledger.start_record(
            job_id=self.ledger_job_id, restart=self.restart, host=socket.gethostname(),
            rollouts_at_start=self.rollouts_at_start, num_rollout=recipe.num_rollout, resume=resume,
            walltime_s=self.plan.walltime_s, lead_s=self.lead_s, damaged_checkpoints=damaged))
        save.clear_save_request(self.paths)  # left by a killed segment: it no longer applies
        if self._cancelled():
            return self._finish_now("cancelled", "the run was cancelled (beam-hpc cancel); not starting")
        if self.rollouts_at_start >= recipe.num_rollout:
            return self._finish_now("completed", f"{self.rollouts_at_start} rollouts already done of {recipe.num_rollout}")
        if len(self.history) + 1 > recipe.lifecycle.max_segments:
            return self._finish_now("error", f"lifecycle.max_segments ({recipe.lifecycle.max_segments}) reached "
                                             "before this segment; raise it and resubmit with --resume")
        try:
            from beam_hpc.run.resume import check_resume

            check_resume(recipe, resume=resume)  # with checkpoints, also what they were made with
        except IdentityError as err:  # a changed plan.json or a hand-edited script: another run's checkpoints
            self._finish_now("error", str(err), retryable=False)
            return EXIT_REFUSED
        except InputError as err:
            self._finish_now("error", str(err))
            return EXIT_REFUSED
        record_identity(self.paths, recipe.identity(), ledger.segment_id(self.ledger_job_id, self.restart),
                        has_ckpt=has_ckpt)
        if self.restart > 0 and not self.want_resume:
            log.info("requeued segment (restart %d): %s", self.restart,
                     f"resuming from checkpoint {checkpoint_layout.latest_iteration(ckpt)}" if has_ckpt
                     else "no checkpoint yet, starting from the beginning")
        return None

    def _pass_over_damaged_checkpoints(self) -> list[dict]:
        """The newest checkpoints that fail their manifest (a file truncated or changed since it was
        published), passed over: the pointer is moved back to the newest complete checkpoint, with
        the run lock held, before anything counts progress from it. Why here and not only in the
        backend (which walks back too): the start line's rollouts, the decision after the segment
        (progress is the pointer's) and ``status`` all read the pointer, and a pointer that names a
        damaged checkpoint would count rollouts the run no longer has. Returns what was passed over
        (the start line records it). With no complete checkpoint at all, the pointer is left as it
        is and the resume is refused with the reasons."""
        ckpt = self.paths.checkpoints
        complete, damaged = checkpoint_layout.newest_complete(ckpt)
        if not damaged:
            return []
        why = "; ".join(f"checkpoint {d['iteration']}: {d['why']}" for d in damaged)
        if complete is None:
            log.error("no complete checkpoint to resume from: %s", why)
            return damaged
        checkpoint_layout.mark_latest(ckpt, complete)
        log.warning("passed over damaged checkpoint(s) for complete checkpoint %d (the pointer now names it; "
                    "rollouts %d-%d are trained again): %s", complete, complete + 1, damaged[0]["iteration"], why)
        return damaged

    def _set_num_rollout(self, n: int) -> None:
        """``--num-rollout N`` on a resubmission: the seed lets it change (total, done included).
        plan.json stays as submitted (the job never writes it): the new total holds for this
        segment, is recorded in its ledger start line, and is passed on to the segment it
        resubmits."""
        if n < 1:
            raise InputError(f"--num-rollout: {n} is not a positive number of rollouts")
        if n != self.plan.recipe.num_rollout:
            log.info("num_rollout %d -> %d (from --num-rollout; passed on to resubmissions)",
                     self.plan.recipe.num_rollout, n)
            self.plan = self.plan.with_num_rollout(n)

    def _lead(self, recipe) -> int:
        """The recipe's lead, or one computed from what earlier segments measured (with a floor),
        never more than half the walltime (a lead that eats the segment leaves no progress)."""
        if recipe.lifecycle.lead_s is not None:
            return recipe.lifecycle.lead_s
        lead = compute_lead_s(recipe, ledger.measured_timings(self.history))
        return min(lead, self.plan.walltime_s // 2)

    def _cancelled(self) -> bool:
        """The cancel flag applies to jobs submitted before it; a later submission (the user
        resumed the run on purpose) clears it."""
        flag = Path(self.paths.cancel_flag)
        try:
            flagged_at = flag.stat().st_mtime
        except FileNotFoundError:
            return False
        info = self._job_info()
        if info is not None and info.submit_time is not None and info.submit_time > flagged_at + 1:
            log.info("cancel flag older than this submission: cleared (the run was resumed)")
            flag.unlink(missing_ok=True)
            return False
        return True

    def _job_info(self) -> JobInfo | None:
        if self.job_id is None:
            return None
        try:
            return self.query(self.job_id)
        except SlurmUnavailable as err:
            log.warning("%s", err)
            return None

    # -- the job ----------------------------------------------------------------------------------
    def _run_job(self) -> int:
        from beam_hpc.job import runner as runtime

        self.metrics_offset = metrics_offset(self.paths)
        lc = self.plan.recipe.lifecycle
        self.stall_watch = StallWatch(self.paths, self.metrics_offset, stall_timeout_s=lc.stall_timeout_s,
                                      startup_timeout_s=lc.startup_timeout_s,
                                      measured=ledger.measured_timings(self.history),
                                      rollouts_at_start=self.rollouts_at_start)
        refusal = self._backend_refuses()
        if refusal is not None:  # the backend itself would stop at its first line: no Ray, no retry
            return self._finish_now("error", refusal, retryable=False)
        try:
            if self.job_id is not None:
                ctx = runtime.JobContext.from_slurm(self.plan, self.env)
                loopback = self.plan.site.network.ip_source == "loopback"
                launcher = runtime.SrunLauncher(ctx, loopback=loopback)
            else:
                ctx, launcher = runtime.JobContext.local(self.plan), runtime.LocalLauncher()
        except runtime.JobError as err:
            return self._finish_now("error", str(err), retryable=False)
        with open(self.paths.segment(self.ledger_job_id, self.restart).driver_log, "ab") as driver_out:
            self.runner = runtime.JobRunner(self.plan, launcher, ctx, driver_stdout=driver_out)
            self._tick(self.runner)  # a signal during the checks above
            if self.interrupt is not None:
                self.runner.request_stop(self.interrupt.kind)
            outcome = runtime.run_job(self.runner, on_tick=self._tick)
        stacks.drop_empty(str(self.runner.segment_dir))  # files of processes that were never asked
        if self.finished:
            return self._exit_code()
        return self._finish_after(outcome.status, outcome.message, outcome.returncode, outcome.failed_nodes)

    def _backend_refuses(self) -> str | None:
        """The backend's own check of the exact driver command, before Ray starts on any node
        (beam_hpc.backends.prestart.check_before_start): seconds here instead of the whole
        allocation held through Ray bring-up until the driver stops. A check that cannot run is
        logged and the segment goes on: the driver then reports the problem itself."""
        from beam_hpc.backends.prestart import check_before_start

        t0 = time.monotonic()
        try:
            refusal = check_before_start(self.plan)
        except Exception as err:  # noqa: BLE001 - never let the checker block a run that may be fine
            log.warning("the backend's pre-start check could not run (%s: %s); starting anyway",
                        type(err).__name__, err)
            return None
        if refusal is None and self.plan.recipe.backend != "reference":
            log.info("backend check of the driver command: accepted (%.1f s)", time.monotonic() - t0)
        return refusal

    def _tick(self, runner) -> None:
        """Called by the runtime every poll while the driver runs."""
        intr = self.watchdog.check()
        if intr is not None:
            self._on_interrupt(intr)
        self._check_stall(runner)

    def _check_stall(self, runner) -> None:
        """The stall watchdog (beam_hpc.lifecycle.stall): when the backend has finished no rollout
        for the timeout, dump every Python process's stacks (beam_hpc.node.stacks), then stop the
        driver and Ray; the end line says ``stalled`` and the next segment resumes from the last
        checkpoint. Not while an interrupt is handled: that stops the segment anyway."""
        watch = self.stall_watch
        if (watch is None or runner is None or runner.driver is None or self.stall is not None
                or self.interrupt is not None or self.finished or self._finishing):
            return
        if watch.started_at is None:
            watch.start()
            return
        stall = watch.check()
        if stall is None:
            return
        self.stall = stall
        log.error("stalled: %s; dumping the stacks of the job's Python processes, then stopping it", stall.describe())
        try:
            dumps = runner.dump_stacks()
        except Exception as err:  # noqa: BLE001 - the stop matters more than the dumps
            log.exception("the stack dumps failed")
            dumps = {"dumps": [], "skipped": [], "suspects": [], "error": f"{type(err).__name__}: {err}"}
        self.stall_record = {**stall.to_record(), **dumps, "skipped": dumps.get("skipped", [])[:20]}
        runner.request_stop("stalled")

    def _on_signal(self, name: str) -> None:
        """From the signal handler: SIGTERM leaves KillWait seconds, so act here and now (the
        ledger line first), whatever phase the runtime is in; other signals wait for a tick,
        except during bring-up, when there is no rollout to save."""
        if self._finishing or self.finished:
            return
        if name in ("SIGTERM", "SIGINT") or self.runner is None or self.runner.driver is None:
            try:
                intr = self.watchdog.check()
                if intr is not None:
                    self._on_interrupt(intr)
            except Exception:  # never let a handler break the code it interrupted
                log.exception("handling %s failed", name)

    def _on_interrupt(self, intr: Interrupt | None) -> None:
        if intr is None or self.finished or self._finishing:
            return
        if intr.kind in ("walltime", "preempted") and not self.plan.recipe.lifecycle.save_on_request:
            log.warning("%s: lifecycle.save_on_request is false, so no save now: running on until Slurm stops "
                        "the job; the next segment resumes from the last periodic checkpoint", intr.kind)
            return
        self.interrupt = intr
        if (intr.kind in ("walltime", "preempted") and self.runner is not None and self.runner.driver is not None
                and self.stall is None):  # a stalled driver saves nothing: it is being stopped
            self._save_now(intr)
        if intr.kind in ("requeued", "cancelled", "timelimit"):
            # no time for a teardown first: record now, the runtime tears down afterwards
            self._finish(_INTERRUPT_REASON[intr.kind], intr.detail)
        if self.runner is not None:
            self.runner.request_stop(intr.kind)
            if self.save_result is not None and not self.finished:
                # the checkpoint is in (or will not come): stop the driver now, before it trains
                # rollouts that nobody will keep (the runtime's stop is idempotent)
                self.runner.stop()

    def _save_now(self, intr: Interrupt) -> None:
        lc = self.plan.recipe.lifecycle
        now = time.time()
        hard_end = intr.hard_end if intr.hard_end is not None else now + lc.save_timeout_s
        deadline = min(now + lc.save_timeout_s, hard_end - save.TEARDOWN_RESERVE_S)
        driver = self.runner.driver

        def more_urgent() -> bool:
            newer = self.watchdog.check()
            if newer is None:
                return self.finished
            if newer.kind in ("requeued", "cancelled", "timelimit"):
                self._on_interrupt(newer)  # records the end now; the save is abandoned
                return True
            self.interrupt = newer  # e.g. preempted during a walltime save: keep saving, requeue after
            return self.finished

        if deadline <= now:
            self.save_result = save.SaveResult(False, checkpoint_layout.latest_iteration(self.paths.checkpoints), 0.0,
                                               "no time left to save; relying on the last checkpoint")
            log.warning("%s", self.save_result.detail)
            return
        self.save_result = save.save_and_wait(
            self.paths, deadline=deadline, driver_running=lambda: driver.poll() is None,
            reason=intr.kind, interrupted=more_urgent)
        (log.info if self.save_result.saved else log.warning)("%s (%.1f s)", self.save_result.detail,
                                                              self.save_result.seconds)

    # -- after the job ----------------------------------------------------------------------------
    def _finish_after(self, status: str, message: str, returncode: int,
                      failed_nodes: list[dict[str, str]] | None = None) -> int:
        done = checkpoint_layout.rollouts_done(self.paths.checkpoints)
        num_rollout = self.plan.recipe.num_rollout
        if done >= num_rollout:
            return self._finish("completed", f"{done} of {num_rollout} rollouts done")
        if self.stall is not None and self.stall_record is not None:
            return self._finish("stalled", self._stall_detail(), stall=self.stall_record)
        if self.interrupt is not None:
            detail = self.interrupt.detail
            if self.save_result is not None:
                detail += f"; {self.save_result.detail}"
            return self._finish(_INTERRUPT_REASON[self.interrupt.kind], detail)
        if status == "completed":  # driver exited 0 short of num_rollout (e.g. stop_after_rollout)
            return self._finish("error", f"the driver exited normally with {done} of {num_rollout} rollouts done")
        return self._finish(_STATUS_REASON.get(status, "error"), f"{message} (exit {returncode})",
                            failed_nodes=failed_nodes)

    def _stall_detail(self) -> str:
        assert self.stall is not None and self.stall_record is not None
        rec = self.stall_record
        seg = self.paths.segment(self.ledger_job_id, self.restart)
        parts = [self.stall.describe(), f"{len(rec.get('dumps') or [])} stack dump(s) in {seg.stacks}"]
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

    def _finish_now(self, reason: str, detail: str, *, retryable: bool = False) -> int:
        """End a segment that never ran the job."""
        return self._finish(reason, detail, retryable=retryable)

    def _finish(self, reason: str, detail: str, *, retryable: bool = True,
                failed_nodes: list[dict[str, str]] | None = None, stall: dict | None = None) -> int:
        """Decide, act, and write the end line; once per segment. ``failed_nodes``: the nodes a
        node failure is blamed on (Slurm runs only), recorded and left out from now on."""
        if self.finished or self._finishing:
            return self._exit_code()
        self._finishing = True
        try:
            recipe = self.plan.recipe
            done = checkpoint_layout.rollouts_done(self.paths.checkpoints)
            metrics = segment_metrics(self.paths, self.metrics_offset)
            outcome = Outcome(reason=reason, rollouts_at_start=self.rollouts_at_start, rollouts_at_end=done,
                              num_rollout=recipe.num_rollout, rollouts_run=metrics.rollouts_run, retryable=retryable,
                              stall=stall)
            failed_nodes = list(failed_nodes or []) if reason == "node-failure" and self.job_id else []
            nodes_short = self._exclusions(failed_nodes)
            decision = decide(outcome, history=self.history, max_segments=recipe.lifecycle.max_segments,
                              cancelled=cancel.cancel_requested(self.paths),
                              requeue_on_preemption=recipe.lifecycle.requeue_on_preemption,
                              nodes_short=nodes_short)
            decision, next_job = self._act(decision)
            save_s = self.save_result.seconds if self.save_result and self.save_result.saved else metrics.save_s
            # Logged before the end line: whoever sees the end line (status, a test, the next
            # segment) then finds the segment's log complete.
            log.info("segment ended: %s (%s); rollouts %d -> %d of %d; next: %s %s", reason, detail,
                     self.rollouts_at_start, done, recipe.num_rollout, decision.action, next_job or "")
            if reason == "stalled" and decision.action == Action.NONE:
                log.error("the chain stops: %s", decision.detail)
            ledger.append(self.paths.ledger, ledger.end_record(
                job_id=self.ledger_job_id, restart=self.restart, rollouts_at_end=done, reason=reason,
                detail=f"{detail} -> {decision.detail}", next_action=decision.action, next_job_id=next_job,
                rollout_s=metrics.rollout_s, save_s=save_s, rollouts_run=metrics.rollouts_run,
                ready_s=None if self.runner is None or self.runner.ready_s is None else round(self.runner.ready_s, 3),
                last_save_at=self._last_save_at(), failed_nodes=failed_nodes, stall=stall))
            self.reason = reason
            self.finished = True
            return self._exit_code()
        finally:
            self._finishing = False

    def _exclusions(self, failed_nodes: list[dict[str, str]]) -> str | None:
        """The run's excluded nodes from now on (the ledger's and these), kept for :meth:`_act`;
        returns why the nodes left cannot hold the groups (None when they can, or Slurm cannot
        say). Slurm is asked only when some node is excluded."""
        if self.job_id is None:
            return None
        segment = ledger.segment_id(self.ledger_job_id, self.restart)
        self.excluded = exclusions.names(exclusions.effective(self.plan.output_dir, self.history, failed_nodes, segment=segment))
        quarantine.record_failures(self.plan.site, failed_nodes, run=self.plan.run_id, run_dir=self.plan.output_dir,
                                   segment=segment)  # the site's, across runs (no-op without one)
        self.excluded = quarantine.excluded_in_job(self.plan.site, self.excluded)
        if failed_nodes:
            log.warning("excluding node(s) %s from the run's next segments: %s",
                        ", ".join(f["node"] for f in failed_nodes), "; ".join(f["why"] for f in failed_nodes))
        return exclusions.plan_shortfall(self.plan.groups, self.excluded)

    def _last_save_at(self) -> float | None:
        """When this segment's last checkpoint was published (None if it published none)."""
        marker = Path(self.paths.checkpoints, checkpoint_layout.LATEST_FILE)
        try:
            at = marker.stat().st_mtime
        except OSError:
            return None
        return at if at >= self.started_at else None

    def _act(self, decision: Decision) -> tuple[Decision, str | None]:
        if decision.action == Action.RESUBMIT:
            script = Path(self.paths.script)
            if self.job_id is None:
                return Decision(Action.NONE, decision.detail + " (not in Slurm: nothing to resubmit)"), None
            if not script.is_file():
                return Decision(Action.NONE, f"{decision.detail}, but {script} is missing; resubmit by hand"), None
            has_ckpt = checkpoint_layout.latest_iteration(self.paths.checkpoints) is not None
            try:
                job = actions.resubmit(str(script), SegmentArgs(resume=has_ckpt, num_rollout=self.num_rollout_arg),
                                       lead_s=self.lead_s, dependency=f"afterany:{self.job_id}",
                                       output=self.paths.batch_log("%j"), exclude=self.excluded)
            except (RuntimeError, OSError) as err:
                log.error("%s", err)
                return Decision(Action.NONE, f"{decision.detail}, but the resubmission failed: {err}"), None
            if cancel.cancel_requested(self.paths):  # cancelled while we were submitting
                cancel.withdraw(job)
                return Decision(Action.NONE, f"the run was cancelled; withdrew the resubmitted job {job}"), None
            log.info("resubmitted as job %s (after this one, %s)", job, "--resume" if has_ckpt else "fresh")
            return decision, job
        if decision.action == Action.REQUEUE:
            if self.interrupt is not None and self.interrupt.kind == "preempted":
                self._requeue_self = True  # we end inside the grace time: Slurm would not requeue
            return decision, self.job_id
        return decision, None

    def _do_requeue_self(self) -> None:
        try:
            actions.requeue_self(self.job_id or "", exclude=self.excluded)
            log.info("requeued job %s", self.job_id)
        except (RuntimeError, OSError) as err:
            log.error("%s; Slurm requeues the job itself when the grace time ends", err)

    def _exit_code(self) -> int:
        if self.reason in ("completed", "walltime", "preempted", "cancelled"):
            return EXIT_OK
        return EXIT_ERROR


def _lines(script: str) -> list[str]:
    """A script's lines without blank ones: Slurm keeps a het job's script without its blank lines,
    so the copy a segment runs from differs from the file submitted in those alone."""
    return [line for line in script.splitlines() if line.strip()]


def _log_to(path: Path | None) -> logging.Handler | None:
    """Log to stderr (the batch log) and, once the segment owns the run, to its segment.log
    (returned, so that it can be removed again)."""
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    fmt = logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s")
    if not any(isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler) for h in root.handlers):
        sh = logging.StreamHandler(sys.stderr)
        sh.setFormatter(fmt)
        root.addHandler(sh)
    if path is None:
        return None
    fh = logging.FileHandler(path)
    fh.setFormatter(fmt)
    root.addHandler(fh)
    return fh


def plan_from_text(text: str, source: str) -> Plan:
    """The plan a rendered script carries (its here-document), or a bad-input error naming it."""
    import json

    try:
        return Plan.from_dict(json.loads(text))
    except InputError as err:
        raise InputError(f"{source}: {err}") from None
    except (ValueError, TypeError, KeyError) as err:
        raise InputError(f"{source}: the plan embedded in the script is damaged ({type(err).__name__}: {err}); "
                         "render the script again (beam-hpc render -o FILE)") from None


def run_segment(plan: str | Plan, args: SegmentArgs, *, script: str | None = None) -> int:
    """One segment of the run whose plan is ``plan`` (a plan.json path, or a script's embedded
    Plan); returns the segment's exit status. ``smoke``: bring the cluster up, run one task per GPU
    bundle of each group, write smoke.json, tear down (no lock, ledger or checkpoint is touched)."""
    name = plan if isinstance(plan, str) else plan.paths.plan
    try:
        if args.smoke:
            from beam_hpc.job import runner

            if not isinstance(plan, str):  # a rendered script's plan: the smoke job reads plan.json
                if Path(plan.paths.plan).exists():  # (no lock here: a live run's plan is left as it is)
                    load_plan(plan.paths.plan)
                else:
                    plan.write()
                Path(plan.paths.logs).mkdir(parents=True, exist_ok=True)
            return runner.run_plan(name, smoke=True)
        return Segment(plan, resume=args.resume, num_rollout=args.num_rollout, script=script).run()
    except InputError as err:  # no plan, a damaged plan, a bad --num-rollout
        _log_to(None)
        log.error("cannot run a segment of %s: %s", name, err)
        return EXIT_REFUSED


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m beam_hpc.job.segment", description=__doc__.splitlines()[0])
    parser.add_argument("--plan", required=True,
                        help="RUN_DIR/plan.json, or - for the plan's JSON on stdin (a rendered script's here-document)")
    parser.add_argument("--script", default=None,
                        help="the batch script this segment runs from (a rendered script passes \"$0\")")
    parser.add_argument("--resume", action="store_true", help="continue from the run's latest checkpoint")
    parser.add_argument("--smoke", action="store_true",
                        help="bring the cluster up, run one task per GPU bundle of each group, write "
                             "smoke.json, tear down (no lock, ledger or checkpoint is touched)")
    parser.add_argument("--num-rollout", type=int, default=None,
                        help="total rollouts, including those already done (the seed's semantics)")
    args = parser.parse_args(argv)
    try:
        seg_args = SegmentArgs(resume=args.resume, num_rollout=args.num_rollout, smoke=args.smoke)
        plan: str | Plan = args.plan
        if args.plan == "-":
            plan = plan_from_text(sys.stdin.read(), args.script or "the batch script")
    except InputError as err:
        _log_to(None)
        log.error("%s", err)
        return EXIT_REFUSED
    return run_segment(plan, seg_args, script=args.script)


if __name__ == "__main__":
    sys.exit(main())
