"""Real Miles (``miles-rl`` from PyPI) for the tests: present, or a clear skip.

Install (no dependencies: it would pull a CUDA torch): ``pip install --no-deps miles-rl==0.0.2``
plus the pure-Python packages its parser imports (the report lists them). Tests that need it skip
with that hint where it is missing, except under ``BEAM_REQUIRE_MILES=1`` (CI), where they fail,
so a broken install cannot pass as skipped tests.
"""

from __future__ import annotations

from optional_package import OptionalPackage

MILES_VERSION = "0.0.2"
MILES = OptionalPackage("miles", "BEAM_REQUIRE_MILES",
                        f"real Miles unavailable: pip install --no-deps miles-rl=={MILES_VERSION} (and the parser's "
                        "pure-Python dependencies) to run the tests against Miles's own code")
have_miles = MILES.present
require_miles = MILES.require
