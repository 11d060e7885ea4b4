"""The node step: what runs on every node of every group (``srun --het-group=i
--ntasks-per-node=1 python -m beam_hpc.node.step --plan P --group G ...``).

In order, so that a bad node fails before Ray starts and is named in the job's error:

1. shared-filesystem canary: the nonce in the runtime.json the batch host wrote must match this
   command line's; this node's report goes beside it (the job reads it back: both directions);
2. node-local staging: NVMe (:mod:`beam_hpc.node.nvme`), the JIT caches
   (:mod:`beam_hpc.node.jit_cache`), the image when the site asks (:mod:`beam_hpc.node.image`);
3. the Ray node (:mod:`beam_hpc.node.ray_node`), inside the container, ``ray start --block`` in the
   foreground; workers first wait for the head's GCS port to answer.

It stays in the foreground until it is told to stop (:meth:`NodeStep.install_signal_handlers`) or
Ray exits on its own (a failure). Every exit path stops Ray, kills this node's stragglers by PID,
and removes the Ray temp dir and the NVMe dir.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from types import FrameType
from typing import IO

from beam_hpc import fault_hooks
from beam_hpc.config.site import Site
from beam_hpc.errors import RuntimeFailure
from beam_hpc.logging_setup import log_to_stream, module_logger
from beam_hpc.node import jit_cache, nvme, stacks
from beam_hpc.node.container import node_step_command
from beam_hpc.node.ray_node import (
    GB,
    ClusterRuntime,
    RayNode,
    RayNodeError,
    check_object_store,
    clean_env,
    cpus_from_slurm,
    gpus_from_slurm,
    loopback_ip,
    make_private_dir,
    node_ip,
    node_private_dir,
    ray_env,
    ray_ports,
    ray_start_argv,
    set_parent_death_signal,
    stop_pids,
    sweep,
    tagged_pids,
    temp_dir_for,
    write_json_atomic,
)
from beam_hpc.plan.paths import SegmentPaths
from beam_hpc.plan.plan import GroupPlan, Plan, fill
from beam_hpc.slurm.environment import SlurmEnvironment

log = module_logger(__name__)  # also run as python -m

RAY_STOP_GRACE_S = 3.0  # SIGTERM to SIGKILL for this node's Ray processes: below Slurm's usual KillWait
RAY_START_ATTEMPTS = 3
RAY_STARTED_LINE = "Ray runtime started"  # `ray start --block` gets this long after SIGTERM before SIGKILL
GCS_POLL_S = 0.25
RAY_LOG_COPY_MAX_BYTES = 5_000_000  # per file, when copying Ray's logs of a failed node


def node_binds(plan: Plan, token_path: str, group: GroupPlan) -> list[str]:
    """Host paths a node's Ray needs inside the container, beside the site's own (node.container):
    the run directory, the token's directory and, on groups that stage it, the NVMe root. The
    node step binds them around ``ray start`` (Apptainer); the launcher mounts them (pyxis)."""
    binds = [plan.output_dir, str(Path(token_path).parent)]
    if plan.nvme.enabled and group.stage_nvme:
        binds.append(plan.nvme.root)
    return binds


class NodeStepError(RuntimeFailure):
    """This node cannot take part in the job; the message says why and what to change."""


class Stop(Exception):
    """A stop was requested (SIGTERM/SIGINT) while the node was still coming up."""


class NodeStep:
    def __init__(self, plan: Plan, group: GroupPlan, rt: ClusterRuntime, *, local_index: int,
                 ip: str | None = None, gpus: int | None = None, cpus: int | None = None,
                 report_path: Path | None = None, index: int | None = None) -> None:
        self.plan, self.group, self.rt = plan, group, rt
        self.site: Site = plan.site
        self.local_index = local_index
        # index: the node's place in the job (its ports and temp dir, and on a loopback site its
        # address); a replacement node is given one past the job's own (beam_hpc.elastic.ray_replacement)
        self.index = (sum(g.nodes for g in plan.groups if g.het_index < group.het_index) + local_index
                      if index is None else index)
        self.hostname = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
        self._ip, self._gpus, self._cpus = ip, gpus, cpus
        self.stop_reason: str | None = None
        self.jit_env: dict[str, str] = {}
        self.child: subprocess.Popen | None = None
        self._stacks_answered: str | None = stacks.pending_request(rt.segment_dir, None)  # an old one is not for us
        # report_path: a replacement node of a Miles run (beam_hpc.elastic.ray_replacement) takes a lost
        # node's place and reports beside it, leaving the lost node's report as it was
        self.report_path = report_path or rt.node_report(group.name, local_index)
        self.report: dict = {
            "group": group.name, "local_index": local_index, "index": self.index,
            "hostname": self.hostname, "pid": os.getpid(),
            "slurm_job_id": SlurmEnvironment.current().job_id, "slurm_step_id": SlurmEnvironment.current().step_id,
        }

    # -- signals -------------------------------------------------------------------------------
    def _on_stop(self, signum: int, _frame: FrameType | None) -> None:
        # only a flag: the main flow checks it at safe points, so cleanup is never cut in half
        self.stop_reason = self.stop_reason or signal.Signals(signum).name

    def _check_stop(self) -> None:
        if self.stop_reason:
            raise Stop(self.stop_reason)

    def _on_ignored(self, signum: int, _frame: FrameType | None) -> None:
        log.info("node %s: %s ignored (the job handles it, Ray keeps running)", self.hostname,
                 signal.Signals(signum).name)

    def install_signal_handlers(self) -> None:
        """SIGTERM/SIGINT (the job's teardown, ``scancel``, the time limit) stop the node step.
        SIGUSR1/SIGUSR2/SIGHUP are logged and ignored: a site's ``--signal=USR1@...`` or
        submitit's ``USR2`` are for the job, not for Ray. If the node step itself is SIGKILLed,
        `ray start` gets SIGTERM from the kernel (parent-death signal), and the next segment's
        staging purges what was left on disk."""
        for s in (signal.SIGTERM, signal.SIGINT):
            signal.signal(s, self._on_stop)
        for s in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP):
            signal.signal(s, self._on_ignored)

    # -- reporting -----------------------------------------------------------------------------
    def _write_report(self, state: str, **extra: object) -> None:
        self.report.update(state=state, time=time.time(), **extra)
        write_json_atomic(self.report_path, self.report)

    # -- steps ---------------------------------------------------------------------------------
    def run(self) -> int:
        """Bring this node up and keep it up; returns the process exit code."""
        try:
            with ExitStack() as cleanup:
                node = self._prepare(cleanup)
                return self._run_ray(node, cleanup)
        except Stop:
            self._write_report("stopped", reason=self.stop_reason)
            return 0
        except (NodeStepError, RayNodeError, nvme.NvmeError, OSError) as err:
            msg = str(err)
            log.error("node %s (%s node %d): %s", self.hostname, self.group.name, self.local_index, msg)
            self._write_report("failed", error=msg)
            return 1

    def _prepare(self, cleanup: ExitStack) -> RayNode:
        rt, site, group = self.rt, self.site, self.group
        ip = self._ip or (loopback_ip(self.index) if rt.host_stride > 1 else node_ip(site.network, self.index))
        if self.index == 0 and ip != rt.head_ip:
            raise NodeStepError(f"the head node's address is {ip}, but the job expected {rt.head_ip}; "
                                "check the site's network settings")
        gpus = self._gpus if self._gpus is not None else gpus_from_slurm(os.environ)
        if gpus is None and group.gpus_per_node == 0:
            gpus = 0
        if gpus != group.gpus_per_node:
            got = "no GPU information" if gpus is None else f"{gpus} GPUs"
            raise NodeStepError(
                f"node has {got} from Slurm, but group {group.name!r} expects "
                f"{group.gpus_per_node} per node (topology.{group.name}.gpus_per_node); check the "
                "site's gres name and the partition's nodes")
        cpus = self._cpus or cpus_from_slurm(os.environ) or group.cpus_per_node or os.cpu_count() or 1
        ports = ray_ports(site.ray, rt.job_num, self.index if rt.host_stride > 1 else 0, rt.host_stride)
        node = RayNode(
            group=group.name, roles=tuple(group.roles), index=self.index, ip=ip, head_ip=rt.head_ip,
            ports=ports, num_cpus=cpus, num_gpus=gpus,
            object_store_bytes=int(site.ray.object_store_gb * GB),
            temp_dir=temp_dir_for(rt.job_id, rt.restart, self.index, rt.temp_root),
        )
        self.report.update(ip=ip, gpus=gpus, cpus=cpus, temp_dir=node.temp_dir)
        self._write_report("starting")
        try:
            fault_hooks.check_bad_node(self.hostname)
        except fault_hooks.InjectedFault as err:
            raise NodeStepError(str(err)) from None
        check_object_store(node.object_store_bytes)
        self._check_stop()
        if self.plan.nvme.enabled and group.stage_nvme:
            staged = cleanup.enter_context(nvme.staged(
                self._nvme_dir(), segment=f"{rt.job_id}-{rt.restart}",
                min_free_bytes=int(self.plan.nvme.min_free_gb * GB), node=self.hostname))
            self.report.update(nvme_dir=str(staged.path), nvme_free_bytes=staged.free_bytes,
                               nvme_purged=[str(p) for p in staged.purged])
            self._write_report("staged")
        self._warm_caches(cleanup)  # entered before the sweep below: saved after Ray's workers are gone
        private = node_private_dir(rt.job_id, rt.restart, self.index, rt.temp_root)
        shutil.rmtree(private, ignore_errors=True)  # left by a requeued segment's SIGKILL
        make_private_dir(private)  # Ray makes its temp dir inside 0777: only this keeps others out
        cleanup.callback(shutil.rmtree, private, True)
        cleanup.callback(self._sweep)
        self._check_stop()
        return node

    def _warm_caches(self, cleanup: ExitStack) -> None:
        """Node-local JIT caches seeded from the group's archive, saved back on exit (beam_hpc.node.jit_cache)."""
        node = self.hostname if self.rt.host_stride == 1 else f"{self.hostname}-{self.index}"  # nodes sharing a host
        local = jit_cache.local_dir(self.site.scratch, self.plan.run_id, self.group.name, node)
        self.jit_env, seeded = cleanup.enter_context(jit_cache.warm(self.plan.paths.jit_cache_archive(self.group.name), local))
        self.report.update(jit_cache_dir=str(local), jit_seeded=seeded.seeded, jit_kept=seeded.kept)

    def _nvme_dir(self) -> str:
        return fill(self.plan.nvme.job_dir, job_id=self.rt.job_id)

    def _sweep(self) -> None:
        left = sweep(self.rt.job_tag, self.index, grace_s=2.0)
        if left:
            log.info("node %s: stopped %d leftover Ray processes by PID: %s", self.hostname, len(left), left)

    def _image(self) -> str | None:
        spec = self.site.container
        if spec.runtime != "apptainer" or not spec.stage_to_local:
            return None
        from beam_hpc.node.image import stage

        if not self.site.scratch:
            raise NodeStepError("container.stage_to_local needs the site's scratch (node-local disk)")
        staged = stage(spec.image or "", Path(self.site.scratch, "beam-images"))
        self.report.update(image=str(staged.path), image_copied=staged.copied)  # False: reused on this node
        return str(staged.path)

    def _wait_for_gcs(self, node: RayNode) -> None:
        """Workers wait until the head's Ray is up: its GCS accepts connections and its node step saw
        `ray start` say so (``ray_started`` in its report). `ray start --address` fails against a GCS
        that is not up yet, and also, after its retries, against one whose head raylet has not
        registered ("No node info found for head node in GCS"), which takes minutes on a loaded node.

        Past the job's readiness deadline a worker keeps waiting (and says so in its report)
        instead of failing: a head that is late is not this node's fault, and a worker that exited
        would be the node the job records as failed and excludes next time. The job ends the wait:
        its readiness check names the nodes that never joined, and its teardown stops this step."""
        late = False
        head = self.rt.node_report(next(g.name for g in self.plan.groups if g.het_index == 0), 0)
        while True:
            if self._head_started(head):
                try:
                    with socket.create_connection((node.head_ip, node.ports.gcs), timeout=1.0):
                        return
                except OSError:
                    pass
            self._check_stop()
            if not late and time.time() > self.rt.deadline:
                late = True
                msg = f"the head's GCS at {node.gcs_address} did not answer before the job's readiness deadline"
                log.warning("node %s: %s; waiting on until the job stops this node", self.hostname, msg)
                self._write_report("waiting-for-head", error=msg)
            time.sleep(GCS_POLL_S)

    def _run_ray(self, node: RayNode, cleanup: ExitStack) -> int:
        image = self._image()
        python = self.plan.node_python
        env = ray_env(token_path=self.rt.token_path, job_tag=self.rt.job_tag, node_index=self.index)
        env.update(self.jit_env)  # the raylet's environment is every actor's: compilers cache node-locally
        env[stacks.SEGMENT_DIR_VAR] = self.rt.segment_dir  # where a process that registers dumps its stacks
        binds = node_binds(self.plan, self.rt.token_path, self.group)
        if self.plan.nvme.enabled and self.group.stage_nvme:
            # Actors inherit the raylet's environment: this is how the backend's optimizer
            # offload finds the dir staged on its own node (beam_hpc.backends.reference.loop.offload).
            env["BEAM_NVME_DIR"] = self._nvme_dir()
        cmd = node_step_command(self.site, ray_start_argv(node, python), env, binds,
                                base=clean_env(os.environ), image=image)
        cleanup.callback(self._stop_child)
        for attempt in range(1, RAY_START_ATTEMPTS + 1):
            if not node.is_head:
                self._wait_for_gcs(node)
            self._check_stop()
            log.info("node %s: %s", self.hostname, " ".join(cmd.argv))
            started = threading.Event()
            self.child = subprocess.Popen(cmd.argv, env=cmd.env, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, preexec_fn=set_parent_death_signal)
            threading.Thread(target=_relay, args=(self.child.stdout, started), daemon=True).start()
            self._write_report("running", ray_pid=self.child.pid, attempt=attempt)
            rc = self._wait_child(started)
            if rc is None:
                return self._stopped()
            if started.is_set() or attempt == RAY_START_ATTEMPTS:
                msg = (f"ray start exited on its own with code {rc}"
                       + ("" if started.is_set() else f" during startup, {attempt} attempts"))
                self._copy_ray_logs(node)
                log.error("node %s: %s", self.hostname, msg)
                self._write_report("failed", error=msg)
                return 1
            # Startup can time out on an overloaded node (e.g. a slow agent import); ray.sub and
            # Miles's launchers retry too. Start clean: no leftover processes, fresh temp dir.
            log.warning("node %s: ray start failed during startup (code %s), attempt %d of %d; retrying",
                        self.hostname, rc, attempt, RAY_START_ATTEMPTS)
            self._copy_ray_logs(node)
            self._sweep()
            shutil.rmtree(node.temp_dir, ignore_errors=True)
        raise AssertionError("unreachable")

    @staticmethod
    def _head_started(report: Path) -> bool:
        try:
            return bool(json.loads(report.read_text()).get("ray_started"))
        except (OSError, ValueError):
            return False

    def _wait_child(self, started: threading.Event) -> int | None:
        """Wait for `ray start` to exit; None when a stop was requested first. Once it says Ray is up,
        the report says so (``ray_started``): the workers of the job wait for that on the head."""
        assert self.child is not None
        while True:
            if self.stop_reason:
                return None
            if started.is_set() and not self.report.get("ray_started"):
                self._write_report("running", ray_started=True)
            self._answer_stack_request()
            try:
                rc = self.child.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                continue
            return None if self.stop_reason else rc

    def _answer_stack_request(self) -> None:
        """The segment stalled and asks for this node's stacks (beam_hpc.node.stacks): dump every
        Python process of this job on this node, within the dump timeout."""
        rid = stacks.pending_request(self.rt.segment_dir, self._stacks_answered)
        if rid is None:
            return
        self._stacks_answered = rid
        pids = tagged_pids(self.rt.job_tag, self.index)
        log.info("node %s: dumping the stacks of %d processes of this job (the segment stalled)", self.hostname, len(pids))
        try:
            stacks.answer_request(self.rt.segment_dir, rid, group=self.group.name, index=self.local_index, pids=pids)
        except OSError as err:
            log.warning("node %s: could not write the stack dumps: %s", self.hostname, err)

    def _stopped(self) -> int:
        self._stop_child()
        self._write_report("stopped", reason=self.stop_reason)
        return 0

    def _stop_child(self) -> None:
        """Stop this node's Ray: SIGTERM to every process of it at once, SIGKILL after the grace.

        Why not only SIGTERM to `ray start --block`: its own shutdown stops Ray's processes one
        after another, each with its own wait, which takes longer than Slurm's KillWait on a busy
        node; Slurm then SIGKILLs the node step, and Ray's temp dir and stragglers stay behind.
        Every Ray process of this node carries its tag (:func:`ray_env`), so all get the signal
        together, `ray start` included."""
        child = self.child
        if child is None or child.poll() is not None:
            return
        stop_pids({child.pid, *tagged_pids(self.rt.job_tag, self.index)}, grace_s=RAY_STOP_GRACE_S)
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(timeout=1.0)  # reaped, or killed above and reaped by the kernel's next tick

    def _copy_ray_logs(self, node: RayNode) -> None:
        """Ray's own logs live in the temp dir, which is removed on exit: keep a copy of a failed
        node's logs in the segment directory."""
        src = Path(node.temp_dir, "session_latest", "logs")
        if not src.is_dir():
            return
        dest = SegmentPaths(self.rt.segment_dir).ray_logs(self.group.name, self.local_index)
        dest.mkdir(parents=True, exist_ok=True)
        for f in src.iterdir():
            if f.is_file() and f.stat().st_size <= RAY_LOG_COPY_MAX_BYTES:
                shutil.copy2(f, dest / f.name)


def _relay(stream: IO[bytes] | None, started: threading.Event) -> None:
    """Copy `ray start`'s output to ours (the node log) and notice when Ray says it is up."""
    if stream is None:
        return
    for line in iter(stream.readline, b""):
        sys.stdout.buffer.write(line)
        sys.stdout.flush()
        if RAY_STARTED_LINE.encode() in line:
            started.set()


def _local_index(arg: int | None) -> int:
    if arg is not None:
        return arg
    index = SlurmEnvironment.current().node_id  # one task per node: the node's index in its group
    if index is not None:
        return index
    raise NodeStepError("no --node-index and no SLURM_NODEID: run me through srun or give --node-index")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m beam_hpc.node.step", description=__doc__.splitlines()[0])
    parser.add_argument("--plan", required=True)
    parser.add_argument("--group", required=True)
    parser.add_argument("--runtime", required=True, help="the segment's runtime.json (written by the job)")
    parser.add_argument("--nonce", required=True, help="must equal runtime.json's nonce (shared-FS canary)")
    parser.add_argument("--node-index", type=int, default=None, help="index in the group (default: SLURM_NODEID)")
    parser.add_argument("--node-ip", default=None, help="address to bind (default: from the site's network)")
    parser.add_argument("--gpus", type=int, default=None, help="GPUs of this node (default: from Slurm)")
    parser.add_argument("--cpus", type=int, default=None, help="CPUs of this node (default: from Slurm)")
    parser.add_argument("--index", type=int, default=None,
                        help="the node's place in the whole job (default: from its group and --node-index)")
    parser.add_argument("--report", type=Path, default=None,
                        help="where to write this node's report (default: the segment's, by group and index)")
    args = parser.parse_args(argv)
    log_to_stream()
    host = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    try:
        rt = ClusterRuntime.load(args.runtime)
    except (OSError, ValueError) as err:
        log.error("node %s: cannot read the job's %s (%s): the run directory is not shared with the "
                  "batch host; put output_dir on a filesystem every node mounts", host, args.runtime, err)
        return 1
    if rt.nonce != args.nonce:
        log.error("node %s: %s holds another job's nonce: this node sees a different run directory "
                  "than the batch host (shared-filesystem canary failed)", host, args.runtime)
        return 1
    plan = Plan.load(args.plan)
    try:
        group = plan.group(args.group)
    except KeyError:
        log.error("node %s: no group %r in %s", host, args.group, args.plan)
        return 2
    try:
        step = NodeStep(plan, group, rt, local_index=_local_index(args.node_index), ip=args.node_ip,
                        gpus=args.gpus, cpus=args.cpus, report_path=args.report,
                        index=args.index)
    except NodeStepError as err:
        log.error("node %s: %s", host, err)
        return 1
    step.install_signal_handlers()
    stacks.register(rt.segment_dir)
    return step.run()


if __name__ == "__main__":
    sys.exit(main())
