"""beam_hpc.lifecycle.actions: the resubmission line (parsing Slurm's answers: tests/slurm/test_slurm_client.py)."""

from __future__ import annotations

from beam_hpc.lifecycle.actions import resubmit_command


def test_resubmit_command_chains_with_resume() -> None:
    from beam_hpc.plan.segment_args import SegmentArgs

    assert resubmit_command("/r/job.sbatch", SegmentArgs(resume=True), lead_s=75, dependency="afterany:8",
                            output="/r/logs/slurm-%j.out") == [
        "sbatch", "--parsable", "--dependency=afterany:8", "--signal=B:USR1@75", "--output=/r/logs/slurm-%j.out",
        "/r/job.sbatch", "--resume"]
    assert resubmit_command("/r/job.sbatch", SegmentArgs(), lead_s=75, dependency="afterany:9")[-1] == "/r/job.sbatch"
    # a total given with --num-rollout is passed on (the job never rewrites plan.json), and it is
    # exactly what the next segment's own parser reads back
    cmd = resubmit_command("/r/job.sbatch", SegmentArgs(resume=True, num_rollout=200), lead_s=75,
                           dependency="afterany:8")
    assert cmd[-3:] == ["--resume", "--num-rollout", "200"]


def test_resubmission_excludes_the_failed_nodes() -> None:
    from beam_hpc.plan.segment_args import SegmentArgs

    cmd = resubmit_command("/r/job.sbatch", SegmentArgs(resume=True), lead_s=75, dependency="afterany:8",
                           exclude=["n3", "n5"])
    assert cmd[:5] == ["sbatch", "--parsable", "--dependency=afterany:8", "--signal=B:USR1@75", "--exclude=n3,n5"]
    assert cmd[5:] == ["/r/job.sbatch", "--resume"]
