"""An optional package the tests use for real: present, or a clear skip (a failure in CI).

Tests that need it skip with its install line where it is missing, except where CI sets the
package's ``BEAM_REQUIRE_*`` variable to 1: there they fail, so a broken install cannot pass as
skipped tests.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import pytest


@dataclass(frozen=True)
class OptionalPackage:
    module: str  # what the tests import
    require_var: str  # CI sets it to 1: missing is a failure, not a skip
    missing: str  # the skip message, with the install line

    def present(self) -> bool:
        """Whether ``module`` is importable; where it is not, under ``require_var=1`` the test fails
        instead of taking its without-the-package branch."""
        if importlib.util.find_spec(self.module) is not None:
            return True
        if os.environ.get(self.require_var) == "1":
            pytest.fail(f"{self.missing} ({self.require_var}=1 requires it)", pytrace=False)
        return False

    def require(self) -> None:
        """Skip (or fail under ``require_var=1``) unless ``module`` is importable."""
        if not self.present():
            pytest.skip(self.missing)
