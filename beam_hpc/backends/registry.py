"""The backends a recipe may name, and the one way a Plan gets its driver command.

``make_plan`` is pure and never imports a backend: the driver command (the backend's argv and
environment, which for Miles may come from the model's config.json or its model script) is computed
here and handed to it as data. :func:`plan_for` does both, so a caller stays one line. Builders
import no Ray, torch or Miles, so a Plan is still computed on a login node in milliseconds.
"""

from __future__ import annotations

import os

from beam_hpc.config.recipe import Recipe
from beam_hpc.config.site import Site
from beam_hpc.plan.local_disk import DeclaredTmpDisk
from beam_hpc.plan.paths import RunPaths
from beam_hpc.plan.plan import RUN_DIR, DriverCommand, Plan, make_plan
from beam_hpc.run import tracking

REFERENCE_MODULE = "beam_hpc.backends.reference"


def driver_command(recipe: Recipe, site: Site) -> DriverCommand:
    """:func:`driver_command_with` the recipe's W&B settings resolved here (:func:`plan_for`
    resolves them once per plan)."""
    return driver_command_with(recipe, site, tracking.settings_for(recipe, site))


def driver_command_with(recipe: Recipe, site: Site, wb: tracking.WandbSettings | None) -> DriverCommand:
    """The backend's driver argv (with Plan placeholders such as ``{ray_address}``) and the
    environment it needs, with the run's W&B settings ``wb``; a backend's own checks (Miles's
    layout rules) raise InputError here."""
    if recipe.backend == "miles":
        from beam_hpc.backends.miles import args  # pure argv builder, no Miles import

        argv, env = args.driver_with(recipe, site, wb)
        return DriverCommand(tuple(argv), env)
    return DriverCommand((site.node_python, "-m", REFERENCE_MODULE, "--plan", RunPaths(RUN_DIR).plan,
                          "--ray-address", "{ray_address}", "--num-rollout", "{num_rollout}"),
                         tracking.wandb_env(wb, RUN_DIR) if wb is not None else {})


def plan_for(recipe: Recipe, site: Site, *, measured: dict[str, float] | None = None,
             tmp_disk: DeclaredTmpDisk | None = None) -> Plan:
    """``make_plan`` with the backend's driver command: recipe + site -> Plan, or InputError (W&B
    online with no key here is one: the job inherits this environment). The W&B settings are
    resolved once, here, for the driver's flags, its environment and the key check; the recipe's
    paths are checked once, by ``make_plan``."""
    wb = tracking.settings_for(recipe, site)
    driver = driver_command_with(recipe, site, wb)
    tracking.check_credentials(wb, os.environ)
    return make_plan(recipe, site, driver=driver, measured=measured, tmp_disk=tmp_disk)
