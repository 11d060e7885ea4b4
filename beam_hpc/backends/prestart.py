"""Each backend's check of the exact driver command, run inside the job before Ray starts.

Kept apart from the registry: the registry is what the Plan reaches (pure, light), while this
check runs the backend's own code (for Miles, its argument parser inside the image), which the
login-node planning path must never import.
"""

from __future__ import annotations

from typing import Any


def check_before_start(plan: Any) -> str | None:
    """Inside the job, on the head node, before Ray starts: the backend's own check of the exact
    driver command (for Miles: the image's Miles parser, with its validation). None when it may
    start, else the refusal for the ledger and the log. Costs seconds; saves the allocation's
    GPUs from Ray bring-up and a driver that would stop at its first line."""
    if plan.recipe.backend != "miles":
        return None
    from beam_hpc.backends.miles import preflight

    return preflight.check_in_job(plan)
