"""beam_hpc.plan.plan: make_plan is pure, the plan's JSON, and what a hand edit of a plan does.

- ``import beam_hpc.plan.plan`` loads no backend, and make_plan gets the same plan with file
  reads, processes and the environment made to fail (the driver command is handed in as data);
- the JSON writer puts a list of scalars on one line and reads back as ``json.dumps`` would;
- an edit of a recipe or site field the derived fields came from is refused on load, one line
  per edited section naming it and the fix; the run directory and the total are honoured: the
  loaded plan is the one a fresh render with those values makes;
- an edit of a derived field (nodes, lead, walltime) or of the driver command is refused, one line
  naming the field, its value and the input to change instead; loading runs make_plan again on
  the inputs the plan keeps (recipe, site, facts, driver command).
"""

from __future__ import annotations

import builtins
import io
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from beam_hpc.backends.registry import driver_command, plan_for
from beam_hpc.config.recipe import Recipe, load_recipe
from beam_hpc.config.site import Site
from beam_hpc.errors import InputError
from beam_hpc.plan.local_disk import TmpDisk
from beam_hpc.plan.plan import PLACEHOLDERS, RUN_DIR, Plan, fill, make_plan, run_id_for, to_json
from beam_hpc.submission.submit import build_recipe, build_site

ROOT = Path(__file__).resolve().parents[2]
SEED = ("dedicated", "colocated", "lora")


def example_site() -> Site:
    return build_site(str(ROOT / "env" / "example-site.yaml"))


def recipe(name: str, *overrides: str) -> Recipe:
    if name == "tiny":  # relative paths in the file: made absolute, as a submission must
        overrides = ("output_dir=/shared/runs/tiny", "data.dir=/shared/data/tiny", "model.path=/shared/models/tiny",
                     *overrides)
    return load_recipe(ROOT / "recipes" / f"{name}.yaml", list(overrides))


# -- pure --------------------------------------------------------------------------------------


def test_importing_the_plan_loads_no_backend() -> None:
    code = ("import sys, beam_hpc.plan.plan; "
            "print(sorted(m for m in sys.modules if m.startswith('beam_hpc.backends')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert out.strip() == "[]"


class Forbidden(BaseException):
    """Raised by the poisoned calls; a BaseException, so no ``except Exception`` can hide it."""


class PoisonedEnviron(dict):
    """os.environ that refuses every read (and records it)."""

    def __init__(self, seen: list[str]) -> None:
        super().__init__()
        self.seen = seen

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        self.seen.append(f"os.environ {args!r}")
        raise Forbidden("make_plan read the environment")

    __getitem__ = get = __contains__ = __iter__ = __len__ = keys = items = values = copy = _refuse


@pytest.mark.parametrize("name", [*SEED, "tiny"])
def test_make_plan_reads_no_file_runs_no_process_and_reads_no_environment(name: str,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    r, site = recipe(name), example_site()
    declared = {"gpu-h200": TmpDisk("gpu-h200", (4_000_000,) * 16)}
    measured = {"rollout_s": 400.0, "save_s": 100.0}
    want = plan_for(r, site, tmp_disk=declared, measured=measured)
    driver = driver_command(r, site)  # the part that may read config.json or run a model script
    seen: list[str] = []

    def forbidden(what: str):  # type: ignore[no-untyped-def]
        def call(*args: Any, **kwargs: Any) -> Any:
            seen.append(what)
            raise Forbidden(f"make_plan called {what}")
        return call

    with monkeypatch.context() as m:
        for target, attr in ((builtins, "open"), (io, "open"), (os, "open"), (os, "stat"), (os, "listdir"),
                             (os, "scandir"), (subprocess, "Popen"), (os, "system"), (os, "fork"),
                             (os, "posix_spawn"), (os, "execv"), (os, "execve")):
            m.setattr(target, attr, forbidden(f"{target.__name__}.{attr}"))
        m.setattr(os, "environ", PoisonedEnviron(seen))
        got = make_plan(r, site, driver=driver, tmp_disk=declared, measured=measured)
        assert seen == []
        # the poison works: each kind of access fails while it is in place
        for attempt in (lambda: open(os.devnull), lambda: Path(os.devnull).read_text(), lambda: os.getenv("HOME"),
                        lambda: subprocess.run(["true"])):
            with pytest.raises(Forbidden):
                attempt()
    assert len(seen) == 4, seen
    assert got == want and got.to_json() == want.to_json()
    assert got.lead_s == 2 * 500 + 30 or name == "tiny"  # measured reached it (tiny's recipe pins lead_s)


# -- the JSON ----------------------------------------------------------------------------------


def test_json_writes_a_list_of_scalars_on_one_line() -> None:
    plan = plan_for(recipe("colocated"), example_site())
    text = plan.to_json()
    assert json.loads(text) == json.loads(json.dumps(plan.to_dict()))
    argv_lines = [line for line in text.splitlines() if line.lstrip().startswith('"driver_argv"')]
    assert len(argv_lines) == 1 and '"--save-interval", "20"' in argv_lines[0]
    assert json.loads(argv_lines[0].strip().removeprefix('"driver_argv": ').rstrip(",")) == list(plan.driver_argv)
    assert '"roles": ["trainer", "rollout"]' in text  # a short list too
    assert '"groups": [\n    {\n' in text  # a list of mappings keeps one item per line
    assert len(text.splitlines()) < len(json.dumps(plan.to_dict(), indent=2).splitlines()) - len(plan.driver_argv) + 2
    assert to_json({"a": [], "b": {}, "c": [[1], {"d": (1, 2)}]}) == (
        '{\n  "a": [],\n  "b": {},\n  "c": [\n    [1],\n    {\n      "d": [1, 2]\n    }\n  ]\n}')


# -- hand edits --------------------------------------------------------------------------------


def edited(plan: Plan, *edits: tuple[str, Any]) -> dict[str, Any]:
    """The plan's JSON mapping with ``(dotted.key, value)`` edits, as a text editor would leave it."""
    d = json.loads(plan.to_json())
    for key, value in edits:
        *path, last = key.split(".")
        node = d
        for part in path:
            node = node[int(part)] if isinstance(node, list) else node[part]
        if isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value
    return d


def refusal(d: dict[str, Any]) -> list[str]:
    with pytest.raises(InputError) as err:
        Plan.from_dict(d)
    return str(err.value).splitlines()


def test_an_edited_recipe_field_is_refused_naming_its_section_and_the_fix() -> None:
    plan = plan_for(recipe("dedicated"), example_site())
    [line] = refusal(edited(plan, ("recipe.checkpoint.interval", 5)))
    assert line.startswith("recipe.checkpoint: edited after the plan was made")
    assert "apply only in part" in line and "--set checkpoint.FIELD=VALUE" in line and "beam-hpc render" in line
    [line] = refusal(edited(plan, ("recipe.seed", 7)))
    assert line.startswith("recipe.seed: ") and "--set seed=VALUE" in line
    [line] = refusal(edited(plan, ("site.container.image", "/elsewhere/beam.sif")))
    assert line.startswith("site: edited") and "change the site file" in line
    lines = refusal(edited(plan, ("recipe.tokens.max_response", 2048), ("recipe.lifecycle.walltime", "12:00:00")))
    assert [x.split(":")[0] for x in lines] == ["recipe.lifecycle", "recipe.tokens"]
    # a value written differently but read the same is no edit
    assert Plan.from_dict(edited(plan, ("recipe.training.optimizer.lr", 0.000001))) == plan


@pytest.mark.parametrize(("edit", "field", "fix"), [
    (("groups.0.nodes", 99), "groups[0].nodes: 99 in the plan, but its recipe and site make it 8",
     "--set topology.trainer.nodes=VALUE"),
    (("groups.1.gpus_per_node", 4), "groups[1].gpus_per_node: 4 in the plan, but its recipe and site make it 8",
     "--set topology.rollout.gpus_per_node=VALUE"),
    (("lead_s", 30), "lead_s: 30 in the plan, but its recipe and site make it ", "--set lifecycle.lead_s=VALUE"),
    (("walltime_s", 99999), "walltime_s: 99999 in the plan, but its recipe and site make it 86400",
     "--set lifecycle.walltime=VALUE"),
    (("groups.0.partition", "elsewhere"), "groups[0].partition: 'elsewhere' in the plan", "change partitions in the site"),
    (("run_id", "0123456789"), "run_id: '0123456789' in the plan", "edit output_dir (both of its lines) instead"),
    (("nvme.min_free_gb", 1), "nvme.min_free_gb: 1 in the plan", "--set training.offload=VALUE"),
])
def test_an_edited_derived_field_is_refused_naming_it_its_value_and_the_input_to_change(
        edit: tuple[str, Any], field: str, fix: str) -> None:
    """make_plan runs again on load: a derived value that is not what it gives is an edit the
    script's header (nodes, --signal lead, time) and the driver argv would not follow."""
    plan = plan_for(recipe("dedicated"), example_site())
    assert plan.group("trainer").nodes == 8 and plan.group("rollout").gpus_per_node == 8  # what the cases say
    [line] = refusal(edited(plan, edit))
    assert line.startswith(field), line
    assert fix in line and "apply only in part" in line and "submit the run again" in line


def test_an_edited_driver_argv_is_refused_and_an_unedited_plan_is_make_plans() -> None:
    plan = plan_for(recipe("dedicated"), example_site())
    argv = list(plan.driver_argv)
    at = argv.index("--actor-num-nodes") + 1
    argv[at] = "99"
    [line] = refusal(edited(plan, ("driver_argv", argv)))
    assert line.startswith("driver_argv: 'python3 -m beam_hpc.backends.miles.launch --plan {run_dir}/plan.json")
    assert "edited after the plan was made" in line
    assert "change the recipe" in line and "beam-hpc render" in line
    [line] = refusal(edited(plan, ("driver_env", {"X": "1"})))
    assert line.startswith("driver_argv: ") and "(or driver_env)" in line
    [line] = refusal(edited(plan, ("facts.measured", {"rollout_s": 1.0})))
    assert line.startswith("facts: ") and "asks again" in line
    [line] = refusal(edited(plan, ("extra", 1)))
    assert line.startswith("extra: not a field of a plan")
    # every field of an unedited plan is what make_plan derives, the facts included
    measured = {"rollout_s": 400.0, "save_s": 100.0}
    declared = {"gpu-h200": TmpDisk("gpu-h200", (4_000_000,) * 16)}
    full = plan_for(recipe("dedicated"), example_site(), measured=measured, tmp_disk=declared)
    assert full.lead_s == 1030 and Plan.from_dict(json.loads(full.to_json())) == full


def test_a_plan_without_its_record_or_of_another_version_is_refused() -> None:
    plan = plan_for(recipe("lora"), example_site())
    d = edited(plan)
    del d["inputs_sha"]
    [line] = refusal(d)
    assert line.startswith("inputs_sha: None is not the plan's record") and "render the script again" in line
    [line] = refusal(edited(plan, ("version", 1)))
    assert "version 1 is not 3; re-render" in line


@pytest.mark.parametrize("name", [*SEED, "tiny"])
def test_the_run_directory_and_the_total_may_be_edited_and_are_honoured_everywhere(name: str) -> None:
    """The loaded plan is the plan a fresh render with the new values makes (the job name aside:
    it is the script header's --job-name, and so is the record of the directory it was rendered
    for, which keeps it so); the driver runs in the new directory."""
    plan = plan_for(recipe(name), example_site())
    new = "/elsewhere/runs/moved/"
    loaded = Plan.from_dict(edited(plan, ("output_dir", new), ("recipe.output_dir", new), ("recipe.num_rollout", 7)))
    fresh = plan_for(recipe(name, f"output_dir={new}", "num_rollout=7"), example_site())
    rendered_dir = {**fresh.inputs_sha, "output_dir": plan.inputs_sha["output_dir"]}
    assert loaded == replace(fresh, job_name=plan.job_name, inputs_sha=rendered_dir)
    assert Plan.from_dict(json.loads(loaded.to_json())) == loaded  # the plan.json the job writes loads again
    assert loaded.output_dir == "/elsewhere/runs/moved" and loaded.run_id == run_id_for(new) != plan.run_id
    assert fill(loaded.nvme.job_dir, job_id="9") == f"{loaded.nvme.root}/{loaded.run_id}/9"
    values = {**dict.fromkeys(PLACEHOLDERS, "x"), "run_dir": loaded.output_dir}  # what the job fills in
    filled = [fill(a, **values) for a in loaded.driver_argv]
    assert f"{loaded.output_dir}/plan.json" in filled and not [a for a in filled if "/shared/runs" in a]
    assert RUN_DIR not in to_json(loaded.recipe.model_dump(mode="json"))


def test_one_of_the_two_output_dirs_edited_alone_is_refused_naming_both() -> None:
    plan = plan_for(recipe("dedicated"), example_site())
    [line] = refusal(edited(plan, ("recipe.output_dir", "/elsewhere/run")))
    assert line.startswith("output_dir: '/shared/runs/beam-dedicated' but recipe.output_dir '/elsewhere/run'")
    assert "give both the same value" in line


def test_an_execute_plan_round_trips(tmp_path: Path) -> None:
    """What `beam-hpc execute` writes (relative paths resolved, the laptop's own site) loads back."""
    r = build_recipe(ROOT / "recipes" / "tiny.yaml", base_dir=tmp_path)
    plan = plan_for(r, build_site(str(ROOT / "env" / "local.yaml")))
    assert Plan.from_dict(json.loads(plan.to_json())) == plan
