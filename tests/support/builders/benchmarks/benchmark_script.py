"""A script of benchmarks/ imported as a module, so that tests/benchmarks/ can test its pure parts
(the scripts are programs, not a package on the path)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[4] / "benchmarks"


def load(name: str) -> ModuleType:
    """benchmarks/<name>.py, registered in sys.modules under ``name`` (dataclasses look it up there)."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
