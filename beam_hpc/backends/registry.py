"""The backends a recipe may name, and the one way the Plan reaches them: the driver command.

``make_plan`` asks here for the command the head node runs once Ray is up; it never imports a
backend's modules itself. Builders are pure (no Ray, torch or Miles import), so a Plan is still
computed on a login node in milliseconds.
"""

from __future__ import annotations

from beam_hpc.config.recipe import Recipe
from beam_hpc.config.site import Site

REFERENCE_MODULE = "beam_hpc.backends.reference"


def driver_command(recipe: Recipe, site: Site, plan_path: str) -> tuple[list[str], dict[str, str]]:
    """The backend's driver argv (with Plan placeholders such as ``{ray_address}``) and the
    environment it needs."""
    if recipe.backend == "reference":
        return [site.node_python, "-m", REFERENCE_MODULE, "--plan", plan_path, "--ray-address", "{ray_address}",
                "--num-rollout", "{num_rollout}"], {}
    from beam_hpc.backends.miles import args  # pure argv builder, no Miles import

    return args.build_driver(recipe, site, plan_path)

