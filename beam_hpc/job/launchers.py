"""How node steps are started and stopped: a strategy, so the rest of the job is the same code
inside Slurm (:class:`SrunLauncher`) and on one machine (:class:`LocalLauncher`, ``beam-hpc
execute``)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from beam_hpc.job.context import JobContext
from beam_hpc.node.ray_node import ClusterRuntime, loopback_ip, set_parent_death_signal
from beam_hpc.plan.paths import SegmentPaths
from beam_hpc.plan.plan import GroupPlan
from beam_hpc.slurm import client as slurm_client

log = logging.getLogger(__name__)


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

    def launch(self, group: GroupPlan, argv: list[str], env: dict[str, str], rt: ClusterRuntime) -> list[StepHandle]: ...

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
    """

    def __init__(self, ctx: JobContext, *, loopback: bool) -> None:
        self.ctx, self.loopback = ctx, loopback

    def launch(self, group: GroupPlan, argv: list[str], env: dict[str, str], rt: ClusterRuntime) -> list[StepHandle]:
        cmd = ["srun"]
        if len(self.ctx.nodelists) > 1:
            cmd.append(f"--het-group={group.het_index}")
        cmd += [
            f"--nodes={group.nodes}", f"--ntasks={group.nodes}", "--ntasks-per-node=1",
            "--kill-on-bad-exit=1", "--overlap", "--mpi=none", f"--job-name=beam-{group.name}",
            f"--output={SegmentPaths(rt.segment_dir).node_log(group.name, '%t')}",
        ]
        out = SegmentPaths(rt.segment_dir).srun_log(group.name)
        with open(out, "ab") as fh:
            proc = subprocess.Popen(cmd + argv, env=env, stdin=subprocess.DEVNULL, stdout=fh,
                                    stderr=subprocess.STDOUT)
        return [StepHandle(group, proc, None, out)]

    def ask_to_stop(self, handles: list[StepHandle], rt: ClusterRuntime) -> None:
        for h in handles:
            if h.proc.poll() is not None:
                continue
            steps = {r["slurm_step_id"] for r in reports(rt, h.group) if r.get("slurm_step_id")}
            comp = self.ctx.component_ids[h.group.name]
            if not steps:  # no task reported yet: only srun knows the step; it kills it
                h.proc.terminate()
            for step in steps:
                try:
                    slurm_client.cancel([f"{comp}.{step}"], signal="TERM", timeout=30)
                except slurm_client.SlurmError as err:  # the step may be gone; force_stop follows
                    log.warning("%s", err)

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

    def launch(self, group: GroupPlan, argv: list[str], env: dict[str, str], rt: ClusterRuntime) -> list[StepHandle]:
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
