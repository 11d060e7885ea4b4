"""Miles's own answer checking, as a second opinion next to beam-hpc's: the eval the seed reported.

Why: the seed's curves (AIME2025 46.25% -> 55.83%) were scored by Miles's math checker,
``miles.rollout.rm_hub.math_utils.grade_answer_verl`` (the one its ``math`` and ``deepscaler``
rewards use), and the two checkers disagree on some answer pairs. So a beam-hpc run records both:
beam-hpc's checker (:mod:`beam_hpc.reward.scoring`, which also gives the training reward, unchanged)
and this verdict, which only ever feeds metrics.

The boundary, stated once: Miles's checker is *imported from Miles*, never copied. Where Miles is
importable (the Miles image, and the test environment with miles-rl) the verdict is "correct" or
"wrong". Where it is not (the reference backend on a machine without Miles, or beside the tests'
Miles stand-in, which has no ``rollout`` package), the verdict is "unavailable", and `status` and
`plot` say so rather than show a number. No fallback imitates it: a number that only resembles
Miles's would defeat the comparison.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

from beam_hpc.run.metric_names import MILES_CORRECT, MILES_UNAVAILABLE, MILES_WRONG


@cache
def _checker() -> Callable[[str, str], bool] | None:
    try:
        from miles.rollout.rm_hub.math_utils import grade_answer_verl
    except ImportError:  # no Miles here (or only the tests' stand-in): the boundary above
        return None
    return grade_answer_verl


def miles_available() -> bool:
    """Whether Miles's checker can be imported in this process."""
    return _checker() is not None


def miles_verdict(response: str, label: str) -> str:
    """Miles's verdict on ``response`` against the reference answer ``label``: MILES_CORRECT,
    MILES_WRONG, or MILES_UNAVAILABLE when Miles cannot be imported here."""
    check = _checker()
    if check is None:
        return MILES_UNAVAILABLE
    try:
        return MILES_CORRECT if check(response, label) else MILES_WRONG
    except Exception:  # noqa: BLE001 - sympy/latex parsing of arbitrary text raises anything: an
        return MILES_WRONG  # answer the checker cannot parse is not counted correct


def verdict_fractions(verdicts: list[str]) -> dict[str, float]:
    """Fraction of samples per verdict, as Miles's ``--log-reward-category`` logs them
    (``error_cat/<verdict>``: only verdicts that occur)."""
    n = len(verdicts)
    return {v: verdicts.count(v) / n for v in sorted(set(verdicts))} if n else {}
