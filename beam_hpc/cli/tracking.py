"""``beam-hpc sync RUN``: upload a run's offline W&B fragments from the login node.

Registered by beam_hpc/cli/app.py (PLUGIN_MODULES). Every process that logs to W&B offline writes
its own fragment of the run (Miles: the driver, the first trainer rank and the rollout manager); the
fragments of each segment that has ended (beam-hpc's ledger says so) are uploaded once by ``wandb
sync`` (the secondary writers' first, then the primaries', so the run ends in the driver's state),
and recorded in ``<run>/wandb/synced.json`` (beam_hpc.run.tracking); those of a
segment still running are left for the next call. ``--dry-run`` has ``wandb sync --dry-run`` list
what it would upload. Exit codes: 0 done, 1 an upload failed, 2 bad input (no such run, or no W&B
files in it).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from beam_hpc.errors import InputError, RuntimeFailure, shorten


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser("sync", help="upload the W&B fragments of a run's ended segments (each once) with wandb sync")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run's output directory")
    p.add_argument("--dry-run", action="store_true",
                   help="only list what would be uploaded (wandb sync --dry-run); needs no key and records nothing")
    p.set_defaults(func=cmd_sync)


def cmd_sync(args: argparse.Namespace) -> int:
    from beam_hpc.plan.paths import RunPaths
    from beam_hpc.run import tracking
    from beam_hpc.run.ledger import read_ledger

    run = Path(args.run_dir)
    if not run.is_dir():
        raise InputError(f"RUN_DIR: {shorten(args.run_dir)} is not a directory; give the run's output directory")
    if tracking.existing_run_id(run) is None:
        raise InputError(f"RUN_DIR: {shorten(args.run_dir)} has no W&B files (no {tracking.SUBDIR}/{tracking.RUN_ID_FILE}); "
                         "set tracking.wandb in the recipe to track a run")
    segments, _warnings = read_ledger(RunPaths(str(run)).ledger)
    try:
        plan = tracking.sync(run, segments, dry_run=args.dry_run)
    except (RuntimeError, OSError) as err:
        raise RuntimeFailure(str(err)) from None
    for name, why in plan.later:
        print(f"left {name}: {why}; sync again when it ends")
    if not plan.upload and not plan.later:
        print(f"nothing to sync: every ended segment of W&B run {tracking.existing_run_id(run)} is uploaded")
    return 0
