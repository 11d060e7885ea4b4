"""beam_hpc.submission.run_guard: the login node's resume checks (the segment's own, on the same
rules: tests/job/test_segment.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from job_plans import make_test_plan

from beam_hpc.errors import InputError
from beam_hpc.run import checkpoint_layout
from beam_hpc.submission.run_guard import check_before_submit, check_submission


def test_login_node_refuses_a_resume_with_another_model_but_allows_num_rollout(tmp_path: Path) -> None:
    plan = make_test_plan(tmp_path / "run", trainer_nodes=1, rollout_nodes=1)  # plan.json written
    recipe = plan.recipe.model_copy(update={"num_rollout": 10})
    ckpt = plan.paths.checkpoints  # checkpoint 4 (rollouts 0-4), with its dataset state
    checkpoint_layout.iteration_dir(ckpt, 4).mkdir(parents=True)
    checkpoint_layout.write_atomic(checkpoint_layout.dataset_state_path(ckpt, 4), b"x")
    checkpoint_layout.mark_latest(ckpt, 4)
    check_before_submit(recipe.model_copy(update={"num_rollout": 50}), resume=True)
    other = recipe.model_copy(update={"model": recipe.model.model_copy(update={"path": "/elsewhere/model"})})
    with pytest.raises(InputError, match=r"identity: .* made with another model\.path \(was "):
        check_before_submit(other, resume=True)  # no run_identity.json yet: plan.json's recipe stands in
    with pytest.raises(InputError, match="5 are already done"):
        check_before_submit(recipe.model_copy(update={"num_rollout": 5}), resume=True)


def test_a_dry_run_refuses_what_the_submission_would_about_the_run_directory(tmp_path: Path) -> None:
    """check_submission, the one place both ask: a dry run judges the run directory and the resume
    rules as the submission does, but not the inputs' existence (data may be prepared later) nor
    the lock; a smoke run judges no checkpoint."""
    plan = make_test_plan(tmp_path / "run", trainer_nodes=1, rollout_nodes=1)
    recipe = plan.recipe.model_copy(update={"num_rollout": 10})
    missing = recipe.model_copy(update={"data": recipe.data.model_copy(update={"dir": str(tmp_path / "no-data")})})
    check_submission(missing, plan.site, resume=False, dry_run=True, smoke=False)  # no checkpoints: only shown
    with pytest.raises(InputError, match=r"^data\.dir: .*no-data.* does not exist; run `beam-hpc prepare"):
        check_submission(missing, plan.site, resume=False, dry_run=False, smoke=False)
    ckpt = plan.paths.checkpoints
    checkpoint_layout.iteration_dir(ckpt, 4).mkdir(parents=True)
    checkpoint_layout.write_atomic(checkpoint_layout.dataset_state_path(ckpt, 4), b"x")
    checkpoint_layout.mark_latest(ckpt, 4)
    with pytest.raises(InputError, match="already holds checkpoints"):
        check_submission(missing, plan.site, resume=False, dry_run=True, smoke=False)  # a fresh run onto them
    check_submission(missing, plan.site, resume=False, dry_run=True, smoke=True)  # smoke: no checkpoint judged
    Path(plan.paths.plan).write_text("{ torn")
    with pytest.raises(InputError, match="plan"):
        check_submission(missing, plan.site, resume=True, dry_run=True, smoke=True)  # a damaged plan.json, always
