"""Contract double of Miles main's ``miles.utils.arguments.parse_args``, for the in-job parser
check (beam_hpc.backends.miles.parser_check) on the local Slurm cluster.

The contract is the flag-name list dumped from Miles main's real parser
(tests/support/fixtures/miles-megatron-flags.txt): a flag outside it is refused with argparse's own
"unrecognized arguments" message, as the real parser refuses it; ``--sglang-*`` and
``--eval-sglang-*`` are accepted by pattern, as that file says. Values are not validated here
(the real parser's validation runs in tests/backends/miles/test_miles_real.py against miles-rl from PyPI).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

FLAGS_FILE = Path(__file__).resolve().parents[4] / "fixtures" / "miles-megatron-flags.txt"
PATTERNS = ("--sglang-", "--eval-sglang-")


def known_flags() -> set[str]:
    return {line.strip() for line in FLAGS_FILE.read_text().splitlines() if line.startswith("--")}


def parse_args() -> argparse.Namespace:
    known = known_flags()
    unknown = [a.split("=", 1)[0] for a in sys.argv[1:]
               if a.startswith("--") and a.split("=", 1)[0] not in known and not a.startswith(PATTERNS)]
    parser = argparse.ArgumentParser(prog=Path(sys.argv[0]).name)
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    return argparse.Namespace(argv=sys.argv[1:])
