"""What an extra rollout job runs: on its batch host, one srun of a node program per node; on each node,
the run's worker (or, for a Miles run, the node's SGLang engines) until Slurm or the user takes it back.
A Miles run's replacement of a lost rollout node (``--replaces NODE``) runs the segment's own node
step in the lost node's place instead, so that its Ray node joins the segment's cluster
(:mod:`beam_hpc.elastic.ray_replacement`); it leaves when that segment ends.

The node program (``--node``) waits for the run (no rendezvous yet is fine: the job may start before
the run's segment or outlive it), serves through :func:`beam_hpc.backends.reference.rollouts.outside_worker.serve` across the
run's segments, and appends the worker's events, with its node, to ``elastic/jobs/<job>.jsonl``. A
stop is a signal: ``USR1`` (the walltime lead, or a preemption's grace: Slurm's own job record says
which), ``TERM`` (a preemption's or the time limit's end, a plain ``scancel``), ``USR2``/``INT``
(``rollout remove``). A node also leaves by itself once the run is over (``run-ended``): its ledger
says the chain stopped and Slurm holds no job of the run (:class:`RunEndWatch`), so that capacity
added to a run does not sit idle until its own time limit. The worker then deregisters and gives its
units in flight back before this program removes its node-local directory and any process it left,
and writes ``left`` with the reason.

The batch side waits for every node, records each node that ended without leaving cleanly in the
site's quarantine (:mod:`beam_hpc.lifecycle.quarantine`, as a segment does), writes the job's own
``left`` and, after a preemption, requeues the job (which then ended by itself, so Slurm would not).
The run's segment never sees any of this: its end reads only its own job's nodes.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

from beam_hpc import fault_hooks
from beam_hpc.elastic import registry
from beam_hpc.logging_setup import log_to_stream, module_logger
from beam_hpc.node.signals import STOP_SIGNALS, Stopper
from beam_hpc.plan.plan import Plan
from beam_hpc.run import ledger
from beam_hpc.slurm.environment import SlurmEnvironment

log = module_logger(__name__)  # also run as python -m

LOCAL_DIR_VAR = "BEAM_ELASTIC_LOCAL_DIR"  # the node-local directory the worker may copy into
SWEEP_GRACE_S = 2.0
LIMIT_SLACK_S = 30.0  # a SIGTERM this close to the time limit is the limit's
RUN_END_POLL_S = 5.0  # how often a node reads the run's ledger for the end of its chain
QUEUE_ASK_S = 30.0  # at most this often, once the ledger says so, it asks Slurm for a job of the run
RUN_ENDED = registry.LeftReason.RUN_ENDED  # a node's and the job's ``left`` reason when the run is over
STEP_STOP_S = 15.0  # SIGTERM to SIGKILL for a replacement's node step (it stops its Ray in 3 s and sweeps)
Reason = registry.LeftReason


def classify(sig: int, info: Any, *, now: float | None = None) -> Reason:
    """Why this signal stops the job: removed, preempted or walltime. ``info``: the job's
    :class:`beam_hpc.slurm.client.JobInfo` (None when Slurm could not say)."""
    at = time.time() if now is None else now
    if sig in (signal.SIGUSR2, signal.SIGINT):
        return Reason.REMOVED
    preempted = info is not None and info.preempt_time is not None and (
        info.submit_time is None or info.preempt_time >= info.submit_time)
    if preempted:
        return Reason.PREEMPTED
    if sig == signal.SIGUSR1:
        return Reason.WALLTIME
    limit = getattr(info, "limit_end", None)
    return Reason.WALLTIME if limit is not None and at >= limit - LIMIT_SLACK_S else Reason.REMOVED


def stop_reason(sig: int | None, job_id: str) -> Reason:
    """:func:`classify` with the job's record asked of Slurm now."""
    if sig is None:
        return Reason.FAILED
    info = None
    if sig in (signal.SIGUSR1, signal.SIGTERM):
        from beam_hpc.slurm import client

        try:
            info = client.show_job(job_id, timeout=10)
        except client.SlurmError as err:
            log.warning("could not ask Slurm why job %s was signalled (%s)", job_id, err)
    return classify(sig, info)


def job_tag(job_id: str, restart: int) -> str:
    return f"elastic-{job_id}-{restart}"


def local_dir(plan: Plan, job_id: str, index: int) -> Path:
    """This node's private directory on node-local disk (the site's scratch), removed on leaving."""
    root = plan.site.scratch or tempfile.gettempdir()
    return Path(root, "beam-elastic", f"{plan.run_id}-{job_id}-{index}")


class RunEndWatch:
    """Is the run over, so that this extra job has nothing left to serve? Over means both: the ledger's
    last end line starts nothing more (:func:`beam_hpc.run.ledger.chain_end`), and Slurm holds no job
    of the run but the one that wrote that line (a ``submit --resume`` or a hand ``sbatch`` shows in
    the queue long before its first ledger line). The ledger is read every look; Slurm is asked at
    most every :data:`QUEUE_ASK_S`, and a Slurm that cannot answer means "not over" (keep serving)."""

    def __init__(self, plan: Plan, *, queued: Callable[[str], list[str]] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.plan, self.clock = plan, clock
        self.queued = queued or _queued_job_ids
        self.next_ask = 0.0

    def over(self) -> str | None:
        """Why the run is over (one line), or None while it is not, or may not be."""
        segments, _ = ledger.read_ledger(self.plan.paths.ledger)
        end = ledger.chain_end(segments)
        if end is None or self.clock() < self.next_ask:
            return None
        self.next_ask = self.clock() + QUEUE_ASK_S
        from beam_hpc.slurm import client

        try:
            waiting = [j for j in self.queued(self.plan.job_name) if j != end["job_id"]]
        except client.SlurmError as err:
            log.info("the run's chain stopped, but Slurm could not say whether a job of it is queued (%s); "
                     "serving on", err)
            return None
        if waiting:
            return None
        return (f"its chain stopped at segment {end['segment']}, {end['reason']}: {end.get('detail') or ''}; "
                f"Slurm holds no job named {self.plan.job_name}")


def _queued_job_ids(name: str) -> list[str]:
    from beam_hpc.slurm import client

    return client.queued_job_ids(name, timeout=30)


class NodeProgram:
    """One node of an extra job: serve the run until stopped, then leave cleanly."""

    def __init__(self, plan: Plan, *, job_id: str, restart: int, node: str, index: int,
                 stopper: Stopper | None = None, replaces: str | None = None) -> None:
        self.plan, self.job_id, self.restart, self.node, self.index = plan, job_id, restart, node, index
        self.replaces = replaces  # a Miles run's lost rollout node whose place this node takes
        self.run_dir = Path(plan.output_dir)
        self.stopper = stopper or Stopper()
        self.reason: Reason | None = None
        self.left = False  # this node's left event is recorded
        self.worker_id = f"x{job_id}-{index}"

    def record(self, event: dict[str, Any]) -> None:
        registry.record(self.run_dir, self.job_id, {**event, "node": self.node, "restart": self.restart})

    def on_event(self, event: dict[str, Any]) -> None:
        """The worker's events into the job's record; its ``left`` carries why this node left."""
        if event.get("event") == "left":
            self.reason = self.reason or stop_reason(self.stopper.signal, self.job_id)
            event = {**event, "reason": self.reason}
            self.left = True
        self.record(dict(event))

    def run(self) -> int:
        from beam_hpc.node.ray_node import JOB_TAG_VAR, NODE_TAG_VAR, sweep

        tag = job_tag(self.job_id, self.restart)
        os.environ[JOB_TAG_VAR], os.environ[NODE_TAG_VAR] = tag, str(self.index)  # children carry them
        local = local_dir(self.plan, self.job_id, self.index)
        shutil.rmtree(local, ignore_errors=True)  # left by a SIGKILLed earlier start of this job
        local.mkdir(parents=True, exist_ok=True)
        os.environ[LOCAL_DIR_VAR] = str(local)
        self.record({"event": "started", "worker": self.worker_id, "pid": os.getpid()})
        watch = threading.Thread(target=self.leave_when_over, args=(RunEndWatch(self.plan),), name="run-end",
                                 daemon=True)
        watch.start()
        rc = 0
        try:
            fault_hooks.check_bad_node(self.node)  # the tests' dying node (inert unless its variable is set)
            if self.replaces is not None:
                self.serve_in_segment(self.replaces)
            elif self.plan.recipe.backend == "miles":
                self.serve_engines()
            else:
                self.serve_worker()
        except Exception as err:  # noqa: BLE001 - any failure of this node is recorded, then it exits 1
            log.exception("node %s: the worker failed", self.node)
            error = f"{type(err).__name__}: {err}"
            if self.left:  # the worker said it left (its deregistration ran) before the error surfaced
                self.record({"event": "error", "error": error})
            else:
                self.record({"event": "left", "reason": Reason.FAILED, "error": error})
            self.reason, self.left, rc = Reason.FAILED, True, 1
        finally:
            left = sweep(tag, self.index, grace_s=SWEEP_GRACE_S)
            if left:
                log.info("node %s: stopped %d leftover processes by PID: %s", self.node, len(left), left)
            shutil.rmtree(local, ignore_errors=True)
        if not self.left:  # a worker that returned without its own left event
            self.reason = self.reason or stop_reason(self.stopper.signal, self.job_id)
            self.record({"event": "left", "reason": self.reason})
        return rc

    def leave_when_over(self, watch: RunEndWatch) -> None:
        """Stop this node, as a signal would, once the run is over (the reason is ``run-ended``)."""
        stop = self.stopper.event
        while not stop.is_set():
            try:
                why = watch.over()
            except (OSError, ValueError) as err:  # an unreadable ledger: the next look decides
                log.info("node %s: could not read the run's ledger: %s", self.node, err)
                why = None
            if why is not None and not stop.is_set():
                log.info("node %s: leaving, the run is over: %s", self.node, why)
                self.reason = RUN_ENDED
                stop.set()
                return
            stop.wait(RUN_END_POLL_S)

    def serve_worker(self) -> None:
        from beam_hpc.backends.reference.model.policy import threads_of
        from beam_hpc.backends.reference.rollouts.outside_worker import (
            serve,  # the run's rollout worker (reference backend)
        )

        threads = threads_of(self.plan.recipe) or 1
        report = serve(self.run_dir, worker_id=self.worker_id, stop=self.stopper.event, threads=threads,
                       on_event=self.on_event)
        log.info("node %s: served %d units (%d samples) of rollouts %s", self.node, report.units_served,
                 report.samples, sorted(set(report.rollouts)))

    def serve_in_segment(self, lost: str) -> None:
        """A Miles run's replacement: the segment's node step in ``lost``'s place, until the
        segment ends (``segment-ended``), the run ends, or a signal stops this node. Its Ray node's
        join is recorded (``joined``) once the step's report says Ray started."""
        from beam_hpc.elastic import ray_replacement
        from beam_hpc.node import container

        order = ray_replacement.read_order(self.run_dir, lost)
        if order is None:
            raise RuntimeError(f"no order to replace node {lost} ({ray_replacement.order_path(self.run_dir, lost)}): "
                               "only a segment that lost the node writes one")
        if ray_replacement.segment_over(self.plan, order.segment):
            log.info("node %s: segment %s, which lost %s, has ended; nothing to join", self.node, order.segment, lost)
            self.reason = Reason.SEGMENT_ENDED
            return
        argv = ray_replacement.step_argv(order, self.plan, self.job_id, container.node_step_python(self.plan.site))
        log.info("node %s: taking %s's place in segment %s: %s", self.node, lost, order.segment, " ".join(argv))
        step = subprocess.Popen(argv, stdin=subprocess.DEVNULL)
        said_joined = False
        try:
            while not self.stopper.event.wait(1.0):
                if not said_joined and ray_replacement.joined(order) is not None:
                    said_joined = True
                    self.record({"event": "joined", "replaces": lost, "segment": order.segment})
                over = ray_replacement.segment_over(self.plan, order.segment)
                if over:
                    log.info("node %s: segment %s ended; leaving", self.node, order.segment)
                    self.reason = Reason.SEGMENT_ENDED
                    return
                rc = step.poll()
                if rc is not None:
                    raise RuntimeError(f"the node step in {lost}'s place exited {rc}")
        finally:
            if step.poll() is None:
                step.terminate()
                try:
                    step.wait(timeout=STEP_STOP_S)
                except subprocess.TimeoutExpired:
                    step.kill()
                    step.wait()

    def serve_engines(self) -> None:
        """A Miles run: this node's SGLang engines, from the image, registered for the run; they stop
        and deregister on leaving. No segment attaches them today (Miles starts no engine it did not
        launch: backends.miles.external_engines), and ``rollout add`` refuses to add engines to a Miles run, so only a
        job submitted by an earlier beam-hpc gets here; its segments say in their logs why they
        leave the engines out."""
        from beam_hpc.backends.miles import external_engines  # the Miles seam: engines, their ports, the registry
        from beam_hpc.node.ray_node import node_ip

        tp = external_engines.gpus_per_engine(self.plan)
        gpus = SlurmEnvironment.current().gpus_on_node or self.plan.site.gpus_per_node
        per_node = max(1, gpus // tp)
        nodes = SlurmEnvironment.current().job_num_nodes
        ports = external_engines.engine_ports(self.plan.site, int(self.job_id), per_node * nodes)
        host = node_ip(self.plan.site.network, self.index)  # the site's way to this node's address
        procs, engines = [], []
        for i in range(per_node):
            k = self.index * per_node + i  # this engine's place in the job: its port and its seed's rank
            argv = external_engines.engine_argv(self.plan, host=host, port=ports[k],
                                                gpu_ids=list(range(i * tp, (i + 1) * tp)),
                                                rank=external_engines.engine_rank(self.plan.site, int(self.job_id), k))
            port = ports[k]
            procs.append(subprocess.Popen(argv))
            engines.append({"host": host, "port": port, "tp": tp})
        self.record({"event": "joined", "engines": engines})
        external_engines.register(self.run_dir, self.job_id, engines)  # this node's, beside the job's other nodes'
        try:
            while not self.stopper.event.wait(1.0):
                dead = [p.args for p in procs if p.poll() is not None]
                if dead:
                    raise RuntimeError(f"an SGLang engine exited: {dead[0]}")
        finally:
            external_engines.deregister(self.run_dir, self.job_id)
            for p in procs:
                p.terminate()
            for p in procs:
                try:
                    p.wait(timeout=SWEEP_GRACE_S)
                except subprocess.TimeoutExpired:
                    p.kill()


# -- the batch side ---------------------------------------------------------------------------------
def node_argv(plan: Plan, job_id: str, replaces: str | None = None) -> list[str]:
    """srun's command for the node programs: inside the site's image (pyxis through srun's own
    options, Apptainer around the command), with the run directory bound. A replacement's node
    program (``replaces``) runs where the segment's node steps run: on the host, or (pyxis) in the
    job's container with the run directory and the segment's Ray token mounted; the node step puts
    its `ray start` in the image itself."""
    from beam_hpc.node import container

    site = plan.site
    if replaces is not None:
        from beam_hpc.elastic import ray_replacement
        from beam_hpc.node.ray_node import ClusterRuntime

        argv = [container.node_step_python(site), "-m", "beam_hpc.elastic.extra_node", "--run-dir", plan.output_dir,
                "--node", "--replaces", replaces]
        order = ray_replacement.read_order(plan.output_dir, replaces)
        if site.container.runtime != "pyxis" or order is None:
            return argv
        token_dir = str(Path(ClusterRuntime.load(order.runtime).token_path).parent)
        return [*container.srun_options(site, job_id=job_id, binds=[plan.output_dir, token_dir],
                                        workdir=plan.output_dir), *argv]
    argv = [site.node_python, "-m", "beam_hpc.elastic.extra_node", "--run-dir", plan.output_dir, "--node"]
    if site.container.runtime == "pyxis":
        return [*container.srun_options(site, job_id=job_id, binds=[plan.output_dir], workdir=plan.output_dir), *argv]
    return container.container_command(site, argv, {}, [plan.output_dir]).argv


def node_outcomes(events: list[dict[str, Any]], restart: int) -> dict[str, Reason | None]:
    """Each node that started in this (re)start of the job -> the reason it left (None: it did not)."""
    out: dict[str, str | None] = {}
    for e in events:
        if e.get("restart") != restart or "node" not in e:
            continue
        if e["event"] == "started":
            out[str(e["node"])] = None
        elif e["event"] == "left" and "reason" in e:
            out[str(e["node"])] = _reason(e["reason"])
    return out


def _reason(text: object) -> Reason:
    """A recorded reason read back; one this beam-hpc does not know counts as a failure."""
    try:
        return Reason(str(text))
    except ValueError:
        return Reason.FAILED


# The job's reason when its nodes left for different ones: the first of these that any node gave.
REASON_ORDER = (Reason.PREEMPTED, Reason.WALLTIME, Reason.REMOVED, Reason.RUN_ENDED, Reason.SEGMENT_ENDED)


def job_reason(outcomes: dict[str, Reason | None]) -> Reason:
    """The job's one reason: failed when any node failed or vanished, else the nodes' own."""
    reasons = list(outcomes.values())
    if not reasons or any(r in (None, Reason.FAILED) for r in reasons):
        return Reason.FAILED
    return next(r for r in REASON_ORDER if r in reasons)


def finish(plan: Plan, job_id: str, restart: int, *, srun_rc: int,
           quarantine: Callable[..., None] | None = None) -> Reason:
    """After the node programs ended: quarantine the nodes that failed, record the job's ``left``."""
    from beam_hpc.lifecycle.quarantine import record_failures

    run_dir = plan.output_dir
    outcomes = node_outcomes(registry.read_events(registry.events_path(run_dir, job_id)), restart)
    failed = [{"node": n, "why": "the extra rollout job's node program "
                                 + ("failed" if r == Reason.FAILED else f"ended without leaving (srun exit {srun_rc})")}
              for n, r in outcomes.items() if r in (None, Reason.FAILED)]
    for f in failed:
        if outcomes[f["node"]] is None:
            registry.record(run_dir, job_id, {"event": "left", "node": f["node"], "restart": restart,
                                              "reason": Reason.FAILED, "error": f["why"]})
    if failed:
        (quarantine or record_failures)(plan.site, failed, run=plan.run_id, run_dir=run_dir,
                                        segment=f"{job_id}-{restart}")
    reason = job_reason(outcomes)
    registry.record(run_dir, job_id, {"event": "left", "reason": reason, "restart": restart,
                                      "failed_nodes": [f["node"] for f in failed]})
    return reason


def _noted(signum: int, _frame: FrameType | None) -> None:
    log.info("the batch side got signal %d; waiting for the nodes to leave", signum)


def supervise(run_dir: Path, replaces: str | None = None) -> int:
    """The batch shell's program: one node program per node, then :func:`finish`."""
    from beam_hpc.slurm import client

    env = SlurmEnvironment.current()
    job_id, restart = env.job_id, env.restart_count
    if job_id is None:
        log.error("not inside a Slurm job: submit this with `beam-hpc rollout add` or sbatch")
        return 2
    plan = Plan.load(run_dir)
    nodelist = env.nodelist(0)
    nodes = client.expand_hostnames(nodelist) if nodelist else []
    registry.record(run_dir, job_id, {"event": "start", "restart": restart, "nodes": nodes,
                                      "gpus_per_node": env.gpus_on_node or 0})
    logs = registry.logs_dir(run_dir)
    logs.mkdir(parents=True, exist_ok=True)
    n = len(nodes) or env.job_num_nodes
    cmd = ["srun", f"--nodes={n}", f"--ntasks={n}", "--ntasks-per-node=1", "--kill-on-bad-exit=0", "--mpi=none",
           f"--job-name={plan.job_name}-rollout-node", f"--output={logs / f'node-{job_id}-{restart}-%t.log'}",
           *node_argv(plan, job_id, replaces)]
    # Slurm signals the nodes' tasks itself (the job's --signal, scancel, preemption); this process
    # only waits for them and then records how they left, so a signal to it changes nothing (caught,
    # not ignored: srun starts with the default actions).
    for sig in STOP_SIGNALS:
        signal.signal(sig, _noted)
    log.info("job %s: %s", job_id, " ".join(cmd))
    rc = subprocess.call(cmd, stdin=subprocess.DEVNULL)
    reason = finish(plan, job_id, restart, srun_rc=rc)
    log.info("job %s left the run: %s", job_id, reason)
    if reason == Reason.PREEMPTED:  # ended by itself within the grace time: Slurm would count it completed
        try:
            client.requeue(job_id)
        except client.SlurmError as err:
            log.warning("could not requeue job %s after its preemption: %s", job_id, err)
    return 1 if reason == Reason.FAILED else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m beam_hpc.elastic.extra_node", description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--node", action="store_true", help="run as one node's program (srun starts these)")
    parser.add_argument("--replaces", default=None, metavar="NODE",
                        help="a Miles run's lost rollout node whose place in the running segment this job takes")
    args = parser.parse_args(argv)
    log_to_stream()
    if not args.node:
        return supervise(args.run_dir, args.replaces)
    env = SlurmEnvironment.current()
    stopper = Stopper()
    stopper.install()
    if env.job_id is None:
        log.error("not inside a Slurm job step: the batch side starts this through srun")
        return 2
    plan = Plan.load(args.run_dir)
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    program = NodeProgram(plan, job_id=env.job_id, restart=env.restart_count, node=node,
                          index=env.node_id or 0, stopper=stopper, replaces=args.replaces)
    return program.run()


if __name__ == "__main__":
    sys.exit(main())
