"""A segment's checks before it writes anything, its run directory once it holds the run lock, and
the backend's own check before Ray starts.

Why apart from the segment: these are the segment's set-up, each a plain function of the plan, the
allocation and the script; the segment calls them in order. A check before writing fails as
bad input (exit 2, nothing written): a hand-edited ``#SBATCH --nodes``/``--gres`` named with its
line, a damaged plan.json, a bad ``--num-rollout``. Once the lock is held, the run directory is
made what a submission leaves (plan.json, job.sbatch, logs/), so a plain ``sbatch x.sbatch`` of
a rendered script needs nothing else.
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path

from beam_hpc.errors import InputError
from beam_hpc.files import write_atomic
from beam_hpc.job.context import allocation_problems
from beam_hpc.node import procs
from beam_hpc.plan.plan import Plan, load_plan
from beam_hpc.plan.segment_args import SegmentArgs
from beam_hpc.slurm.environment import SlurmEnvironment

log = logging.getLogger(__name__)


def check_before_writing(plan: Plan, slurm: SlurmEnvironment, *, script: str | None, num_rollout: int | None) -> None:
    """Bad input that must stop the segment before it writes anything (InputError): an allocation
    that does not match the plan (a hand-edited ``#SBATCH`` line, named), a run directory whose
    plan.json is damaged (named), a bad ``--num-rollout``."""
    if num_rollout is not None:
        SegmentArgs(num_rollout=num_rollout)  # validates
    if slurm.job_id is not None:
        text = None
        if script:
            with contextlib.suppress(OSError):
                text = Path(script).read_text(errors="replace")
        problems = allocation_problems(plan, slurm, script=script, script_text=text)
        if problems:
            raise InputError("; ".join(problems))
    if Path(plan.paths.plan).exists():
        load_plan(plan.paths.plan)  # a torn or hand-broken plan.json: exit 2 naming it, nothing written


def materialize(plan: Plan, *, script: str | None, job_id: str | None) -> None:
    """With the lock held: the run directory as a submission leaves it. A rendered script's plan
    becomes plan.json (as ``submit`` writes it: replaced when the script's differs, and the
    resume checks still judge the checkpoints against it), the script becomes job.sbatch (what
    the lifecycle resubmits, hand edits included), logs/ exists, and the batch log is linked
    where ``beam-hpc logs`` looks when Slurm wrote it elsewhere (the submit directory)."""
    paths = plan.paths
    Path(paths.logs).mkdir(parents=True, exist_ok=True)
    if script is None:
        return
    if not Path(paths.plan).exists() or load_plan(paths.plan) != plan:
        write_atomic(Path(paths.plan), plan.to_json())
    with contextlib.suppress(OSError):
        text = Path(script).read_text()
        target = Path(paths.script)
        if Path(script).resolve() != target.resolve() and (
                not target.exists() or _lines(target.read_text()) != _lines(text)):
            write_atomic(target, text)
            target.chmod(0o755)
    if job_id is not None:
        stderr_target = procs.open_files("self").get(2)  # the batch log Slurm opened for us
        with contextlib.suppress(OSError):
            out = Path(stderr_target or "")
            link = Path(paths.batch_log(job_id))
            if stderr_target and out.is_absolute() and out.exists() and out != link and not link.exists():
                link.symlink_to(out)


def _lines(script: str) -> list[str]:
    """A script's lines without blank ones: Slurm keeps a het job's script without its blank lines,
    so the copy a segment runs from differs from the file submitted in those alone."""
    return [line for line in script.splitlines() if line.strip()]


def backend_refusal(plan: Plan) -> str | None:
    """The backend's own check of the exact driver command, before Ray starts on any node
    (beam_hpc.backends.prestart.check_before_start): seconds here instead of the whole
    allocation held through Ray bring-up until the driver stops. A check that cannot run is
    logged and the segment goes on: the driver then reports the problem itself."""
    from beam_hpc.backends.prestart import check_before_start

    t0 = time.monotonic()
    try:
        refusal = check_before_start(plan)
    except Exception as err:  # noqa: BLE001 - never let the checker block a run that may be fine
        log.warning("the backend's pre-start check could not run (%s: %s); starting anyway",
                    type(err).__name__, err)
        return None
    if refusal is None and plan.recipe.backend != "reference":
        log.info("backend check of the driver command: accepted (%.1f s)", time.monotonic() - t0)
    return refusal
