"""beam_hpc.job.runner.run_local: the same job code with no Slurm (what `beam-hpc execute` runs), on the
host and through the Apptainer seam (the stand-in binary of tests/fake_apptainer.py, whose image
sets RAY_AUTH_MODE=disabled: only the job's forced environment can turn token auth back on), and
the readiness deadline with one node whose `ray start` hangs."""

from __future__ import annotations

import json
import os
import sys
from glob import glob
from pathlib import Path

import pytest
from run_watch import gone

from beam_hpc.job.runner import run_local, smoke_driver_argv
from beam_hpc.node.ray_node import TEST_HANG_RAY_START_VAR, tagged_pids
from fake_apptainer import install_fake_apptainer
from job_plans import make_test_plan


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.parametrize("runtime", ["host", "apptainer"])
def test_run_local_brings_up_both_groups_places_work_and_cleans_up(tmp_path, monkeypatch, runtime):
    site = None
    if runtime == "apptainer":
        bin_dir = install_fake_apptainer(tmp_path / "bin")
        monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
        image = tmp_path / "beam.sif"
        image.write_text("stand-in image")
        scratch = tmp_path / "scratch"
        scratch.mkdir()
        site = {"container": {"runtime": "apptainer", "image": str(image), "python": sys.executable},
                "scratch": str(scratch)}
    plan = make_test_plan(tmp_path / "run", trainer_nodes=1, rollout_nodes=1, gpus=1, site=site)
    outcome = run_local(plan, driver_argv=smoke_driver_argv(plan), ready_timeout_s=300)
    assert outcome.status == "completed", outcome.message
    assert outcome.ready_s and outcome.ready_s > 0 and outcome.teardown_s is not None
    smoke = json.loads(Path(plan.output_dir, "smoke.json").read_text())
    assert smoke["ok"]
    by_role = {t["role"]: t["ip"] for t in smoke["tasks"]}
    assert by_role == {"trainer": "127.0.0.10", "rollout": "127.0.0.11"}  # loopback node per group
    assert {t["ray_auth_mode"] for t in smoke["tasks"]} == {"token"}
    job_id = f"l{os.getpid()}"
    assert gone(lambda: tagged_pids(f"{plan.run_id}.{job_id}.0")) == []
    assert gone(lambda: glob(f"/tmp/beam-{job_id}.0-*")) == []
    assert not Path(plan.output_dir, ".ray-auth").exists()
    saved = json.loads(Path(outcome.segment_dir, "outcome.json").read_text())
    assert saved["status"] == "completed" and saved["ready_s"] == outcome.ready_s


@pytest.mark.ray
@pytest.mark.slow
def test_a_node_whose_ray_start_hangs_is_named_at_the_readiness_deadline(tmp_path, monkeypatch):
    """The rollout node's `ray start` never starts Ray (ray_node's test-only hang hook, set for node
    index 1 only); the trainer head comes up for real. At the short deadline the job ends not-ready,
    naming the rollout node, its state and its log, and leaves nothing running."""
    monkeypatch.setenv(TEST_HANG_RAY_START_VAR, "1")
    plan = make_test_plan(tmp_path / "run", trainer_nodes=1, rollout_nodes=1, gpus=1)
    outcome = run_local(plan, driver_argv=smoke_driver_argv(plan), ready_timeout_s=10)
    assert outcome.status == "not-ready", outcome.message
    seg = Path(outcome.segment_dir)
    assert "Ray cluster not ready by its deadline" in outcome.message
    assert "trainer: 1/1 nodes, 1/1 GPUs; rollout: 0/1 nodes, 0/1 GPUs" in outcome.message
    assert (f"never joined: rollout node 0 (local-rollout-0, 127.0.0.11: state running; log "
            f"{seg / 'node-rollout-0.log'})") in outcome.message
    assert "hung ray start" in (seg / "node-rollout-0.log").read_text()
    # the node to leave out next time (beam_hpc.lifecycle.exclusions): the one that never joined
    assert [f["node"] for f in outcome.failed_nodes] == ["local-rollout-0"]
    assert "did not join in time" in outcome.failed_nodes[0]["why"]
    assert "hung ray start" not in (seg / "node-trainer-0.log").read_text()
    hung_pid = json.loads((seg / "nodes" / "rollout-0.json").read_text())["ray_pid"]
    assert not gone(lambda: _alive(hung_pid))
    job_id = f"l{os.getpid()}"
    assert gone(lambda: tagged_pids(f"{plan.run_id}.{job_id}.0")) == []
    assert gone(lambda: glob(f"/tmp/beam-{job_id}.0-*")) == []
    assert not Path(plan.output_dir, ".ray-auth").exists()


def _alive(pid: int) -> bool:
    """A process that exists and is not a zombie (a zombie has ended; only its parent's reap is late)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False
