"""beam-hpc: run the Beam GRPO/DAPO math-RL recipe as native Slurm batch work.

``import beam_hpc`` stays light (``beam-hpc render`` must start fast on a login node): the public
names below are loaded on first use.

    import beam_hpc
    sub = beam_hpc.submit("recipes/colocated.yaml", "env/mycluster.yaml")
    print(sub.job.state)          # a submitit Job handle for the heterogeneous job
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from beam_hpc.version import __version__

# public name -> (module, attribute)
_EXPORTS = {
    "submit": ("beam_hpc.submission.submit", "submit"),
    "Submission": ("beam_hpc.submission.submit", "Submission"),
    "SubmitRequest": ("beam_hpc.submission.request", "SubmitRequest"),
    "Recipe": ("beam_hpc.config.recipe", "Recipe"),
    "Site": ("beam_hpc.config.site", "Site"),
    "Plan": ("beam_hpc.plan.plan", "Plan"),
    "make_plan": ("beam_hpc.plan.plan", "make_plan"),
    "plan_for": ("beam_hpc.backends.registry", "plan_for"),
    "load_recipe": ("beam_hpc.config.recipe", "load_recipe"),
    "load_site": ("beam_hpc.config.site", "load_site"),
}
__all__ = ["__version__", *_EXPORTS]

if TYPE_CHECKING:  # the lazy exports above, for type checkers (F401: used through __all__)
    from beam_hpc.backends.registry import plan_for  # noqa: F401
    from beam_hpc.config.recipe import Recipe, load_recipe  # noqa: F401
    from beam_hpc.config.site import Site, load_site  # noqa: F401
    from beam_hpc.plan.plan import Plan, make_plan  # noqa: F401
    from beam_hpc.submission.request import SubmitRequest  # noqa: F401
    from beam_hpc.submission.submit import Submission, submit  # noqa: F401


def __getattr__(name: str) -> Any:
    """Load a public name on first use (PEP 562)."""
    try:
        module, attr = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module 'beam_hpc' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value
