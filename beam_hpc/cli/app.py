"""`beam-hpc`: the command line. The only layer that prints for people and picks exit codes.

Exit codes: 0 success, 1 a run or tool failed, 2 invalid input (recipe, site, override, flag): one
line naming the field, the value and the fix, before anything is submitted, never a traceback.
Subcommands of other modules register through their ``add_parser(subparsers)``; heavy imports
happen inside handlers so that ``beam-hpc render`` starts fast on a login node.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from beam_hpc.errors import EXIT_FAILURE, BeamError, InputError, shorten
from beam_hpc.files import write_atomic
from beam_hpc.logging_setup import log_to_stream
from beam_hpc.version import __version__

# Modules that contribute subcommands with add_parser(subparsers); missing ones are skipped so a
# partial install (no torch, no ray) still renders and submits.
PLUGIN_MODULES = (
    "beam_hpc.cli.prepare",
    "beam_hpc.cli.image",
    "beam_hpc.cli.run",
    "beam_hpc.cli.observe",
    "beam_hpc.cli.tracking",
    "beam_hpc.cli.execute",
    "beam_hpc.cli.nodes",
    "beam_hpc.cli.rollout",
)


class _Parser(argparse.ArgumentParser):
    """argparse with beam-hpc's rule for bad input: one line (no usage block), the value
    shortened, exit 2. Subcommand parsers are of the same class (argparse makes them so)."""

    def error(self, message: str) -> NoReturn:  # type: ignore[override]
        if len(message) > 300:
            message = f"{message[:300]}... ({len(message)} characters)"
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _common_recipe_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", help="recipe file, e.g. recipes/dedicated.yaml")
    p.add_argument("--site", default=None, help="site profile: a path or a name under env/ (default: local)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a recipe field, e.g. --set num_rollout=200 (repeatable)")
    p.add_argument("--output-dir", default=None, help="run directory on shared storage (overrides output_dir)")
    p.add_argument("--num-rollout", type=int, default=None, help="total rollouts, including those already done")
    p.add_argument("--no-async-training", action="store_true", help="generation and training take turns")
    p.add_argument("--ray-address", default=None, metavar="HOST:PORT",
                   help="use the site's running Ray cluster (its GCS address): start no Ray, leave it running")
    p.add_argument("--ray-token-file", default=None, help="that cluster's auth token file (required with --ray-address)")


def _site_from_args(args: argparse.Namespace):
    from beam_hpc.config.site import with_existing_ray
    from beam_hpc.submission.submit import build_site

    return with_existing_ray(build_site(args.site), args.ray_address, args.ray_token_file)


def _recipe_from_args(args: argparse.Namespace):
    from beam_hpc.submission.submit import build_recipe

    return build_recipe(
        args.recipe, overrides=args.overrides, output_dir=args.output_dir,
        num_rollout=args.num_rollout, no_async_training=args.no_async_training,
    )


def cmd_render(args: argparse.Namespace) -> int:
    from beam_hpc.backends.registry import plan_for
    from beam_hpc.plan.segment_args import SegmentArgs
    from beam_hpc.submission.request import SubmitRequest, Via

    plan = plan_for(_recipe_from_args(args), _site_from_args(args))
    # the same request `submit --via sbatch` materializes: the script carries its plan, so a plain
    # `sbatch FILE` runs it with no other step
    request = SubmitRequest(plan=plan, segment=SegmentArgs(), via=Via.SBATCH,
                            source=f"{Path(args.recipe).name} + site {plan.site.name}")
    text = request.script_text()
    if args.output:  # whole or not at all: a reader (or sbatch) never sees half a script
        write_atomic(args.output, text, mode=0o755)
        print(f"wrote {args.output}")
    else:
        sys.stdout.write(text)
    if args.plan_json:
        write_atomic(args.plan_json, plan.to_json())
    return 0


def cmd_submit(args: argparse.Namespace) -> int:
    from beam_hpc.submission import tmp_disk
    from beam_hpc.submission.submit import describe, submit

    sub = submit(
        args.recipe, _site_from_args(args), overrides=args.overrides, output_dir=args.output_dir,
        resume=args.resume, num_rollout=args.num_rollout, no_async_training=args.no_async_training,
        via=args.via, dry_run=args.dry_run, smoke=args.smoke, include_nodes=args.include_nodes,
    )
    if args.dry_run:
        print(describe(sub))
        print("dry run: nothing submitted")
        return 0
    print(f"submitted job {sub.job_id} ({sub.plan.job_name}); run directory {sub.plan.output_dir}")
    for line in tmp_disk.describe(sub.plan):  # the --tmp decision (beam_hpc.plan.local_disk) and why
        print(line)
    if sub.estimate is not None:
        print(sub.estimate.describe())
    print(f"watch it: beam-hpc status {sub.plan.output_dir}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="beam-hpc", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"beam-hpc {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("render", help="write the heterogeneous sbatch script of a recipe")
    _common_recipe_args(p)
    p.add_argument("--output", "-o", default=None, help="write the script here (default: stdout)")
    p.add_argument("--plan-json", default=None,
                   help="also write the plan as JSON here (the script carries it already; the job writes plan.json)")
    p.set_defaults(func=cmd_render)

    p = sub.add_parser("submit", help="submit a recipe to Slurm (submitit or sbatch)")
    _common_recipe_args(p)
    p.add_argument("--resume", action="store_true", help="continue the run in the output directory")
    p.add_argument("--via", choices=["submitit", "sbatch"], default="submitit")
    p.add_argument("--dry-run", action="store_true", help="print what would be submitted; submit nothing")
    p.add_argument("--smoke", action="store_true",
                   help="the same job, but only bring Ray up, run one task per GPU bundle, write smoke.json")
    p.add_argument("--include-node", dest="include_nodes", action="append", default=[], metavar="NAME",
                   help="with --resume: stop excluding a node the run left out after it failed "
                        "(repeatable; 'all' clears every exclusion; see beam-hpc status)")
    p.set_defaults(func=cmd_submit)

    for name in PLUGIN_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError as err:
            if err.name != name:  # the module exists but something it needs is missing: say so
                raise
            continue
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; the only place where errors become exit codes (beam_hpc.errors)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    log_to_stream(level=None)  # warnings (and a segment's INFO lines) in the one format
    handler: Callable[[argparse.Namespace], int] = args.func
    try:
        return int(handler(args) or 0)
    except BeamError as err:
        prefix = "beam-hpc: error: " if isinstance(err, InputError) else "beam-hpc: "
        print(f"{prefix}{_slurm_unreachable(err, argv) or err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print("beam-hpc: interrupted", file=sys.stderr)
        return 130
    except Exception as err:  # a bug: one line for the user, the traceback in a log
        log_path = _write_crash_log(argv)
        print(f"beam-hpc: internal error ({type(err).__name__}: {shorten(str(err), 160)}); "
              f"the traceback is in {log_path}", file=sys.stderr)
        return EXIT_FAILURE


def _slurm_unreachable(err: BeamError, argv: list[str] | None) -> str | None:
    """The one line for a Slurm controller that could not be reached or was busy: which
    controller, and the command to retry; None for any other error."""
    from beam_hpc.slurm.client import SlurmUnavailable, describe_controller

    if not isinstance(err, SlurmUnavailable) or not err.transient:
        return None
    import shlex

    said = ("; nothing was sent to it" if err.argv[:2] == ["scontrol", "ping"]
            else f"; {err.argv[0]} said: {err.last_line}")
    maybe = ("; Slurm may have acted on it all the same: look at `squeue --me` before retrying"
             if err.may_have_landed else "")
    again = shlex.join(["beam-hpc", *(sys.argv[1:] if argv is None else argv)])
    return (f"Slurm's controller did not answer ({describe_controller(err)}{said}){maybe}; "
            f"retry `{again}` once `scontrol ping` says UP")


def _write_crash_log(argv: list[str] | None) -> str:
    """Write the current exception's traceback to a private file and return its path."""
    import tempfile
    import time
    import traceback

    base = Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state") / "beam-hpc"
    try:
        base.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError:
        base = Path(tempfile.gettempdir())
    fd, path = tempfile.mkstemp(prefix=time.strftime("crash-%Y%m%d-%H%M%S-"), suffix=".log", dir=base)
    with os.fdopen(fd, "w") as out:
        out.write(f"beam-hpc {__version__}; argv: {sys.argv if argv is None else argv}\n")
        traceback.print_exc(file=out)
    return path


if __name__ == "__main__":
    sys.exit(main())
