"""Every batch script beam-hpc writes, from one renderer: :class:`BatchJob` -> :func:`render_batch`.

A script is thin: ``#SBATCH`` lines, the site block (:func:`site_lines`: environment, setup, module
loads, in that order, since a site's setup may define ``module``), then a body that execs Python.
The run's hetjob script (:func:`render_script`), the Miles conversion job and the tests' own scripts
are all a :class:`BatchJob`, so their site lines cannot drift apart. The run's plan travels inside
its script, as a quoted here-document on the segment's stdin: a plain ``sbatch x.sbatch`` needs no
other file (Slurm spools only the script), and a resubmission or requeue runs the very same script.
Job-level options (name, time, signal, requeue, output) go in the first component only: Slurm
applies them to the whole heterogeneous job. Per-component options (nodes, GPUs, partition,
account, constraint, ``--tmp``) and the site's extra lines are repeated after each ``#SBATCH hetjob``.
A hand-submitted job's output goes to the submit directory (``%x-%j.out``); beam-hpc's own
submissions put it under the run's logs/ with ``--output`` on the sbatch line.

The submitit path (``beam_hpc.submission.via_submitit``) takes each component's options from the
same :meth:`Component.options`, and ``beam_hpc.slurm.submitit_het`` writes its ``#SBATCH`` lines
with :func:`sbatch_option` and :func:`directive`: there is one writer of option text.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, replace

from beam_hpc.config.site import Site
from beam_hpc.errors import InputError, shorten
from beam_hpc.plan.node_loss import NodeLossAction, keeps_the_job, on_node_loss
from beam_hpc.plan.plan import GroupPlan, Plan, sbatch_time
from beam_hpc.version import __version__

HETJOB = "#SBATCH hetjob"  # the line between two components of a heterogeneous job


def sbatch_option(name: str, value: str | int | bool) -> str:
    """One sbatch option as every beam-hpc script writes it: ``--name=value``, or ``--name`` for a
    flag (``True``). An empty value stays (``--dependency=`` clears an inherited one)."""
    return f"--{name}" if value is True else f"--{name}={value}"


def directive(option: str) -> str:
    """An option as a batch script's ``#SBATCH`` line."""
    return f"#SBATCH {option}"


@dataclass(frozen=True)
class Component:
    """What one heterogeneous component asks Slurm for, as values (not flag text): the sbatch
    script renders it as ``#SBATCH`` lines, the submitit path passes the same values as executor
    parameters, so neither parses the other's output."""

    nodes: int
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    gres: str | None = None  # e.g. "gpu:8"
    cpus_per_task: int | None = None
    mem: str | None = None
    constraint: str | None = None
    tmp: str | None = None
    exclusive: bool = False
    no_kill: bool = False  # --no-kill: a node's failure does not revoke the component (see keeps_the_job)

    def options(self) -> dict[str, str | int | bool]:
        """The component's sbatch options by name, in the order the script writes them: the
        values both the rendered script and the submitit path use."""
        opts: dict[str, str | int | bool] = {"nodes": self.nodes, "ntasks-per-node": 1}
        for name, value in (("partition", self.partition), ("account", self.account), ("qos", self.qos),
                            ("gres", self.gres), ("cpus-per-task", self.cpus_per_task), ("mem", self.mem),
                            ("constraint", self.constraint), ("tmp", self.tmp)):
            if value is not None and value != "":
                opts[name] = value
        if self.exclusive:
            opts["exclusive"] = True
        if self.no_kill:
            opts["no-kill"] = True
        return opts

    def sbatch_flags(self) -> list[str]:
        return [sbatch_option(name, value) for name, value in self.options().items()]


def site_component(site: Site, *, nodes: int, gpus_per_node: int, partition: str | None = None,
                   cpus_per_task: int | None = None, constraint: str | None = None,
                   tmp: str | None = None) -> Component:
    """A request for ``nodes`` nodes of ``gpus_per_node`` GPUs each, with the site's job-wide
    options (account, qos, gres name, memory, exclusivity): what every job beam-hpc submits asks."""
    return Component(
        nodes=nodes,
        partition=partition or None,
        account=site.account or None,
        qos=site.qos or None,
        gres=f"{site.gres}:{gpus_per_node}" if gpus_per_node else None,
        cpus_per_task=cpus_per_task or None,
        mem=site.mem,
        constraint=constraint or None,
        tmp=tmp or None,
        exclusive=site.exclusive,
    )


def asks_no_kill(plan: Plan) -> bool:
    """Whether the run's job asks Slurm not to revoke it when a node fails (``--no-kill``): when
    one of its groups must outlive a node's loss, to train on without it or to save before the
    segment ends (beam_hpc.plan.node_loss). Then every component asks it, because Slurm
    22.05.8 applies one component's node failure to every component of the heterogeneous job
    (measured on the local cluster: slurmctld logged "Removing failed node n6" for the component
    that did not hold n6 as well) and keeps a component only with ``--no-kill`` and more than one
    node; a one-node component, or one without it, is killed, which ends (or, with
    ``--requeue``, requeues) the whole job. So a trainer group of one node still loses the job
    to any node's failure: the docs say so. ``--no-kill`` on the trainer component is safe:
    the segment's own watch of its node steps ends the segment on a trainer node's loss, naming
    the node (a failed node, excluded next time) where Slurm's kill would record a preemption."""
    return any(keeps_the_job(plan, g) for g in plan.groups)


def no_kill_notes(plan: Plan) -> tuple[str, ...]:
    """The script's words on ``--no-kill`` (none when the job does not ask it)."""
    if not asks_no_kill(plan):
        return ()
    single = [g.name for g in plan.groups if g.nodes < 2]
    if any(on_node_loss(plan, g) is NodeLossAction.GO_ON for g in plan.groups):
        out = ("--no-kill: a lost rollout node does not end the job; the segment goes on and asks for a replacement.",)
    else:
        out = ("--no-kill: a lost rollout node does not end the job at once; the segment saves at the next rollout "
               "boundary and trains on once a replacement node has joined in its place, or ends and is resubmitted "
               "without the node.",)
    if single:
        out += (f"Slurm 22.05 still ends it on any node's failure while a component has one node ({', '.join(single)}).",)
    return out


def component(plan: Plan, group: GroupPlan) -> Component:
    """The Slurm request of one node group: the group's own resources from the Plan, the
    site's job-wide ones, and ``--no-kill`` when the run goes on without a lost rollout node."""
    return replace(site_component(plan.site, nodes=group.nodes, gpus_per_node=group.gpus_per_node,
                                  partition=group.partition, cpus_per_task=group.cpus_per_node,
                                  constraint=group.constraint, tmp=group.tmp), no_kill=asks_no_kill(plan))


# The job's output when the script is submitted by hand: the submit directory always exists when
# sbatch runs, so Slurm can open it (a run directory's logs/ may not exist yet, and then Slurm
# ends the job at once with no output at all). beam-hpc's own sbatch lines pass --output under
# the run's logs/ instead (RunPaths.batch_log), and the segment links a hand-submitted job's
# output there.
HAND_OUTPUT = "%x-%j.out"
PLAN_HEREDOC = "BEAM_PLAN_JSON"


@dataclass(frozen=True)
class BatchJob:
    """One batch script as values: the job-level options, one :class:`Component` per (hetjob)
    component, the site whose lines prepare the batch shell, and the body that runs after them
    (shell lines, usually ending in an ``exec``). :func:`render_batch` writes it."""

    name: str
    time: str  # Slurm's time format
    output: str  # --output, may hold %x / %j
    components: tuple[Component, ...]
    site: Site
    body: tuple[str, ...]
    requeue: bool = False
    signal: str | None = None  # --signal, e.g. "B:USR1@120"
    open_mode: str | None = None  # --open-mode, e.g. "append"
    notes: tuple[str, ...] = ()  # comment lines under the shebang
    labels: tuple[str, ...] = ()  # a comment line above each component's directives

    def job_flags(self) -> list[str]:
        """The job-level flags, written in the first component only."""
        flags = [f"--job-name={self.name}", f"--time={self.time}"]
        if self.signal:
            flags.append(f"--signal={self.signal}")
        if self.open_mode:
            flags.append(f"--open-mode={self.open_mode}")
        flags.append(f"--output={self.output}")
        flags.append("--requeue" if self.requeue else "--no-requeue")
        return flags


def render_batch(job: BatchJob) -> str:
    """The script's text: shebang and notes, the ``#SBATCH`` header (job flags in the first
    component, then each component's own flags and the site's extra lines), the site block, the body."""
    if not job.components:
        raise ValueError("a batch job needs at least one component")
    if job.labels and len(job.labels) != len(job.components):
        raise ValueError(f"{len(job.labels)} labels for {len(job.components)} components")
    lines = ["#!/bin/bash", *(f"# {note}" for note in job.notes)]
    for i, comp in enumerate(job.components):
        if i:
            lines.append(HETJOB)
        if job.labels:
            lines.append(f"# {job.labels[i]}")
        flags = (job.job_flags() if i == 0 else []) + comp.sbatch_flags() + list(job.site.sbatch_extra)
        lines.extend(directive(f) for f in flags)
    # sbatch (22.05, checked on the local cluster) drops the empty lines of a heterogeneous job's
    # script: writing none there makes the script on disk, and the dry run, the one Slurm keeps
    lines += [*([""] if len(job.components) == 1 else []), "set -eo pipefail", *site_lines(job.site), *job.body]
    return "\n".join(lines) + "\n"


def site_lines(site: Site) -> list[str]:
    """The site's shell lines, in the order they run: its environment (``export``), its setup lines
    (which may define ``module``, e.g. ``source /etc/profile.d/modules.sh``: a batch shell is not a
    login shell), then its module loads. The rendered script writes them; submitit gets the same
    list as its ``setup``, so both batch scripts prepare the job identically."""
    lines = [f"export {key}={shlex.quote(str(value))}" for key, value in sorted(site.env.items())]
    lines.extend(site.setup)
    lines.extend(f"module load {shlex.quote(mod)}" for mod in site.module_loads)
    return lines


def extra_parameters(site: Site) -> dict[str, str | bool]:
    """The site's ``sbatch_extra`` lines as sbatch options by name (``--hold`` -> {"hold": True},
    ``--reservation=r`` -> {"reservation": "r"}): what submitit's ``additional_parameters`` takes.
    Raises InputError for a line that is not a long sbatch option."""
    out: dict[str, str | bool] = {}
    for line in site.sbatch_extra:
        text = line.strip()
        if not text.startswith("--") or len(text) < 3:
            raise InputError(f"sbatch_extra: {shorten(line)} is not a long sbatch option; write it as "
                             "--name or --name=value (e.g. --reservation=big)")
        name, sep, value = text[2:].partition("=")
        if not sep and " " in name:
            name, _, value = name.partition(" ")
            sep = " "
        out[name.strip()] = value.strip() if sep else True
    return out


def segment_command(plan: Plan) -> str:
    """The line that runs the segment from a rendered script: the plan on stdin (the here-document
    that follows), the script itself as ``--script`` (so the segment can copy it to job.sbatch for
    the resubmissions and name an edited ``#SBATCH`` line), and the script's own arguments."""
    py = shlex.quote(plan.site.python)
    return f'exec {py} -m beam_hpc.job.segment --plan - --script "$0" "$@" <<\'{PLAN_HEREDOC}\''


def batch_job(plan: Plan, *, body: tuple[str, ...] = (), source: str = "") -> BatchJob:
    """The run's hetjob as a :class:`BatchJob`: one name per run (segments chain with
    ``--dependency=afterany:<id>``; a propagated ``singleton`` deadlocks a hetjob on Slurm 22.05),
    the walltime, its warning to the batch shell, requeue on preemption, appended logs."""
    notes = (
        f"Generated by beam-hpc {__version__}{' from ' + source if source else ''}.",
        f"Run {plan.run_id}: {plan.total_nodes} nodes / {plan.total_gpus} GPUs, output in {plan.output_dir}",
        "Submit: sbatch THIS_FILE        Resume a run: sbatch THIS_FILE --resume [--num-rollout N]",
        "The run's plan is the JSON at the end of this file: the job writes it to plan.json.",
        "Edits to --time are fine; --nodes/--gres must match the plan's groups (the job checks).",
    ) + no_kill_notes(plan)
    return BatchJob(
        name=plan.job_name, time=sbatch_time(plan), output=HAND_OUTPUT,
        components=tuple(component(plan, g) for g in plan.groups), site=plan.site, body=body,
        requeue=plan.recipe.lifecycle.requeue_on_preemption, signal=f"B:USR1@{plan.lead_s}", open_mode="append",
        notes=notes, labels=tuple(f"--- het group {g.het_index}: {g.name} ({'+'.join(g.roles)}) ---" for g in plan.groups),
    )


def render_script(plan: Plan, *, source: str = "") -> str:
    """The whole sbatch script for a plan, with the plan inside it."""
    plan_json = plan.to_json()
    if any(line == PLAN_HEREDOC for line in plan_json.splitlines()):  # cannot happen with JSON's quoting
        raise InputError(f"the plan contains a line {PLAN_HEREDOC!r}, which would end its here-document")
    body = (segment_command(plan), plan_json, PLAN_HEREDOC)
    return render_batch(batch_job(plan, body=body, source=source))

