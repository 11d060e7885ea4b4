"""Real Miles (``miles-rl`` from PyPI) for the tests: present, or a clear skip.

Install (no dependencies: it would pull a CUDA torch): ``pip install --no-deps miles-rl==0.0.2``
plus the pure-Python packages its parser imports (the report lists them). Tests that need it skip
with that hint where it is missing, except under ``BEAM_REQUIRE_MILES=1`` (CI), where they fail,
so a broken install cannot pass as skipped tests.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

MILES_VERSION = "0.0.2"


def have_miles() -> bool:
    """Whether ``miles`` from miles-rl is importable; where it is not, under BEAM_REQUIRE_MILES=1
    (CI) the test fails instead of taking its without-Miles branch."""
    if importlib.util.find_spec("miles") is not None:
        return True
    if os.environ.get("BEAM_REQUIRE_MILES") == "1":
        pytest.fail(_MISSING + " (BEAM_REQUIRE_MILES=1 requires it)", pytrace=False)
    return False


def require_miles() -> None:
    """Skip (or fail under BEAM_REQUIRE_MILES=1) unless ``miles`` from miles-rl is importable."""
    if not have_miles():
        pytest.skip(_MISSING)


_MISSING = (f"real Miles unavailable: pip install --no-deps miles-rl=={MILES_VERSION} (and the parser's "
            "pure-Python dependencies) to run the tests against Miles's own code")
