"""The Plan: everything a run's jobs need, computed once from recipe + site by pure code.

The Plan is written to ``<output-dir>/plan.json`` (and embedded in a rendered script); everything
inside the allocation reads it rather than derive anything again. :func:`make_plan` is a pure function of
its arguments (no I/O, no process, no clock, no environment): what only the disk or the model
script can tell (the backend's driver command, Slurm's TmpDisk) the caller computes and hands in as
data (``beam_hpc.backends.registry.plan_for`` does it for the driver). Values that exist only once
Slurm has started the job (job id, node addresses, the run directory as the job reads it) appear as
``{placeholders}`` that :func:`fill` expands there.

plan.json keeps make_plan's inputs (the recipe, the site, the measured :class:`Facts` and the
driver command) beside what it derived from them (groups, walltime, lead, NVMe plan, ids). A
derived value is baked into more than one place (the script's ``#SBATCH`` lines, the ``--signal``
lead, the driver's argv), so an edit of one copy would apply only in part. Loading therefore runs
make_plan again on the inputs and refuses (InputError, one line per field: the field, its value,
the fix) a derived field that differs from what make_plan gives, and ``inputs_sha`` refuses an
edit of an input the others were computed from (the driver command was computed from the recipe
and site by the backend, which this pure module cannot run again). The run directory and the
rollout total are the edits it honours: what derives from them is derived again.
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
from beam_hpc.plan.local_disk import DeclaredTmpDisk, TmpDisk
from beam_hpc.plan.paths import PLAN_FILE, RunPaths

PLAN_VERSION = 3  # 3: facts, and every derived field is checked against make_plan on load

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
class Facts:
    """What was measured when the plan was made: make_plan's inputs besides the recipe and site,
    kept in the plan so that loading it can derive the same fields again. ``measured``: per-step
    timings (``rollout_s``, ``save_s``) that raise the lead; ``tmp_disk``: what Slurm (sinfo) said
    the staging partitions' nodes declare as TmpDisk, per partition as the site names it (None:
    not asked; an asked partition missing from it: Slurm could not say)."""

    measured: dict[str, float] | None = None
    tmp_disk: tuple[tuple[str | None, TmpDisk], ...] | None = None

    @classmethod
    def of(cls, measured: dict[str, float] | None, tmp_disk: DeclaredTmpDisk | None) -> Facts:
        declared = None if tmp_disk is None else tuple(
            sorted(tmp_disk.items(), key=lambda kv: (kv[0] is not None, kv[0] or "")))
        return cls(None if measured is None else {k: float(v) for k, v in sorted(measured.items())}, declared)

    def declared(self) -> dict[str | None, TmpDisk] | None:
        return None if self.tmp_disk is None else dict(self.tmp_disk)

    def to_dict(self) -> dict[str, Any]:
        disk = None if self.tmp_disk is None else [
            {"asked": asked, "partition": t.partition, "node_mb": list(t.node_mb)} for asked, t in self.tmp_disk]
        return {"measured": self.measured, "tmp_disk": disk}

    @classmethod
    def from_dict(cls, d: Any) -> Facts:
        """The facts of plan.json; InputError when they are not what a plan writes."""
        try:
            measured = d["measured"]
            disk = d["tmp_disk"]
            return cls.of(None if measured is None else {str(k): float(v) for k, v in measured.items()},
                          None if disk is None else {e["asked"]: TmpDisk(str(e["partition"]), tuple(int(n) for n in e["node_mb"]))
                                                     for e in disk})
        except (TypeError, KeyError, ValueError, AttributeError):
            raise InputError(f"facts: {shorten(d, 60)} is not what a plan records of Slurm's answers and the "
                             "measured timings; render the script again (beam-hpc render -o FILE) or submit "
                             "the run again") from None


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
    facts: Facts = field(default_factory=Facts)

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
        d["facts"] = self.facts.to_dict()
        return d

    def to_json(self) -> str:
        return to_json(self.to_dict())

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        """A Plan from plan.json's mapping: make_plan run again on the inputs it keeps (recipe,
        site, facts, driver command). The recipe and site are validated again, so a plan edited by
        hand into something invalid is refused here, naming the field; so is an edit of an input
        the others were computed from (:func:`edited_inputs`) and an edit of a derived field
        (:func:`edited_derived`). The run directory may be edited (both ``output_dir`` lines): what
        derives from it is derived again, but the job name, which the script's ``--job-name``
        carries, stays."""
        if d.get("version") != PLAN_VERSION:
            raise InputError(f"plan.json version {d.get('version')} is not {PLAN_VERSION}; re-render the run (a script: "
                             "beam-hpc render -o FILE; a run directory: move plan.json aside and submit the run "
                             "again with --resume, which writes the plan anew)")
        unknown = sorted(set(d) - {f.name for f in fields(cls)})
        if unknown:
            raise InputError(f"{unknown[0]}: not a field of a plan; remove it, or render the script again "
                             "(beam-hpc render -o FILE)")
        recipe = recipe_from_dict(d["recipe"], "plan.json recipe")
        site = site_from_dict(d["site"], "plan.json site")
        recorded = d.get("inputs_sha")
        if not isinstance(recorded, dict):
            raise InputError(f"inputs_sha: {shorten(recorded, 60)} is not the plan's record of what it was made "
                             "from; render the script again (beam-hpc render -o FILE) or submit the run again")
        facts = Facts.from_dict(d.get("facts"))
        driver = DriverCommand(tuple(str(a) for a in d["driver_argv"]), dict(d.get("driver_env") or {}))
        problems = edited_inputs(recorded, recipe, site, driver=driver, facts=facts)
        output_dir = os.path.normpath(recipe.output_dir)
        if os.path.normpath(str(d["output_dir"])) != output_dir:
            problems.append(f"output_dir: {shorten(d['output_dir'])} but recipe.output_dir {shorten(recipe.output_dir)}; "
                            "the run directory is written twice in the plan: give both the same value")
        if [p for p in problems if not p.startswith("driver_argv:")]:  # the derived fields follow the edit
            raise InputError("\n".join(problems))
        made = make_plan(recipe, site, driver=driver, measured=facts.measured, tmp_disk=facts.declared())
        moved = recorded.get(OUTPUT_DIR_SHA) != made.inputs_sha[OUTPUT_DIR_SHA]
        if moved:  # the job name stays the header's, and the record of the rendered directory stays, so
            # that the plan.json the job writes from this plan loads the same way again
            made = replace(made, job_name=str(d["job_name"]),
                           inputs_sha={**made.inputs_sha, OUTPUT_DIR_SHA: str(recorded.get(OUTPUT_DIR_SHA))})
        problems += edited_derived(d, made, moved=moved)  # no derived field comes from the driver command
        if problems:
            raise InputError("\n".join(problems))
        return made

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


# inputs_sha's record of the run directory: not an input a plan refuses an edit of, but how a load
# tells an output_dir edit (then run_id, job_name and the NVMe directory follow it) from an edit of
# a field derived from it.
OUTPUT_DIR_SHA = "output_dir"


def inputs_sha(recipe: Recipe, site: Site, *, driver: DriverCommand, facts: Facts) -> dict[str, str]:
    """A digest of each recipe section (but :data:`FREE_RECIPE_FIELDS`), of the site, of the
    driver command and of the facts: what the derived fields were computed from. Plus the run
    directory's (:data:`OUTPUT_DIR_SHA`)."""
    sections: dict[str, Any] = {f"recipe.{k}": v for k, v in recipe.model_dump(mode="json").items()
                                if k not in FREE_RECIPE_FIELDS}
    sections["site"] = site.model_dump(mode="json")
    sections["driver"] = {"argv": list(driver.argv), "env": dict(driver.env)}
    sections["facts"] = facts.to_dict()
    sections[OUTPUT_DIR_SHA] = os.path.normpath(recipe.output_dir)
    return {k: _digest(v) for k, v in sorted(sections.items())}


def edited_inputs(recorded: dict[str, str], recipe: Recipe, site: Site, *, driver: DriverCommand,
                  facts: Facts) -> list[str]:
    """One line per input section whose digest is not the ``recorded`` one: the plan was edited
    after it was made, and what was computed from that section still holds the old value."""
    now = inputs_sha(recipe, site, driver=driver, facts=facts)
    dump = recipe.model_dump(mode="json")
    lines = []
    for key in sorted((now.keys() | recorded.keys()) - {OUTPUT_DIR_SHA}):
        if now.get(key) == recorded.get(key):
            continue
        name = key.removeprefix("recipe.")
        again = "render again (`beam-hpc render RECIPE --site SITE -o FILE`) or submit the run again"
        if key == "driver":
            lines.append(f"driver_argv: {shorten(' '.join(driver.argv), 80)} (or driver_env) edited after the plan "
                         "was made; the backend computes the driver command from the recipe and site, so the edit "
                         f"would disagree with them: change the recipe (`--set FIELD=VALUE`) and {again}")
            continue
        if key == "facts":
            lines.append(f"facts: {shorten(facts.to_dict(), 80)} edited after the plan was made; they are what "
                         f"Slurm said and what was measured when it was made, and the groups' --tmp and the lead "
                         f"were derived from them: {again}, which asks again")
            continue
        how = ("change the site file and render again (`beam-hpc render RECIPE --site SITE -o FILE`)"
               if key == "site" else
               f"render again with the change (`beam-hpc render RECIPE --site SITE --set "
               f"{name}{'.FIELD' if isinstance(dump.get(name), dict) else ''}=VALUE -o FILE`)")
        lines.append(f"{key}: edited after the plan was made, but the driver command, groups and lead were "
                     f"computed from the old value, so the edit would apply only in part; {how}, or submit "
                     f"the run again (only {' and '.join(FREE_RECIPE_FIELDS)} may be edited in a plan)")
    return lines


# The derived fields a load compares with make_plan's, and (per field) where their value comes from.
DERIVED = ("run_id", "job_name", "identity_sha", "groups", "walltime_s", "lead_s", "nvme")
FOLLOW_OUTPUT_DIR = ("run_id", "job_name", "nvme.job_dir")  # derived from the run directory
_GROUP_SOURCE = {"nodes": "topology.{g}.nodes", "gpus_per_node": "topology.{g}.gpus_per_node",
                 "cpus_per_node": "topology.{g}.cpus_per_node", "partition": "site:partitions",
                 "constraint": "site:constraints", "tmp": "training.offload.min_free_gb",
                 "tmp_why": "training.offload.min_free_gb", "stage_nvme": "training.offload.target",
                 "roles": "training.colocated"}
_SOURCE = {"walltime_s": "lifecycle.walltime", "lead_s": "lifecycle.lead_s", "identity_sha": "topology",
           "run_id": "output_dir", "job_name": "output_dir", "nvme": "training.offload"}


def _leaves(path: str, stored: Any, made: Any) -> list[tuple[str, Any, Any]]:
    """(path, stored, made) for each leaf where the two JSON values differ."""
    if isinstance(stored, dict) and isinstance(made, dict):
        return [x for k in sorted(stored.keys() | made.keys())
                for x in _leaves(f"{path}.{k}", stored.get(k), made.get(k))]
    if isinstance(stored, list) and isinstance(made, list) and len(stored) == len(made) and (
            any(isinstance(x, (dict, list)) for x in made)):
        return [x for i, (a, b) in enumerate(zip(stored, made, strict=True)) for x in _leaves(f"{path}[{i}]", a, b)]
    return [] if stored == made else [(path, stored, made)]


def _source_of(path: str, made: Plan) -> str:
    """The recipe field (or ``site:`` field) a derived field's value comes from."""
    top = path.split(".")[0].split("[")[0]
    if top == "groups" and "[" in path:
        index = int(path.split("[")[1].split("]")[0])
        key = path.split(".")[-1]
        name = made.groups[index].name if index < len(made.groups) else "trainer"
        return _GROUP_SOURCE.get(key, "topology").format(g=name)
    return _SOURCE.get(top, "topology")


def edited_derived(stored: dict[str, Any], made: Plan, *, moved: bool) -> list[str]:
    """One line per derived field of the ``stored`` plan.json mapping that is not what make_plan
    ``made`` of its inputs: a hand edit that would apply only in part (the script's ``#SBATCH``
    lines, its ``--signal`` lead and the driver's argv were made from the old value). ``moved``:
    the run directory was edited, and the fields that follow it are not compared."""
    want = json.loads(made.to_json())
    lines = []
    for key in DERIVED:
        for path, have, should in _leaves(key, stored.get(key), want[key]):
            if moved and path in FOLLOW_OUTPUT_DIR:
                continue
            source = _source_of(path, made)
            if source.startswith("site:"):
                fix = (f"change {source.removeprefix('site:')} in the site file and render again "
                       "(`beam-hpc render RECIPE --site SITE -o FILE`)")
            elif source == "output_dir":
                fix = "edit output_dir (both of its lines) instead, or render again (`beam-hpc render RECIPE --site SITE --set output_dir=DIR -o FILE`)"
            else:
                fix = (f"set {source} instead and render again (`beam-hpc render RECIPE --site SITE --set "
                       f"{source}=VALUE -o FILE`)")
            lines.append(f"{path}: {shorten(have, 60)} in the plan, but its recipe and site make it "
                         f"{shorten(should, 60)}; a derived field cannot be edited (the script's #SBATCH lines, "
                         f"its --signal and the driver command keep the old value, so the edit would apply "
                         f"only in part): {fix}, or submit the run again")
    return lines


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
    # This module's own fields first (none of them can be refused), then those that the modules
    # below compute (each group's local disk, the walltime, the identity): the recipe goes down the
    # layers once, and the refusals come in the order they always did (paths, groups, lead).
    output_dir = os.path.normpath(recipe.output_dir)
    run_id = run_id_for(output_dir)
    off = recipe.training.offload
    nvme = NvmePlan(
        enabled=off.target == "nvme",
        root=off.nvme_dir,
        job_dir=nvme_job_dir(off.nvme_dir, run_id),
        min_free_gb=off.min_free_gb,
    )
    lead_s = compute_lead_s(recipe, measured)
    facts = Facts.of(measured, tmp_disk)
    driver = DriverCommand(tuple(driver.argv), dict(driver.env))
    digests = inputs_sha(recipe, site, driver=driver, facts=facts)
    groups = _groups(recipe, site, tmp_disk)
    walltime_s = parse_walltime(recipe.lifecycle.walltime)
    if lead_s >= walltime_s:
        raise InputError(
            f"lifecycle.lead_s: {lead_s} s lead leaves no time in a {recipe.lifecycle.walltime} walltime; "
            "raise lifecycle.walltime or lower lifecycle.lead_s"
        )
    return Plan(
        version=PLAN_VERSION,
        run_id=run_id,
        job_name=f"beam-{recipe.name}-{run_id[:6]}",
        output_dir=output_dir,
        recipe=recipe,
        site=site,
        identity_sha=recipe.identity_sha(),
        groups=groups,
        walltime_s=walltime_s,
        lead_s=lead_s,
        nvme=nvme,
        driver_argv=driver.argv,
        driver_env=driver.env,
        inputs_sha=digests,
        facts=facts,
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
