"""A Miles run's lost rollout node replaced inside the segment (beam_hpc.elastic.ray_replacement),
fast and real where it can be: real order and report files, the runner's own wait with a real
driver process, and `beam-hpc rollout add --replaces`'s refusals through the CLI. Slurm is not
asked here (a local runner submits nothing); the whole flow, a replacement job whose Ray node
joins and a Miles double whose engine restart then returns, runs on the local Slurm cluster in
tests/backends/miles/test_miles_engine_recovery_slurm.py."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
from job_plans import make_test_plan

from beam_hpc.elastic import ray_replacement, registry
from beam_hpc.elastic.replace import REPLACEMENT_EVENT, add_command, may_replace
from beam_hpc.job.context import NodeStepFailed
from beam_hpc.job.launchers import StepHandle, for_job
from beam_hpc.job.runner import JobRunner
from beam_hpc.node.ray_node import ClusterRuntime
from beam_hpc.run import ledger


def _miles_plan(tmp_path: Path, *overrides: str):  # type: ignore[no-untyped-def]
    """The Miles double's run (tests/support/builders/miles) with two rollout nodes of one engine
    each: a lost one is SAVE_FIRST (beam_hpc.plan.node_loss)."""
    from miles_run import local_site, miles_recipe

    from beam_hpc.backends.registry import plan_for
    from beam_hpc.config.recipe import apply_overrides, recipe_from_dict
    from beam_hpc.config.site import site_from_dict

    d = miles_recipe(tmp_path)
    d["topology"] = {"trainer": {"nodes": 2, "gpus_per_node": 1},
                     "rollout": {"nodes": 2, "gpus_per_node": 1, "gpus_per_engine": 1}}
    apply_overrides(d, list(overrides))
    return plan_for(recipe_from_dict(d, "miles test"), site_from_dict(local_site(), "local site"))


def _runner(tmp_path: Path, *overrides: str) -> JobRunner:
    from beam_hpc.plan.node_loss import NodeLossAction, on_node_loss

    plan = _miles_plan(tmp_path, *overrides)
    assert on_node_loss(plan, plan.group("rollout")) is NodeLossAction.SAVE_FIRST
    ctx, launcher = for_job(plan, srun=False)
    runner = JobRunner(plan, launcher, ctx, stop_grace_s=1.0)
    runner.segment_dir.mkdir(parents=True, exist_ok=True)
    runner.rt = ClusterRuntime(job_id=ctx.job_id, job_num=1, restart=ctx.restart, job_tag="t", head_ip="127.0.0.10",
                               gcs_port=21000, host_stride=3, token_path=str(tmp_path / "token"),
                               segment_dir=str(runner.segment_dir), nonce="n0nce", deadline=time.time() + 60,
                               nodelists={"trainer": ["n1"], "rollout": ["n2", "n3"]})
    runner.rt.write()
    runner.driver = subprocess.Popen(["sleep", "60"])
    return runner


def _lost_step(runner: JobRunner) -> tuple[StepHandle, NodeStepFailed]:
    step = StepHandle(group=runner.plan.group("rollout"), proc=subprocess.Popen(["true"]), local_index=1,
                      output=runner.segment_dir / "node-rollout-1.log")
    step.proc.wait()
    runner.steps.append(step)
    return step, NodeStepFailed("node step of group rollout on node n3 ended: node failure", node="n3")


def _report(runner: JobRunner, name: str, **fields: object) -> None:
    path = runner.seg.node_reports / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(fields))


def test_the_segment_waits_for_the_replacement_and_trains_on_once_it_joined(tmp_path: Path) -> None:
    runner = _runner(tmp_path)
    stall_from: list[float] = []
    asked: list[dict] = []
    runner.count_stall_from, runner.on_rollout_node_lost = stall_from.append, asked.append
    step, failure = _lost_step(runner)
    try:
        t0 = time.time()
        assert runner._waits_for_replacement(step, failure)
        order = ray_replacement.read_order(runner.plan.output_dir, "n3")
        assert order is not None and (order.group, order.local_index, order.nonce) == ("rollout", 1, "n0nce")
        assert order.index == 4  # past the job's 2 trainer and 2 rollout nodes: a place of its own
        assert order.runtime == str(runner.rt.path) and order.segment == f"{runner.ctx.job_id}-{runner.ctx.restart}"
        assert step not in runner.steps and [x["node"] for x in asked] == ["n3"] == [x["node"] for x in runner.lost_nodes]
        assert stall_from == [pytest.approx(t0 + 600, abs=5)]  # held to the wait's end (replacement_wait_s 600)
        # the lost node's own report, and a replacement still starting, are no join
        _report(runner, "rollout-1.json", state="running", ray_started=True, slurm_job_id="1")
        _report(runner, "rollout-1-replacement-77.json", state="starting", slurm_job_id="77", hostname="n9")
        runner.check()
        assert runner.awaited is not None and "replaced_by" not in runner.lost_nodes[0]
        _report(runner, "rollout-1-replacement-77.json", state="running", ray_started=True, slurm_job_id="77",
                hostname="n9")
        runner.check()
        assert runner.awaited is None
        assert runner.lost_nodes[0]["replaced_by"] == "77" and runner.lost_nodes[0]["replaced_on"] == "n9"
        assert len(stall_from) == 2 and stall_from[1] >= t0  # the stall clock counts from the join
        # the ledger's end line keeps who took the node's place
        end = ledger.end_record(job_id="5", restart=0, rollouts_at_end=3, reason=ledger.Reason.COMPLETED, detail="",
                                next_action="none", next_job_id=None, rollout_s=None, save_s=None,
                                failed_nodes=runner.lost_nodes)
        assert end["failed_nodes"][0]["replaced_by"] == "77" and ledger.check_record(end) is None
    finally:
        runner.driver.kill()


def test_no_replacement_in_time_ends_the_segment_as_the_lost_nodes_failure(tmp_path: Path) -> None:
    runner = _runner(tmp_path, "lifecycle.replacement_wait_s=1")
    runner.on_rollout_node_lost = lambda lost: None
    step, failure = _lost_step(runner)
    try:
        assert runner._waits_for_replacement(step, failure)
        runner.check()  # within the wait: nothing yet
        time.sleep(1.2)
        with pytest.raises(NodeStepFailed, match=r"no replacement joined within lifecycle.replacement_wait_s=1") as err:
            runner.check()
        assert [f["node"] for f in err.value.failed_nodes] == ["n3"] and runner.lost_nodes == []
        assert runner.awaited is None
    finally:
        runner.driver.kill()


@pytest.mark.parametrize("overrides", [("lifecycle.replacement_wait_s=0",), ("lifecycle.max_replacements=0",)])
def test_without_a_replacement_to_wait_for_the_segment_ends(tmp_path: Path, overrides: tuple[str, ...]) -> None:
    runner = _runner(tmp_path, *overrides)
    runner.on_rollout_node_lost = lambda lost: None
    step, failure = _lost_step(runner)
    try:
        assert not runner._waits_for_replacement(step, failure)
        assert step in runner.steps and runner.lost_nodes == [] and runner.awaited is None
        assert ray_replacement.read_order(runner.plan.output_dir, "n3") is None
    finally:
        runner.driver.kill()


def test_the_cap_counts_the_runs_replacements(tmp_path: Path) -> None:
    plan = make_test_plan(tmp_path / "run", trainer_nodes=1, rollout_nodes=2, overrides=["lifecycle.max_replacements=1"])
    assert may_replace(plan)
    registry.record(plan.output_dir, "41", {"event": REPLACEMENT_EVENT, "replaces": "n3", "segment": "5-0"})
    assert not may_replace(plan)


def test_rollout_add_replaces_only_a_node_its_running_miles_segment_lost(tmp_path: Path, capsys) -> None:
    """Exit 2, one line per problem, before Slurm is asked anything."""
    from beam_hpc.cli.app import main as cli_main

    plan = make_test_plan(tmp_path / "run", trainer_nodes=1, rollout_nodes=2)
    assert cli_main(["rollout", "add", plan.output_dir, "--nodes", "2", "--replaces", "n3"]) == 2
    err = capsys.readouterr().err
    assert "--replaces: 'n3': only a Miles run's segment" in err and "--nodes: 2 with --replaces" in err
    assert "the run has no order to replace it" in err
    assert cli_main(["rollout", "add", plan.output_dir, "--nodes", "1", "--replaces", "../../plan"]) == 2
    assert "is not a Slurm node name" in capsys.readouterr().err
    # an order whose segment has ended
    order = ray_replacement.Order(node="n3", group="rollout", local_index=1, index=3, runtime=str(tmp_path / "runtime.json"),
                                  nonce="x", segment="5-0", asked_at=time.time())
    ray_replacement.write_order(plan.output_dir, order)
    (only,) = ray_replacement.request_problems(plan, "n3", nodes=1)  # while segment 5-0 runs: the backend's line
    assert "only a Miles run's segment" in only
    ledger.append(plan.paths.ledger, ledger.end_record(job_id="5", restart=0, rollouts_at_end=1,
                                                       reason=ledger.Reason.PREEMPTED, detail="", next_action="none",
                                                       next_job_id=None, rollout_s=None, save_s=None))
    assert any("segment 5-0, which lost it, has ended" in p for p in ray_replacement.request_problems(plan, "n3", nodes=1))
    assert "--replaces" not in add_command(plan, "n3")  # a reference run's replacement joins by itself


def test_a_miles_runs_replacement_asks_to_take_the_nodes_place() -> None:
    from beam_hpc.backends.registry import plan_for
    from beam_hpc.submission.submit import build_recipe, build_site

    root = Path(__file__).resolve().parents[2]
    plan = plan_for(build_recipe(str(root / "recipes" / "dedicated.yaml"), overrides=[]),
                    build_site(str(root / "env" / "example-site.yaml")))
    argv = add_command(plan, "n7", "backfill")
    assert argv[-4:] == ["--exclude", "n7", "--replaces", "n7"] and "--partition" in argv


def test_a_second_lost_node_while_one_is_awaited_ends_the_segment_without_a_save(tmp_path: Path) -> None:
    """Miles waits in its weight update for the first node's engine, so no save can come: the
    second loss ends the segment at once, both nodes recorded, the wait over."""
    runner = _runner(tmp_path)
    runner.on_rollout_node_lost = lambda lost: None
    saves: list[str] = []
    runner.save_before_node_failure = lambda failure: saves.append(str(failure)) or True
    step, failure = _lost_step(runner)
    try:
        assert runner._waits_for_replacement(step, failure)
        other = StepHandle(group=runner.plan.group("rollout"), proc=subprocess.Popen(["true"]), local_index=0,
                           output=runner.segment_dir / "node-rollout-0.log")
        other.proc.wait()
        assert not runner._save_before_ending(other, NodeStepFailed("n2 ended", node="n2"))
        assert saves == [] and runner.awaited is not None
        runner.awaited, awaited = None, runner.awaited  # the control: with no wait, the same loss is saved for
        assert runner._save_before_ending(other, NodeStepFailed("n2 ended", node="n2")) and saves == ["n2 ended"]
        runner.awaited = awaited
        runner._cancel_replacement()
        assert runner.awaited is None and [x["node"] for x in runner.lost_nodes] == ["n3"]
    finally:
        runner.driver.kill()
