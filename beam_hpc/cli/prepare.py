"""``beam-hpc prepare``: the CLI face of :mod:`beam_hpc.data.prepare` (registered by beam_hpc/cli/app.py).

``--tiny`` writes the synthetic addition set in the upstream schemas to a temporary directory and
prepares from it, so the embedded recipe's data goes through the same code as the real data.
``--convert RECIPE --site SITE`` instead submits the recipe's HF -> torch_dist conversion as a
Slurm job of its own (:mod:`beam_hpc.backends.miles.convert`), once: a later call skips it.
Errors are :class:`beam_hpc.data.convert.PrepareError` / ``RuntimeFailure`` / ``InputError``; cli/app.py turns
them into an exit code.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

DEFAULT_DATA_DIR = "data"


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser(
        "prepare",
        help="download DAPO-Math-17k and AIME2025 (and a model) and write Miles-format JSONL",
        description="Write <data-dir>/dapo-math-17k.jsonl, aime-2025.jsonl and manifest.json; "
        "files already complete and verified are skipped.",
    )
    p.add_argument("--data-dir", default=os.environ.get("BEAM_HPC_DATA_DIR", DEFAULT_DATA_DIR),
                   help="output directory on shared storage (default: $BEAM_HPC_DATA_DIR or ./data)")
    p.add_argument("--model", default=None, metavar="ID",
                   help="also download this Hugging Face model into <data-dir>/models/<name>")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--from-local", nargs="+", type=Path, default=None, metavar="FILE",
                        help="offline: parquet/JSONL files in the upstream schemas (recognised by their columns)")
    source.add_argument("--tiny", action="store_true",
                        help="prepare the synthetic two-digit addition set of the embedded tiny recipe")
    p.add_argument("--seed", type=int, default=0, help="with --tiny: the seed of the synthetic set")
    p.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")
    convert = p.add_argument_group("checkpoint conversion (Miles backend)")
    convert.add_argument("--convert", default=None, metavar="RECIPE",
                         help="submit the recipe's HF -> torch_dist conversion (model.path -> model.ref_load) as a "
                              "Slurm job on one trainer node, inside the site's container; skipped when done")
    convert.add_argument("--site", default=None, help="with --convert: site profile, a path or a name under env/")
    convert.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                         help="with --convert: override a recipe field (repeatable)")
    convert.add_argument("--walltime", default=None, metavar="HH:MM:SS",
                         help="with --convert: the conversion job's time limit (default 04:00:00)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from beam_hpc.errors import InputError

    if args.convert is not None:
        if args.tiny or args.from_local or args.model:
            raise InputError("--convert: submits the checkpoint conversion only; prepare data (--tiny, --from-local, "
                              "--model) in a separate call")
        return run_convert(args)
    if args.site or args.overrides or args.walltime:
        raise InputError("--site/--set/--walltime: these go with --convert RECIPE")
    from beam_hpc.data.prepare import prepare

    data_dir = Path(args.data_dir)
    progress = not args.no_progress
    if args.tiny:
        from beam_hpc.data.tiny import PREPARED_EVAL_NAME, SET_NAME, write_tiny_sources

        with tempfile.TemporaryDirectory(prefix="beam-hpc-tiny-") as tmp:
            sources = write_tiny_sources(Path(tmp), seed=args.seed)
            report = prepare(data_dir, model=args.model, from_local=sources, progress=progress,
                             eval_file=PREPARED_EVAL_NAME, set_name=SET_NAME)
    else:
        report = prepare(data_dir, model=args.model, from_local=args.from_local, progress=progress)
    for f in report.files:
        state = "verified, skipped" if f.skipped else "written"
        origin = f" from {f.input_rows} input rows" if f.input_rows and f.input_rows != f.rows else ""
        print(f"{f.path}: {f.rows} rows{origin} ({state})")
    if report.model_dir is not None:
        print(f"{report.model_dir}: model ({'verified, skipped' if report.model_skipped else 'downloaded'})")
    for note in report.notes:
        print(f"note: {note}")
    print(f"manifest: {report.manifest}")
    return 0


def run_convert(args: argparse.Namespace) -> int:
    from beam_hpc.backends.miles.convert import DEFAULT_WALLTIME, submit_convert
    from beam_hpc.submission.submit import build_recipe, build_site

    recipe = build_recipe(args.convert, overrides=args.overrides)
    result = submit_convert(recipe, build_site(args.site), walltime=args.walltime or DEFAULT_WALLTIME)
    spec = result.spec
    if result.action == "skipped":
        print(f"{spec.output}: torch_dist copy of {spec.hf_checkpoint} already converted; skipped")
    elif result.action == "pending":
        print(f"{spec.output}: conversion already queued or running as job {result.job_id}; not submitted again")
    else:
        print(f"submitted conversion job {result.job_id} ({spec.job_name}): {spec.hf_checkpoint} -> {spec.output}")
        print(f"script {spec.script_path}; log {spec.log_dir}/convert-{result.job_id}.out")
    return 0
