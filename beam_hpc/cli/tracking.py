"""``beam-hpc sync RUN``: upload a run's offline W&B segments from the login node.

Registered by beam_hpc/cli/app.py (PLUGIN_MODULES). Each finished segment is uploaded once with
W&B's own ``wandb sync`` and recorded in ``<run>/wandb/synced.json`` (beam_hpc.run.tracking); a
segment still being written is left for the next call. Exit codes: 0 done, 1 an upload failed,
2 bad input (no such run, or no W&B files in it).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from beam_hpc.errors import InputError, RuntimeFailure, shorten


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser("sync", help="upload a run's offline W&B segments (each finished one once) with wandb sync")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run's output directory")
    p.set_defaults(func=cmd_sync)


def cmd_sync(args: argparse.Namespace) -> int:
    from beam_hpc.run import tracking

    run = Path(args.run_dir)
    if not run.is_dir():
        raise InputError(f"RUN_DIR: {shorten(args.run_dir)} is not a directory; give the run's output directory")
    if tracking.existing_run_id(run) is None:
        raise InputError(f"RUN_DIR: {shorten(args.run_dir)} has no W&B files (no {tracking.SUBDIR}/{tracking.RUN_ID_FILE}); "
                         "set tracking.wandb in the recipe to track a run")
    try:
        done, later = tracking.sync(run)
    except (RuntimeError, OSError) as err:
        raise RuntimeFailure(str(err)) from None
    for name in later:
        print(f"left {name}: its segment is still running; sync again when it ends")
    if not done and not later:
        print(f"nothing to sync: every offline segment of W&B run {tracking.existing_run_id(run)} is uploaded")
    return 0
