"""What one segment is asked to do beyond its plan: ``--resume``, ``--num-rollout N``, ``--smoke``.

These are the batch script's own arguments (``sbatch job.sbatch [--resume] [--num-rollout N]``).
They live here, below the job and lifecycle layers, because every way a segment is launched
builds them: submission (sbatch line, submitit call, ``beam-hpc execute``), and the lifecycle's
resubmission inside the job, which passes a ``--num-rollout`` total on to the next segment. One
type, one :meth:`SegmentArgs.argv`, so no path formats them differently from another.
"""

from __future__ import annotations

from dataclasses import dataclass

from beam_hpc.errors import InputError


@dataclass(frozen=True)
class SegmentArgs:
    """A segment's arguments. ``num_rollout`` is a total (rollouts already done included, the
    seed's semantics); plan.json is never rewritten for it: the segment runs to it, records it in
    its ledger start line, fills it into the driver's command and passes it on."""

    resume: bool = False
    num_rollout: int | None = None
    smoke: bool = False

    def __post_init__(self) -> None:
        if self.num_rollout is not None and (isinstance(self.num_rollout, bool) or self.num_rollout < 1):
            raise InputError(f"--num-rollout: {self.num_rollout} is not a positive number of rollouts; "
                             "give the total, rollouts already done included")
        if self.smoke and self.resume:
            raise InputError("--smoke: a smoke run touches no checkpoint; drop --resume (or --smoke)")

    def argv(self) -> list[str]:
        """The batch script's arguments (what ``python -m beam_hpc.job.segment`` parses back)."""
        out = ["--resume"] if self.resume else []
        if self.num_rollout is not None:
            out += ["--num-rollout", str(self.num_rollout)]
        return out + (["--smoke"] if self.smoke else [])

    def with_resume(self, resume: bool) -> SegmentArgs:
        """The same arguments for the next segment of a chain (resume when a checkpoint exists)."""
        return SegmentArgs(resume=resume, num_rollout=self.num_rollout, smoke=self.smoke)
