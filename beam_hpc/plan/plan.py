"""The Plan: everything a run's jobs need, computed once from recipe + site by pure code.

DESIGN.md: the Plan is written to ``<output-dir>/plan.json``; everything inside the allocation
reads it and nothing re-derives it. Values that only exist once Slurm has started the job (job id,
node addresses) appear as ``{placeholders}`` that :func:`fill` expands there, so the Plan itself stays
a pure function of its inputs (no I/O, no clock, no environment).
"""

from __future__ import annotations

from beam_hpc.errors import InputError

import hashlib
import json
import os
import string
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from beam_hpc.config.recipe import Recipe, format_walltime, parse_walltime
from beam_hpc.config.site import Site
from beam_hpc.plan.paths import PLAN_FILE, RunPaths  # RunPaths re-exported: its old home

PLAN_VERSION = 1
GROUP_RESOURCE_PREFIX = "beam_"  # Ray custom resource per group: beam_trainer, beam_rollout
GROUP_LABEL_KEY = "beam-group"  # Ray node label key (ray start --labels)

# Placeholders a job fills in (beam_hpc.plan.plan.fill); nothing else is templated.
PLACEHOLDERS = ("job_id", "nvme_dir", "head_ip", "ray_address", "run_dir")


@dataclass(frozen=True)
class GroupPlan:
    """One heterogeneous component: ``srun --het-group=<het_index>`` starts one node step per node."""

    name: str  # trainer | rollout
    het_index: int
    nodes: int
    gpus_per_node: int
    cpus_per_node: int | None
    partition: str | None
    roles: tuple[str, ...]  # ("trainer",), ("rollout",) or ("trainer", "rollout") when colocated
    stage_nvme: bool  # stage the optimizer dir on these nodes

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class NvmePlan:
    enabled: bool
    root: str  # node-local root, e.g. /scratch/beam-optimizer
    job_dir: str  # template with {job_id}
    min_free_gb: float


@dataclass(frozen=True)
class Plan:
    version: int
    run_id: str
    job_name: str
    output_dir: str
    recipe: dict[str, Any]
    site: dict[str, Any]
    identity_sha: str
    groups: tuple[GroupPlan, ...]
    walltime_s: int
    lead_s: int
    nvme: NvmePlan
    driver_argv: tuple[str, ...]
    driver_env: dict[str, str] = field(default_factory=dict)

    @property
    def paths(self) -> RunPaths:
        return RunPaths(self.output_dir)

    @property
    def total_nodes(self) -> int:
        return sum(g.nodes for g in self.groups)

    @property
    def total_gpus(self) -> int:
        return sum(g.gpus for g in self.groups)

    def group(self, name: str) -> GroupPlan:
        for g in self.groups:
            if g.name == name:
                return g
        raise KeyError(name)

    def recipe_obj(self) -> Recipe:
        return Recipe.model_validate(self.recipe)

    def site_obj(self) -> Site:
        return Site.model_validate(self.site)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Plan":
        if d.get("version") != PLAN_VERSION:
            raise InputError(f"plan.json version {d.get('version')} is not {PLAN_VERSION}; re-render the run")
        d = dict(d)
        d["groups"] = tuple(GroupPlan(**{**g, "roles": tuple(g["roles"])}) for g in d["groups"])
        d["nvme"] = NvmePlan(**d["nvme"])
        d["driver_argv"] = tuple(d["driver_argv"])
        return cls(**d)

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        p = Path(path)
        if p.is_dir():
            p = p / PLAN_FILE
        return cls.from_dict(json.loads(p.read_text()))

    def write(self) -> Path:
        """Write plan.json atomically (the only I/O this module does, and only when asked)."""
        from beam_hpc.run.files import write_atomic  # stdlib-only helper; lazy: plan stays import-light

        out = Path(self.paths.plan)
        write_atomic(out, self.to_json())
        return out


def identity_sha(recipe: Recipe) -> str:
    blob = json.dumps(recipe.identity(), sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def run_id_for(output_dir: str) -> str:
    """Stable per output directory, so NVMe dirs and ports of one run are recognisable across
    segments (Miles's own default run id is a timestamp, which breaks every resume)."""
    return hashlib.sha256(os.path.normpath(output_dir).encode()).hexdigest()[:10]


def compute_lead_s(recipe: Recipe, measured: dict[str, float] | None) -> int:
    """Seconds before the walltime at which the final save starts.

    The rollout in flight must finish and its checkpoint must land before Slurm kills the job, so
    the lead covers one rollout+train step and one save, doubled for safety, plus the 30 s by
    which Slurm's signal may be early or late; never below the recipe's floor.
    """
    lc = recipe.lifecycle
    if lc.lead_s is not None:
        return lc.lead_s
    if not measured:
        return lc.lead_floor_s
    step = measured.get("rollout_s", 0.0) + measured.get("save_s", 0.0)
    return max(lc.lead_floor_s, int(2 * step + 30))


def make_plan(recipe: Recipe, site: Site, *, measured: dict[str, float] | None = None) -> Plan:
    """Recipe + site -> Plan. Raises InputError for impossible combinations, before any allocation."""
    for field_name, value in (("output_dir", recipe.output_dir), ("data.dir", recipe.data.dir),
                              ("model.path", recipe.model.path)):
        if not os.path.isabs(value):
            raise InputError(
                f"{field_name}: {value!r} is relative; give an absolute path on shared storage "
                f"(every node and every later segment reads it), e.g. --set {field_name}=/shared/..."
            )
    output_dir = os.path.normpath(recipe.output_dir)
    groups = _groups(recipe, site)
    walltime_s = parse_walltime(recipe.lifecycle.walltime)
    lead_s = compute_lead_s(recipe, measured)
    if lead_s >= walltime_s:
        raise InputError(
            f"lifecycle.lead_s: {lead_s} s lead leaves no time in a {recipe.lifecycle.walltime} walltime; "
            "raise lifecycle.walltime or lower lifecycle.lead_s"
        )
    run_id = run_id_for(output_dir)
    off = recipe.training.offload
    nvme_root = off.nvme_dir
    nvme = NvmePlan(
        enabled=off.target == "nvme",
        root=nvme_root,
        job_dir=f"{nvme_root.rstrip('/')}/{run_id}/{{job_id}}",
        min_free_gb=off.min_free_gb,
    )
    plan_path = RunPaths(output_dir).plan
    argv, env = _driver(recipe, site, plan_path)
    return Plan(
        version=PLAN_VERSION,
        run_id=run_id,
        job_name=f"beam-{recipe.name}-{run_id[:6]}",
        output_dir=output_dir,
        recipe=recipe.model_dump(mode="json"),
        site=site.model_dump(mode="json"),
        identity_sha=identity_sha(recipe),
        groups=groups,
        walltime_s=walltime_s,
        lead_s=lead_s,
        nvme=nvme,
        driver_argv=tuple(argv),
        driver_env=env,
    )


def _groups(recipe: Recipe, site: Site) -> tuple[GroupPlan, ...]:
    topo = recipe.topology
    colocated = recipe.training.colocated
    stage = recipe.training.offload.target == "nvme"
    out = [
        GroupPlan(
            name="trainer",
            het_index=0,
            nodes=topo.trainer.nodes,
            gpus_per_node=topo.trainer.gpus_per_node,
            cpus_per_node=topo.trainer.cpus_per_node or site.cpus_per_node,
            partition=site.partitions.for_group("trainer"),
            roles=("trainer", "rollout") if colocated else ("trainer",),
            stage_nvme=stage,
        )
    ]
    if topo.rollout is not None:
        out.append(
            GroupPlan(
                name="rollout",
                het_index=1,
                nodes=topo.rollout.nodes,
                gpus_per_node=topo.rollout.gpus_per_node,
                cpus_per_node=topo.rollout.cpus_per_node or site.cpus_per_node,
                partition=site.partitions.for_group("rollout"),
                roles=("rollout",),
                stage_nvme=False,
            )
        )
    for g in out:
        if g.gpus_per_node > site.gpus_per_node:
            raise InputError(
                f"topology.{g.name}.gpus_per_node: {g.gpus_per_node} GPUs per node, but site "
                f"{site.name!r} nodes have {site.gpus_per_node}; lower it or use another site"
            )
    return tuple(out)


def _driver(recipe: Recipe, site: Site, plan_path: str) -> tuple[list[str], dict[str, str]]:
    """The backend's command line, run on the head node once Ray is ready."""
    if recipe.backend == "reference":
        py = site.container.python if site.container.runtime == "apptainer" else site.python
        return [py, "-m", "beam_hpc.backends.reference", "--plan", plan_path, "--ray-address", "{ray_address}"], {}
    from beam_hpc.backends.miles import args as miles_args  # pure argv builder, no Miles import

    return miles_args.build_driver(recipe, site, plan_path)


def fill(template: str, **values: str) -> str:
    """Expand the Plan's ``{placeholders}``; an unknown or missing one is a bug, so it raises."""
    fields = {f for _, f, _, _ in string.Formatter().parse(template) if f}
    unknown = fields - set(PLACEHOLDERS)
    if unknown:
        raise KeyError(f"unknown placeholder(s) {sorted(unknown)} in {template!r}")
    return template.format(**{k: values[k] for k in fields})


def sbatch_time(plan: Plan) -> str:
    return format_walltime(plan.walltime_s)
