"""The Plan: everything a run's jobs need, computed once from recipe + site by pure code.

The Plan is written to ``<output-dir>/plan.json`` (and embedded in a rendered script); everything
inside the allocation reads it rather than derive anything again. :func:`make_plan` is a pure function of
its arguments (no I/O, no process, no clock, no environment): what only the disk or the model
script can tell (the backend's driver command, Slurm's TmpDisk) the caller computes and hands in as
data (``beam_hpc.backends.registry.plan_for`` does it for the driver). Values that exist only once
Slurm has started the job (job id, node addresses, the run directory as the job reads it) appear as
``{placeholders}`` that :func:`fill` expands there. ``inputs_sha`` records what the derived fields
were computed from, so a hand edit of the recipe or site in a plan is refused on load instead of
being applied in part; the run directory and the rollout total are the edits it honours.
"""

from __future__ import annotations

import hashlib
import json
import os
import string
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from beam_hpc.config.recipe import Recipe, format_walltime, parse_walltime, recipe_from_dict
from beam_hpc.config.site import Site, site_from_dict
from beam_hpc.errors import InputError, shorten
from beam_hpc.plan import local_disk
from beam_hpc.plan.local_disk import DeclaredTmpDisk
from beam_hpc.plan.paths import PLAN_FILE, RunPaths

PLAN_VERSION = 2  # 2: inputs_sha, and the run directory reaches the driver command as {run_dir}

# Placeholders a job fills in (beam_hpc.plan.plan.fill); nothing else is templated. ``num_rollout``
# is the total the segment runs to: the plan's, or the segment's own ``--num-rollout`` (a resume may
# change it, the seed's semantics), so the driver's command is completed in the job, never baked.
PLACEHOLDERS = ("job_id", "nvme_dir", "head_ip", "ray_address", "run_dir", "num_rollout")
# The run directory as the driver command names it: the job fills it with the plan's output_dir, so
# a plan whose output_dir was edited by hand runs its driver there too.
RUN_DIR = "{run_dir}"
# Recipe fields a hand edit of the plan may change: nothing derived holds their value (the driver
# command has {run_dir} and {num_rollout}; run_id and the NVMe directory are derived again on load).
FREE_RECIPE_FIELDS = ("output_dir", "num_rollout")


@dataclass(frozen=True)
class DriverCommand:
    """The backend's driver: argv and environment, Plan placeholders unfilled. The backend computes
    it (it may read the model's config.json or run its model script) and make_plan stores it."""

    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class GroupPlan:
    """One heterogeneous component: ``srun --het-group=<het_index>`` starts one node step per node.

    It carries every per-group Slurm resource already resolved from the site (partition,
    constraint, local disk), so that the sbatch script, submitit and the job read them here and
    nobody re-implements the site's per-group fallbacks."""

    name: str  # trainer | rollout
    het_index: int
    nodes: int
    gpus_per_node: int
    cpus_per_node: int | None
    partition: str | None
    roles: tuple[str, ...]  # ("trainer",), ("rollout",) or ("trainer", "rollout") when colocated
    stage_nvme: bool  # stage the optimizer dir on these nodes
    constraint: str | None = None  # --constraint for this group's nodes
    tmp: str | None = None  # --tmp: node-local disk each node of the group must have
    tmp_why: str = ""  # why tmp is what it is (beam_hpc.plan.local_disk): shown by submit and --dry-run

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
    """Everything a run's jobs need. Frozen and typed: ``recipe`` and ``site`` are the validated
    objects, never dicts; inside the allocation it is read from plan.json and never written back
    (what a segment learns goes into the ledger and its segment directory instead)."""

    version: int
    run_id: str
    job_name: str
    output_dir: str
    recipe: Recipe
    site: Site
    identity_sha: str
    groups: tuple[GroupPlan, ...]
    walltime_s: int
    lead_s: int
    nvme: NvmePlan
    driver_argv: tuple[str, ...]
    driver_env: dict[str, str] = field(default_factory=dict)
    inputs_sha: dict[str, str] = field(default_factory=dict)  # section -> digest (:func:`inputs_sha`)

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

    @property
    def node_python(self) -> str:
        """The interpreter that runs beam-hpc and backend code on the nodes (Site.node_python)."""
        return self.site.node_python

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["recipe"] = self.recipe.model_dump(mode="json")
        d["site"] = self.site.model_dump(mode="json")
        d["groups"] = [asdict(g) for g in self.groups]
        d["nvme"] = asdict(self.nvme)
        d["driver_argv"] = list(self.driver_argv)
        return d

    def to_json(self) -> str:
        return to_json(self.to_dict())

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        """A Plan from plan.json's mapping. The recipe and site are validated again, so a plan
        edited by hand into something invalid is refused here, naming the field; an edit of a
        field the derived ones came from is refused too (:func:`edited_inputs`). The run directory
        may be edited (both ``output_dir`` lines): what is derived from it is derived again here."""
        if d.get("version") != PLAN_VERSION:
            raise InputError(f"plan.json version {d.get('version')} is not {PLAN_VERSION}; re-render the run")
        d = dict(d)
        d["recipe"] = recipe = recipe_from_dict(d["recipe"], "plan.json recipe")
        d["site"] = site = site_from_dict(d["site"], "plan.json site")
        recorded = d.get("inputs_sha")
        if not isinstance(recorded, dict):
            raise InputError(f"inputs_sha: {shorten(recorded, 60)} is not the plan's record of what it was made "
                             "from; render the script again (beam-hpc render -o FILE) or submit the run again")
        problems = edited_inputs(recorded, recipe, site)
        output_dir = os.path.normpath(recipe.output_dir)
        if os.path.normpath(str(d["output_dir"])) != output_dir:
            problems.append(f"output_dir: {shorten(d['output_dir'])} but recipe.output_dir {shorten(recipe.output_dir)}; "
                            "the run directory is written twice in the plan: give both the same value")
        if problems:
            raise InputError("\n".join(problems))
        d["output_dir"] = output_dir
        d["run_id"] = run_id_for(output_dir)
        d["groups"] = tuple(GroupPlan(**{**g, "roles": tuple(g["roles"])}) for g in d["groups"])
        nvme = NvmePlan(**d["nvme"])
        d["nvme"] = replace(nvme, job_dir=nvme_job_dir(nvme.root, d["run_id"]))
        d["driver_argv"] = tuple(d["driver_argv"])
        return cls(**d)

    def with_num_rollout(self, n: int) -> Plan:
        """The same plan with another total ``num_rollout`` (the seed lets a resume change it)."""
        return replace(self, recipe=self.recipe.model_copy(update={"num_rollout": n}))

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        p = Path(path)
        if p.is_dir():
            p = p / PLAN_FILE
        return cls.from_dict(json.loads(p.read_text()))

    def write(self) -> Path:
        """Write plan.json atomically (the only I/O this module does, and only when asked)."""
        from beam_hpc.files import write_atomic  # stdlib-only helper; lazy: plan stays import-light

        out = Path(self.paths.plan)
        write_atomic(out, self.to_json())
        return out


def load_plan(path: str | Path) -> Plan:
    """A run's plan.json, or InputError naming the file (missing, torn, or edited into something
    invalid): every launch way (submit, execute, the segment itself) answers a damaged run
    directory the same way, exit 2, before it writes anything."""
    try:
        return Plan.load(path)
    except FileNotFoundError:
        raise InputError(f"{path}: no such plan; submit the run (beam-hpc submit) or render its script") from None
    except InputError as err:
        raise InputError(f"{path}: {err}") from None
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as err:
        raise InputError(f"{path}: not a readable plan ({type(err).__name__}: {shorten(str(err))}); the run "
                         "directory is damaged: move plan.json aside and submit the run again with --resume "
                         "(it writes the plan anew), or use another --output-dir") from None


def to_json(value: Any) -> str:
    """JSON with two-space indents and sorted keys, a list of scalars on one line (a driver argv of
    a hundred flags stays one line of the script); ``json.loads`` reads it back as ``json.dumps``'s."""

    def write(v: Any, depth: int) -> str:
        pad, inner = "  " * depth, "  " * (depth + 1)
        if isinstance(v, dict) and v:
            items = (f"{inner}{json.dumps(str(k))}: {write(v[k], depth + 1)}" for k in sorted(v))
            return "{\n" + ",\n".join(items) + f"\n{pad}}}"
        if isinstance(v, (list, tuple)) and any(isinstance(x, (dict, list, tuple)) for x in v):
            return "[\n" + ",\n".join(f"{inner}{write(x, depth + 1)}" for x in v) + f"\n{pad}]"
        return json.dumps(list(v) if isinstance(v, tuple) else v)

    return write(value, 0)


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:12]


def inputs_sha(recipe: Recipe, site: Site) -> dict[str, str]:
    """A digest of each recipe section (but :data:`FREE_RECIPE_FIELDS`) and of the site: what the
    derived fields (the driver command, groups, lead, NVMe plan) were computed from."""
    sections: dict[str, Any] = {f"recipe.{k}": v for k, v in recipe.model_dump(mode="json").items()
                                if k not in FREE_RECIPE_FIELDS}
    sections["site"] = site.model_dump(mode="json")
    return {k: _digest(v) for k, v in sorted(sections.items())}


def edited_inputs(recorded: dict[str, str], recipe: Recipe, site: Site) -> list[str]:
    """One line per section of ``recipe``/``site`` whose digest is not the ``recorded`` one: the
    plan was edited after it was made, and its derived fields still hold the old values."""
    now = inputs_sha(recipe, site)
    dump = recipe.model_dump(mode="json")
    lines = []
    for key in sorted(now.keys() | recorded.keys()):
        if now.get(key) == recorded.get(key):
            continue
        name = key.removeprefix("recipe.")
        how = ("change the site file and render again (`beam-hpc render RECIPE --site SITE -o FILE`)"
               if key == "site" else
               f"render again with the change (`beam-hpc render RECIPE --site SITE --set "
               f"{name}{'.FIELD' if isinstance(dump.get(name), dict) else ''}=VALUE -o FILE`)")
        lines.append(f"{key}: edited after the plan was made, but the driver command, groups and lead were "
                     f"computed from the old value, so the edit would apply only in part; {how}, or submit "
                     f"the run again (only {' and '.join(FREE_RECIPE_FIELDS)} may be edited in a plan)")
    return lines


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


def nvme_job_dir(root: str, run_id: str) -> str:
    """The NVMe directory of one job of a run (``{job_id}`` filled in the job)."""
    return f"{root.rstrip('/')}/{run_id}/{{job_id}}"


def require_absolute_paths(recipe: Recipe) -> None:
    """InputError unless the recipe's paths are absolute (every node and later segment reads them)."""
    for field_name, value in (("output_dir", recipe.output_dir), ("data.dir", recipe.data.dir),
                              ("model.path", recipe.model.path)):
        if not os.path.isabs(value):
            raise InputError(
                f"{field_name}: {value!r} is relative; give an absolute path on shared storage "
                f"(every node and every later segment reads it), e.g. --set {field_name}=/shared/..."
            )


def make_plan(recipe: Recipe, site: Site, *, driver: DriverCommand, measured: dict[str, float] | None = None,
              tmp_disk: DeclaredTmpDisk | None = None) -> Plan:
    """Recipe + site -> Plan. Raises InputError for impossible combinations, before any allocation.
    ``driver``: the backend's driver command (``beam_hpc.backends.registry.driver_command``; the
    backend's own checks ran there). ``tmp_disk``: what Slurm says the partitions' nodes declare as
    TmpDisk (asked by the caller, beam_hpc.submission.tmp_disk; None: not asked), which decides
    each group's ``--tmp``. Pure: reads no file, runs no process, reads no environment."""
    require_absolute_paths(recipe)
    output_dir = os.path.normpath(recipe.output_dir)
    groups = _groups(recipe, site, tmp_disk)
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
        job_dir=nvme_job_dir(nvme_root, run_id),
        min_free_gb=off.min_free_gb,
    )
    return Plan(
        version=PLAN_VERSION,
        run_id=run_id,
        job_name=f"beam-{recipe.name}-{run_id[:6]}",
        output_dir=output_dir,
        recipe=recipe,
        site=site,
        identity_sha=identity_sha(recipe),
        groups=groups,
        walltime_s=walltime_s,
        lead_s=lead_s,
        nvme=nvme,
        driver_argv=tuple(driver.argv),
        driver_env=dict(driver.env),
        inputs_sha=inputs_sha(recipe, site),
    )


def _groups(recipe: Recipe, site: Site, tmp_disk: DeclaredTmpDisk | None) -> tuple[GroupPlan, ...]:
    topo = recipe.topology
    colocated = recipe.training.colocated
    off = recipe.training.offload
    stage = off.target == "nvme"

    def group(name: str, het_index: int, spec: Any, roles: tuple[str, ...], stage_nvme: bool) -> GroupPlan:
        partition = site.partitions.for_group(name)
        disk = local_disk.decide(name, spec.nodes, partition, site_tmp=site.tmp, min_free_gb=off.min_free_gb,
                                 nvme_dir=off.nvme_dir, declared=tmp_disk) if stage_nvme else None
        return GroupPlan(
            name=name, het_index=het_index, nodes=spec.nodes, gpus_per_node=spec.gpus_per_node,
            cpus_per_node=spec.cpus_per_node or site.cpus_per_node, partition=partition,
            roles=roles, stage_nvme=stage_nvme, constraint=site.constraints.for_group(name),
            tmp=disk.request if disk else None, tmp_why=disk.why if disk else "",
        )

    out = [group("trainer", 0, topo.trainer, ("trainer", "rollout") if colocated else ("trainer",), stage)]
    if topo.rollout is not None:
        out.append(group("rollout", 1, topo.rollout, ("rollout",), False))
    for g in out:
        if g.gpus_per_node > site.gpus_per_node:
            raise InputError(
                f"topology.{g.name}.gpus_per_node: {g.gpus_per_node} GPUs per node, but site "
                f"{site.name!r} nodes have {site.gpus_per_node}; lower it or use another site"
            )
    return tuple(out)


def fill(template: str, **values: str) -> str:
    """Expand the Plan's ``{placeholders}``; an unknown or missing one is a bug, so it raises."""
    fields = {f for _, f, _, _ in string.Formatter().parse(template) if f}
    unknown = fields - set(PLACEHOLDERS)
    if unknown:
        raise KeyError(f"unknown placeholder(s) {sorted(unknown)} in {template!r}")
    return template.format(**{k: values[k] for k in fields})


def sbatch_time(plan: Plan) -> str:
    return format_walltime(plan.walltime_s)
