"""Miles's ``--use-fault-tolerance`` in beam-hpc's Miles command and in the Miles double (issue 42 item 3).

beam-hpc passes ``--use-fault-tolerance`` on every Miles run: with it Miles checks each SGLang engine
and restarts a dead one in place before the next weight update (radixark/miles@31f1ca961; the facts
are listed in tests/support/standins/miles_standin/miles/utils/health_monitor.py), which is what lets a
segment go on after an engine dies (tests/backends/miles/test_miles_engine_recovery_slurm.py). Miles's
health-check flags pass through ``backend_options.extra_args``; ``--ft-components``, which can turn the
rollout part off, is refused. The double's flag defaults are checked against miles-rl's own parser
source, read with ``ast`` (importing miles-rl takes about 90 s here).
"""

from __future__ import annotations

import ast
import importlib.util
import json
import sys
from pathlib import Path

import pytest

from beam_hpc.backends.miles.args import build_driver
from beam_hpc.config.recipe import load_recipe
from beam_hpc.config.site import Site

ROOT = Path(__file__).resolve().parents[3]
STANDIN = ROOT / "tests" / "support" / "standins" / "miles_standin"
FLAGS_FILE = ROOT / "tests" / "support" / "fixtures" / "miles-megatron-flags.txt"
SITE = Site(name="t", container={"runtime": "host"}, network={"ip_source": "interface", "interface": "ib0"})
HEALTH_FLAGS = ("--rollout-health-check-interval", "--rollout-health-check-timeout", "--rollout-health-check-first-wait")


def _miles_argv(name: str, *overrides: str) -> list[str]:
    argv, _ = build_driver(load_recipe(ROOT / "recipes" / f"{name}.yaml", list(overrides)), SITE)
    return argv[argv.index("--") + 2:]


@pytest.mark.parametrize("name", ["dedicated", "colocated", "lora"])
def test_every_miles_run_asks_for_engine_restarts(name: str) -> None:
    argv = _miles_argv(name)
    assert argv.count("--use-fault-tolerance") == 1, argv
    assert "--ft-components" not in argv  # Miles's default list: rollout


def test_mileses_health_check_flags_pass_through_extra_args() -> None:
    contract = {line.strip() for line in FLAGS_FILE.read_text().splitlines() if line.startswith("--")}
    assert set(HEALTH_FLAGS) <= contract and "--use-fault-tolerance" in contract
    extra = ["--rollout-health-check-interval", "5", "--rollout-health-check-timeout", "10"]
    argv = _miles_argv("dedicated", f"backend_options={{extra_args: {json.dumps(extra)}}}")
    assert argv[-len(extra):] == extra and "--use-fault-tolerance" in argv


def test_ft_components_in_extra_args_exits_2_naming_the_fix(capsys: pytest.CaptureFixture[str]) -> None:
    from beam_hpc.cli.app import main as cli_main

    extra = json.dumps(["--ft-components", "train"])
    code = cli_main(["submit", str(ROOT / "recipes" / "dedicated.yaml"), "--site", str(ROOT / "env" / "example-site.yaml"),
                     "--dry-run", "--set", f"backend_options={{extra_args: {extra}}}"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    (line,) = [x for x in err.splitlines() if "--ft-components" in x]
    assert "backend_options.extra_args: --ft-components belongs to beam-hpc" in line, line
    assert "leave it out" in line and "restarts a dead SGLang engine in place" in line, line


def _miles_rl_defaults() -> dict[str, object]:
    """The defaults miles-rl's own ``add_fault_tolerance_arguments`` gives the fault-tolerance flags."""
    spec = importlib.util.find_spec("miles")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("miles-rl is not installed")
    source = Path(spec.submodule_search_locations[0], "utils", "arguments.py").read_text()
    found: dict[str, object] = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef) and node.name == "add_fault_tolerance_arguments":
            for call in ast.walk(node):
                if isinstance(call, ast.Call) and getattr(call.func, "attr", "") == "add_argument":
                    flag = call.args[0].value if call.args and isinstance(call.args[0], ast.Constant) else None
                    default = next((ast.literal_eval(k.value) for k in call.keywords if k.arg == "default"), None)
                    found[flag] = default
    return found


def test_the_doubles_fault_tolerance_defaults_are_mileses() -> None:
    real = _miles_rl_defaults()
    assert set(HEALTH_FLAGS) | {"--use-fault-tolerance"} <= set(real), real
    sys.path.insert(0, str(STANDIN))
    try:
        from standin_driver import parse
    finally:
        sys.path.remove(str(STANDIN))
    ns = parse(["--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1", "--dump-details", "d"])
    for flag in (*HEALTH_FLAGS, "--use-fault-tolerance"):
        assert getattr(ns, flag[2:].replace("-", "_")) == real[flag], flag
