"""How the suite is spread over pytest-xdist workers: which tests must share a worker, and in what
order the work goes out.

Why our own scheduler (``pytest_xdist_make_scheduler`` in tests/conftest.py) instead of
``--dist loadgroup``: with pytest 9.2 and xdist 3.8 the ``xdist_group`` mark no longer reaches the
node ids the scheduler reads, and a group's tests silently land on different workers (each then
rebuilds the group's module fixture: a 20-rollout learning run, a Ray cluster). Reading the rule from
the test files themselves needs no mark to keep in step:

- **Work units.** The tests of a module that use one of its module-scoped fixtures go to one worker
  together (the fixture is built once); every other test is a unit of its own.
- **Order.** Units go out longest first, by the seconds measured in ``test_durations.json`` (this
  directory), so the long end-to-end chains start at once and the short tests fill the gaps at the
  end. A test not measured yet counts ``UNMEASURED_SLOW_S`` if marked slow, else ``UNMEASURED_S``.

Refresh the measurements after adding slow tests (any run's JUnit XML will do)::

    python -m pytest -n 4 --junitxml=/tmp/junit.xml && python tests/support/xdist/xdist_schedule.py /tmp/junit.xml
"""

from __future__ import annotations

import ast
import json
import sys
import xml.etree.ElementTree as ET
from collections.abc import Iterable
from functools import cache
from pathlib import Path

from xdist.scheduler import LoadScopeScheduling

ROOT = Path(__file__).resolve().parents[3]
DURATIONS = Path(__file__).with_name("test_durations.json")
UNMEASURED_S = 0.5
UNMEASURED_SLOW_S = 60.0


@cache
def tests_sharing_a_module_fixture(module_path: str) -> frozenset[str]:
    """The test functions of the module at ``module_path`` (relative to the repository) that use one
    of its module-scoped fixtures, directly or through another fixture of the module. Parsed, not
    imported: the xdist controller never imports the tests."""
    try:
        tree = ast.parse((ROOT / module_path).read_text())
    except (OSError, SyntaxError):
        return frozenset()
    functions = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
    fixtures: dict[str, tuple[bool, set[str]]] = {}  # name -> (module-scoped, the names it takes)
    for fn in functions:
        for deco in fn.decorator_list:
            target = deco.func if isinstance(deco, ast.Call) else deco
            if isinstance(target, ast.Attribute) and target.attr == "fixture":
                scoped = isinstance(deco, ast.Call) and any(
                    k.arg == "scope" and isinstance(k.value, ast.Constant) and k.value.value == "module"
                    for k in deco.keywords)
                fixtures[fn.name] = (scoped, {a.arg for a in fn.args.args})
    shared = {name for name, (scoped, _) in fixtures.items() if scoped}
    grew = True
    while grew:  # a fixture that takes a shared one shares it too
        grew = False
        for name, (_, takes) in fixtures.items():
            if name not in shared and takes & shared:
                shared.add(name)
                grew = True
    return frozenset(fn.name for fn in functions
                     if fn.name.startswith("test") and {a.arg for a in fn.args.args} & shared)


def unit_of(nodeid: str) -> str:
    """The work unit of a test: ``<module>::<shared>`` for the tests of a module that share one of its
    module-scoped fixtures (they go to one worker, which builds the fixture once), else the test."""
    module, _, rest = nodeid.partition("::")
    function = rest.split("::")[-1].split("[", 1)[0]
    return f"{module}::<shared>" if function in tests_sharing_a_module_fixture(module) else nodeid


@cache
def measured() -> dict[str, float]:
    try:
        return json.loads(DURATIONS.read_text())
    except (OSError, ValueError):
        return {}


def expected_s(nodeid: str, slow: bool) -> float:
    return measured().get(nodeid, UNMEASURED_SLOW_S if slow else UNMEASURED_S)


def longest_first(tests: Iterable[tuple[str, bool]]) -> list[str]:
    """Node ids (given with their slow mark) reordered: units by their summed expected seconds,
    longest first; a unit's own tests keep their order."""
    units: dict[str, list[str]] = {}
    cost: dict[str, float] = {}
    for nodeid, slow in tests:
        unit = unit_of(nodeid)
        units.setdefault(unit, []).append(nodeid)
        cost[unit] = cost.get(unit, 0.0) + expected_s(nodeid, slow)
    order = sorted(units, key=lambda u: -cost[u])  # sorted() is stable: ties keep collection order
    return [nodeid for unit in order for nodeid in units[unit]]


class DurationScheduling(LoadScopeScheduling):
    """xdist's scope scheduler with our units, in the order the workers collected (longest first,
    see tests/conftest.py), instead of its default reordering by the number of tests per scope."""

    def __init__(self, config, log=None) -> None:  # type: ignore[no-untyped-def]
        super().__init__(config, log)
        config.option.loadscopereorder = False

    def _split_scope(self, nodeid: str) -> str:
        return unit_of(nodeid)


def durations_from_junit(paths: Iterable[Path]) -> dict[str, float]:
    """Node id -> seconds (setup + call + teardown, as JUnit's ``time`` counts them)."""
    out: dict[str, float] = {}
    for path in paths:
        for case in ET.parse(path).getroot().iter("testcase"):
            module = case.get("classname", "").replace(".", "/")
            # classname is dotted (tests.lifecycle.test_x[.Class]); the module is the part that is a file
            parts = module.split("/")
            for cut in range(len(parts), 0, -1):
                if (ROOT / ("/".join(parts[:cut]) + ".py")).is_file():
                    nodeid = "::".join(["/".join(parts[:cut]) + ".py", *parts[cut:], case.get("name", "")])
                    out[nodeid] = round(float(case.get("time", 0.0)), 1)
                    break
    return out


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    durations = durations_from_junit(Path(a) for a in argv)
    DURATIONS.write_text(json.dumps(dict(sorted(durations.items())), indent=0) + "\n")
    print(f"{len(durations)} tests, {sum(durations.values()):.0f} s in all -> {DURATIONS}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
