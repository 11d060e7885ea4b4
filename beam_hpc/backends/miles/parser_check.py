"""Run the image's own Miles argument parser, with all its validation, on one argv; print the verdict.

``python -m beam_hpc.backends.miles.parser_check -- train_async.py <Miles flags>``, run by
``backends.miles.preflight`` through the site's container seam, so the parser is the one of the
Miles the run will use (the image's), not the version the flag table was written against. It calls
``miles.utils.arguments.parse_args()`` (what ``train.py`` / ``train_async.py`` call first) with the
driver's argv; nothing is trained, no GPU or Ray is touched. On a node without GPUs, the device
queries Megatron's ``validate_args`` makes answer 9.0 (:func:`patch_device_capability`), and a
GPU-only package the import chain pulls in but cannot load there gets an inert stand-in
(:func:`install_stand_ins`): the check tests the arguments, not the node.

Output: one line ``BEAM-MILES-CHECK {"ok": ..., "error": ..., "unrecognized": [...], ...}`` on
stdout; the exit status is 0 either way (the caller reads the line). Imports only the standard
library at the top, so a broken Miles cannot stop it from reporting.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.abc
import importlib.machinery
import json
import os
import re
import sys
import time
import traceback
import types
from typing import Any

RESULT_PREFIX = "BEAM-MILES-CHECK "
GPU_ONLY_PACKAGES = ("torchvision", "triton")
STAND_IN_CAPABILITY = (9, 0)
_UNRECOGNIZED = re.compile(r"unrecognized arguments: (.*)")


class _Inert:
    """Anything a stand-in module is asked for: a no-op decorator (``@jit``, ``@autotune(...)``),
    indexable; a call without arguments (a device query such as
    ``triton.runtime.driver.active.get_current_target()``) raises, as on a machine without a GPU,
    which is what the callers' CPU fallbacks expect."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return _member(f"{self._name}.{attr}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]  # used as a decorator (@triton.jit)
        if not args and not kwargs:
            raise RuntimeError(f"{self._name}(): no GPU package here (beam-hpc parser check stand-in)")
        return _Inert(self._name + "(...)")

    def __getitem__(self, item: Any) -> _Inert:
        return self

    def __mro_entries__(self, bases: tuple[Any, ...]) -> tuple[type, ...]:
        return (object,)


def _member(name: str) -> Any:
    """A stand-in's member: a class for a capitalised name (callers test ``isinstance`` against
    them, e.g. torch's flop counter against ``triton.runtime.jit.JITFunction``), else inert."""
    short = name.rsplit(".", 1)[-1]
    if short[:1].isupper():
        return type(short, (), {"__module__": name.rsplit(".", 1)[0]})
    return _Inert(name)


class _StandInModule(types.ModuleType):
    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        value = _member(f"{self.__name__}.{attr}")
        setattr(self, attr, value)  # the same object on every access
        return value


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves inert modules for ``packages`` and their submodules."""

    def __init__(self, packages: set[str]) -> None:
        self.packages = packages

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname.split(".")[0] in self.packages:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> types.ModuleType:
        module = _StandInModule(spec.name)
        module.__path__ = []  # a package, so submodules resolve through this finder too
        module.__version__ = "0.0.0+beam-stand-in"
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def install_stand_ins() -> list[str]:
    """Stand-ins for the GPU-only packages that cannot be imported here; returns their names.

    SGLang's utilities import ``torchvision.io.decode_jpeg`` and ``triton`` at module level, though
    only GPU code uses them. Only when the real one cannot be imported (a CPU test environment: PyPI
    has no torchvision that loads beside the CPU torch) is an inert module registered; in the image
    the real ones load."""
    missing = set()
    for name in GPU_ONLY_PACKAGES:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - absent, or present but unloadable beside this torch
            sys.modules.pop(name, None)
            missing.add(name)
    if missing:
        _settle_availability_probes()
        sys.meta_path.insert(0, _StandInFinder(missing))
    return sorted(missing)


def _settle_availability_probes() -> None:
    """Let libraries that probe for the packages (transformers caches "is torchvision available")
    answer before the stand-ins exist: a stand-in is for the import chain, not a capability."""
    try:
        from transformers.utils import import_utils
    except Exception:  # noqa: BLE001
        return
    for probe in ("is_torchvision_available", "is_torchvision_v2_available", "is_triton_available"):
        fn = getattr(import_utils, probe, None)
        if callable(fn):
            try:
                fn()
            except Exception:  # noqa: BLE001
                pass


def patch_device_capability() -> bool:
    """Answer Megatron's compute-capability query on a node without CUDA (this process only).

    ``validate_args`` reads ``torch.cuda.get_device_capability()`` (for ``--moe-grouped-gemm``) and
    ``get_device_properties(...).major`` (``get_device_arch_version``), which raise without a CUDA
    device; both answer 9.0 here (the H100/H200 class the image targets). ``is_available()`` still
    says false, so nothing takes a GPU code path."""
    try:
        import torch
    except Exception:  # noqa: BLE001 - Miles's own import will report it
        return False
    if torch.cuda.is_available():
        return False
    major, minor = STAND_IN_CAPABILITY
    props = types.SimpleNamespace(major=major, minor=minor, name="beam-hpc parser check (no GPU)",
                                  total_memory=141 * 2**30, multi_processor_count=132)
    torch.cuda.get_device_capability = lambda device=None: STAND_IN_CAPABILITY  # type: ignore[assignment]
    torch.cuda.get_device_properties = lambda device=None: props  # type: ignore[assignment]
    return True


class ParserError(Exception):
    """argparse refused the command line (its message, as it would print it)."""


def _raise_parser_error(self: argparse.ArgumentParser, message: str) -> None:
    """``ArgumentParser.error`` for this check: raise the message instead of printing usage and
    exiting, so the verdict carries argparse's own words (patched in this process only)."""
    raise ParserError(f"{self.prog}: error: {message}")


def check(argv: list[str]) -> dict[str, Any]:
    """Run Miles's parse_args on ``argv`` (entry point first); the verdict as a dict."""
    start = time.monotonic()
    result: dict[str, Any] = {"ok": False, "error": "", "unrecognized": [], "stand_ins": install_stand_ins(),
                              "capability_patched": patch_device_capability(), "miles": ""}
    saved = sys.argv, argparse.ArgumentParser.error
    try:
        sys.argv = list(argv)
        argparse.ArgumentParser.error = _raise_parser_error  # type: ignore[method-assign]
        from miles.utils import arguments

        result["miles"] = getattr(arguments, "__file__", "")
        arguments.parse_args()
        result["ok"] = True
    except ParserError as exc:  # argparse's own refusal ("unrecognized arguments: ...")
        result["error"] = str(exc)
        m = _UNRECOGNIZED.search(str(exc))
        if m:
            result["unrecognized"] = [w for w in m.group(1).split() if w.startswith("--")]
    except SystemExit as exc:
        result["error"] = f"Miles's parser exited with status {exc.code}"
    except Exception as exc:  # noqa: BLE001 - an assertion or error of Miles's validation: report it
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc(limit=6)
    finally:
        sys.argv, argparse.ArgumentParser.error = saved  # type: ignore[method-assign]
    result["seconds"] = round(time.monotonic() - start, 3)
    return result


def expand(options: list[str], argv: list[str]) -> tuple[list[str], dict[str, Any]]:
    """The launcher's ``--model-script`` options applied to ``argv`` (entry point first), with the
    function the launcher uses, then the result compared with the model's config.json: what the
    driver would run, checked with beam-hpc's clearer message before Miles's own. Also returns
    what was found (``{"path", "form", "flags"}``, empty without a deferred script), which the
    preflight reports: in the image, which form of model script the run will use."""
    from beam_hpc.backends.miles import architecture as arch

    script, script_vars = None, []
    for flag, value in zip(options[::2], options[1::2], strict=False):
        if flag == arch.MODEL_SCRIPT_OPTION:
            script = value
        elif flag == arch.MODEL_SCRIPT_VAR_OPTION:
            script_vars.append(value)
    if script is None:
        return argv, {}
    miles_argv, form = arch.expand_deferred_with_form(script, script_vars, argv[1:])
    found = {"path": script, "form": form, "flags": len(miles_argv) - len(argv) + 1}
    hf = arch.flag_values(miles_argv).get("--hf-checkpoint")
    config = os.path.join(hf, "config.json") if hf else None
    if config and os.path.isfile(config):
        with open(config) as fh:
            arch.compare_with_config(miles_argv, json.load(fh), source=f"model.miles_model_script ({script})",
                                     config_path=config)
    return [argv[0], *miles_argv], found


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if "--" not in args or args.index("--") + 1 >= len(args):
        print("usage: python -m beam_hpc.backends.miles.parser_check [--model-script PY|SH ...] -- train_async.py "
              "<Miles flags>", file=sys.stderr)
        return 2
    cut = args.index("--")
    try:
        full, found = expand(args[:cut], args[cut + 1:])
    except Exception as exc:  # noqa: BLE001 - beam-hpc's own refusal (InputError): report it
        print(RESULT_PREFIX + json.dumps({"ok": False, "error": str(exc), "unrecognized": []}), flush=True)
        return 0
    result = check(full)
    if found:
        result["model_script"] = found
    sys.stdout.flush()
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
