"""Where a segment runs: the Slurm facts of its allocation (or stand-ins on one machine), and how
a job fails.

Split from the runner so that the segment can check its allocation against the plan in its first
seconds (:meth:`JobContext.from_slurm`), before the lock, the ledger or Ray, and so that the
launchers and the runner share one error family. Every ``SLURM_*`` variable comes through
:class:`beam_hpc.slurm.environment.SlurmEnvironment`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

from beam_hpc.errors import RuntimeFailure
from beam_hpc.plan.plan import Plan
from beam_hpc.slurm import client as slurm_client
from beam_hpc.slurm.environment import SlurmEnvironment


class JobStatus(StrEnum):
    """How the job ended (``outcome.json``'s ``status``; the values are the strings it always had)."""

    COMPLETED = "completed"
    DRIVER_FAILED = "driver-failed"
    NODE_FAILURE = "node-failure"
    NOT_READY = "not-ready"
    STOPPED = "stopped"
    ERROR = "error"


STATUSES = tuple(s.value for s in JobStatus)


class JobError(RuntimeFailure):
    """The job cannot go on; ``status`` says how (a JobStatus), ``node``/``log`` name the culprit.
    ``failed_nodes`` ({"node", "why"} each) are the Slurm nodes to blame, so that the next segment
    can leave them out (beam_hpc.lifecycle.exclusions); empty when no single node is to blame."""

    status = JobStatus.ERROR

    def __init__(self, message: str, *, node: str | None = None, log_path: str | None = None,
                 failed_nodes: list[dict[str, str]] | None = None) -> None:
        super().__init__(message)
        self.node, self.log_path = node, log_path
        self.failed_nodes = list(failed_nodes or ([{"node": node, "why": message}] if node else []))


class NodeStepFailed(JobError):
    status = JobStatus.NODE_FAILURE


class NotReady(JobError):
    status = JobStatus.NOT_READY


class StopRequested(JobError):
    status = JobStatus.STOPPED


@dataclass(frozen=True)
class JobContext:
    """The Slurm facts of this segment (or stand-ins for a local run)."""

    job_id: str  # het group 0's job id (the leader), or "l<pid>" for a local run
    job_num: int  # an integer that picks this job's ports
    restart: int  # SLURM_RESTART_COUNT
    component_ids: dict[str, str]  # group -> job id of its het component (steps are addressed by it)
    nodelists: dict[str, list[str]]  # group -> node names

    @property
    def segment(self) -> str:
        return f"{self.job_id}-{self.restart}"

    @property
    def in_slurm(self) -> bool:
        """A Slurm job (every group has a component id), not a local run (``local`` leaves them empty)."""
        return bool(self.component_ids) and all(self.component_ids.values())

    @classmethod
    def from_slurm(cls, plan: Plan, env: Mapping[str, str] | None = None) -> JobContext:
        slurm = SlurmEnvironment(dict(os.environ if env is None else env))
        job_id = slurm.job_id
        if not job_id:
            raise JobError("SLURM_JOB_ID is not set: run this inside a Slurm allocation "
                           "(or use `beam-hpc execute` for a local run)")
        if slurm.het_size != len(plan.groups):
            raise JobError(f"the allocation has {slurm.het_size} het component(s) but the plan has "
                           f"{len(plan.groups)} group(s); submit the script rendered for this plan")
        comps, lists = {}, {}
        for g in plan.groups:
            comps[g.name] = slurm.component_id(g.het_index) or job_id
            names = expand_nodelist(slurm.nodelist(g.het_index))
            if len(names) != g.nodes:
                raise JobError(f"het group {g.het_index} ({g.name}) has nodes {names}, but the plan "
                               f"expects {g.nodes}; submit the script rendered for this plan")
            lists[g.name] = names
        return cls(job_id, int(job_id), slurm.restart_count, comps, lists)

    @classmethod
    def local(cls, plan: Plan) -> JobContext:
        pid = os.getpid()
        return cls(f"l{pid}", pid, 0, {g.name: "" for g in plan.groups},
                   {g.name: [f"local-{g.name}-{i}" for i in range(g.nodes)] for g in plan.groups})


def expand_nodelist(text: str) -> list[str]:
    """``n[1-2],n4`` -> [n1, n2, n4], through Slurm's own parser (:mod:`beam_hpc.slurm.client`)."""
    try:
        return slurm_client.expand_hostnames(text)
    except slurm_client.SlurmError as err:
        raise JobError(f"scontrol show hostnames {text!r} failed: {err.detail}") from err


def _sbatch_lines(script_text: str) -> dict[int, dict[str, tuple[int, str]]]:
    """``#SBATCH`` lines of a batch script per het component: {component: {flag: (line number, line)}}
    for the flags the plan's groups fix (``--nodes``/``-N``, ``--gres``)."""
    out: dict[int, dict[str, tuple[int, str]]] = {0: {}}
    comp = 0
    for no, line in enumerate(script_text.splitlines(), 1):
        words = line.split()
        if not words or words[0] != "#SBATCH":
            if line.strip() and not line.startswith("#"):
                break  # Slurm stops reading #SBATCH lines at the first command
            continue
        for w in words[1:]:
            if w == "hetjob":
                comp += 1
                out[comp] = {}
            elif w.startswith(("--nodes=", "-N")):
                out[comp]["nodes"] = (no, line.strip())
            elif w.startswith("--gres="):
                out[comp]["gres"] = (no, line.strip())
    return out


def _gpus_of_tres(text: str | None) -> int | None:
    """GPUs per node from Slurm's ``TresPerNode`` (``gres/gpu:8``, ``gres:gpu:h200:8``)."""
    if not text:
        return None
    for item in text.split(","):
        parts = item.replace("gres/", "gres:").split(":")
        if "gpu" in parts and parts[-1].isdigit():
            return int(parts[-1])
    return None


def allocation_problems(plan: Plan, slurm: SlurmEnvironment, *, script: str | None = None,
                        script_text: str | None = None) -> list[str]:
    """What in this allocation does not match the plan's groups (components, nodes, GPUs per node),
    one line each naming the ``#SBATCH`` line of ``script`` that asked for it and the plan's value.

    Why: a user may edit a rendered script's ``#SBATCH`` lines. A changed ``--time`` is fine (the
    watchdog reads the job's EndTime), but the plan's topology is what every part of the job is built
    for (Ray's groups, Miles's actor and engine counts): a job that does not match would hold its
    nodes through a bring-up that cannot succeed. Checked in the segment's first seconds."""
    if slurm.num_nodes(0) is None:  # Slurm always describes its allocations; nothing to compare here
        return []
    lines = _sbatch_lines(script_text) if script_text else {}
    where = script or "the job's #SBATCH options"

    def named(comp: int, flag: str, fallback: str) -> str:
        hit = lines.get(comp, {}).get(flag)
        return f"{where}:{hit[0]}: `{hit[1]}`" if hit else f"{fallback} (the sbatch command line or the script)"

    if slurm.het_size != len(plan.groups):
        return [f"{where}: the job has {slurm.het_size} het component(s) (`#SBATCH hetjob` lines + 1), but the "
                f"plan has {len(plan.groups)} group(s) ({', '.join(g.name for g in plan.groups)}); "
                "render the script again instead of editing its components"]
    problems = []
    records: list[dict[str, str]] | None = None
    for g in plan.groups:
        nodes = slurm.num_nodes(g.het_index)
        if nodes is not None and nodes != g.nodes:
            problems.append(f"{named(g.het_index, 'nodes', f'--nodes of het group {g.het_index}')}: het group "
                            f"{g.het_index} ({g.name}) got {nodes} node(s), but the plan's {g.name} group has "
                            f"{g.nodes}; set --nodes={g.nodes} there, or render the script again for another topology")
        if not g.gpus_per_node:
            continue
        if g.het_index == 0:
            gpus = slurm.gpus_on_node
        else:
            if records is None:
                try:
                    records = slurm_client.show_job_records(slurm.job_id or "") or []
                except slurm_client.SlurmError:
                    records = []
            rec = records[g.het_index] if g.het_index < len(records) else {}
            gpus = _gpus_of_tres(rec.get("TresPerNode"))
        if gpus is not None and gpus != g.gpus_per_node:
            problems.append(f"{named(g.het_index, 'gres', f'--gres of het group {g.het_index}')}: het group "
                            f"{g.het_index} ({g.name}) got {gpus} GPU(s) per node, but the plan's {g.name} group "
                            f"uses {g.gpus_per_node}; set --gres={plan.site.gres}:{g.gpus_per_node} there, or render "
                            "the script again for another topology")
    return problems
