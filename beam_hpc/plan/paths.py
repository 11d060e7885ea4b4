"""Every name in a run directory, spelled once.

Why: the run directory is the interface between the login node (submit, status, logs, cancel), the
batch shell (segment), the node steps and the driver, which run as different processes on different
hosts, and beam-hpc versions may differ between segments of one run. A file name spelled in two
modules drifts; here each is a property, and everything else asks for it. docs/architecture.md
("The run directory") lists every file, what it holds and which module writes it.

    <run>/                           RunPaths: plan.json, ledger.jsonl, job.sbatch, checkpoints/, ...
        logs/<jobid>-<restart>/      SegmentPaths: one per segment (segment.log, driver.log,
                                     runtime.json, nodes/, ray-logs/, stacks/, ...)

Pure names: no I/O, no imports beyond the standard library.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

PLAN_FILE = "plan.json"
LEDGER_FILE = "ledger.jsonl"
SCRIPT_FILE = "job.sbatch"  # written into the run directory by every beam-hpc submission
SMOKE_FILE = "smoke.json"
DRIVER_LOG = "driver.log"  # in each segment directory (also globbed for: logs/*/driver.log)
DRIVER_RECORD = "driver.json"  # in each segment directory: the driver's argv and what it saw of the site
RAY_AUTH_DIR = ".ray-auth"  # per-segment Ray tokens under the run directory
SUBMITIT_DIR = "submitit"  # under logs/: submitit's folder (its %j expands per job)
IDENTITY_FILE = "run_identity.json"  # under checkpoints/
PLACEMENT_FILE = "placement.json"
STACKS_DIR = "stacks"  # in each segment directory
SEGMENT_DIR_RE = re.compile(r"^(\d+)-(\d+)$")  # logs/<jobid>-<restart>


def batch_log_name(job_id: str) -> str:
    """Slurm's ``--output`` file of one job, with the job id expanded (``%j`` for the script)."""
    return f"slurm-{job_id}.out"


def node_log_name(group: str, node_index: int | str) -> str:
    """One node step's log inside its segment directory (``%t`` as ``node_index`` for srun)."""
    return f"node-{group}-{node_index}.log"


@dataclass(frozen=True)
class SegmentPaths:
    """``logs/<job>-<restart>/``: what one segment's processes write."""

    root: str

    def _p(self, *parts: str) -> Path:
        return Path(self.root, *parts)

    @property
    def name(self) -> str:
        return Path(self.root).name

    @property
    def segment_log(self) -> Path:
        return self._p("segment.log")

    @property
    def driver_log(self) -> Path:
        return self._p(DRIVER_LOG)

    @property
    def driver_record(self) -> Path:
        """What the driver was started with: argv, rollout total, the site's variables it saw."""
        return self._p(DRIVER_RECORD)

    @property
    def ready(self) -> Path:
        return self._p("ready.json")

    @property
    def readiness_log(self) -> Path:
        return self._p("readiness.log")

    @property
    def outcome(self) -> Path:
        return self._p("outcome.json")

    @property
    def runtime(self) -> Path:
        return self._p("runtime.json")

    @property
    def node_reports(self) -> Path:
        return self._p("nodes")

    def node_report(self, group: str, index: int) -> Path:
        return self._p("nodes", f"{group}-{index}.json")

    def node_log(self, group: str, index: int | str) -> Path:
        return self._p(node_log_name(group, index))

    def srun_log(self, group: str) -> Path:
        return self._p(f"srun-{group}.log")

    def ray_logs(self, group: str, index: int) -> Path:
        return self._p("ray-logs", f"{group}-{index}")

    @property
    def stacks(self) -> Path:
        """Stack dumps of the segment's processes (beam_hpc.node.stacks), one file per process."""
        return self._p(STACKS_DIR)

    def stack_file(self, host: str, pid: int) -> Path:
        return self._p(STACKS_DIR, f"{host}-{pid}.txt")

    @property
    def stacks_request(self) -> Path:
        """Written by the segment on a stall: every node step dumps its node's processes."""
        return self._p(STACKS_DIR, "request.json")

    def stacks_answer(self, group: str, index: int) -> Path:
        return self._p(STACKS_DIR, f"{group}-{index}.json")

    @property
    def stacks_index(self) -> Path:
        """Every process asked for its stacks on a stall, and what came of it (the ledger keeps a summary)."""
        return self._p(STACKS_DIR, "index.json")


@dataclass(frozen=True)
class RunPaths:
    """The run directory's own files and directories (the words of docs/architecture.md's glossary)."""

    root: str

    def _p(self, *parts: str) -> str:
        return str(Path(self.root, *parts))

    @property
    def plan(self) -> str:
        return self._p(PLAN_FILE)

    @property
    def ledger(self) -> str:
        return self._p(LEDGER_FILE)

    @property
    def script(self) -> str:
        """The batch script every submission writes and a segment resubmits."""
        return self._p(SCRIPT_FILE)

    @property
    def smoke(self) -> str:
        return self._p(SMOKE_FILE)

    @property
    def placement(self) -> str:
        """Where the driver records the placement it got (Miles's sorted bundles, or the
        reference backend's actors), whichever backend runs: the proof that groups landed apart."""
        return self._p(PLACEMENT_FILE)

    @property
    def checkpoints(self) -> str:
        return self._p("checkpoints")

    @property
    def identity(self) -> str:
        """``checkpoints/run_identity.json`` (beam_hpc.run.identity)."""
        return self._p("checkpoints", IDENTITY_FILE)

    @property
    def dumps(self) -> str:
        return self._p("dumps")

    @property
    def tensorboard(self) -> str:
        return self._p("tensorboard")

    @property
    def logs(self) -> str:
        return self._p("logs")

    @property
    def plots(self) -> str:
        """Where `beam-hpc plot` writes its PNGs unless told otherwise (-o)."""
        return self._p("plots")

    @property
    def convert(self) -> str:
        """``prepare --convert``'s work directory (its plan, script and logs: beam_hpc.backends.miles.convert)."""
        return self._p("convert")

    @property
    def sentinel(self) -> str:
        """Miles's --save-trigger-sentinel: if it exists at a rollout boundary, save and delete it."""
        return self._p("SAVE_NOW")

    @property
    def lock(self) -> str:
        return self._p("run.lock")

    @property
    def cancel_flag(self) -> str:
        return self._p("CANCELLED")

    @property
    def node_exclusions(self) -> str:
        """Excluded nodes let back in with ``submit --resume --include-node`` (beam_hpc.lifecycle.exclusions)."""
        return self._p("node-exclusions.json")

    def jit_cache_archive(self, group: str) -> str:
        """The group's shared JIT-cache archive: seeds every node's local caches (beam_hpc.node.jit_cache)."""
        return self._p("jit-cache", f"{group}.tar")

    @property
    def submitit(self) -> str:
        """``logs/submitit/%j``: the folder handed to submitit (it expands ``%j`` per job)."""
        return self._p("logs", SUBMITIT_DIR, "%j")

    def ray_auth(self, segment: str) -> str:
        """``.ray-auth/<jobid>-<restart>``: one segment's Ray token directory."""
        return self._p(RAY_AUTH_DIR, segment)

    def batch_log(self, job_id: str) -> str:
        """``logs/slurm-<jobid>.out``; ``job_id="%j"`` gives the pattern for ``sbatch --output``."""
        return self._p("logs", batch_log_name(job_id))

    def segment_logs(self, job_id: str, restart: int) -> str:
        return self._p("logs", f"{job_id}-{restart}")

    def segment(self, job_id: str, restart: int) -> SegmentPaths:
        return SegmentPaths(self.segment_logs(job_id, restart))

    def segment_named(self, name: str) -> SegmentPaths:
        """A segment directory by its name ``<jobid>-<restart>`` (as observe lists them)."""
        return SegmentPaths(self._p("logs", name))
