"""``beam-hpc cancel RUN_DIR``: the CLI face of a run's lifecycle.

Registered by beam_hpc/cli/app.py (PLUGIN_MODULES); prints for people and picks exit codes, while
:func:`beam_hpc.lifecycle.cancel.cancel_run` does the work. Exit codes: 0 cancelled, 1 a scancel failed
or Slurm's controller does not answer (the cancel flag is written all the same: no segment of the
run resubmits or requeues after it), 2 not a run directory.
"""

from __future__ import annotations

import argparse
import sys


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser(
        "cancel", help="stop a run's chain: no further resubmission or requeue, and its running job is cancelled")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run's output directory")
    p.set_defaults(func=cmd_cancel)


def cmd_cancel(args: argparse.Namespace) -> int:
    from beam_hpc.lifecycle.cancel import cancel_run
    from beam_hpc.observe.run_dir import check_run_dir, load_plan
    from beam_hpc.slurm import client

    # Before the cancel flag is written: a path that is no directory, or a damaged plan.json, is
    # bad input (exit 2, named with its repair) and leaves the run directory as it was.
    load_plan(check_run_dir(args.run_dir))
    try:  # at once when slurmctld is down; each scancel would wait about 9 s before it said so
        client.ping(timeout=5)
        down = None
    except client.SlurmUnavailable as err:
        down = client.describe_controller(err)
    res = cancel_run(args.run_dir, scancel=down is None)  # not a run directory: InputError, exit 2 (the CLI maps it)
    print(f"cancel flag written: {res.flag} (no segment of this run resubmits, requeues or starts after it)")
    if down is not None:
        jobs = (f"job(s) {', '.join(res.job_ids)}" if res.job_ids else
                f"jobs named {res.job_name}" if res.job_name else "its jobs")
        print(f"beam-hpc: Slurm's controller does not answer ({down}), so {jobs} were not scancelled: retry "
              f"`beam-hpc cancel {args.run_dir}` once `scontrol ping` says UP", file=sys.stderr)
        return 1
    if res.job_ids:
        print(f"scancel sent to job(s) {', '.join(res.job_ids)}" + (f" and jobs named {res.job_name}" if res.job_name else ""))
    elif res.job_name:
        print(f"scancel sent to jobs named {res.job_name} (no running job recorded)")
    for err in res.errors:
        print(f"beam-hpc: {err}", file=sys.stderr)
    print(f"to continue later: beam-hpc submit RECIPE --output-dir {args.run_dir} --resume")
    return 1 if res.errors else 0
