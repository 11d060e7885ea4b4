"""Plan -> a heterogeneous sbatch script that people can read, edit and submit by hand.

The script is thin on purpose (DESIGN.md: shell is thin): ``#SBATCH`` lines, the site's lines
(:func:`site_lines`: environment, setup, module loads), then ``exec`` into ``python -m
beam_hpc.job.segment``, which does everything else. The plan travels inside the script, as a
quoted here-document on the segment's stdin after the ``exec`` line: a plain ``sbatch x.sbatch``
needs no other file (Slurm copies only the script into its spool, so a file beside it would have
to be found by an absolute path that a user's copy of the script no longer has), and a
resubmission or requeue runs the very same script. The job's output goes to the submit directory
(``%x-%j.out``), which exists whenever sbatch runs; beam-hpc's own submissions and resubmissions
put it under the run's logs/ with ``--output`` on the sbatch line.
Job-level options (name, time, signal, requeue, output) go in the first component only: Slurm
applies them to the whole heterogeneous job. Per-component options (nodes, GPUs, partition,
account, constraint, ``--tmp``) are repeated for each component after ``#SBATCH hetjob``.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

from beam_hpc import __version__
from beam_hpc.config.site import Site
from beam_hpc.errors import InputError, shorten
from beam_hpc.plan.plan import GroupPlan, Plan, sbatch_time


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

    def sbatch_flags(self) -> list[str]:
        flags = [f"--nodes={self.nodes}", "--ntasks-per-node=1"]
        for name, value in (("partition", self.partition), ("account", self.account), ("qos", self.qos),
                            ("gres", self.gres), ("cpus-per-task", self.cpus_per_task), ("mem", self.mem),
                            ("constraint", self.constraint), ("tmp", self.tmp)):
            if value is not None and value != "":
                flags.append(f"--{name}={value}")
        if self.exclusive:
            flags.append("--exclusive")
        return flags


def component(plan: Plan, group: GroupPlan) -> Component:
    """The Slurm request of one node group: the group's own resources from the Plan, the
    site's job-wide ones (account, qos, gres name, memory, exclusivity)."""
    site = plan.site
    return Component(
        nodes=group.nodes,
        partition=group.partition or None,
        account=site.account or None,
        qos=site.qos or None,
        gres=f"{site.gres}:{group.gpus_per_node}" if group.gpus_per_node else None,
        cpus_per_task=group.cpus_per_node or None,
        mem=site.mem,
        constraint=group.constraint or None,
        tmp=group.tmp or None,
        exclusive=site.exclusive,
    )


def component_flags(plan: Plan, group: GroupPlan) -> list[str]:
    """The per-component ``#SBATCH`` flags of one node group."""
    return component(plan, group).sbatch_flags()


# The job's output when the script is submitted by hand: the submit directory always exists when
# sbatch runs, so Slurm can open it (a run directory's logs/ may not exist yet, and then Slurm
# ends the job at once with no output at all). beam-hpc's own sbatch lines pass --output under
# the run's logs/ instead (RunPaths.batch_log), and the segment links a hand-submitted job's
# output there.
HAND_OUTPUT = "%x-%j.out"
PLAN_HEREDOC = "BEAM_PLAN_JSON"


def job_flags(plan: Plan) -> list[str]:
    """Job-level flags: one name per run (segments chain with ``--dependency=afterany:<id>``; a
    propagated ``singleton`` deadlocks a hetjob on Slurm 22.05), the
    walltime, the walltime warning to the batch shell, requeue on preemption, appended logs."""
    flags = [
        f"--job-name={plan.job_name}",
        f"--time={sbatch_time(plan)}",
        f"--signal=B:USR1@{plan.lead_s}",
        "--open-mode=append",
        f"--output={HAND_OUTPUT}",
    ]
    flags.append("--requeue" if plan.recipe.lifecycle.requeue_on_preemption else "--no-requeue")
    return flags


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


def render_script(plan: Plan, *, source: str = "") -> str:
    """The whole sbatch script for a plan, with the plan inside it."""
    site = plan.site
    lines = ["#!/bin/bash"]
    lines.append(f"# Generated by beam-hpc {__version__}{' from ' + source if source else ''}.")
    lines.append(f"# Run {plan.run_id}: {plan.total_nodes} nodes / {plan.total_gpus} GPUs, output in {plan.output_dir}")
    lines.append("# Submit: sbatch THIS_FILE        Resume a run: sbatch THIS_FILE --resume [--num-rollout N]")
    lines.append("# The run's plan is the JSON at the end of this file: the job writes it to plan.json.")
    lines.append("# Edits to --time are fine; --nodes/--gres must match the plan's groups (the job checks).")
    for i, group in enumerate(plan.groups):
        if i:
            lines.append("#SBATCH hetjob")
        lines.append(f"# --- het group {group.het_index}: {group.name} ({'+'.join(group.roles)}) ---")
        flags = (job_flags(plan) if i == 0 else []) + component_flags(plan, group)
        lines.extend(f"#SBATCH {f}" for f in flags)
        lines.extend(f"#SBATCH {f}" for f in site.sbatch_extra)
    lines.append("")
    lines.append("set -eo pipefail")
    lines.extend(site_lines(site))
    lines.append(segment_command(plan))
    plan_json = plan.to_json()
    if any(line == PLAN_HEREDOC for line in plan_json.splitlines()):  # cannot happen with JSON's quoting
        raise InputError(f"the plan contains a line {PLAN_HEREDOC!r}, which would end its here-document")
    lines.append(plan_json)
    lines.append(PLAN_HEREDOC)
    return "\n".join(lines) + "\n"


def write_script(plan: Plan, path: str | Path, *, source: str = "") -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(render_script(plan, source=source))
    p.chmod(0o755)
    return p
