"""One submission request: a Plan plus what this submission asks of it, scheduled one of three ways.

The request is materialized once: the batch script (which carries the plan), the plan, and the
segment's arguments (:class:`beam_hpc.plan.segment_args.SegmentArgs`). ``beam-hpc submit
--dry-run`` prints it, with the exact batch script its scheduler will get; ``--via sbatch`` hands
the script and arguments to sbatch (exactly what a user would type); ``--via submitit`` gives the
same plan and segment arguments to beam-hpc's submitit executor, whose script carries the same
site lines; ``beam-hpc execute`` runs the same segment on this machine; a resubmission inside the
job runs the same script with the next segment's SegmentArgs (beam_hpc.lifecycle.actions).
"""

from __future__ import annotations

import enum
import shlex
from dataclasses import dataclass
from pathlib import Path

from beam_hpc.plan.plan import Plan
from beam_hpc.plan.segment_args import SegmentArgs
from beam_hpc.slurm.script import render_script


class Via(enum.StrEnum):
    """How a request is scheduled."""

    SUBMITIT = "submitit"
    SBATCH = "sbatch"
    LOCAL = "local"  # beam-hpc execute: this machine, no Slurm


@dataclass(frozen=True)
class SubmitRequest:
    """Everything one submission does: the plan, the segment's arguments, the scheduler."""

    plan: Plan
    segment: SegmentArgs
    via: Via = Via.SUBMITIT
    dependency: str | None = None
    source: str = ""  # what the plan was made from, for the script's header
    # nodes the job must not get: the run's failed nodes (resuming) and the site's quarantine,
    # decided before the dry run returns so that it prints them (--exclude, in every component)
    exclude: tuple[str, ...] = ()

    @property
    def script(self) -> Path:
        """The run directory's batch script (written by every submission, used by resubmissions)."""
        return Path(self.plan.paths.script)

    def script_text(self) -> str:
        """The rendered batch script (with the plan in it) that sbatch runs and resubmissions reuse."""
        return render_script(self.plan, source=self.source)

    @property
    def uses_sbatch(self) -> bool:
        return self.via is Via.SBATCH or self.segment.smoke

    def sbatch_argv(self) -> list[str]:
        """The sbatch command line of this request (``--via sbatch``, and ``--smoke``); the job's
        output goes under the run's logs/ (which the submission creates)."""
        cmd = ["sbatch", "--parsable"]
        if self.dependency:
            cmd.append(f"--dependency={self.dependency}")
        if self.exclude:
            cmd.append(f"--exclude={','.join(self.exclude)}")
        cmd.append(f"--output={self.plan.paths.batch_log('%j')}")
        return [*cmd, str(self.script), *self.segment.argv()]

    def command(self) -> list[str]:
        """What scheduling this request runs, for people to read."""
        if self.uses_sbatch:
            return self.sbatch_argv()
        if self.via is Via.LOCAL:
            return ["python", "-m", "beam_hpc.job.segment", "--plan", self.plan.paths.plan, *self.segment.argv()]
        return ["submitit", f"(executor beamhet: the job of {self.script}, arguments {self.segment.argv()})"]

    def describe(self) -> str:
        """What a dry run prints: the plan in one paragraph and the exact command."""
        p = self.plan
        groups = ", ".join(f"{g.name}: {g.nodes} nodes x {g.gpus_per_node} GPUs ({'+'.join(g.roles)})"
                           for g in p.groups)
        return (
            f"run {p.run_id} ({p.job_name}) -> {p.output_dir} ({{run_dir}} below)\n"
            f"groups: {groups}\n"
            f"walltime {p.walltime_s} s, final save starts {p.lead_s} s before it\n"
            f"driver: {shlex.join(p.driver_argv)}\n"
            f"segment: {shlex.join(self.segment.argv()) or '(no arguments)'}; runs to "
            f"{self.segment.num_rollout or p.recipe.num_rollout} rollouts in total ({{num_rollout}} above)\n"
            + (f"Ray: the site's running cluster at {p.site.ray_address} (the job starts none)\n"
               if p.site.ray_address else "")
            + (f"excluded nodes: {','.join(self.exclude)} (the run's failed nodes and the site's quarantine)\n"
               if self.exclude else "")
            + f"would run: {shlex.join(self.command())}"
        )
