"""The lost-rollout-node policy switch (``lifecycle.rollout_node_loss``, issue 42): ``in_place``
makes the job ask Slurm for ``--no-kill`` and launch the rollout group one step per node;
``restart`` asks neither, so Slurm revokes the job on a node's failure and the chain resumes from
its checkpoint. The job reads the choice back from plan.json, so it must survive the round trip.
The real flow of both policies is benchmarks/faults.py --node-loss (on a private Slurm cluster)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from job_plans import make_test_plan

from beam_hpc.plan.node_loss import survives_node_loss
from beam_hpc.plan.plan import load_plan
from beam_hpc.slurm.script import render_script

ROOT = Path(__file__).resolve().parents[2]
DEDICATED = {"trainer_nodes": 2, "rollout_nodes": 2, "gpus": 1}


def _rollout(plan):  # type: ignore[no-untyped-def]
    return next(g for g in plan.groups if g.roles == ("rollout",))


def test_in_place_is_the_default_and_asks_no_kill(tmp_path: Path) -> None:
    plan = make_test_plan(tmp_path / "run", **DEDICATED)
    assert plan.recipe.lifecycle.rollout_node_loss == "in_place"
    assert survives_node_loss(plan, _rollout(plan))
    assert render_script(plan).count("#SBATCH --no-kill") == 2  # both components of the hetjob
    # the default is left out of plan.json (the seed's scripts and digests stay as they were) and
    # still reads back as in_place
    assert "rollout_node_loss" not in Path(plan.paths.plan).read_text()
    assert load_plan(plan.paths.plan).recipe.lifecycle.rollout_node_loss == "in_place"


def test_restart_drops_no_kill_and_the_per_node_steps_and_survives_plan_json(tmp_path: Path) -> None:
    plan = make_test_plan(tmp_path / "run", **DEDICATED, overrides=["lifecycle.rollout_node_loss=restart"])
    assert not survives_node_loss(plan, _rollout(plan))
    script = render_script(plan)
    assert "--no-kill" not in script, script
    assert "#SBATCH --requeue" in script  # Slurm's revocation requeues it, as before issue 42
    loaded = load_plan(plan.paths.plan)  # what the job (runner, launchers) decides from
    assert loaded.recipe.lifecycle.rollout_node_loss == "restart"
    assert not survives_node_loss(loaded, _rollout(loaded))


def test_a_misspelt_policy_exits_2_naming_the_field_and_the_choices(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "beam_hpc.cli.app", "submit", str(ROOT / "recipes" / "tiny.yaml"),
                           "--site", str(ROOT / "env" / "local.yaml"), "--dry-run", "--output-dir", str(tmp_path / "r"),
                           "--set", "lifecycle.rollout_node_loss=inplace"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "lifecycle.rollout_node_loss" in proc.stderr and "inplace" in proc.stderr, proc.stderr
    assert "in_place" in proc.stderr and "restart" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "r").exists()  # refused before anything is written


@pytest.mark.parametrize("policy", ["in_place", "restart"])
def test_a_one_node_rollout_group_never_survives(tmp_path: Path, policy: str) -> None:
    plan = make_test_plan(tmp_path / "run", trainer_nodes=2, rollout_nodes=1, gpus=1,
                          overrides=[f"lifecycle.rollout_node_loss={policy}"])
    assert not survives_node_loss(plan, _rollout(plan))
    assert "--no-kill" not in render_script(plan)


# -- a Miles run: save, then end (Miles cannot train on without the lost engine) ----------------
def _seed_plan(name: str, *overrides: str):  # type: ignore[no-untyped-def]
    from beam_hpc.backends.registry import plan_for
    from beam_hpc.submission.submit import build_recipe, build_site

    return plan_for(build_recipe(str(ROOT / "recipes" / f"{name}.yaml"), overrides=list(overrides)),
                    build_site(str(ROOT / "env" / "example-site.yaml")))


def test_the_seeds_dedicated_miles_run_saves_before_ending_on_a_lost_rollout_node() -> None:
    """4 rollout nodes of 8 GPUs, engines of 16: a lost node takes one of two engines, the other
    finishes the rollout in flight, so the job keeps running (--no-kill, a step per node) to save."""
    from beam_hpc.plan.node_loss import NodeLossAction, keeps_the_job, on_node_loss

    plan = _seed_plan("dedicated")
    assert plan.recipe.backend == "miles"
    assert on_node_loss(plan, plan.group("rollout")) is NodeLossAction.SAVE_FIRST
    assert not survives_node_loss(plan, plan.group("rollout"))  # it does not train on without it
    assert keeps_the_job(plan, plan.group("rollout"))
    assert on_node_loss(plan, plan.group("trainer")) is NodeLossAction.END
    script = render_script(plan)
    assert script.count("#SBATCH --no-kill") == 2 and "trains on once a replacement node has joined" in script
    restart = _seed_plan("dedicated", "lifecycle.rollout_node_loss=restart")
    assert on_node_loss(restart, restart.group("rollout")) is NodeLossAction.END
    assert "--no-kill" not in render_script(restart)


@pytest.mark.parametrize(("name", "overrides"), [
    ("lora", []),  # 2 rollout nodes, one engine of 16 GPUs spans both: no engine is left
    ("dedicated", ["topology.rollout.nodes=2"]),  # the same with the dedicated recipe
    ("colocated", []),  # one group: the trainer is on every node
])
def test_a_miles_run_that_would_keep_no_whole_engine_ends_as_before(name: str, overrides: list[str]) -> None:
    from beam_hpc.plan.node_loss import NodeLossAction, on_node_loss

    plan = _seed_plan(name, *overrides)
    assert all(on_node_loss(plan, g) is NodeLossAction.END for g in plan.groups)
    assert "--no-kill" not in render_script(plan)
