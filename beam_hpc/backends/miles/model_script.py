"""A Miles model script -> its Megatron architecture flags, in either of the two forms Miles has shipped.

Why: Megatron builds the network only from flags, and Miles keeps them per model in
``scripts/models/``: Miles main (radixark/miles, read at 31f1ca96) ships Python files there, older
Miles (and miles-rl 0.0.2, which ``source`` them) bash files. A recipe names either, with
``model.miles_model_script_vars`` for the values the script takes from outside.

- **Python** (``<name>.py``): run as Miles runs it, through Miles's own loader, in a child process
  (:func:`run_python_script`); where no Miles loader is reachable the script is read in the job
  instead (:class:`LoaderMissing`);
- **bash** (``<name>.sh``): its ``MODEL_ARGS=( ... )`` array is read *without running bash*
  (:func:`parse_model_script`); anything it cannot resolve is refused naming the line.

Which Python runs ``model_args()``: the caller's (beam-hpc's on the login node, the image's in the
job). Nothing here imports Miles in beam-hpc's own process.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from beam_hpc.errors import InputError, shorten

ARRAY_NAME = "MODEL_ARGS"
FORM_PYTHON = "python"
FORM_BASH = "bash"
# Where Miles keeps its loader, relative to the checkout root (31f1ca96).
LOADER_IN_CHECKOUT = ("miles", "utils", "external_utils", "model_args_utils.py")
LOADER_MODULE = "miles.utils.external_utils.model_args_utils"
RESULT_PREFIX = "BEAM-MODEL-ARGS "
TIMEOUT_S = 120.0  # importing one small file; generous for a loaded login node


def form_of(path: str) -> str:
    """``python`` for a ``.py`` script (Miles main), ``bash`` otherwise (``.sh``, older Miles)."""
    return FORM_PYTHON if path.endswith(".py") else FORM_BASH


class LoaderMissing(Exception):
    """No Miles ``model_args_utils`` where this Python can reach it: the script cannot be run as
    Miles runs it here (the caller defers it to the job, or refuses when already in the job)."""


@dataclass(frozen=True)
class ScriptFlags:
    """What a model script gave: its flags, its form, and (Python form) the loader that ran it."""

    args: tuple[str, ...]
    form: str
    loader: str = ""


def read_model_script(path: str, overrides: dict[str, str] | None = None, *,
                      python: str | None = None) -> list[str]:
    """The script's flags, either form; raises InputError (or LoaderMissing for a Python script
    whose Miles loader is not reachable from ``python``)."""
    return list(read_script(path, overrides, python=python).args)


def read_script(path: str, overrides: dict[str, str] | None = None, *, python: str | None = None) -> ScriptFlags:
    """:func:`read_model_script` with the form and loader it used (for the preflight's report)."""
    if form_of(path) == FORM_PYTHON:
        return run_python_script(path, overrides, python=python)
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise InputError(f"model.miles_model_script: {shorten(path)}: {err.strerror or err}") from None
    return ScriptFlags(tuple(parse_model_script(text, where=path, overrides=overrides)), FORM_BASH)


# -- the Python form -----------------------------------------------------------------------------

def run_python_script(path: str, overrides: dict[str, str] | None = None, *, python: str | None = None,
                      timeout_s: float = TIMEOUT_S) -> ScriptFlags:
    """Miles's own ``load_model_args`` on ``path`` in a child ``python`` (default: this one), with
    ``overrides`` in its environment. A child, not this process: the script and Miles's loader
    register modules (``model_args_utils``) and read the environment, and a broken script must not
    take the launcher down with it.

    The file defines ``model_args(...)`` returning the flags as one string; its optional parameters
    (``nlayers``, ``rotary_base`` in the MoE scripts) fall back to environment variables
    (``MODEL_ARGS_NUM_LAYERS``, ``MODEL_ARGS_ROTARY_BASE``), and it imports helpers such as
    ``moe_layer_freq`` from a module named ``model_args_utils``. Miles's
    ``load_model_args(model_type, model_script_dir)`` registers that module, imports the file and
    joins the returned string's words; its launchers pass ``model_args()`` no keyword arguments, so
    the environment is how a variant is chosen, here as there (:func:`find_loader` says where the
    loader is looked for)."""
    if not Path(path).is_file():
        raise InputError(f"model.miles_model_script: {shorten(path)} is not a readable file")
    bad = sorted(k for k in (overrides or {}) if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k))
    if bad:
        raise InputError(f"model.miles_model_script_vars: {', '.join(map(shorten, bad))} cannot be environment "
                         "variable names; use names such as MODEL_ARGS_NUM_LAYERS")
    env = {**os.environ, **{k: str(v) for k, v in (overrides or {}).items()}}
    argv = [python or sys.executable, "-m", __name__, path]
    try:
        res = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise InputError(f"model.miles_model_script: {shorten(path)}: model_args() did not return within "
                         f"{timeout_s:.0f} s") from None
    except OSError as err:
        raise InputError(f"model.miles_model_script: cannot run {shorten(argv[0])} to call model_args(): {err}") from None
    for line in reversed(res.stdout.splitlines()):
        if line.startswith(RESULT_PREFIX):
            d = json.loads(line[len(RESULT_PREFIX):])
            break
    else:
        tail = " | ".join((res.stderr or res.stdout).strip().splitlines()[-3:])
        raise InputError(f"model.miles_model_script: {shorten(path)}: the call of model_args() printed no result "
                         f"(exit {res.returncode}): {tail}")
    if d.get("missing_loader"):
        raise LoaderMissing(d["error"])
    if not d.get("ok"):
        raise InputError(f"model.miles_model_script: {shorten(path)}: {d['error']}; fix the script or the values "
                         "in model.miles_model_script_vars (they reach it as environment variables)")
    return ScriptFlags(tuple(d["args"]), FORM_PYTHON, d.get("loader", ""))


def _checkout_of(script: Path) -> Path:
    """The Miles checkout a ``<checkout>/scripts/models/<name>.py`` belongs to (its grandparent)."""
    parents = script.resolve().parents
    return parents[2] if len(parents) > 2 else script.resolve().parent


def find_loader(script: Path) -> tuple[Any, str] | None:
    """(Miles's ``load_model_args``, where it came from) reachable from this Python, or None:
    the script's own checkout first (the loader that matches the script), then ``import miles``."""
    import importlib
    import importlib.util

    candidate = _checkout_of(script).joinpath(*LOADER_IN_CHECKOUT)
    if candidate.is_file():
        name = "_beam_miles_model_args_utils"
        spec = importlib.util.spec_from_file_location(name, candidate)
        if spec is not None and spec.loader is not None:
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module  # the loader registers itself as model_args_utils from here
            spec.loader.exec_module(module)
            return module.load_model_args, str(candidate)
    try:
        module = importlib.import_module(LOADER_MODULE)
    except Exception:  # noqa: BLE001 - absent (ImportError) or an install that does not load: no loader here
        return None
    return module.load_model_args, str(getattr(module, "__file__", LOADER_MODULE))


def _child(path: str) -> dict[str, Any]:
    """In the child: call Miles's loader as its launchers do (no keyword arguments)."""
    script = Path(path)
    found = find_loader(script)
    if found is None:
        return {"ok": False, "missing_loader": True,
                "error": f"no Miles model_args_utils in {_checkout_of(script)} nor importable as {LOADER_MODULE} "
                         f"in {sys.executable}"}
    load, where = found
    try:
        text = load(script.stem, model_script_dir=script.parent)
    except BaseException as exc:  # noqa: BLE001 - the script's own failure, reported as input
        return {"ok": False, "error": f"model_args() failed: {type(exc).__name__}: {exc}"}
    return {"ok": True, "args": str(text).split(), "loader": where}


# -- the bash form -----------------------------------------------------------------------------

_ASSIGN = re.compile(r"^(?:export\s+|local\s+|readonly\s+)?([A-Za-z_][A-Za-z0-9_]*)=(.*)$")
_VAR = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?-)([^}]*))?\}|([A-Za-z_][A-Za-z0-9_]*)|\(\(([^)]*)\)\))")


def parse_model_script(text: str, *, where: str, overrides: dict[str, str] | None = None) -> list[str]:
    """The words of the script's ``MODEL_ARGS=( ... )`` array, variables resolved; raises InputError.

    Only what can be known without running bash: comments, line continuations, quotes, plain
    ``NAME=value`` assignments before the array (their values resolved the same way), ``$NAME``,
    ``${NAME}``, ``${NAME:-default}`` / ``${NAME-default}`` and integer ``$((a + b))``;
    ``overrides`` set or win over variables (e.g. ``MOE_LAYER_FREQ``, which those scripts build
    with a bash loop). Anything else is refused naming the line; ``where`` names the file in errors.
    """
    overrides = dict(overrides or {})
    env: dict[str, str] = {}
    lines = _logical_lines(text)
    start = None
    for i, (lineno, line) in enumerate(lines):
        if re.match(rf"^(?:export\s+)?{ARRAY_NAME}=\(", line):
            start = i
            break
        m = _ASSIGN.match(line)
        if m and not m.group(2).startswith("("):
            try:
                words = shlex.split(_expand(m.group(2), env, overrides, where, lineno), comments=True)
            except (InputError, ValueError):
                continue  # a value we cannot know (command substitution, arrays): unknown unless used
            if len(words) <= 1:
                env[m.group(1)] = words[0] if words else ""
    if start is None:
        raise InputError(f"model.miles_model_script: {where} has no {ARRAY_NAME}=( ... ) array; "
                         "point it at a Miles scripts/models/<name>.sh (bash) or <name>.py (Miles main), or use model.miles_model_args")
    body: list[tuple[int, str]] = []
    depth = 0
    first_no, first = lines[start]
    rest = first.split("(", 1)[1]
    for lineno, line in [(first_no, rest), *lines[start + 1:]]:
        stripped = _strip_comment(line)
        depth, end = _close(stripped, depth if body else 0)
        if end >= 0:
            body.append((lineno, stripped[:end]))
            break
        body.append((lineno, stripped))
    else:
        raise InputError(f"model.miles_model_script: {where}: {ARRAY_NAME}=( is never closed")
    words: list[str] = []
    for lineno, chunk in body:
        expanded = _expand(chunk, env, overrides, where, lineno)
        try:
            words += shlex.split(expanded)
        except ValueError as err:
            raise InputError(f"model.miles_model_script: {where} line {lineno}: {err}") from None
    return words


def _logical_lines(text: str) -> list[tuple[int, str]]:
    """(first line number, line) with backslash continuations joined and whole-line comments dropped."""
    out: list[tuple[int, str]] = []
    buf, first = "", 0
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.rstrip()
        if not buf:
            first = n
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        if buf.strip() and not buf.strip().startswith("#"):
            out.append((first, buf.strip()))
        buf = ""
    if buf.strip():
        out.append((first, buf.strip()))
    return out


def _close(text: str, depth: int) -> tuple[int, int]:
    """(paren depth after ``text``, index of the ``)`` that closes the array or -1); parentheses
    inside quotes and those of ``$(( ))`` do not close it."""
    for i, ch in enumerate(text):
        if _inside_quotes(text, i):
            continue
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth < 0:
                return depth, i
    return depth, -1


def _quotes_open(text: str, pos: int) -> tuple[bool, bool]:
    """Whether a single- and a double-quoted string are open at ``pos`` (bash rules: each kind
    of quote is literal inside the other)."""
    single = double = False
    for ch in text[:pos]:
        if ch == "'" and not double:
            single = not single
        elif ch == '"' and not single:
            double = not double
    return single, double


def _in_single_quotes(text: str, pos: int) -> bool:
    return _quotes_open(text, pos)[0]


def _inside_quotes(text: str, pos: int) -> bool:
    return any(_quotes_open(text, pos))


def _strip_comment(line: str) -> str:
    """Drop a ``# comment`` that starts a word outside quotes."""
    for i, ch in enumerate(line):
        if ch == "#" and (i == 0 or line[i - 1].isspace()) and not _inside_quotes(line, i):
            return line[:i]
    return line


def _expand(text: str, env: dict[str, str], overrides: dict[str, str], where: str, lineno: int) -> str:
    def value(name: str) -> str | None:
        return overrides.get(name, env.get(name))

    def sub(m: re.Match[str]) -> str:
        if _in_single_quotes(text, m.start()):
            return m.group(0)  # bash leaves '$X' alone
        if m.group(5) is not None:
            return str(_arith(m.group(5), value, where, lineno))
        name = m.group(1) or m.group(4)
        got = value(name)
        op, default = m.group(2), m.group(3)
        if op == ":-" and not got:
            return _expand(default, env, overrides, where, lineno)
        if op == "-" and got is None:
            return _expand(default, env, overrides, where, lineno)
        if got is None:
            raise InputError(
                f"model.miles_model_script: {where} line {lineno}: ${name} is not a plain assignment in the "
                f"script (bash would compute it); set it with model.miles_model_script_vars: {{{name}: ...}} "
                "(e.g. MOE_LAYER_FREQ: \"[0]*3+[1]*58\"), or give the flags in model.miles_model_args"
            )
        return got

    if "$(" in text.replace("$((", ""):
        raise InputError(f"model.miles_model_script: {where} line {lineno}: command substitution $( ... ) is not "
                         "read without running bash; give the flags in model.miles_model_args")
    return _VAR.sub(sub, text)


def _arith(expr: str, value: Any, where: str, lineno: int) -> int:
    """Integer ``a + b - c * d`` over numbers and variable names (bash ``$(( ))``, the part scripts use)."""
    tokens = re.findall(r"\d+|[A-Za-z_][A-Za-z0-9_]*|[-+*]", expr.replace("$", ""))
    if not tokens or "".join(tokens) != re.sub(r"[\s$]", "", expr):
        raise InputError(f"model.miles_model_script: {where} line {lineno}: $(({expr})) is beyond the arithmetic "
                         "read here (+, -, * of integers); give the flags in model.miles_model_args")
    nums: list[int] = []
    ops: list[str] = []
    for t in tokens:
        if t in "+-*":
            ops.append(t)
            continue
        v = t if t.isdigit() else value(t)
        if v is None or not str(v).lstrip("-").isdigit():
            raise InputError(f"model.miles_model_script: {where} line {lineno}: {t} in $(({expr})) is not a known "
                             "integer; set it with model.miles_model_script_vars")
        nums.append(int(v))
    terms, prod = [], nums[0]
    signs = ["+"]
    for op, n in zip(ops, nums[1:], strict=False):
        if op == "*":
            prod *= n
        else:
            terms.append(prod)
            signs.append(op)
            prod = n
    terms.append(prod)
    return sum(t if s == "+" else -t for s, t in zip(signs, terms, strict=False))


if __name__ == "__main__":
    print(RESULT_PREFIX + json.dumps(_child(sys.argv[1])), flush=True)
