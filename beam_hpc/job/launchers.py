"""How a job's Ray cluster comes and goes: a strategy, chosen once per job by :func:`for_job`, so
the rest of the job (:mod:`beam_hpc.job.runner`) is the same code whoever starts the nodes.

Three strategies:

- :class:`SrunLauncher`, inside a Slurm allocation: one ``srun --het-group=i`` per group starts
  the node steps, and the job's own Ray runs on them;
- :class:`LocalLauncher`, on one machine (``beam-hpc execute``, tests): the node steps are
  processes of this machine on loopback addresses;
- :class:`SiteRayCluster`, where the site runs its own Ray cluster (site ``ray_address`` and
  ``ray_token_file``): no node step starts, the head and token are the site's, and teardown leaves
  that cluster and its token as they were.

The first two bring up a cluster of the job's own (:class:`OwnCluster`: a fresh token in the run
directory, the head on the first node of group 0, temp directories removed at the end).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from glob import glob
from pathlib import Path
from typing import NamedTuple, Protocol

from beam_hpc.config.site import Site
from beam_hpc.job.context import JobContext, JobError, NodeStepFailed
from beam_hpc.node import container
from beam_hpc.node.ray_node import (
    LOOPBACK_MAX_NODES,
    ClusterRuntime,
    loopback_ip,
    node_ip,
    ray_ports,
    set_parent_death_signal,
    temp_dir_prefix,
    write_token,
)
from beam_hpc.node.step import node_binds
from beam_hpc.plan.node_loss import keeps_the_job
from beam_hpc.plan.paths import SegmentPaths
from beam_hpc.plan.plan import GroupPlan, Plan
from beam_hpc.slurm import client as slurm_client
from beam_hpc.slurm.environment import SlurmEnvironment

log = logging.getLogger(__name__)

CONTROLLER_CHECK_S = 3.0  # `scontrol ping` before a stop: instant when slurmctld is down, this long when it hangs
SCANCEL_TIMEOUT_S = 10.0
CTRL_C_GAP_S = 0.3  # between the two SIGINTs to srun (it aborts on the second within a second)
INTERRUPT_WAIT_S = 15.0  # for the node steps to report that they stopped, after the SIGINTs


@dataclass
class StepHandle:
    """One launched process: a whole group's srun, or one local node."""

    group: GroupPlan
    proc: subprocess.Popen
    local_index: int | None  # None: one srun process covers every node of the group
    output: Path


class RayHead(NamedTuple):
    """Where the job's Ray cluster is reached: what a launcher decides before anything starts."""

    head_ip: str
    gcs_port: int
    host_stride: int  # port slots per host: LOOPBACK_MAX_NODES where nodes share one host, else 1
    token_path: Path
    existing: bool  # the site's own cluster: the job starts none of it and leaves it running


class Launcher(Protocol):
    """How this job's Ray cluster comes and goes; the rest of the job does not care."""

    def head(self, plan: Plan, ctx: JobContext) -> RayHead:
        """The head's address and the token file (a fresh one for a cluster of the job's own)."""
        ...

    def start_nodes(self, plan: Plan, rt: ClusterRuntime, argv: list[str], env: dict[str, str]) -> list[StepHandle]:
        """Start every group's node steps (``argv``: the node step's command, ``--group`` added)."""
        ...

    def binds(self, rt: ClusterRuntime) -> list[str]:
        """Host paths beyond the run directory that a process talking to this Ray needs in its container."""
        ...

    def ask_to_stop(self, handles: list[StepHandle], rt: ClusterRuntime) -> None: ...

    def force_stop(self, handles: list[StepHandle]) -> None: ...

    def launcher_errors(self, handle: StepHandle) -> list[tuple[str, int, str]]:
        """(node, task index, what) for each task the launcher itself saw fail."""
        ...

    def clean_up(self, rt: ClusterRuntime) -> None:
        """After every process of the job has gone: what of the cluster is the job's to remove."""
        ...


class OwnCluster:
    """What :class:`SrunLauncher` and :class:`LocalLauncher` share: the job brings up a Ray cluster
    of its own, one node step per node, and removes its token and temp directories at the end.
    Subclasses say how one group's node steps start (:meth:`launch`) and stop."""

    loopback: bool  # nodes share this host (distinct loopback addresses, per-node ports)

    def launch(self, group: GroupPlan, argv: list[str], env: dict[str, str], rt: ClusterRuntime,
               container: Sequence[str] = (), *, per_node: bool = False) -> list[StepHandle]:
        """Start the group's node steps; ``container``: srun options that put each task in the
        site's image (pyxis's, from beam_hpc.node.container.srun_options), empty otherwise;
        ``per_node``: one step per node, so that one node's loss ends its own step only
        (:func:`~beam_hpc.plan.node_loss.keeps_the_job`)."""
        raise NotImplementedError

    def head(self, plan: Plan, ctx: JobContext) -> RayHead:
        token = write_token(Path(plan.paths.ray_auth(ctx.segment)))
        stride = LOOPBACK_MAX_NODES if self.loopback else 1
        head_ip = loopback_ip(0) if self.loopback else node_ip(plan.site.network, 0)
        return RayHead(head_ip, ray_ports(plan.site.ray, ctx.job_num, 0, stride).gcs, stride, token, existing=False)

    def start_nodes(self, plan: Plan, rt: ClusterRuntime, argv: list[str], env: dict[str, str]) -> list[StepHandle]:
        handles: list[StepHandle] = []
        for g in plan.groups:
            log.info("starting node steps of group %s (%d nodes: %s)", g.name, g.nodes, ",".join(rt.nodelists.get(g.name, [])))
            # pyxis: the container around each task, given to srun (none for other runtimes)
            around = container.srun_options(plan.site, job_id=rt.job_id, workdir=plan.output_dir,
                                            binds=node_binds(plan, rt.token_path, g))
            handles += self.launch(g, [*argv, "--group", g.name], env, rt, container=around,
                                   per_node=keeps_the_job(plan, g))
        return handles

    def binds(self, rt: ClusterRuntime) -> list[str]:
        return []  # the token lives in the run directory

    def clean_up(self, rt: ClusterRuntime) -> None:
        for d in glob(temp_dir_prefix(rt.job_id, rt.restart, rt.temp_root) + "*"):
            shutil.rmtree(d, ignore_errors=True)
        token_dir = Path(rt.token_path).parent
        shutil.rmtree(token_dir, ignore_errors=True)
        with contextlib.suppress(OSError):
            token_dir.parent.rmdir()  # .ray-auth, when no other segment's token is left


# srun's words for a task that ended badly, and for a node Slurm declared failed under the step (it
# then kills the step's other tasks, which come after it: "srun: error: Node failure on n2",
# "srun: error: n1: task 0: Killed", measured on the local cluster with Slurm 22.05)
_SRUN_TASK_ERROR = re.compile(r"srun: error: (?:Node failure on (?P<lost>\S+)|(?P<node>\S+): tasks? (?P<task>\d+)[^:]*: (?P<what>.+))")


class SrunLauncher(OwnCluster):
    """Inside a Slurm allocation: ``srun --het-group=i`` per group, one task per node.

    ``--kill-on-bad-exit`` turns one dead node step into the end of its group's srun, which the job
    sees at once. Stopping goes through ``scancel --signal=TERM <component>.<step>``: that delivers
    SIGTERM to the tasks (graceful), whereas SIGTERM to srun itself makes Slurm SIGKILL the step
    (measured on the local cluster), which would skip the node steps' cleanup.

    Both go through the controller. When it does not answer (``scontrol ping``), each scancel would
    wait about 18 s, and srun's own abort asks the controller too (with slurmctld stopped, the tasks
    of a SIGTERMed srun ran on). So then the stop goes around it (:meth:`_interrupt`): two SIGINTs
    to our srun, which forwards the Ctrl-C to every task of its step through each node's slurmd,
    no controller involved; the node steps stop on SIGINT as on SIGTERM.
    """

    def __init__(self, ctx: JobContext, *, loopback: bool) -> None:
        self.ctx, self.loopback = ctx, loopback

    def launch(self, group: GroupPlan, argv: list[str], env: dict[str, str], rt: ClusterRuntime,
               container: Sequence[str] = (), *, per_node: bool = False) -> list[StepHandle]:
        if per_node:
            return self._launch_per_node(group, argv, env, rt, container)
        cmd = ["srun"]
        if len(self.ctx.nodelists) > 1:
            cmd.append(f"--het-group={group.het_index}")
        cmd += [
            f"--nodes={group.nodes}", f"--ntasks={group.nodes}", "--ntasks-per-node=1",
            "--kill-on-bad-exit=1", "--overlap", "--mpi=none", f"--job-name=beam-{group.name}",
            f"--output={SegmentPaths(rt.segment_dir).node_log(group.name, '%t')}",
        ]
        cmd += container  # the site's container around each task (pyxis), after srun's own options
        out = SegmentPaths(rt.segment_dir).srun_log(group.name)
        with open(out, "ab") as fh:
            proc = subprocess.Popen(cmd + argv, env=env, stdin=subprocess.DEVNULL, stdout=fh,
                                    stderr=subprocess.STDOUT)
        return [StepHandle(group, proc, None, out)]

    def _launch_per_node(self, group: GroupPlan, argv: list[str], env: dict[str, str], rt: ClusterRuntime,
                         container: Sequence[str]) -> list[StepHandle]:
        """One single-task step per node of the group (``--nodelist`` names it, ``--node-index``
        its index in the group). Why not one step with ``srun --no-kill``: Slurm then keeps the
        step but its srun neither ends nor reports which task went (``--no-kill`` disables
        ``--kill-on-bad-exit`` and ``--wait``), so the job could not tell the loss; a step of one
        node is killed with its node (Slurm kills the steps on a failed node) and leaves the others
        running, and its srun's end names the node. Measured on Slurm 22.05.8: in a two-node
        ``--no-kill`` component, marking one node DOWN killed that node's step only."""
        cmd = ["srun"]
        if len(self.ctx.nodelists) > 1:
            cmd.append(f"--het-group={group.het_index}")
        handles = []
        paths = SegmentPaths(rt.segment_dir)
        for i, node in enumerate(rt.nodelists[group.name]):
            out = paths.srun_log(f"{group.name}-{i}")
            one = [*cmd, "--nodes=1", "--ntasks=1", f"--nodelist={node}", "--overlap", "--mpi=none",
                   f"--job-name=beam-{group.name}", f"--output={paths.node_log(group.name, i)}", *container]
            with open(out, "ab") as fh:
                proc = subprocess.Popen(one + argv + ["--node-index", str(i)], env=env, stdin=subprocess.DEVNULL,
                                        stdout=fh, stderr=subprocess.STDOUT)
            handles.append(StepHandle(group, proc, i, out))
        return handles

    def ask_to_stop(self, handles: list[StepHandle], rt: ClusterRuntime) -> None:
        live = [h for h in handles if h.proc.poll() is None]
        if not live:
            return
        try:
            slurm_client.ping(timeout=CONTROLLER_CHECK_S)
        except slurm_client.SlurmUnavailable as err:
            log.warning("Slurm's controller does not answer (%s): stopping the node steps through their srun", err.detail)
            self._interrupt(live, rt)
            return
        for i, h in enumerate(live):
            steps = {r["slurm_step_id"] for r in reports(rt, h.group) if r.get("slurm_step_id")
                     and (h.local_index is None or r.get("local_index") == h.local_index)}
            comp = self.ctx.component_ids[h.group.name]
            if not steps:  # no task reported yet: only srun knows the step; it kills it
                h.proc.terminate()
            for step in steps:
                try:
                    slurm_client.cancel([f"{comp}.{step}"], signal="TERM", timeout=SCANCEL_TIMEOUT_S)
                except slurm_client.SlurmUnavailable as err:  # gone since the ping: the rest goes around it
                    log.warning("%s: stopping the node steps through their srun", err)
                    self._interrupt(live[i:], rt)
                    return
                except slurm_client.SlurmError as err:  # the step may be gone; force_stop follows
                    log.warning("%s", err)

    def _interrupt(self, handles: list[StepHandle], rt: ClusterRuntime) -> None:
        """Stop the groups' node steps without the controller: srun answers a second SIGINT within
        a second of the first by forwarding SIGINT to its tasks through the nodes' slurmd (measured
        with slurmctld stopped: the task had it within 0.3 s). srun itself then waits on the absent
        controller (about 9 s) before it exits: once every node of a group reports that it stopped,
        its srun is killed, as it has nothing left to do."""
        for _ in range(2):
            for h in handles:
                if h.proc.poll() is None:
                    h.proc.send_signal(signal.SIGINT)
            time.sleep(CTRL_C_GAP_S)
        deadline = time.monotonic() + INTERRUPT_WAIT_S
        waiting = list(handles)
        while waiting and time.monotonic() < deadline:
            for h in list(waiting):
                mine = [r for r in reports(rt, h.group) if h.local_index is None or r.get("local_index") == h.local_index]
                states = [r.get("state") for r in mine]
                if h.proc.poll() is not None:
                    waiting.remove(h)
                elif len(states) == (h.group.nodes if h.local_index is None else 1) and all(
                        st in ("stopped", "failed") for st in states):
                    h.proc.kill()  # its tasks are done; srun would only wait on the controller
                    waiting.remove(h)
            time.sleep(0.2)

    def force_stop(self, handles: list[StepHandle]) -> None:
        for h in handles:
            if h.proc.poll() is None:
                h.proc.terminate()  # srun then has Slurm SIGKILL the step

    def launcher_errors(self, handle: StepHandle) -> list[tuple[str, int, str]]:
        try:
            text = handle.output.read_text(errors="replace")
        except OSError:
            return []
        nodes = self.ctx.nodelists.get(handle.group.name, [])
        return [(m["lost"], nodes.index(m["lost"]) if m["lost"] in nodes else 0, "node failure") if m["lost"]
                else (m["node"], int(m["task"]), m["what"].strip()) for m in _SRUN_TASK_ERROR.finditer(text)]


class LocalLauncher(OwnCluster):
    """No Slurm: every node step is a subprocess of this machine with its own loopback address
    (127.0.0.10+i), GPU count from the plan (fake GPUs for Ray), CPUs from the plan or this host."""

    loopback = True

    def launch(self, group: GroupPlan, argv: list[str], env: dict[str, str], rt: ClusterRuntime,
               container: Sequence[str] = (), *, per_node: bool = False) -> list[StepHandle]:
        # one process per node always: per_node changes nothing here
        if container:
            raise JobError("container.runtime: pyxis puts containers around srun's tasks; a run without Slurm "
                           "(beam-hpc execute) needs a site with runtime host or apptainer")
        handles = []
        first = rt_first_index(rt, group)
        for i in range(group.nodes):
            out = rt.node_log(group.name, i)
            extra = ["--node-index", str(i), "--node-ip", loopback_ip(first + i),
                     "--gpus", str(group.gpus_per_node),
                     "--cpus", str(group.cpus_per_node or os.cpu_count() or 1)]
            with open(out, "ab") as fh:
                proc = subprocess.Popen(argv + extra, env=env, stdin=subprocess.DEVNULL, stdout=fh,
                                        stderr=subprocess.STDOUT, start_new_session=True,
                                        preexec_fn=set_parent_death_signal)
            handles.append(StepHandle(group, proc, i, out))
        return handles

    def ask_to_stop(self, handles: list[StepHandle], rt: ClusterRuntime) -> None:
        for h in handles:
            if h.proc.poll() is None:
                h.proc.terminate()

    def force_stop(self, handles: list[StepHandle]) -> None:
        for h in handles:
            if h.proc.poll() is None:
                h.proc.kill()

    def launcher_errors(self, handle: StepHandle) -> list[tuple[str, int, str]]:
        return []


class SiteRayCluster:
    """The site's own Ray cluster (site ``ray_address`` + ``ray_token_file``): nothing to start,
    nothing to stop. Readiness (told by ``runtime.json``'s ``existing``) checks that the cluster has
    every group's nodes and GPUs; the job's processes bind the token's directory."""

    def __init__(self, site: Site) -> None:
        self.address, self.token_file = site.ray_address or "", site.ray_token_file or ""

    def head(self, plan: Plan, ctx: JobContext) -> RayHead:
        host, _, port = self.address.rpartition(":")
        return RayHead(host, int(port), 1, self._token(), existing=True)

    def _token(self) -> Path:
        """The site's token file: it must be there and readable by the job."""
        p = Path(self.token_file)
        try:
            ok = p.is_file() and bool(p.read_text().strip())
        except OSError as err:
            raise JobError(f"ray_token_file: cannot read {p} ({err.strerror}); the job must be able to read the "
                           "existing Ray cluster's token (set ray_token_file in the site or --ray-token-file)") from None
        if not ok:
            raise JobError(f"ray_token_file: {p} is missing or empty; point ray_token_file (or --ray-token-file) at "
                           "the existing Ray cluster's token file")
        if p.stat().st_mode & 0o077:
            log.warning("ray_token_file %s is readable by others (mode %o); chmod 600 it", p, p.stat().st_mode & 0o777)
        return p

    def start_nodes(self, plan: Plan, rt: ClusterRuntime, argv: list[str], env: dict[str, str]) -> list[StepHandle]:
        log.info("using the site's Ray cluster at %s: no node step started", rt.address)
        return []

    def binds(self, rt: ClusterRuntime) -> list[str]:
        return [str(Path(rt.token_path).parent)]  # the site's token file lives outside the run directory

    def ask_to_stop(self, handles: list[StepHandle], rt: ClusterRuntime) -> None:
        pass  # no node step of the job's own

    def force_stop(self, handles: list[StepHandle]) -> None:
        pass

    def launcher_errors(self, handle: StepHandle) -> list[tuple[str, int, str]]:
        return []

    def clean_up(self, rt: ClusterRuntime) -> None:
        log.info("the site's Ray cluster at %s keeps running", rt.address)  # its temp dirs and token are the site's


def rt_first_index(rt: ClusterRuntime, group: GroupPlan) -> int:
    """Global index of the group's first node (groups in het order): from the node lists."""
    order = list(rt.nodelists)
    return sum(len(rt.nodelists[g]) for g in order[: order.index(group.name)])


def reports(rt: ClusterRuntime, group: GroupPlan) -> list[dict]:
    out = []
    for i in range(group.nodes):
        with contextlib.suppress(OSError, ValueError):
            out.append(json.loads(rt.node_report(group.name, i).read_text()))
    return out


def node_failure(launcher: Launcher, rt: ClusterRuntime, h: StepHandle) -> NodeStepFailed:
    """What a node step that ended means: the node whose task the launcher saw end first (srun's
    task errors, in the order they happened), else the node named by its own report, else the first
    node of the handle, with its log. The launcher comes first because one srun step covers every
    node of a group that does not survive a node's loss: when one node's task dies (a lost node
    writes no report), srun ends the others (``--kill-on-bad-exit``), and those may report "failed"
    on their way out; blaming them would exclude healthy nodes and keep the lost one. A node's own
    report still gives the detail when it is the one that failed."""
    g, rc = h.group, h.proc.returncode
    failed = [r for r in reports(rt, g) if r.get("state") == "failed"]
    if h.local_index is not None:
        failed = [r for r in failed if r.get("local_index") == h.local_index] or failed
    errors = launcher.launcher_errors(h)
    if errors:
        node, i, detail = errors[0]
        own = next((r for r in failed if int(r.get("local_index", -1)) == i), None)
        detail = own.get("error", detail) if own is not None else detail
    elif failed:
        r = failed[0]
        i = int(r.get("local_index", 0))
        node, detail = rt.node_name(g.name, i), r.get("error", "failed")
    else:
        i = h.local_index or 0
        node, detail = rt.node_name(g.name, i), _ended_without_a_word(rc)
    log_path = str(rt.node_log(g.name, i))
    msg = f"node step of group {g.name} on node {node} ended: {detail}; log: {log_path}"
    if h.local_index is None:
        msg += f" (srun output: {h.output})"
    return NodeStepFailed(msg, node=node, log_path=log_path, failed_nodes=[{"node": node, "why": f"node step failed: {detail}"}])


def _ended_without_a_word(rc: int | None) -> str:
    """Why a node step ended when neither the launcher nor the node said: its exit status in words.
    A step stopped from outside (its node lost, the step cancelled, the node's processes killed)
    often exits 0 or by a signal, and "exit code 0" read as if the step had finished its work."""
    if rc is not None and rc < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-rc).name} without a word (its node lost, or the step killed)"
        return f"killed by signal {-rc} without a word (its node lost, or the step killed)"
    if rc == 0:
        return "ended while the job ran, without a word (exit code 0: its node lost, or the step cancelled)"
    return f"exit code {rc}, without a word (see the node's log)"


def for_job(plan: Plan, *, srun: bool | None = None, env: Mapping[str, str] | None = None) -> tuple[JobContext, Launcher]:
    """The job's context and launcher, the one place either is chosen: the site's own Ray cluster
    when the site names one, else srun inside a Slurm allocation, else processes of this machine
    (``beam-hpc execute``, tests). ``srun``: None decides by whether ``env`` (default: this
    process's) is a Slurm job's. Raises JobError when the allocation does not fit the plan."""
    if srun is None:
        srun = SlurmEnvironment(dict(os.environ if env is None else env)).in_job
    ctx = JobContext.from_slurm(plan, env) if srun else JobContext.local(plan)
    if plan.site.ray_address:
        return ctx, SiteRayCluster(plan.site)
    if srun:
        return ctx, SrunLauncher(ctx, loopback=plan.site.network.ip_source == "loopback")
    return ctx, LocalLauncher()
