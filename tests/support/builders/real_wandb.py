"""The real ``wandb`` package for the tests: present, or a clear skip.

Tests that need it skip with the install line where it is missing, except under
``BEAM_REQUIRE_WANDB=1`` (CI), where they fail, so a broken install cannot pass as skipped tests.
They run W&B offline only: no network, no key.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

WANDB_VERSION = "0.31.0"
_MISSING = f"wandb unavailable: pip install wandb=={WANDB_VERSION} to run the W&B tracking tests"


def have_wandb() -> bool:
    """Whether wandb is importable; under ``BEAM_REQUIRE_WANDB=1`` its absence fails the test. For a
    test that checks W&B on top of what it checks anyway (the walltime chain), so that a machine
    without wandb still runs the rest."""
    if importlib.util.find_spec("wandb") is not None:
        return True
    if os.environ.get("BEAM_REQUIRE_WANDB") == "1":
        pytest.fail(_MISSING + " (BEAM_REQUIRE_WANDB=1 requires it)", pytrace=False)
    return False


def require_wandb() -> None:
    if importlib.util.find_spec("wandb") is not None:
        return
    if os.environ.get("BEAM_REQUIRE_WANDB") == "1":
        pytest.fail(_MISSING + " (BEAM_REQUIRE_WANDB=1 requires it)", pytrace=False)
    pytest.skip(_MISSING)
