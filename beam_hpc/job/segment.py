"""``python -m beam_hpc.job.segment --plan RUN/plan.json|- [--script PATH] [--resume] [--num-rollout N]``: one segment.

The batch script execs into this, so this process is the batch shell: it receives the walltime
warning (``--signal=B:USR1@lead``) and Slurm's SIGTERM. A rendered script carries its plan (``--plan -``:
its here-document on stdin) and names itself (``--script "$0"``), so a plain ``sbatch x.sbatch`` needs
nothing else. In order: the checks before anything is written, the run lock, the run directory
(:mod:`beam_hpc.job.run_setup`); the start line and the checks that may refuse
(:mod:`beam_hpc.lifecycle.start`); the job (:mod:`beam_hpc.job.runner`) while interrupts and stalls
are acted on (:mod:`beam_hpc.lifecycle.stopping`); the end: decide, resubmit or requeue, the end line
(:mod:`beam_hpc.lifecycle.end`); the lock released (a job that requeues itself does so after that).

Exit status: 0 when the segment ended as planned (completed, walltime, preempted, cancelled), 1 on
a runtime failure (a lock another live segment holds included), 2 on bad input (a damaged plan, an
allocation that does not match the plan, a resume the run's checkpoints refuse), as the CLI maps them.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from beam_hpc.errors import InputError, RuntimeFailure
from beam_hpc.job import run_setup
from beam_hpc.job.context import JobStatus
from beam_hpc.lifecycle import end, exclusions, save, start
from beam_hpc.lifecycle.decide import Outcome
from beam_hpc.lifecycle.end import EXIT_ERROR, EXIT_REFUSED, Ending, SegmentFacts
from beam_hpc.lifecycle.segment_metrics import metrics_offset, segment_metrics
from beam_hpc.lifecycle.stall import StallWatch
from beam_hpc.lifecycle.stopping import Stopping
from beam_hpc.lifecycle.watchdog import InterruptKind, Watchdog
from beam_hpc.logging_setup import log_to_file, log_to_stream
from beam_hpc.node import stacks
from beam_hpc.plan.plan import Plan, load_plan
from beam_hpc.plan.segment_args import SegmentArgs
from beam_hpc.run import checkpoint_layout, ledger
from beam_hpc.run.ledger import Reason
from beam_hpc.run.lock import Holder, RunLockError, acquire, release
from beam_hpc.slurm import client as slurm_client
from beam_hpc.slurm.client import JobInfo, SlurmUnavailable, show_job
from beam_hpc.slurm.environment import SlurmEnvironment

log = logging.getLogger(__name__)

# The runtime's outcome statuses as ledger reasons, when no interrupt or stall explains them.
_STATUS_REASON = {JobStatus.NODE_FAILURE: Reason.NODE_FAILURE, JobStatus.NOT_READY: Reason.NODE_FAILURE,
                  JobStatus.DRIVER_FAILED: Reason.ERROR, JobStatus.ERROR: Reason.ERROR}


class Segment:
    """One segment of a run: lock, start, job, stops, end. ``query`` is how Slurm is asked about
    this job, its time limit included (tests hand in answers)."""

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
        self.stopping = Stopping(self.plan.recipe.lifecycle, self.paths, self.watchdog, finish=self._finish)
        self.runner = None  # beam_hpc.job.runner.JobRunner once started
        self.started_at = time.time()
        self.metrics_offset = 0.0
        # what the start found (beam_hpc.lifecycle.start); these stand in for a segment that never got there
        self.history: list[dict] = []
        self.rollouts_at_start = 0
        self.lead_s = self.plan.lead_s
        self.ending: Ending | None = None  # once the end line is written

    # -- entry ------------------------------------------------------------------------------------
    def run(self) -> int:
        self.watchdog.install()  # first: a signal may come at any moment
        log_to_stream()
        handler: logging.Handler | None = None
        try:
            try:
                run_setup.check_before_writing(self.plan, self.slurm, script=self.script,
                                               num_rollout=self.num_rollout_arg)
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
                run_setup.materialize(self.plan, script=self.script, job_id=self.job_id)
            except (OSError, RuntimeFailure) as err:
                release(self.paths.lock, self.me)
                log.error("cannot write the run directory %s: %s", self.plan.output_dir, err)
                return EXIT_ERROR
            seg = self.paths.segment(self.ledger_job_id, self.restart)
            Path(seg.root).mkdir(parents=True, exist_ok=True)
            handler = log_to_file(seg.segment_log)
            log.info("segment %s of run %s (%s) on %s", ledger.segment_id(self.ledger_job_id, self.restart),
                     self.plan.run_id, self.plan.output_dir, socket.gethostname())
            if previous is not None:
                log.warning("took over the run lock of %s", previous.describe())
            try:
                return self._run_locked()
            finally:
                if self.ending is not None:  # after the lock is released: a requeued job takes it again
                    end.after_release(self.ending, self.job_id)
        finally:
            self.watchdog.uninstall()
            if handler is not None:
                logging.getLogger().removeHandler(handler)
                handler.close()

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
        """The start line and the checks; an exit code when the segment must not run the job."""
        if self.num_rollout_arg is not None:
            self.plan = start.with_num_rollout(self.plan, self.num_rollout_arg)
        info = self._job_info()  # asked once: its time limit (the job's own, whatever the script's header said), SubmitTime
        begun = start.survey(self.plan, restart=self.restart, want_resume=self.want_resume,
                             time_limit_s=None if info is None else info.time_limit_s)
        self.history, self.rollouts_at_start, self.lead_s = begun.history, begun.rollouts_at_start, begun.lead_s
        self.watchdog.lead_s = self.lead_s
        self.watchdog.on_signal = self.stopping.on_signal
        if self.job_id is not None:  # KillWait, asked at the start while the controller answers (at the end it may not)
            self.stopping.kill_clock.kill_wait_s = slurm_client.kill_wait_s()
        self.watchdog.refresh()
        start.write_start_line(self.plan, begun, job_id=self.ledger_job_id, restart=self.restart,
                               host=socket.gethostname())
        refusal = start.check(self.plan, begun, segment=ledger.segment_id(self.ledger_job_id, self.restart),
                              restart=self.restart, job_info=info)
        if refusal is None:
            return None
        code = self._finish(refusal.reason, refusal.detail, retryable=False)
        return EXIT_REFUSED if refusal.bad_input else code

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
        from beam_hpc.job import launchers
        from beam_hpc.job import runner as runtime

        self.metrics_offset = metrics_offset(self.paths)
        lc = self.plan.recipe.lifecycle
        stall_watch = StallWatch(self.paths, self.metrics_offset, stall_timeout_s=lc.stall_timeout_s,
                                 startup_timeout_s=lc.startup_timeout_s,
                                 measured=ledger.measured_timings(self.history), rollouts_at_start=self.rollouts_at_start)
        refusal = run_setup.backend_refusal(self.plan)
        if refusal is not None:  # the backend itself would stop at its first line: no Ray, no retry
            return self._finish(Reason.ERROR, refusal, retryable=False)
        try:
            ctx, launcher = launchers.for_job(self.plan, env=self.env)
        except runtime.JobError as err:
            return self._finish(Reason.ERROR, str(err), retryable=False)
        with open(self.paths.segment(self.ledger_job_id, self.restart).driver_log, "ab") as driver_out:
            self.runner = runtime.JobRunner(self.plan, launcher, ctx, driver_stdout=driver_out)
            if self.job_id is not None:  # in Slurm: a lost rollout node's capacity comes back by itself
                self.runner.on_rollout_node_lost = self._replace_lost
            self.runner.save_before_node_failure = lambda failure: self.stopping.save_for_lost_node(str(failure))
            self.runner.count_stall_from = self.stopping.count_stall_from
            self.stopping.attach(self.runner, stall_watch)  # after a signal during the checks above
            outcome = runtime.run_job(self.runner, on_tick=self.stopping.tick)
        stacks.drop_empty(str(self.runner.segment_dir))  # files of processes that were never asked
        if self.ending is not None:
            return self.ending.exit_code
        reason, detail, stall = self._why_ended(outcome.status, outcome.message, outcome.returncode)
        return self._finish(reason, detail, failed_nodes=outcome.failed_nodes, lost_nodes=outcome.lost_nodes, stall=stall)

    def _replace_lost(self, lost: dict[str, str]) -> None:
        from beam_hpc.elastic.replace import replace_in_background

        replace_in_background(self.plan, lost, segment=ledger.segment_id(self.ledger_job_id, self.restart))

    def _why_ended(self, status: str, message: str, returncode: int) -> tuple[Reason, str, dict | None]:
        """The end line's reason and detail once the job is over: all rollouts done, else a stall,
        else the interrupt that stopped it, else how the runtime ended."""
        done = checkpoint_layout.rollouts_done(self.paths.checkpoints)
        total = self.plan.recipe.num_rollout
        caught, intr, saved = self.stopping.stall, self.stopping.interrupt, self.stopping.saved
        if done >= total:
            return Reason.COMPLETED, f"{done} of {total} rollouts done", None
        if caught is not None and caught.dumps is not None:
            return Reason.STALLED, caught.describe(self.paths.segment(self.ledger_job_id, self.restart).stacks), caught.record()
        after = f"; {saved.detail}" if saved is not None else ""  # what a save on request did
        if intr is not None:
            return intr.reason, intr.detail + after, None
        if status == JobStatus.COMPLETED:  # driver exited 0 short of num_rollout (e.g. stop_after_rollout)
            return Reason.ERROR, f"the driver exited normally with {done} of {total} rollouts done", None
        return _STATUS_REASON.get(status, Reason.ERROR), f"{message} (exit {returncode}){after}", None

    # -- the end ----------------------------------------------------------------------------------
    def _finish(self, reason: Reason, detail: str, *, retryable: bool = True,
                failed_nodes: list[dict[str, str]] | None = None, lost_nodes: list[dict[str, object]] | None = None,
                stall: dict | None = None) -> int:
        """Hand the outcome to the end of the segment (beam_hpc.lifecycle.end), once per segment."""
        if self.stopping.over:
            return self.exit_code
        with self.stopping.finishing():
            metrics = segment_metrics(self.paths, self.metrics_offset)
            outcome = Outcome(reason=Reason(reason), rollouts_at_start=self.rollouts_at_start,
                              rollouts_at_end=checkpoint_layout.rollouts_done(self.paths.checkpoints),
                              num_rollout=self.plan.recipe.num_rollout, rollouts_run=metrics.rollouts_run,
                              retryable=retryable, stall=stall)
            facts = SegmentFacts(self.plan, self.job_id, self.ledger_job_id, self.restart, self.started_at,
                                 self.history, self.lead_s, self.num_rollout_arg, self.stopping.kill_clock)
            intr = self.stopping.interrupt
            self.ending = end.end_segment(
                outcome, facts, detail=detail, metrics=metrics, failed_nodes=failed_nodes or [], lost_nodes=lost_nodes or [],
                slurm_failed=self._failed_in_slurm(outcome.reason), saved=self.stopping.saved,
                ready_s=None if self.runner is None else self.runner.ready_s,
                requeue_self=intr is not None and intr.kind == InterruptKind.PREEMPTED)
        return self.exit_code

    def _failed_in_slurm(self, reason: Reason) -> list[dict[str, str]]:
        """When Slurm stopped the job (a requeue, a preemption, a SIGTERM): the nodes of this
        allocation Slurm has DOWN, FAIL or NOT_RESPONDING. A node lost under a job that does not go
        on without it (a Miles run, a one-node group: beam_hpc.plan.node_loss) makes Slurm revoke and
        requeue the whole job, and this segment sees only the SIGTERM: Slurm alone can name the node.
        Asked here, in the SIGTERM's own handler when that ends the segment: the sooner, the likelier
        the node is still out (a node whose slurmd answers again may be back in service at once)."""
        intr = self.stopping.interrupt
        if self.job_id is None or not (reason == Reason.PREEMPTED or (intr is not None and intr.source == "SIGTERM")):
            return []
        return exclusions.failed_in_slurm([self.slurm.nodelist(i) for i in range(self.slurm.het_size)])

    @property
    def exit_code(self) -> int:
        return EXIT_ERROR if self.ending is None else self.ending.exit_code


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
        log_to_stream()
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
        log_to_stream()
        log.error("%s", err)
        return EXIT_REFUSED
    return run_segment(plan, seg_args, script=args.script)


if __name__ == "__main__":
    # run as beam_hpc.job.segment, not as __main__: its logger and classes then carry the module's name
    from beam_hpc.job.segment import main as _main

    sys.exit(_main())
