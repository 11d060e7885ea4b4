"""``beam-hpc status | plot | logs | doctor``: the CLI face of watching a run and checking a cluster.

Registered by beam_hpc/cli/app.py (PLUGIN_MODULES). Like the rest of the CLI layer it prints for
people and picks exit codes; the modules behind it (beam_hpc.observe: status, plot, logs, doctor)
only compute and raise. Their imports happen inside the handlers, so `beam-hpc --help` stays fast.
Exit codes: 0 fine, 1 a check failed or nothing to show (or, for status, Slurm could not be asked:
everything the run directory knows is still shown), 2 bad input (a path or flag).
"""

from __future__ import annotations

import argparse
import json
import sys

from beam_hpc.errors import InputError, shorten


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser("status", help="where a run stands: segments, rollouts, accuracy, goodput, ETA")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run's output directory")
    p.add_argument("--json", action="store_true", help="stable JSON instead of the table")
    p.add_argument("--no-slurm", action="store_true", help="do not ask Slurm for the live job state")
    p.set_defaults(func=cmd_status)

    p = subparsers.add_parser("plot", help="PNG charts: eval accuracy and response length (on the run's eval set), reward")
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("--output", "-o", default=None, help="directory for the PNGs (default RUN_DIR/plots)")
    p.set_defaults(func=cmd_plot)

    p = subparsers.add_parser("logs", help="print (or follow) one log of a run")
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("--group", choices=["trainer", "rollout"], default=None,
                   help="a node step's log (default: the driver's, else the batch log)")
    p.add_argument("--node", type=int, default=None, help="node index within the group (default 0)")
    p.add_argument("--segment", default=None, metavar="K",
                   help="position (0 first, -1 latest: the default) or id JOBID-RESTART")
    p.add_argument("--lines", "-n", type=int, default=None, help="only the last N lines")
    p.add_argument("--follow", "-f", action="store_true",
                   help="keep printing new lines; moves on to the next segment's log unless --segment is given")
    p.add_argument("--list", action="store_true", help="list the segment's log files instead")
    p.set_defaults(func=cmd_logs)

    p = subparsers.add_parser("doctor", help="preflight: is the cluster fit for a run? (pass/fail with fixes)")
    p.add_argument("--site", default=None, help="site profile: a path or a name under env/ (default: local)")
    p.add_argument("--in-job", action="store_true",
                   help="also check on compute nodes (srun, one task per node; inside an allocation: its nodes)")
    p.add_argument("--nodes", type=int, default=1, help="with --in-job: nodes per partition (default 1)")
    p.add_argument("--output-dir", default=None,
                   help="where runs will write (checked as shared storage; holds the --in-job canary)")
    p.add_argument("--scratch-gb", type=float, default=None,
                   help="free node-local scratch needed (default: the site's tmp, else 1 GB)")
    p.add_argument("--wait", type=int, default=300, help="with --in-job: seconds to wait for nodes")
    p.add_argument("--recipe", default=None,
                   help="also run the image's Miles parser on this recipe's driver command (as the job does)")
    p.add_argument("--json", action="store_true", help="the checks as JSON")
    p.set_defaults(func=cmd_doctor)


def _fail(msg: str, code: int) -> int:
    print(f"beam-hpc: {msg}", file=sys.stderr)
    return code


def cmd_status(args: argparse.Namespace) -> int:
    from beam_hpc.observe.run_dir import RunDirError
    from beam_hpc.observe.status import gather
    from beam_hpc.observe.status_table import format_status

    try:
        status = gather(args.run_dir, slurm=not args.no_slurm)
    except RunDirError as err:
        return _fail(str(err), 2)
    print(json.dumps(status, indent=2, sort_keys=True) if args.json else format_status(status))
    controller = status["slurm"].get("controller")
    if controller:
        return _fail(f"Slurm could not be asked about job {status['slurm']['job_id']} ({controller}); the status above "
                     f"is the run directory's alone: retry `beam-hpc status {args.run_dir}` once `scontrol ping` "
                     "says UP", 1)
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from beam_hpc.observe.plot import plot_run

    result = plot_run(args.run_dir, args.output)  # a missing or wrong path: InputError, exit 2
    for warning in result.warnings:
        print(f"beam-hpc: warning: {warning}", file=sys.stderr)
    for path in result.written:
        print(f"wrote {path}")
    for name, why in result.skipped.items():
        print(f"skipped {name}: {why}")
    if result.eval_set is not None:
        print(f"eval set: {result.eval_set.label} ({result.eval_set.name}); data {result.eval_set.data.describe()}")
    if not result.written:
        return _fail(f"{shorten(args.run_dir)}: nothing to plot yet (metrics source: {result.source or 'none'})", 1)
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    from beam_hpc.observe import logs as run_logs
    from beam_hpc.observe.run_dir import check_run_dir

    run_logs.check_lines(args.lines)  # bad input (a path, a flag): InputError, exit 2 (cli.app)
    check_run_dir(args.run_dir)
    if args.node is not None and args.node < 0:
        raise InputError(f"--node: {args.node} is negative; give a node index within its group (0 first)")
    try:
        if args.list:
            seg = run_logs.resolve_segment(args.run_dir, args.segment)
            for path in run_logs.available(args.run_dir, seg):
                print(path)
            return 0
        path = run_logs.find_log(args.run_dir, group=args.group, node=args.node, segment=args.segment)
    except run_logs.SegmentNotFound:
        raise  # a --segment the run does not have is bad input: exit 2 (cli.app)
    except run_logs.LogNotFoundError as err:  # the run has no such log (yet): nothing to show
        return _fail(str(err), 1)
    print(f"==> {path} <==", file=sys.stderr)
    sys.stdout.write(run_logs.read_tail(path, args.lines))
    sys.stdout.flush()
    if args.follow:
        for line in run_logs.follow(args.run_dir, path, switch_segments=args.segment is None):
            sys.stdout.write(line)
            sys.stdout.flush()
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    from beam_hpc.observe import doctor
    from beam_hpc.submission.submit import build_site

    site = build_site(args.site)  # a bad site is an InputError: cli/app.py prints it, exit 2
    recipe = None
    if args.recipe:
        from beam_hpc.submission.submit import build_recipe

        recipe = build_recipe(args.recipe)
    checks = doctor.run_doctor(site, in_job=args.in_job, nodes=args.nodes, output_dir=args.output_dir,
                               scratch_gb=args.scratch_gb, wait_s=args.wait, recipe=recipe)
    if args.json:
        print(json.dumps([c.to_dict() for c in checks], indent=2))
    else:
        print(doctor.format_checks(checks))
    return 1 if doctor.failed(checks) else 0
