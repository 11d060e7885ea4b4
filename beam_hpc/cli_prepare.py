"""``beam-hpc prepare``: the CLI face of :mod:`beam_hpc.prepare` (registered by beam_hpc/cli.py).

``--tiny`` writes the synthetic addition set in the upstream schemas to a temporary directory and
prepares from it, so the embedded recipe's data goes through the same code as the real data.
Errors are :class:`beam_hpc.prepare.PrepareError`; cli.py turns them into an exit code.
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
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from beam_hpc.prepare import prepare

    data_dir = Path(args.data_dir)
    progress = not args.no_progress
    if args.tiny:
        from beam_hpc.tiny_data import write_tiny_sources

        with tempfile.TemporaryDirectory(prefix="beam-hpc-tiny-") as tmp:
            sources = write_tiny_sources(Path(tmp), seed=args.seed)
            report = prepare(data_dir, model=args.model, from_local=sources, progress=progress)
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
