"""The trainer's AdamW: torch's own, without the compiler import it makes on every call.

``torch.optim.AdamW`` wraps ``__init__``'s ``add_param_group``, ``zero_grad``, ``state_dict``,
``load_state_dict`` and ``step`` in decorators that ``import torch._dynamo`` (to mark graph breaks
and keep the compiler out) the first time each runs, compiled or not. Nothing here is compiled, and
that import is most of torch's compiler: about 0.8 CPU-s, a third of a small run's trainer process.

:class:`AdamW` is ``torch.optim.AdamW`` with those methods bound to the functions the decorators
wrap (found with ``inspect.unwrap``), and ``step`` run under ``torch.no_grad()``, which is what its
decorator does outside compilation (it sets grad mode to the optimizer's ``differentiable``, which
the trainer leaves False). The arithmetic, the state and its ``state_dict`` are torch's, bit for bit
(``tests/backends/reference/test_optimizer.py`` compares the two). Should a torch release stop
wrapping a method, ``inspect.unwrap`` returns it as it is and only the saving is lost.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

_Optimizer = torch.optim.Optimizer


class AdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` whose methods never import ``torch._dynamo`` (see the module)."""

    add_param_group = inspect.unwrap(_Optimizer.add_param_group)
    zero_grad = inspect.unwrap(_Optimizer.zero_grad)
    state_dict = inspect.unwrap(_Optimizer.state_dict)
    load_state_dict = inspect.unwrap(_Optimizer.load_state_dict)

    def step(self, closure: Any = None) -> Any:
        if self.defaults.get("differentiable"):
            return super().step(closure)  # grad mode on inside the step: torch's own path
        with torch.no_grad():
            return _ADAMW_STEP(self, closure)


_ADAMW_STEP = inspect.unwrap(torch.optim.AdamW.step)
