"""Stopping a run's chain from outside (``beam-hpc cancel``), and the flag every segment honours.

Why a flag and a scancel: scancel alone races a segment that is just resubmitting itself (its
successor would not be cancelled), so the cancel flag goes first: no segment resubmits, requeues
or starts after it, and a segment woken by the scancel already sees it. The jobs are found from
the run directory (lock holder, ledger) and by the plan's job name (a successor not yet recorded).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from beam_hpc.errors import InputError, shorten
from beam_hpc.files import write_json_atomic
from beam_hpc.plan.paths import RunPaths
from beam_hpc.slurm import client


@dataclass(frozen=True)
class CancelResult:
    flag: str
    job_ids: tuple[str, ...]  # jobs of the run that scancel was sent to
    job_name: str | None  # scancel --name was sent for it too (catches a successor not yet recorded)
    errors: tuple[str, ...]


def run_job_ids(paths: RunPaths) -> list[str]:
    """Jobs that may still work on the run: the lock holder, the last segment without an end line,
    and the successor named by the last end line."""
    from beam_hpc.run.ledger import read_ledger
    from beam_hpc.run.lock import read_holder

    ids: list[str] = []
    holder = read_holder(paths.lock)
    if holder is not None and holder.job_id:
        ids.append(holder.job_id)
    segments, _ = read_ledger(paths.ledger)
    if segments:
        last = segments[-1]
        if "end" not in last and "start" in last:
            ids.append(str(last["start"]["job_id"]))
        nxt = (last.get("end") or {}).get("next") or {}
        if nxt.get("job_id"):
            ids.append(str(nxt["job_id"]))
    return [i for n, i in enumerate(ids) if i.isdigit() and i not in ids[:n]]


def cancel_run(run_dir: str, *, scancel: bool = True) -> CancelResult:
    """Stop a run's chain: write the cancel flag (no segment resubmits, requeues or starts after
    it), then scancel its jobs. The flag goes first so that a segment woken by the scancel already
    sees it. Raises InputError when ``run_dir`` is not a run directory; scancel failures come back
    in ``errors`` (the flag already holds). ``scancel=False``: the flag only (Slurm's controller
    does not answer; the jobs found are still returned)."""
    paths = RunPaths(os.path.abspath(run_dir))
    plan_file = Path(paths.plan)
    if not plan_file.is_file() and not Path(paths.ledger).is_file():
        raise InputError(f"{shorten(run_dir)}: no plan.json and no ledger.jsonl; give the run's --output-dir")
    write_json_atomic(paths.cancel_flag, {"time": time.time(), "by": os.environ.get("USER", "")}, indent=None)
    job_name = None
    try:
        job_name = json.loads(plan_file.read_text()).get("job_name")
    except (OSError, ValueError):
        pass
    ids = run_job_ids(paths)
    errors: list[str] = []
    env = client.slurm_env_free()
    targets = ([{"job_ids": ids}] if ids else []) + ([{"name": job_name}] if job_name else [])
    for target in targets if scancel else []:
        try:
            client.cancel(**target, env=env, timeout=60)
        except client.SlurmError as err:
            errors.append(str(err))
    return CancelResult(paths.cancel_flag, tuple(ids), job_name, tuple(errors))


def cancel_requested(paths: RunPaths) -> bool:
    return Path(paths.cancel_flag).exists()


def withdraw(job_id: str) -> None:
    """scancel a job this segment just submitted (the run was cancelled in the meantime); a failure
    is not this segment's to handle (the successor sees the cancel flag and does not start)."""
    try:
        client.cancel([job_id], env=client.slurm_env_free(), timeout=60)
    except client.SlurmError:
        pass
