"""The job inside the allocation: node steps up, readiness, the driver, teardown.

:class:`JobRunner`, run in-process by the segment (:mod:`beam_hpc.job.segment`) on the first node
of het group 0, where the Ray head runs: it writes the segment's runtime.json and a fresh Ray token (0600),
starts one node step per group (:mod:`beam_hpc.node.step`, through a launcher of
:mod:`beam_hpc.job.launchers`: ``srun --het-group=i`` inside Slurm, local processes on loopback
addresses for ``beam-hpc execute``), waits for readiness (:mod:`beam_hpc.job.readiness`), runs the
driver with the job's Ray environment, failing fast on a dead node step throughout, and tears down:
driver, readiness, node steps (SIGTERM through Slurm, then kill), this job's stragglers on this host
by PID, then what the launcher says is the job's (for a cluster of its own, the Ray temp dirs and
the token); never ``ray stop`` or ``pkill``: other jobs may share the nodes. The launcher is the
one difference between a job inside Slurm, one on this machine and one on the site's own Ray
cluster; it is chosen once, by :func:`beam_hpc.job.launchers.for_job`. Lifecycle code (ledger,
lock, walltime, requeue) wraps it; :func:`run_job` returns a :class:`JobOutcome` and never raises
for job failures. :func:`run_plan` (``python -m beam_hpc.job.runner``) runs a job with no lifecycle
around it, as ``--smoke`` does.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

from beam_hpc.backends.miles.external_engines import attach as attach_engines
from beam_hpc.elastic import ray_replacement
from beam_hpc.elastic.replace import may_replace, on_node_lost
from beam_hpc.files import write_json_atomic
from beam_hpc.job.context import (  # noqa: F401 (re-exported: the runner's public names)
    STATUSES,
    JobContext,
    JobError,
    JobStatus,
    NodeStepFailed,
    NotReady,
    StopRequested,
    expand_nodelist,
)
from beam_hpc.job.launchers import Launcher, StepHandle, for_job, node_failure
from beam_hpc.job.readiness import EXIT_READY, never_joined
from beam_hpc.job.smoke import smoke_driver_argv
from beam_hpc.logging_setup import log_to_stream, module_logger
from beam_hpc.node import container, stacks
from beam_hpc.node.container import container_command
from beam_hpc.node.ray_node import ClusterRuntime, clean_env, driver_job_env, ray_env, set_parent_death_signal, sweep
from beam_hpc.plan.node_loss import NodeLossAction, on_node_loss, survives_node_loss
from beam_hpc.plan.paths import SegmentPaths
from beam_hpc.plan.plan import Plan, fill
from beam_hpc.slurm import client as slurm_client
from beam_hpc.slurm.client import slurm_env_free

log = module_logger(__name__)

DEFAULT_READY_TIMEOUT_S = 600.0
DEFAULT_STOP_GRACE_S = 20.0
POLL_S = 0.2
NODE_FAILURE_GRACE_S = 1.5  # after a driver failure, look this long for the dead node behind it
STACKS_WAIT_S = stacks.DUMP_TIMEOUT_S + 8.0  # node steps look for a dump request every 0.5 s, then dump in parallel
KILLED_WAIT_S = 10.0  # after SIGKILL: a process stuck in the kernel (state D) may never go; stop waiting



# -- the outcome ------------------------------------------------------------------------------------
@dataclass
class AwaitedReplacement:
    """A Miles run's lost rollout node, saved for, whose replacement the segment waits for."""

    order: ray_replacement.Order
    failure: NodeStepFailed  # what ends the segment if none joins by the deadline
    lost: dict[str, Any]  # its entry in the runner's lost_nodes
    deadline: float


@dataclass
class JobOutcome:
    """How the segment ended. Written to ``<segment dir>/outcome.json``; lifecycle code reads it."""

    status: JobStatus
    returncode: int
    message: str
    node: str | None = None
    log: str | None = None
    ready_s: float | None = None  # job start -> every node and GPU joined
    teardown_s: float | None = None
    segment_dir: str = ""
    failed_nodes: list[dict[str, str]] = field(default_factory=list)  # {"node", "why"}: to exclude next time
    lost_nodes: list[dict[str, Any]] = field(default_factory=list)  # rollout nodes lost while the segment went on

    def write(self) -> Path:
        path = SegmentPaths(self.segment_dir).outcome
        write_json_atomic(path, asdict(self))
        return path


# -- the runner -------------------------------------------------------------------------------------
class JobRunner:
    """One segment's Ray cluster and driver. Use :func:`run_job`, or the phases directly:

    ``start()`` (raises NodeStepFailed / NotReady / StopRequested), ``run_driver(on_tick)``
    (returns the driver's exit code; raises on node failure or stop), ``stop()`` (idempotent;
    returns the teardown seconds). ``request_stop(reason)`` is safe to call from a signal handler
    or from ``on_tick``; the running phase then raises StopRequested after stopping the driver.
    """

    def __init__(
        self,
        plan: Plan,
        launcher: Launcher,
        ctx: JobContext,
        *,
        driver_argv: Sequence[str] | None = None,
        ready_timeout_s: float = DEFAULT_READY_TIMEOUT_S,
        stop_grace_s: float = DEFAULT_STOP_GRACE_S,
        driver_stdout: IO[bytes] | None = None,
        t0: float | None = None,
    ) -> None:
        self.plan, self.launcher, self.ctx = plan, launcher, ctx
        self.site = plan.site
        self.driver_template = list(driver_argv if driver_argv is not None else plan.driver_argv)
        self.ready_timeout_s, self.stop_grace_s = ready_timeout_s, stop_grace_s
        self.driver_stdout = driver_stdout
        self.t0 = time.time() if t0 is None else t0
        self.seg = plan.paths.segment(ctx.job_id, ctx.restart)
        self.segment_dir = Path(self.seg.root)
        self.rt: ClusterRuntime | None = None
        self.steps: list[StepHandle] = []
        self.readiness: subprocess.Popen | None = None
        self.driver: subprocess.Popen | None = None
        self.ready: dict | None = None
        self.ready_s: float | None = None
        self.stop_reason: str | None = None
        self._torn_down: float | None = None
        self.lost_nodes: list[dict[str, Any]] = []  # rollout nodes lost mid-run, the segment going on
        # called with each such node ({"node", "why"}): the segment asks for its replacement
        self.on_rollout_node_lost: Callable[[dict[str, str]], object] | None = None
        # called with a lost node that ends the segment once the rollout in flight is saved (a Miles
        # run's rollout node, beam_hpc.plan.node_loss): the segment's save on request, which returns
        # once the checkpoint is in or will not come
        self.save_before_node_failure: Callable[[NodeStepFailed], bool] | None = None
        # called with the time from which the stall watch counts (beam_hpc.lifecycle.stall): while a
        # Miles run waits for a lost node's replacement, and again once the replacement has joined
        self.count_stall_from: Callable[[float], object] | None = None
        self.awaited: AwaitedReplacement | None = None  # a Miles run's replacement, not joined yet
        self.replacements_asked = 0  # Miles replacements this segment asked for (each takes a place of its own)

    # -- shared ------------------------------------------------------------------------------
    @property
    def job_tag(self) -> str:
        return f"{self.plan.run_id}.{self.ctx.job_id}.{self.ctx.restart}"

    def request_stop(self, reason: str) -> None:
        self.stop_reason = self.stop_reason or reason

    def _container_python(self) -> str:
        return self.plan.node_python

    def _ray_process(self, argv: list[str]) -> tuple[list[str], dict[str, str]]:
        """argv + env of a process that talks to the job's Ray (readiness, driver)."""
        assert self.rt is not None
        env = ray_env(token_path=self.rt.token_path, job_tag=self.job_tag)
        # driver_env holds plan placeholders ({ray_address}, ...) like the driver's argv: fill them.
        env.update({k: fill(v, **self._placeholder_values()) for k, v in self.plan.driver_env.items()})
        env.update(BEAM_RAY_ADDRESS=self.rt.address, BEAM_JOB_ID=self.ctx.job_id, BEAM_RUN_DIR=self.plan.output_dir)
        env.update(driver_job_env(self.ctx.segment, self.ctx.job_num))  # its segment id and port slot
        env[stacks.SEGMENT_DIR_VAR] = str(self.segment_dir)  # also where its stacks go (beam_hpc.node.stacks)
        binds = [self.plan.output_dir, *self.launcher.binds(self.rt)]
        if self.plan.nvme.enabled:
            binds.append(self.plan.nvme.root)
        cmd = container_command(self.site, argv, env, binds, base=clean_env(os.environ))
        return cmd.argv, cmd.env

    # -- phases ------------------------------------------------------------------------------
    def prepare(self) -> ClusterRuntime:
        """Token, runtime.json and segment directory; no process started yet."""
        ctx = self.ctx
        self.segment_dir.mkdir(parents=True, exist_ok=True)
        head = self.launcher.head(self.plan, ctx)
        self.rt = ClusterRuntime(
            job_id=ctx.job_id, job_num=ctx.job_num, restart=ctx.restart, job_tag=self.job_tag,
            head_ip=head.head_ip, gcs_port=head.gcs_port, host_stride=head.host_stride,
            token_path=str(head.token_path), segment_dir=str(self.segment_dir),
            nonce=secrets.token_hex(8), deadline=time.time() + self.ready_timeout_s,
            nodelists=ctx.nodelists, existing=head.existing,
        )
        shutil.rmtree(self.rt.node_dir, ignore_errors=True)  # reports of an earlier try
        self.rt.write()
        return self.rt

    def start(self) -> dict:
        """Launch every group's node steps and the readiness poller; return ready.json's report."""
        rt = self.rt or self.prepare()
        step_argv = [container.node_step_python(self.site), "-m", "beam_hpc.node.step", "--plan",
                     self.plan.paths.plan, "--runtime", str(rt.path), "--nonce", rt.nonce]
        self.steps = self.launcher.start_nodes(self.plan, rt, step_argv, dict(os.environ, PYTHONUNBUFFERED="1"))
        ready_json = self.seg.ready
        argv, env = self._ray_process([self._container_python(), "-m", "beam_hpc.job.readiness",
                                       "--plan", self.plan.paths.plan, "--runtime", str(rt.path),
                                       "--output", str(ready_json)])
        with open(self.seg.readiness_log, "ab") as fh:
            self.readiness = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=fh,
                                              stderr=subprocess.STDOUT, preexec_fn=set_parent_death_signal)
        while True:
            self.check()
            rc = self.readiness.poll()
            if rc is not None:
                report = _read_json(ready_json)
                if rc == EXIT_READY and report.get("ready"):
                    self.ready, self.ready_s = report, time.time() - self.t0
                    report["ready_s"] = round(self.ready_s, 3)
                    write_json_atomic(ready_json, report)
                    log.info("Ray ready after %.1f s: %s", self.ready_s, report.get("summary"))
                    return report
                self.check()  # a node step that died explains it better
                message = (report.get("summary") or
                           f"readiness check failed (exit {rc}); see {self.seg.readiness_log}")
                raise NotReady(message, failed_nodes=never_joined(self.plan, rt, report, message) if self.steps else [])
            if time.time() > rt.deadline + 60:
                raise NotReady(f"readiness check did not finish by its deadline; see {self.seg.readiness_log}")
            time.sleep(POLL_S)

    def check(self) -> None:
        """Raise StopRequested when asked to stop, NodeStepFailed as soon as a node step ended."""
        if self.stop_reason:
            raise StopRequested(f"stop requested ({self.stop_reason})")
        for h in list(self.steps):
            if h.proc.poll() is not None:
                failure = node_failure(self.launcher, self.rt, h)
                if not self._goes_on_without(h, failure):
                    if not (self._save_before_ending(h, failure) and self._waits_for_replacement(h, failure)):
                        self._cancel_replacement()  # a second node lost while one was awaited
                        raise failure
        if self.awaited is not None:
            self._check_replacement(self.awaited)

    def _goes_on_without(self, h: StepHandle, failure: NodeStepFailed) -> bool:
        """A node step that ended is a lost rollout node the segment goes on without when the
        driver runs, its group survives a node's loss (launchers.survives_node_loss: the driver
        serves the lost worker's units with the others) and another node of the group still runs.
        The node is recorded (``lost_nodes``: the end line's failed nodes, so later segments and
        the site's quarantine leave it out) and its step forgotten. A trainer node, a colocated
        group, the last rollout node, or a loss before the driver started end the segment."""
        if self.driver is None or self.stop_reason or h.local_index is None:
            return False
        others_up = sum(1 for o in self.steps if o is not h and o.group.name == h.group.name and o.proc.poll() is None)
        if not on_node_lost(survives=survives_node_loss(self.plan, h.group), others_up=others_up,
                            replacements=0, cap=0).goes_on:
            return False
        self.steps.remove(h)
        log.warning("%s: a rollout node; the segment goes on with the rollout nodes left", failure)
        for f in failure.failed_nodes:
            # lost_at: when the segment saw it (status charges the node's GPUs from then, observe/node_losses)
            lost = {"node": f["node"], "why": f"rollout node lost mid-segment (it went on): {f['why']}",
                    "lost_at": round(time.time(), 3)}
            self.lost_nodes.append(lost)
            if self.on_rollout_node_lost is not None:
                try:
                    self.on_rollout_node_lost(lost)
                except Exception:  # noqa: BLE001 - a replacement is a bonus: the segment goes on regardless
                    log.exception("asking for a replacement of %s failed", lost["node"])
        return True

    def _save_before_ending(self, h: StepHandle, failure: NodeStepFailed) -> bool:
        """A lost node whose group saves before the segment ends (a Miles run's rollout node, while
        a whole engine is left: :class:`~beam_hpc.plan.node_loss.NodeLossAction`): while the driver
        runs, the segment asks it to save at its next rollout boundary and waits for the checkpoint,
        so that the next segment, without the node, loses at most the rollout in flight. The wait
        ends early when the driver exits or a signal ends the segment. True when the checkpoint is
        in (the segment may then wait for a replacement); the failure ends the segment otherwise."""
        hook = self.save_before_node_failure
        if (hook is None or self.driver is None or self.driver.poll() is not None or self.stop_reason
                or h.local_index is None or on_node_loss(self.plan, h.group) is not NodeLossAction.SAVE_FIRST):
            return False
        if self.awaited is not None:  # Miles waits in its weight update for the first node's engine: no save comes
            return False
        log.warning("%s: a rollout node of a run that cannot train on without it; saving first", failure)
        try:
            return bool(hook(failure))
        except Exception:  # noqa: BLE001 - the save is a bonus: the node failure ends the segment regardless
            log.exception("the save for the lost node failed")
            return False

    def _waits_for_replacement(self, h: StepHandle, failure: NodeStepFailed) -> bool:
        """After the save: ask for a node to take the lost one's place in this segment's Ray cluster
        (beam_hpc.elastic.ray_replacement) and go on while it comes, for at most
        ``lifecycle.replacement_wait_s``. Miles waits meanwhile in its next weight update, for the
        restart of the lost engine on its placement-group bundle, which Ray places on the
        replacement once it joins; the stall watch is held until the wait is over. False (the
        segment ends as the node failure) with no replacement to ask for: the driver ended or a
        stop came during the save, no way to submit (not in Slurm), ``replacement_wait_s: 0``, or
        ``lifecycle.max_replacements`` reached."""
        lc = self.plan.recipe.lifecycle
        if (self.on_rollout_node_lost is None or self.rt is None or h.local_index is None or lc.replacement_wait_s <= 0
                or self.stop_reason or self.driver is None or self.driver.poll() is not None):
            return False
        if not may_replace(self.plan):
            log.warning("%s: no replacement, the run has asked for lifecycle.max_replacements=%d already; the "
                        "segment ends", failure, lc.max_replacements)
            return False
        node = failure.failed_nodes[0]["node"] if failure.failed_nodes else self.rt.node_name(h.group.name, h.local_index)
        now = time.time()
        order = ray_replacement.Order(node=node, group=h.group.name, local_index=h.local_index,
                                      index=ray_replacement.replacement_index(self.plan, self.replacements_asked),
                                      runtime=str(self.rt.path), nonce=self.rt.nonce,
                                      segment=self.ctx.segment, asked_at=now)
        self.replacements_asked += 1
        ray_replacement.write_order(self.plan.output_dir, order)
        self.steps.remove(h)
        lost = {"node": node, "why": f"rollout node lost mid-segment (saved; a replacement asked for): {failure}",
                "lost_at": round(now, 3)}
        self.lost_nodes.append(lost)
        self.awaited = AwaitedReplacement(order=order, failure=failure, lost=lost, deadline=now + lc.replacement_wait_s)
        if self.count_stall_from is not None:
            self.count_stall_from(self.awaited.deadline)
        log.warning("%s: saved; the segment waits up to %d s (lifecycle.replacement_wait_s) for a node to take its "
                    "place in the Ray cluster", failure, lc.replacement_wait_s)
        try:
            self.on_rollout_node_lost(lost)
        except Exception:  # noqa: BLE001 - then nothing joins, and the wait's end ends the segment
            log.exception("asking for a replacement of %s failed", node)
        return True

    def _check_replacement(self, awaited: AwaitedReplacement) -> None:
        """The replacement has joined (the segment trains on, the stall watch counts from now), or
        the wait is over: the replacement asked for is cancelled and the lost node ends the segment."""
        report = ray_replacement.joined(awaited.order)
        if report is not None:
            self.awaited = None
            awaited.lost.update(replaced_by=str(report.get("slurm_job_id")), replaced_on=str(report.get("hostname")))
            log.warning("rollout node %s replaced: job %s's node %s joined the Ray cluster in its place after %.0f s; "
                        "the segment trains on", awaited.order.node, report.get("slurm_job_id"), report.get("hostname"),
                        time.time() - awaited.order.asked_at)
            if self.count_stall_from is not None:
                self.count_stall_from(time.time())
            return
        if time.time() <= awaited.deadline:
            return
        self._end_wait(awaited, f"no replacement joined within lifecycle.replacement_wait_s="
                                f"{self.plan.recipe.lifecycle.replacement_wait_s}")

    def _cancel_replacement(self) -> None:
        """The segment ends while a replacement is awaited: cancel it (pending or starting; one that
        runs would leave by itself once it reads the segment's end line). The lost node stays
        recorded (``lost_nodes``)."""
        from beam_hpc.elastic.replace import asked_for

        awaited, self.awaited = self.awaited, None
        if awaited is None or not self.ctx.in_slurm:
            return
        jobs = asked_for(self.plan, awaited.order.node, awaited.order.segment)
        if jobs:
            log.info("cancelling replacement job(s) %s of %s: the segment ends", ", ".join(jobs), awaited.order.node)
            try:
                slurm_client.cancel(jobs, env=slurm_env_free(), timeout=30)
            except slurm_client.SlurmError as err:
                log.warning("could not cancel replacement job(s) %s: %s", ", ".join(jobs), err)

    def _end_wait(self, awaited: AwaitedReplacement, why: str) -> None:
        """End the segment as the lost node's failure (it saved first), the replacement cancelled."""
        self._cancel_replacement()
        self.lost_nodes.remove(awaited.lost)  # the failure names it: the end line's failed node
        raise NodeStepFailed(f"{awaited.failure} ({why})", node=awaited.order.node, log_path=awaited.failure.log_path,
                             failed_nodes=awaited.failure.failed_nodes)

    def _placeholder_values(self) -> dict[str, str]:
        """What the plan's placeholders stand for in this job (see plan.PLACEHOLDERS)."""
        assert self.rt is not None
        return dict(ray_address=self.rt.address, head_ip=self.rt.head_ip, job_id=self.ctx.job_id,
                    run_dir=self.plan.output_dir, nvme_dir=fill(self.plan.nvme.job_dir, job_id=self.ctx.job_id),
                    # the total this segment runs to: the plan's, or the segment's --num-rollout
                    # (the segment hands the runner a plan with it applied; plan.json keeps its own)
                    num_rollout=str(self.plan.recipe.num_rollout))

    def driver_argv(self) -> list[str]:
        values = self._placeholder_values()
        return [fill(a, **values) for a in self.driver_template]

    def run_driver(self, on_tick: Callable[[JobRunner], None] | None = None) -> int:
        """Run the driver to its end; fail fast if a node step dies or a stop is requested."""
        # a Miles run gets the engines its extra rollout jobs registered (backends.miles.external_engines)
        argv, env = self._ray_process(attach_engines(self.plan, self.driver_argv()))
        log.info("driver: %s", " ".join(argv))
        self._record_driver(argv, env)
        self.driver = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=self.driver_stdout,
                                       start_new_session=True, preexec_fn=set_parent_death_signal)
        while True:
            rc = self.driver.poll()
            if rc is not None:
                if rc != 0:  # a dead node often kills the driver first: name the node instead
                    deadline = time.monotonic() + NODE_FAILURE_GRACE_S
                    while time.monotonic() < deadline:
                        self.check()
                        time.sleep(POLL_S)
                    if self.awaited is not None:  # Miles's restart of the lost engine failed: the loss explains it
                        self._end_wait(self.awaited, f"the driver exited {rc} while the replacement was awaited")
                    self._raise_if_slurm_took_a_node()
                return rc
            self.check()
            if on_tick is not None:
                on_tick(self)
            time.sleep(POLL_S)

    def _raise_if_slurm_took_a_node(self) -> None:
        """After a driver failure that no node step's end explained: a node Slurm took from the job
        (``--no-kill``: the steps on it end seconds later under load) is the failure's cause, and
        the segment ends as that node failure (beam_hpc.lifecycle.exclusions.taken_from_job).
        Rollout nodes the segment already went on without are not counted again."""
        if not self.ctx.in_slurm:
            return
        from beam_hpc.lifecycle.exclusions import taken_from_job

        known = {f["node"] for f in self.lost_nodes}
        taken = [f for f in taken_from_job(self.ctx.job_id, self.ctx.component_ids, self.ctx.nodelists)
                 if f["node"] not in known]
        if taken:
            names = ", ".join(f["node"] for f in taken)
            raise NodeStepFailed(f"the driver failed and Slurm had taken node(s) {names} from the job",
                                 node=taken[0]["node"], log_path="", failed_nodes=taken)

    def _record_driver(self, argv: list[str], env: dict[str, str]) -> None:
        """``driver.json`` in the segment directory: the command the driver ran with, the total it
        runs to, and the site's variables as the driver got them (its ``env`` section, and
        ``LOADEDMODULES``, which Lmod and Environment Modules keep). Whether a site's settings reached
        the job is then a file to read, whichever way the job was launched."""
        record = {"argv": argv, "num_rollout": self.plan.recipe.num_rollout,
                  "site_env": {k: env.get(k) for k in sorted(self.site.env)},
                  "loaded_modules": env.get("LOADEDMODULES")}
        write_json_atomic(self.seg.driver_record, record)

    def dump_stacks(self, wait_s: float = STACKS_WAIT_S, dump_timeout_s: float = stacks.DUMP_TIMEOUT_S) -> dict[str, Any]:
        """Every Python process of the job dumps its stacks into ``stacks/`` (beam_hpc.node.stacks):
        the driver's process tree here, each node's processes by its node step, all at once. Returns
        the record the ledger keeps: the dump files, the processes that did not answer in time and
        the nodes they ran on (``suspects``), node steps that did not answer, and how many
        processes could not be asked (no py-spy, no registered signal)."""
        seg = str(self.segment_dir)
        t0 = time.monotonic()
        rid = stacks.request(seg) if self.steps and self.rt is not None else None
        records: list[dict[str, Any]] = []
        node_of: dict[int, str] = {}  # index in records -> the Slurm node it ran on
        head = self.rt.node_name(self.plan.groups[0].name, 0) if self.rt is not None else stacks.host_name()
        if self.driver is not None and self.driver.poll() is None:
            records += stacks.dump_all(stacks.process_tree(self.driver.pid), seg, timeout_s=dump_timeout_s)
            node_of.update({i: head for i in range(len(records))})
        silent: list[str] = []
        if rid is not None and self.rt is not None:
            want = [(g.name, i) for g in self.plan.groups for i in range(g.nodes)]
            got: dict[tuple[str, int], list[dict[str, Any]]] = {}
            deadline = t0 + wait_s
            while True:
                for key in want:
                    if key not in got:
                        answer = stacks.read_answer(seg, rid, *key)
                        if answer is not None:
                            got[key] = answer
                if len(got) == len(want) or time.monotonic() > deadline:
                    break
                time.sleep(POLL_S)
            for key in want:
                name = self.rt.node_name(*key)
                if key not in got:
                    silent.append(name)
                    continue
                for r in got[key]:
                    node_of[len(records)] = name
                    records.append(r)
        late = [i for i, r in enumerate(records) if r.get("skipped") and not r.get("unregistered")]
        suspects = sorted({node_of.get(i, records[i].get("host", "?")) for i in late} | set(silent))
        out = {
            "dumps": [r["file"] for r in records if r.get("file")],
            "skipped": [{"node": node_of.get(i, records[i].get("host")), "pid": records[i]["pid"],
                         "name": records[i].get("name"), "why": records[i]["skipped"]} for i in late],
            "not_dumpable": sum(1 for r in records if r.get("unregistered")),
            "silent_nodes": silent,
            "suspects": suspects,
            "seconds": round(time.monotonic() - t0, 3),
        }
        write_json_atomic(self.seg.stacks_index, {"request": rid, **out, "records": records})
        log.info("stack dumps: %d files in %s (%.1f s)%s%s", len(out["dumps"]), self.seg.stacks, out["seconds"],
                 f"; {len(out['skipped'])} processes did not answer in time" if out["skipped"] else "",
                 f"; node steps that did not answer: {', '.join(silent)}" if silent else "")
        return out

    def stop(self) -> float:
        """Stop everything of this segment; returns the seconds it took (0 when already done)."""
        if self._torn_down is not None:
            return 0.0
        t = time.monotonic()
        self._cancel_replacement()
        _stop_group(self.driver, min(self.stop_grace_s, 10.0))
        if self.readiness is not None and self.readiness.poll() is None:
            self.readiness.kill()
            self.readiness.wait()
        rt = self.rt
        if rt is not None:
            self.launcher.ask_to_stop(self.steps, rt)
            _wait_all([h.proc for h in self.steps], self.stop_grace_s)
            if any(h.proc.poll() is None for h in self.steps):
                log.warning("node steps still running %.0f s after SIGTERM: killing them", self.stop_grace_s)
                self.launcher.force_stop(self.steps)
                _wait_all([h.proc for h in self.steps], 10.0)
                for h in self.steps:
                    if h.proc.poll() is None:
                        h.proc.kill()
                        h.proc.wait()
            left = sweep(self.job_tag, grace_s=2.0)  # only this job's tag: never the site's cluster
            if left:
                log.info("stopped %d leftover processes of this job by PID: %s", len(left), left)
            self.launcher.clean_up(rt)
        self._torn_down = time.monotonic() - t
        log.info("teardown took %.1f s", self._torn_down)
        return self._torn_down


def _stop_group(proc: subprocess.Popen | None, grace_s: float) -> None:
    """SIGTERM a process and its session (the driver's own children), then SIGKILL."""
    if proc is None or proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        try:
            proc.wait(timeout=KILLED_WAIT_S)
        except subprocess.TimeoutExpired:  # stuck in the kernel (e.g. a dead filesystem): it goes when it can
            log.error("pid %d did not end %.0f s after SIGKILL (state %s); going on without it", proc.pid,
                      KILLED_WAIT_S, stacks.process_state(proc.pid))


def _wait_all(procs: list[subprocess.Popen], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.1)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


# -- entry points -------------------------------------------------------------------------------------
def run_job(runner: JobRunner, on_tick: Callable[[JobRunner], None] | None = None) -> JobOutcome:
    """All phases, teardown always; job failures come back as the outcome, never raised."""
    try:
        runner.start()
        rc = runner.run_driver(on_tick)
        status = JobStatus.COMPLETED if rc == 0 else JobStatus.DRIVER_FAILED
        outcome = JobOutcome(status, rc, f"driver exited with code {rc}")
    except JobError as err:
        outcome = JobOutcome(err.status, 1, str(err), node=err.node, log=err.log_path,
                             failed_nodes=err.failed_nodes)
    except KeyboardInterrupt:
        outcome = JobOutcome(JobStatus.STOPPED, 130, "interrupted")
    except Exception as err:  # noqa: BLE001 - teardown must still run; the outcome says what broke
        log.exception("job failed")
        outcome = JobOutcome(JobStatus.ERROR, 1, f"{type(err).__name__}: {err}")
    finally:
        teardown_s = runner.stop()
    outcome.lost_nodes = list(runner.lost_nodes)
    outcome.ready_s = None if runner.ready_s is None else round(runner.ready_s, 3)
    outcome.teardown_s = round(teardown_s, 3)
    outcome.segment_dir = str(runner.segment_dir)
    outcome.write()
    (log.info if outcome.status == JobStatus.COMPLETED else log.error)("job %s: %s", outcome.status, outcome.message)
    return outcome


def run_local(plan: Plan, *, driver_argv: Sequence[str] | None = None,
              ready_timeout_s: float = DEFAULT_READY_TIMEOUT_S,
              on_tick: Callable[[JobRunner], None] | None = None) -> JobOutcome:
    """The job of ``plan`` with no Slurm and no lifecycle: node steps are subprocesses of this
    machine, or the site's own Ray cluster where the site names one (tests and benchmarks;
    ``beam-hpc execute`` runs a whole segment, beam_hpc.job.segment, through the same choice).
    Ctrl-C stops it cleanly."""
    if not Path(plan.paths.plan).exists():  # a Plan made in this process (tests, benchmarks): the
        plan.write()                          # node steps read it from the run directory, like a job
    ctx, launcher = for_job(plan, srun=False)
    runner = JobRunner(plan, launcher, ctx, driver_argv=driver_argv, ready_timeout_s=ready_timeout_s)
    return run_job(runner, on_tick)


def install_signal_handlers(runner: JobRunner, signals: Sequence[int] = (
        signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)) -> None:
    """Default: any of these stops the segment cleanly (lifecycle code replaces USR1/USR2)."""
    def handler(signum: int, _frame: object) -> None:
        runner.request_stop(signal.Signals(signum).name)

    for s in signals:
        signal.signal(s, handler)


def _process_start_time() -> float:
    """When this process started (the batch script execs into it): bring-up is timed from here."""
    from beam_hpc.node import procs

    return procs.start_time() or time.time()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m beam_hpc.job.runner", description=__doc__.splitlines()[0])
    parser.add_argument("--plan", required=True, help="RUN_DIR/plan.json")
    parser.add_argument("--smoke", action="store_true", help="driver: place one task per GPU bundle, write smoke.json")
    parser.add_argument("--launcher", choices=["auto", "srun", "local"], default="auto",
                        help="how node steps start (auto: srun inside Slurm, else local)")
    parser.add_argument("--ready-timeout", type=float, default=DEFAULT_READY_TIMEOUT_S,
                        help="seconds for every node and GPU to join (default %(default)s)")
    parser.add_argument("--stop-grace", type=float, default=DEFAULT_STOP_GRACE_S,
                        help="seconds node steps get to stop before they are killed")
    args = parser.parse_args(argv)
    return run_plan(args.plan, smoke=args.smoke, launcher=args.launcher, ready_timeout_s=args.ready_timeout,
                    stop_grace_s=args.stop_grace)


def run_plan(plan_path: str, *, smoke: bool = False, launcher: str = "auto",
             ready_timeout_s: float = DEFAULT_READY_TIMEOUT_S, stop_grace_s: float = DEFAULT_STOP_GRACE_S) -> int:
    """The job of ``plan_path`` on its own (no lock, ledger or lifecycle: what ``--smoke`` runs);
    returns its exit status. Node steps start through srun inside Slurm, else locally."""
    log_to_stream()
    t0 = _process_start_time()
    plan = Plan.load(plan_path)
    try:
        ctx, starter = for_job(plan, srun={"srun": True, "local": False}.get(launcher))
    except JobError as err:  # the allocation does not fit the plan: a runtime failure (exit 1)
        log.error("%s", err)
        return 1
    runner = JobRunner(plan, starter, ctx, driver_argv=smoke_driver_argv(plan) if smoke else None,
                       ready_timeout_s=ready_timeout_s, stop_grace_s=stop_grace_s, t0=t0)
    install_signal_handlers(runner)
    return run_job(runner).returncode


if __name__ == "__main__":
    sys.exit(main())
