"""The real ``wandb`` package for the tests: present, or a clear skip.

Tests that need it skip with the install line where it is missing, except under
``BEAM_REQUIRE_WANDB=1`` (CI), where they fail, so a broken install cannot pass as skipped tests.
They run W&B offline only: no network, no key.
"""

from __future__ import annotations

from optional_package import OptionalPackage

WANDB_VERSION = "0.31.0"
WANDB = OptionalPackage("wandb", "BEAM_REQUIRE_WANDB",
                        f"wandb unavailable: pip install wandb=={WANDB_VERSION} to run the W&B tracking tests")
# have_wandb: for a test that checks W&B on top of what it checks anyway (the walltime chain)
have_wandb = WANDB.present
require_wandb = WANDB.require
