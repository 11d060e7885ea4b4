"""The rollout-only Slurm job that adds capacity to a running run: its request, checks and script.

One component with the run's rollout group's per-node shape (GPUs, CPUs, constraint) and the
site's job-wide options, rendered by the same :func:`beam_hpc.slurm.script.render_batch` as the
run's own jobs, so its site lines (env, setup, module loads) cannot drift from the run's. It asks
for ``--requeue`` (a preempted extra job comes back and joins again) and a signal lead sent to
every task (``--signal=USR1@<lead>``, no ``B:``): each node's program drains itself, so nothing
has to forward the signal. The quarantine and the run's failed nodes are ``--exclude`` lines in the
script itself, so a hand ``sbatch`` of it keeps them. Every check asks Slurm or the disk before
anything is written (:func:`problems`): one line per problem, naming the field and its fix.
"""

from __future__ import annotations

import shlex
import time
from dataclasses import dataclass
from pathlib import Path

from beam_hpc.config.recipe import format_walltime, parse_walltime
from beam_hpc.config.site import Site
from beam_hpc.elastic import registry
from beam_hpc.errors import shorten
from beam_hpc.plan.plan import GroupPlan, Plan
from beam_hpc.slurm.script import HAND_OUTPUT, BatchJob, render_batch, site_component
from beam_hpc.version import __version__

LEAD_CAP_S = 120  # a node drains one unit and deregisters: the run's save lead is more than it needs


def rollout_group(plan: Plan) -> GroupPlan:
    """The group whose nodes generate rollouts (the colocated run's one group does both)."""
    for g in plan.groups:
        if "rollout" in g.roles and "trainer" not in g.roles:
            return g
    return next(g for g in plan.groups if "rollout" in g.roles)


@dataclass(frozen=True)
class ExtraJobRequest:
    """One ``rollout add``: the run's plan, the site the extra job runs on, and what it asks for."""

    plan: Plan
    site: Site
    nodes: int
    partition: str | None
    time_s: int
    exclude: tuple[str, ...] = ()
    replaces: str | None = None  # a Miles run's lost rollout node whose place in the running segment the job takes

    @property
    def group(self) -> GroupPlan:
        return rollout_group(self.plan)

    @property
    def run_dir(self) -> str:
        return self.plan.output_dir

    @property
    def lead_s(self) -> int:
        return max(10, min(self.plan.lead_s, LEAD_CAP_S, self.time_s // 2))

    @property
    def name(self) -> str:
        return f"{self.plan.job_name}-rollout"


def make_request(plan: Plan, site: Site, *, nodes: int, partition: str | None, time: str | None,
                 exclude: tuple[str, ...] = (), replaces: str | None = None) -> tuple[ExtraJobRequest | None, list[str]]:
    """The request, or None and the problems of its plain values (no Slurm asked yet)."""
    problems = []
    if nodes < 1:
        problems.append(f"--nodes: {nodes} is not a node count; give 1 or more")
    time_s = plan.walltime_s
    if time is not None:
        try:
            time_s = parse_walltime(time)
            if time_s <= 0:
                raise ValueError(time)
        except ValueError:
            problems.append(f"--time: {shorten(time)} is not a Slurm time; write HH:MM:SS or D-HH:MM:SS")
    part = partition or site.partitions.for_group("rollout") or rollout_group(plan).partition
    if problems:
        return None, problems
    return ExtraJobRequest(plan=plan, site=site, nodes=nodes, partition=part, time_s=time_s, exclude=exclude,
                           replaces=replaces), []


def _inside(path: str, parent: str) -> bool:
    p, q = Path(path).resolve(), Path(parent).resolve()
    return p == q or q in p.parents


def model_problems(req: ExtraJobRequest) -> list[str]:
    """The model the extra nodes load must be where they can read it: on the site's shared paths
    (or in the run directory), and there. A model the backend builds itself is exempt from being
    there. A site that names no shared paths (every node sees every path) is not asked."""
    recipe = req.plan.recipe
    made = bool(recipe.backend_options.get("tiny_model") or recipe.backend_options.get("smollm2_model"))
    path = recipe.model.path
    out = []
    shared = [*req.site.shared_paths, req.run_dir]
    if req.site.shared_paths and not any(_inside(path, s) for s in shared):
        out.append(f"model.path: {shorten(path)} is not under the site's shared_paths "
                   f"({', '.join(req.site.shared_paths)}): the extra nodes cannot read it; put the model on "
                   "shared storage or add its directory to shared_paths in the site")
    elif not made and not Path(path).exists():
        out.append(f"model.path: {shorten(path)} does not exist; the extra nodes load the run's model from "
                   "there: fix the run's model.path or restore the model")
    return out


def slurm_problems(req: ExtraJobRequest) -> list[str]:
    """Can the partition hold ``nodes`` nodes of the rollout group's shape? Asked of Slurm
    (``scontrol show partition``, ``sinfo``); a question Slurm cannot answer is left to sbatch."""
    from beam_hpc.slurm import client

    part = req.partition
    label = f"--partition: {part}" if part else "--partition: (the default partition)"
    if part is not None:
        fields = client.show_partition(part)
        if fields is None:
            known = client.partition_names()
            if known:
                return [f"{label} is not a partition of this cluster; give one of: {', '.join(sorted(set(known)))}"]
            return []
        if fields.get("State") not in (None, "UP"):
            return [f"{label} is {fields.get('State')}; pick a partition that is UP (`sinfo -s`)"]
    out = []
    members = client.partition_nodes(part)
    if members is not None:
        left = [n for n in members if n not in set(req.exclude)]
        if len(left) < req.nodes:
            gone = len(members) - len(left)
            out.append(f"--nodes: {req.nodes}, but partition {part or '(default)'} has {len(members)} nodes"
                       + (f", {gone} of them quarantined or excluded" if gone else "")
                       + f"; ask for at most {len(left)} or pick another partition")
    g, site = req.group, req.site
    if part is not None and g.gpus_per_node > 0:
        counts = client.gres_counts(client.partition_gres(part), site.gres)
        if counts and max(counts) < g.gpus_per_node:
            out.append(f"{label}: its nodes have at most {max(counts)} {site.gres} GPUs, but the run's rollout "
                       f"group needs {g.gpus_per_node} per node; pick a partition with {g.gpus_per_node}-GPU nodes")
        elif not counts:
            out.append(f"{label}: its nodes have no {site.gres} GPUs, but the run's rollout group needs "
                       f"{g.gpus_per_node} per node; pick a GPU partition")
    if part is not None and g.cpus_per_node:
        fields = client.show_partition(part) or {}
        cpus, nodes = fields.get("TotalCPUs", ""), fields.get("TotalNodes", "")
        if cpus.isdigit() and nodes.isdigit() and int(nodes) and int(cpus) // int(nodes) < g.cpus_per_node:
            out.append(f"{label}: its nodes have {int(cpus) // int(nodes)} CPUs, but the run's rollout group "
                       f"needs {g.cpus_per_node} per node; pick another partition")
    return out


def miles_problems(req: ExtraJobRequest) -> list[str]:
    """A Miles run's extra nodes start SGLang engines the next segment attaches: a run that cannot
    attach them (colocated, LoRA) is refused here rather than on the nodes."""
    if req.plan.recipe.backend != "miles" or req.replaces is not None:  # a replacement starts no engine
        return []
    try:
        from beam_hpc.backends.miles import external_engines  # the Miles seam (engines, ports, registration)
    except ImportError:
        return ["backend: miles: this beam-hpc has no extra SGLang engines (beam_hpc.backends.miles."
                "external_engines); install one that has, or add capacity to a reference-backend run"]
    why = external_engines.refusal(req.plan)
    return [why] if why else []


def problems(req: ExtraJobRequest) -> list[str]:
    """Everything wrong with the request, one line each (empty: it may be submitted)."""
    return model_problems(req) + miles_problems(req) + slurm_problems(req)


def node_command(req: ExtraJobRequest) -> str:
    """The batch shell's last line: the job's own program, which starts one node program per node."""
    py = shlex.quote(req.site.python)
    replaces = f" --replaces {shlex.quote(req.replaces)}" if req.replaces else ""
    return f"exec {py} -m beam_hpc.elastic.extra_node --run-dir {shlex.quote(req.run_dir)}{replaces}"


def batch_job(req: ExtraJobRequest) -> BatchJob:
    g = req.group
    comp = site_component(req.site, nodes=req.nodes, gpus_per_node=g.gpus_per_node, partition=req.partition,
                          cpus_per_task=g.cpus_per_node, constraint=g.constraint)
    extra = [f"--exclude={','.join(req.exclude)}"] if req.exclude else []
    site = req.site.model_copy(update={"sbatch_extra": [*req.site.sbatch_extra, *extra]}) if extra else req.site
    notes = (
        f"Generated by beam-hpc {__version__} (beam-hpc rollout add).",
        f"Extra rollout capacity for run {req.plan.run_id} ({req.run_dir}): {req.nodes} node(s) of its "
        f"{g.name} group's shape" + (f", in the place of lost node {req.replaces} in the running segment's Ray "
                                     "cluster." if req.replaces else "."),
        "Submit: sbatch THIS_FILE   Leave: beam-hpc rollout remove RUN JOBID (the nodes drain first).",
    )
    return BatchJob(name=req.name, time=format_walltime(req.time_s), output=HAND_OUTPUT, components=(comp,),
                    site=site, body=(node_command(req),), requeue=True, signal=f"USR1@{req.lead_s}",
                    open_mode="append", notes=notes)


def render(req: ExtraJobRequest) -> str:
    return render_batch(batch_job(req))


def sbatch_args(req: ExtraJobRequest, script: Path) -> list[str]:
    """sbatch's arguments (after ``sbatch``) for the written script: the output under the run."""
    return ["--parsable", f"--output={registry.logs_dir(req.run_dir) / 'slurm-%j.out'}", str(script)]


def write_script(req: ExtraJobRequest, *, now: float | None = None) -> Path:
    from beam_hpc.files import write_atomic

    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(time.time() if now is None else now))
    path = registry.script_path(req.run_dir, stamp)
    path.parent.mkdir(parents=True, exist_ok=True)
    registry.logs_dir(req.run_dir).mkdir(parents=True, exist_ok=True)
    write_atomic(path, render(req))
    path.chmod(0o755)
    return path


def submit(req: ExtraJobRequest) -> tuple[str, Path]:
    """Write the script under ``elastic/``, sbatch it, record ``submitted``; returns (job id, script)."""
    from beam_hpc.slurm import client

    script = write_script(req)
    # without the SLURM_* variables of a job this may run in (a segment replacing a lost rollout
    # node): sbatch would hand them to the new job, whose srun then reads the segment's hetjob
    job_id = client.sbatch(sbatch_args(req, script), env=client.slurm_env_free(), timeout=60)
    registry.record(req.run_dir, job_id, {"event": "submitted", "nodes": req.nodes, "partition": req.partition,
                                          "gpus_per_node": req.group.gpus_per_node, "script": str(script)})
    return job_id, script
