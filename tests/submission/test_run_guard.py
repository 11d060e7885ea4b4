"""beam_hpc.submission.run_guard: the login node's resume checks (the segment's own, on the same
rules: tests/job/test_segment.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from job_plans import make_test_plan

from beam_hpc.errors import InputError
from beam_hpc.run import checkpoint_layout
from beam_hpc.submission.run_guard import check_before_submit


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
