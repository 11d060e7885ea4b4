"""One submission request, three schedulers (issue 13 item 5): what --dry-run prints is what
sbatch, submitit and `beam-hpc execute` are given, and refusals come before anything is written.

Fast: nothing here submits; the Slurm paths themselves run in tests/test_submit_slurm.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import beam_hpc
from beam_hpc.errors import InputError
from beam_hpc.job.segment import SegmentArgs, main as segment_main
from beam_hpc.slurm.script import component, render_script
from beam_hpc.submission.request import SubmitRequest, Via
from beam_hpc.submission.via_submitit import executor_parameters

REPO = Path(__file__).resolve().parents[2]
SITE = REPO / "env" / "example-site.yaml"


def _submit(tmp_path: Path, name: str = "dedicated", **kw):  # type: ignore[no-untyped-def]
    return beam_hpc.submit(REPO / "recipes" / f"{name}.yaml", SITE, output_dir=str(tmp_path / "run"), **kw)


def test_package_exports_submit_and_a_dry_run_writes_nothing(tmp_path: Path) -> None:
    sub = _submit(tmp_path, dry_run=True, via="sbatch", resume=True, num_rollout=200)
    assert isinstance(sub, beam_hpc.Submission) and isinstance(sub.request, beam_hpc.SubmitRequest)
    assert isinstance(sub.plan, beam_hpc.Plan) and isinstance(sub.plan.recipe, beam_hpc.Recipe)
    assert sub.plan.recipe.num_rollout == 200 and sub.job_id is None
    assert sub.command == ["sbatch", "--parsable", str(tmp_path / "run" / "job.sbatch"), "--resume"]
    assert "would run: sbatch --parsable" in sub.request.describe()
    assert not (tmp_path / "run").exists()


def test_segment_arguments_round_trip_through_the_batch_scripts_parser() -> None:
    """The arguments sbatch gets are the ones the segment parses back (no second format)."""
    args = SegmentArgs(resume=True, num_rollout=200)
    assert args.argv() == ["--resume", "--num-rollout", "200"]
    assert SegmentArgs(smoke=True).argv() == ["--smoke"] and SegmentArgs().argv() == []


def test_submitit_gets_the_same_components_as_the_script(tmp_path: Path) -> None:
    plan = _submit(tmp_path, dry_run=True).plan
    params = executor_parameters(SubmitRequest(plan=plan, segment=SegmentArgs(), dependency="afterany:7"))
    comps = [component(plan, g) for g in plan.groups]
    first, second = comps
    assert (params["nodes"], params["partition"], params["additional_parameters"]["gres"]) == (
        first.nodes, first.partition, first.gres)
    assert params["het_components"][0]["nodes"] == second.nodes
    assert params["het_components"][0]["additional_parameters"]["gres"] == second.gres
    assert params["additional_parameters"]["dependency"] == "afterany:7"
    assert params["additional_parameters"]["signal"] == f"USR1@{plan.lead_s}"
    script = render_script(plan)
    for c in comps:
        for flag in c.sbatch_flags():
            assert f"#SBATCH {flag}" in script


def test_smoke_with_resume_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="--smoke"):
        _submit(tmp_path, smoke=True, resume=True, via="sbatch")
    with pytest.raises(InputError, match="--via"):
        _submit(tmp_path, via="carrier-pigeon")
    with pytest.raises(InputError, match="execute"):
        _submit(tmp_path, via=Via.LOCAL)
    assert not (tmp_path / "run").exists()


def test_a_plan_is_typed_and_survives_plan_json(tmp_path: Path) -> None:
    plan = _submit(tmp_path, dry_run=True).plan
    again = beam_hpc.Plan.from_dict(__import__("json").loads(plan.to_json()))
    assert again == plan
    assert again.site.name == plan.site.name and again.recipe.lifecycle.walltime == plan.recipe.lifecycle.walltime
    assert plan.with_num_rollout(7).recipe.num_rollout == 7 and plan.recipe.num_rollout != 7


def test_segment_main_refuses_a_missing_plan_with_exit_2(tmp_path: Path) -> None:
    assert segment_main(["--plan", str(tmp_path / "nothing" / "plan.json")]) == 2


def test_dry_run_states_gpu_hours_from_the_recipe_or_the_runs_own_ledger(tmp_path: Path) -> None:
    from beam_hpc.run import checkpoint_layout, ledger

    fresh = _submit(tmp_path, dry_run=True, overrides=["lifecycle.rollout_s_estimate=360"])
    assert fresh.estimate is not None and fresh.estimate.rollout_s == 360
    assert fresh.estimate.gpu_hours == pytest.approx(96 * fresh.estimate.wall_s / 3600)
    assert "lifecycle.rollout_s_estimate" in fresh.estimate.basis
    # resuming: 40 of 100 rollouts done, the ledger measured 200 s a rollout and 100 s to be ready
    run = tmp_path / "run"
    ckpt = run / "checkpoints"
    it = Path(checkpoint_layout.iteration_dir(str(ckpt), 39))
    it.mkdir(parents=True)
    state = Path(checkpoint_layout.dataset_state_path(str(ckpt), 39))
    state.parent.mkdir(parents=True)
    state.write_text("{}")
    checkpoint_layout.mark_latest(str(ckpt), 39)
    ledger.append(run / "ledger.jsonl", ledger.start_record(job_id="5", restart=0, host="h", rollouts_at_start=0,
                                                            num_rollout=100, resume=False, walltime_s=86400, lead_s=600))
    ledger.append(run / "ledger.jsonl", {**ledger.end_record(
        job_id="5", restart=0, rollouts_at_end=40, reason="walltime", detail="", next_action="none",
        next_job_id=None, rollout_s=200.0, save_s=30.0), "ready_s": 100.0})
    again = _submit(tmp_path, dry_run=True, resume=True)
    assert again.estimate is not None and again.estimate.rollouts_left == 100 - checkpoint_layout.rollouts_done(str(ckpt))
    assert again.estimate.rollout_s == 200.0 and "measured" in again.estimate.basis
    assert again.estimate.wall_s == pytest.approx(again.estimate.rollouts_left * 200 + again.estimate.segments * 100)
