"""One submission request: a Plan plus what this submission asks of it, scheduled one of three ways.

``beam-hpc submit --dry-run`` prints it; ``--via sbatch`` hands its script and arguments to
sbatch (exactly what a user would type); ``--via submitit`` gives the same plan and segment
arguments to beam-hpc's submitit executor; ``beam-hpc execute`` runs the same segment on this
machine. All three read the one request, so they cannot drift apart.
"""

from __future__ import annotations

import enum
import shlex
from dataclasses import dataclass
from pathlib import Path

from beam_hpc.job.segment import SegmentArgs
from beam_hpc.plan.plan import Plan



class Via(str, enum.Enum):
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

    @property
    def script(self) -> Path:
        """The run directory's batch script (written by every submission, used by resubmissions)."""
        return Path(self.plan.paths.script)

    def sbatch_argv(self) -> list[str]:
        """The sbatch command line of this request (``--via sbatch``, and ``--smoke``)."""
        cmd = ["sbatch", "--parsable"]
        if self.dependency:
            cmd.append(f"--dependency={self.dependency}")
        return [*cmd, str(self.script), *self.segment.argv()]

    def command(self) -> list[str]:
        """What scheduling this request runs, for people to read."""
        if self.via is Via.SBATCH or self.segment.smoke:
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
            f"run {p.run_id} ({p.job_name}) -> {p.output_dir}\n"
            f"groups: {groups}\n"
            f"walltime {p.walltime_s} s, final save starts {p.lead_s} s before it\n"
            f"driver: {shlex.join(p.driver_argv)}\n"
            + (f"Ray: the site's running cluster at {p.site.ray_address} (the job starts none)\n"
               if p.site.ray_address else "")
            + f"would run: {shlex.join(self.command())}"
        )
