"""beam_hpc.job.launchers.for_job: the one place that picks srun, local processes or the site's own
Ray cluster (the launchers themselves run in tests/job/test_job_slurm.py, test_job_local.py and
test_existing_ray.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from job_plans import make_test_plan

from beam_hpc.job.context import JobError
from beam_hpc.job.launchers import LocalLauncher, SiteRayCluster, SrunLauncher, for_job
from beam_hpc.node.ray_node import ClusterRuntime


def test_srun_inside_a_slurm_job_else_local_processes(tmp_path: Path) -> None:
    plan = make_test_plan(tmp_path / "run", trainer_nodes=1, rollout_nodes=1)
    ctx, launcher = for_job(plan, env={})
    assert isinstance(launcher, LocalLauncher) and ctx.job_id.startswith("l")
    ctx, launcher = for_job(plan, srun=False, env={"SLURM_JOB_ID": "5"})  # asked for local processes
    assert isinstance(launcher, LocalLauncher)


def test_a_site_that_names_its_ray_cluster_gets_that_cluster_and_starts_nothing(tmp_path: Path) -> None:
    """The site's own cluster is a launcher of its own: its head and token are the site's, it starts
    no node step, it binds the token's directory, and its clean-up removes nothing of the site's."""
    token = tmp_path / "site-auth" / "token"
    token.parent.mkdir()
    token.write_text("secret\n")
    token.chmod(0o600)
    plan = make_test_plan(tmp_path / "run", trainer_nodes=1, rollout_nodes=1,
                          site={"ray_address": "127.0.0.40:6390", "ray_token_file": str(token)})
    ctx, launcher = for_job(plan, env={})
    assert isinstance(launcher, SiteRayCluster)
    head = launcher.head(plan, ctx)
    assert (head.head_ip, head.gcs_port, head.token_path, head.existing) == ("127.0.0.40", 6390, token, True)
    assert not (tmp_path / "run" / ".ray-auth").exists(), "no token of the job's own"
    rt = _runtime(ctx, head, tmp_path)
    assert launcher.binds(rt) == [str(token.parent)]
    assert launcher.start_nodes(plan, rt, ["python", "-m", "beam_hpc.node.step"], {}) == []
    launcher.clean_up(rt)
    assert token.read_text() == "secret\n"
    token.write_text("")
    with pytest.raises(JobError, match=r"ray_token_file: .* is missing or empty"):
        launcher.head(plan, ctx)


def _runtime(ctx, head, tmp_path: Path) -> ClusterRuntime:
    return ClusterRuntime(job_id=ctx.job_id, job_num=ctx.job_num, restart=0, job_tag="t", head_ip=head.head_ip,
                          gcs_port=head.gcs_port, host_stride=head.host_stride, token_path=str(head.token_path),
                          segment_dir=str(tmp_path / "seg"), nonce="n", deadline=0.0, nodelists=ctx.nodelists,
                          existing=head.existing)


@pytest.mark.slow
@pytest.mark.slurm
def test_srun_for_a_het_job_and_a_refusal_for_a_plain_one(tmp_path: Path) -> None:
    """Inside a job the node lists are expanded by ``scontrol show hostnames``: it needs a Slurm
    configuration, so this half runs with the local cluster."""
    plan = make_test_plan(tmp_path / "run", trainer_nodes=1, rollout_nodes=1)
    het = {"SLURM_JOB_ID": "5", "SLURM_HET_SIZE": "2", "SLURM_JOB_NODELIST_HET_GROUP_0": "n1",
           "SLURM_JOB_NODELIST_HET_GROUP_1": "n2", "SLURM_JOB_ID_HET_GROUP_0": "5", "SLURM_JOB_ID_HET_GROUP_1": "6"}
    ctx, launcher = for_job(plan, env=het)
    assert isinstance(launcher, SrunLauncher) and launcher.loopback and ctx.job_id == "5"
    with pytest.raises(JobError, match="het"):  # a plain job where the plan has two groups
        for_job(plan, env={"SLURM_JOB_ID": "5"})


def test_a_lost_node_in_a_group_step_is_the_one_srun_saw_end_first(tmp_path: Path) -> None:
    """One srun step covers every node of a group that does not survive a node's loss. When one
    node is lost its task dies without a word (no report), srun ends the others
    (``--kill-on-bad-exit``), and they may report "failed" on their way out: the node to blame is
    the task srun saw end first, not a node that reported last (on the local cluster the head trainer
    node was excluded and the lost one kept). A node that failed on its own keeps its report's reason."""
    import subprocess

    from beam_hpc.job.context import JobContext
    from beam_hpc.job.launchers import StepHandle, node_failure
    from beam_hpc.plan.paths import SegmentPaths

    plan = make_test_plan(tmp_path / "run", trainer_nodes=2, rollout_nodes=1)
    rt = ClusterRuntime(job_id="5", job_num=5, restart=0, job_tag="t", head_ip="127.0.0.1", gcs_port=1, host_stride=1,
                        token_path=str(tmp_path / "token"), segment_dir=str(tmp_path / "seg"), nonce="n", deadline=0.0,
                        nodelists={"trainer": ["n1", "n2"], "rollout": ["n3"]})
    reports = SegmentPaths(rt.segment_dir)
    Path(reports.node_report("trainer", 0)).parent.mkdir(parents=True)
    # n1 (task 0) was ended by srun after n2 (task 1) was lost, and said so in its report
    Path(reports.node_report("trainer", 0)).write_text('{"state": "failed", "local_index": 0, "error": "SIGTERM"}')
    output = tmp_path / "srun-trainer.log"
    output.write_text("srun: error: n2: task 1: Killed\nsrun: Terminating StepId=5+0.1\n"
                      "srun: error: n1: task 0: Terminated\n")
    proc = subprocess.Popen(["false"])
    proc.wait()
    handle = StepHandle(group=plan.group("trainer"), proc=proc, local_index=None, output=output)
    srun = SrunLauncher(JobContext(job_id="5", job_num=5, restart=0, component_ids={"trainer": "5", "rollout": "6"},
                                   nodelists=rt.nodelists), loopback=True)
    err = node_failure(srun, rt, handle)
    assert err.failed_nodes == [{"node": "n2", "why": "node step failed: Killed"}], err.failed_nodes
    assert "on node n2 ended: Killed" in str(err)
    # a node that failed on its own: srun names it first, and its report says why
    Path(reports.node_report("trainer", 1)).write_text('{"state": "failed", "local_index": 1, "error": "NVMe missing"}')
    err = node_failure(srun, rt, handle)
    assert err.failed_nodes == [{"node": "n2", "why": "node step failed: NVMe missing"}], err.failed_nodes
    # Slurm declared the node failed under the step (what srun printed when the local cluster lost n2)
    Path(reports.node_report("trainer", 1)).unlink()
    output.write_text("srun: error: Node failure on n2\nsrun: error: n1: task 0: Killed\n"
                      "srun: launch/slurm: _step_signal: Terminating StepId=75.0\nsrun: Force Terminated StepId=75.0\n")
    assert node_failure(srun, rt, handle).failed_nodes == [{"node": "n2", "why": "node step failed: node failure"}]
    # no word from srun (its output lost): the node's own report
    output.write_text("")
    assert node_failure(srun, rt, handle).failed_nodes[0]["node"] == "n1"
    # no word from anyone: the step's exit status in words, never a bare "exit code 0"
    Path(reports.node_report("trainer", 0)).unlink()
    stopped = subprocess.Popen(["true"])
    stopped.wait()
    why = node_failure(srun, rt, StepHandle(group=plan.group("trainer"), proc=stopped, local_index=None,
                                            output=output)).failed_nodes[0]["why"]
    assert why == ("node step failed: ended while the job ran, without a word (exit code 0: its node lost, "
                   "or the step cancelled)"), why
    killed = subprocess.Popen(["sleep", "30"])
    killed.kill()
    killed.wait()
    why = node_failure(srun, rt, StepHandle(group=plan.group("trainer"), proc=killed, local_index=None,
                                            output=output)).failed_nodes[0]["why"]
    assert why == "node step failed: killed by SIGKILL without a word (its node lost, or the step killed)", why
