"""How node steps are started and stopped: a strategy, so the rest of the job is the same code
inside Slurm (:class:`SrunLauncher`) and on one machine (:class:`LocalLauncher`, ``beam-hpc
execute``)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from beam_hpc.job.context import JobContext, JobError
from beam_hpc.node.ray_node import ClusterRuntime, loopback_ip, set_parent_death_signal
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


class Launcher(Protocol):
    """How node steps are started and stopped; the rest of the job does not care."""

    loopback: bool  # nodes share this host (distinct loopback addresses, per-node ports)

    def launch(self, group: GroupPlan, argv: list[str], env: dict[str, str], rt: ClusterRuntime,
               container: Sequence[str] = ()) -> list[StepHandle]:
        """Start the group's node steps; ``container``: srun options that put each task in the
        site's image (pyxis's, from beam_hpc.node.container.srun_options), empty otherwise."""
        ...

    def ask_to_stop(self, handles: list[StepHandle], rt: ClusterRuntime) -> None: ...

    def force_stop(self, handles: list[StepHandle]) -> None: ...

    def launcher_errors(self, handle: StepHandle) -> list[tuple[str, int, str]]:
        """(node, task index, what) for each task the launcher itself saw fail."""
        ...


_SRUN_TASK_ERROR = re.compile(r"srun: error: (\S+): tasks? (\d+)[^:]*: (.+)")


class SrunLauncher:
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
               container: Sequence[str] = ()) -> list[StepHandle]:
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
            steps = {r["slurm_step_id"] for r in reports(rt, h.group) if r.get("slurm_step_id")}
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
                states = [r.get("state") for r in reports(rt, h.group)]
                if h.proc.poll() is not None:
                    waiting.remove(h)
                elif len(states) == h.group.nodes and all(st in ("stopped", "failed") for st in states):
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
        return [(m[1], int(m[2]), m[3].strip()) for m in _SRUN_TASK_ERROR.finditer(text)]


class LocalLauncher:
    """No Slurm: every node step is a subprocess of this machine with its own loopback address
    (127.0.0.10+i), GPU count from the plan (fake GPUs for Ray), CPUs from the plan or this host."""

    loopback = True

    def launch(self, group: GroupPlan, argv: list[str], env: dict[str, str], rt: ClusterRuntime,
               container: Sequence[str] = ()) -> list[StepHandle]:
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


def for_job(plan: Plan, *, srun: bool | None = None, env: Mapping[str, str] | None = None) -> tuple[JobContext, Launcher]:
    """The job's context and launcher: srun inside a Slurm allocation, else processes of this
    machine (``beam-hpc execute``, tests). ``srun``: None decides by whether ``env`` (default: this
    process's) is a Slurm job's. Raises JobError when the allocation does not fit the plan."""
    if srun is None:
        srun = SlurmEnvironment(dict(os.environ if env is None else env)).in_job
    if srun:
        ctx = JobContext.from_slurm(plan, env)
        return ctx, SrunLauncher(ctx, loopback=plan.site.network.ip_source == "loopback")
    return JobContext.local(plan), LocalLauncher()
