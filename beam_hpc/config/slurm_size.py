"""Slurm's size notation, read in one place: ``--tmp`` in a site profile, the ``--tmp`` a plan asks
for, the TmpDisk a node declares, and the doctor's scratch check all go through :func:`parse_mib`.

What Slurm accepts (``sbatch --tmp``, Slurm 22.05, checked with ``sbatch --test-only`` on the local
cluster): a whole number with an optional unit letter K, M, G or T, case-insensitive, in powers
of 1024; no unit means M, Slurm's "MB", which is a MiB; K is rounded up to whole MB. Fractions are
refused by Slurm ("Invalid --tmp specification" for ``1.5T``), so they are refused here too: a
site that writes one hears it when the site is loaded, not from sbatch after the plan is written.
A ``B`` after the unit (``2000GB``) is accepted, as Slurm accepts it.

Why in ``config``: the site schema validates ``tmp`` with it, and config is the lowest stage, so
the plan, the doctor and the node checks import it without reaching any Slurm code
(tests/test_layout.py).
"""

from __future__ import annotations

import math
import re

_SIZE = re.compile(r"^(\d+)(?:([KMGT])B?)?$", re.IGNORECASE)
_MIB_PER_UNIT = {"M": 1, "G": 1024, "T": 1024**2}

# What to write in a fix line when a size is refused.
SIZE_HINT = "a whole number with K, M, G or T, e.g. 2000G or 2T (a bare number is MB; Slurm takes no fractions)"


def parse_mib(text: str | int) -> int:
    """A Slurm size in MiB (Slurm's "MB"). Raises ValueError for anything Slurm would refuse."""
    m = _SIZE.match(str(text).strip())
    if not m:
        raise ValueError(f"{text!r} is not a Slurm size")
    number, unit = int(m.group(1)), (m.group(2) or "M").upper()
    if unit == "K":
        return math.ceil(number / 1024)
    return number * _MIB_PER_UNIT[unit]


def gib_text(mib: int) -> str:
    """A size for people, in Slurm's own units, the G rounded down (what a ``--tmp`` in G may ask
    of it): ``3000000 MB (2929G)``."""
    return f"{mib} MB ({mib // 1024}G)" if mib >= 1024 else f"{mib} MB"
