"""The package's shape, held by a test: no import cycles, and the dependency rules that keep each
stage replaceable.

Every module of ``beam_hpc`` is parsed (not imported) and every import is counted, at the top
level and inside function bodies alike: an import hidden in a function is still a dependency,
and hiding one is how the cycles this test now forbids used to survive.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "beam_hpc"

# Stages, top to bottom; an import of a stage listed earlier is an upward import. Backends sit above
# node, because a backend runs on the nodes and uses the node's own seams (the container command for
# Miles's conversion job, the Ray node's address helpers), while nothing in node knows a backend.
# Elastic (an extra rollout job's node program and the run's record of its extra jobs) runs in an
# allocation of its own and uses the backends' outside workers and engines; the request and script
# of that job are the submission's (submission/rollout_job.py).
LAYERS = ("cli", "observe", "submission", "job", "elastic", "lifecycle", "backends", "node", "reward", "data",
          "run", "slurm", "plan", "config")
# The package's face (beam_hpc/__init__.py) names the public API, which lives in the top layers: no
# module of the package imports it. Below every layer sit the leaves, the modules at the top of the
# package (errors, the progress bar, the log format, the atomic-file helpers, the version, the tests'
# fault hooks): every stage may import them, and they import nothing of beam_hpc but one another.
FACE = "beam_hpc"
HEAVY = ("ray", "submitit", "torch")
ALLOCATION_STAGES = ("job", "elastic", "node", "lifecycle")


@dataclass(frozen=True)
class Import:
    source: str  # importing module
    target: str  # imported module (beam_hpc.*) or top-level package name (third party)
    line: int


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE_DIR.rglob("*.py"))}


def _resolve(base: str, name: str, modules: dict[str, Path]) -> str:
    """``from base import name``: the submodule base.name if there is one, else base."""
    return f"{base}.{name}" if f"{base}.{name}" in modules else base


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> Iterator[Import]:
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(module, alias.name if alias.name.startswith("beam_hpc") else alias.name.split(".")[0],
                             node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if not base.startswith("beam_hpc"):
                yield Import(module, base.split(".")[0], node.lineno)
                continue
            for alias in node.names:
                yield Import(module, _resolve(base, alias.name, modules), node.lineno)


def graph() -> tuple[dict[str, Path], list[Import]]:
    modules = all_modules()
    edges = [imp for name, path in modules.items() for imp in imports_of(name, path, modules)]
    return modules, edges


def stage(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else None


def _describe(imp: Import, modules: dict[str, Path]) -> str:
    return f"{modules[imp.source].relative_to(PACKAGE_DIR.parent)}:{imp.line}: {imp.source} imports {imp.target}"


def find_cycle(nodes: list[str], edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle in the module graph, or None (iterative DFS with colours)."""
    colour = {n: 0 for n in nodes}
    for start in nodes:
        if colour[start]:
            continue
        stack: list[tuple[str, Iterator[str]]] = [(start, iter(sorted(edges.get(start, ()))))]
        path = [start]
        colour[start] = 1
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                colour[node] = 2
                stack.pop()
                path.pop()
            elif colour.get(child) == 1:
                return path[path.index(child):] + [child]
            elif colour.get(child) == 0:
                colour[child] = 1
                stack.append((child, iter(sorted(edges.get(child, ())))))
                path.append(child)
    return None


def test_no_import_cycles_counting_imports_in_function_bodies() -> None:
    modules, edges = graph()
    internal: dict[str, set[str]] = {}
    for imp in edges:
        if imp.target in modules and imp.target != imp.source and imp.target != FACE:
            internal.setdefault(imp.source, set()).add(imp.target)
    cycle = find_cycle(sorted(modules), internal)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_imports_point_down_the_layers() -> None:
    modules, edges = graph()
    bad = []
    for imp in edges:
        src, dst = stage(imp.source), stage(imp.target)
        if src is None or dst is None or src == dst:
            continue
        if LAYERS.index(dst) < LAYERS.index(src):
            bad.append(_describe(imp, modules))
    assert not bad, "upward imports:\n" + "\n".join(bad)


# The reference backend's rooms, top to bottom (beam_hpc/backends/reference/__init__.py says what
# each holds): the loop drives rollouts and loads the model; rollouts use the model; the model
# knows neither. A module at the backend's top (its __main__) may use any room.
REFERENCE = "beam_hpc.backends.reference"
REFERENCE_ROOMS = ("loop", "rollouts", "model")


def _room(module: str) -> str | None:
    parts = module.removeprefix(REFERENCE + ".").split(".")
    return parts[0] if module.startswith(REFERENCE + ".") and parts[0] in REFERENCE_ROOMS else None


def test_the_reference_backend_rooms_import_downwards() -> None:
    modules, edges = graph()
    rooms = {name for name in modules if _room(name)}
    assert {_room(name) for name in rooms} == set(REFERENCE_ROOMS), "a room of the reference backend is missing"
    bad = [_describe(imp, modules) for imp in edges
           if (src := _room(imp.source)) and (dst := _room(imp.target)) and src != dst
           and REFERENCE_ROOMS.index(dst) < REFERENCE_ROOMS.index(src)]
    assert not bad, "upward imports between the reference backend's rooms:\n" + "\n".join(bad)
    flat = sorted(name for name in modules if name.startswith(REFERENCE + ".") and not _room(name)
                  and name != f"{REFERENCE}.__main__")
    assert not flat, f"reference backend modules outside its rooms: {flat}"


def _reachable(start: str, edges: list[Import], modules: dict[str, Path]) -> dict[str, list[str]]:
    """Every module and third-party package reachable from ``start``, with one path to it."""
    by_source: dict[str, list[str]] = {}
    for imp in edges:
        by_source.setdefault(imp.source, []).append(imp.target)
    seen = {start: [start]}
    todo = [start]
    while todo:
        cur = todo.pop()
        for nxt in by_source.get(cur, []):
            if nxt not in seen:
                seen[nxt] = seen[cur] + [nxt]
                if nxt in modules:
                    todo.append(nxt)
    return seen


@pytest.mark.parametrize("layer", ["config", "plan"])
def test_config_and_plan_reach_no_slurm_ray_submitit_or_torch(layer: str) -> None:
    modules, edges = graph()
    bad = []
    for name in modules:
        if stage(name) != layer:
            continue
        for target, path in _reachable(name, edges, modules).items():
            if target in HEAVY or stage(target) == "slurm":
                bad.append(" -> ".join(path))
    assert not bad, f"{layer} must stay pure:\n" + "\n".join(bad)


def test_code_in_the_allocation_never_imports_submission_or_script_rendering() -> None:
    modules, edges = graph()
    bad = []
    for name in modules:
        if stage(name) not in ALLOCATION_STAGES:
            continue
        for target, path in _reachable(name, edges, modules).items():
            if stage(target) == "submission" or target == "beam_hpc.slurm.script":
                bad.append(" -> ".join(path))
    assert not bad, "inside the allocation:\n" + "\n".join(bad)


def test_plan_reaches_no_backend() -> None:
    """make_plan is handed the backend's driver command as data (beam_hpc.backends.registry.plan_for
    computes it), so nothing the plan stage reaches is a backend, however indirectly."""
    modules, edges = graph()
    bad = [" -> ".join(path) for name in modules if stage(name) == "plan"
           for target, path in _reachable(name, edges, modules).items() if stage(target) == "backends"]
    assert not bad, "\n".join(bad)


def _in_main_block(tree: ast.Module) -> set[int]:
    """Line numbers inside ``if __name__ == "__main__":`` blocks (a program's own entry)."""
    lines: set[int] = set()
    for node in tree.body:
        if (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
                and isinstance(node.test.left, ast.Name) and node.test.left.id == "__name__"):
            for sub in ast.walk(node):
                if hasattr(sub, "lineno"):
                    lines.add(sub.lineno)
    return lines


def test_only_the_cli_prints_for_people_and_picks_exit_codes() -> None:
    """``print`` and ``sys.exit``/``SystemExit`` belong to the CLI (and to the ``main`` of a module
    that is a program of its own: what the job starts on nodes or in the container, whose stdout
    is a protocol, not text for people); everywhere else errors are raised as beam_hpc.errors
    classes and messages go to logging."""
    bad = []
    for name, path in all_modules().items():
        if stage(name) == "cli":
            continue
        tree = ast.parse(path.read_text(), str(path))
        main_lines = _in_main_block(tree)
        if main_lines:  # a program of its own (started on a node or in a container): its main() speaks
            for fn in tree.body:
                if isinstance(fn, ast.FunctionDef) and fn.name == "main":
                    main_lines |= {n.lineno for n in ast.walk(fn) if hasattr(n, "lineno")}
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call) or node.lineno in main_lines:
                continue
            f = node.func
            called = f.id if isinstance(f, ast.Name) else (
                f"{f.value.id}.{f.attr}" if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else "")
            if called in ("print", "sys.exit", "SystemExit", "exit", "quit"):
                bad.append(f"{path.relative_to(PACKAGE_DIR.parent)}:{node.lineno}: {called}(...)")
    assert not bad, "\n".join(bad)


def leaves(modules: dict[str, Path]) -> set[str]:
    """The modules at the top of the package, beside the layers' folders (the face excluded)."""
    return {name for name, path in modules.items() if path.parent == PACKAGE_DIR and name != FACE}


def test_leaves_import_only_leaves() -> None:
    modules, edges = graph()
    below = leaves(modules)
    assert {"beam_hpc.errors", "beam_hpc.files", "beam_hpc.version"} <= below  # the checker sees them
    bad = [_describe(i, modules) for i in edges
           if i.source in below and i.target.startswith("beam_hpc") and i.target not in below]
    assert not bad, "a leaf imports beyond the leaves:\n" + "\n".join(bad)


def test_no_module_imports_the_package_face() -> None:
    """``from beam_hpc import __version__`` used to climb from slurm through the face, whose public
    names are the top layers' (submit, Plan); the version is a leaf of its own (beam_hpc.version)."""
    modules, edges = graph()
    bad = [_describe(i, modules) for i in edges if i.target == FACE and i.source != FACE]
    assert not bad, "import the leaf or the module itself, not the package face:\n" + "\n".join(bad)


def test_the_walker_sees_imports_inside_functions(tmp_path: Path) -> None:
    """The checker itself: a cycle made only of function-body imports is found."""
    pkg = tmp_path / "beam_hpc"
    (pkg / "plan").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "plan" / "__init__.py").write_text("")
    (pkg / "plan" / "a.py").write_text("def f():\n    from beam_hpc.plan import b\n")
    (pkg / "plan" / "b.py").write_text("def g():\n    from beam_hpc.plan.a import f\n")
    modules = {module_name_in(p, tmp_path): p for p in pkg.rglob("*.py")}
    edges: dict[str, set[str]] = {}
    for name, path in modules.items():
        for imp in imports_of(name, path, modules):
            if imp.target in modules:
                edges.setdefault(name, set()).add(imp.target)
    assert find_cycle(sorted(modules), edges) is not None


def module_name_in(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


# -- tests/ mirrors beam_hpc/ ---------------------------------------------------------------------

TESTS_DIR = Path(__file__).resolve().parent
# Test directories that are not a sub-package: the shared helpers (on pytest's pythonpath), and the
# tests of the repository's benchmarks/ scripts (their pure parts: a schedule, a table), which
# belong to no stage of the package.
NOT_A_PACKAGE = {"support", "benchmarks"}
# Test modules about the whole repository rather than one sub-package, at the top of tests/: this
# file (the package's shape) and test_docs.py (README's commands and the user guide's reference).
WHOLE_REPOSITORY = {Path(__file__).name, "test_docs.py"}


def test_tests_mirror_the_package() -> None:
    """Every test module sits in the directory of the sub-package it tests (tests/<subpkg>/..., with
    tests/backends/<backend>/), so the tests of a stage are found where its code is; only the tests
    about the whole repository (WHOLE_REPOSITORY) stay at the top. Helpers live in tests/support/."""
    packages = {p.parent.relative_to(PACKAGE_DIR).as_posix() for p in PACKAGE_DIR.rglob("__init__.py")} - {"."}
    flat = sorted(p.name for p in TESTS_DIR.glob("test_*.py") if p.name not in WHOLE_REPOSITORY)
    assert not flat, f"test modules outside a sub-package directory: {flat}"
    test_dirs = {p.parent.relative_to(TESTS_DIR).as_posix() for p in TESTS_DIR.rglob("test_*.py")} - {"."}
    strays = sorted(d for d in test_dirs if d not in packages and d.split("/")[0] not in NOT_A_PACKAGE)
    assert not strays, f"test directories with no beam_hpc sub-package of that name: {strays}"
    assert not list((TESTS_DIR / "support").glob("test_*.py")), "tests/support/ holds helpers, not tests"
    scripts = PACKAGE_DIR.parent / "benchmarks"
    orphans = sorted(p.name for p in (TESTS_DIR / "benchmarks").glob("test_*.py")
                     if not (scripts / p.name.removeprefix("test_")).is_file())
    assert not orphans, f"tests/benchmarks/test_X.py tests benchmarks/X.py, which is missing for: {orphans}"


def test_only_slurm_environment_reads_slurm_variables() -> None:
    """One owner of the allocation's facts (issue 20): a ``SLURM_*`` variable is read through
    beam_hpc.slurm.environment.SlurmEnvironment, never with os.environ / os.getenv elsewhere, so a
    het job's per-group spelling cannot be got wrong in one more place."""
    import re

    read = re.compile(r"""(?:environ\.get|getenv|environ\[)\(?\s*["']SLURM_""")
    owner = PACKAGE_DIR / "slurm" / "environment.py"
    found = [f"{p.relative_to(PACKAGE_DIR.parent)}:{i}" for p in sorted(PACKAGE_DIR.rglob("*.py")) if p != owner
             for i, line in enumerate(p.read_text().splitlines(), 1) if read.search(line)]
    assert not found, f"SLURM_* read outside SlurmEnvironment: {found}"
