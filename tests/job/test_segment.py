"""beam_hpc.job.segment: a segment's checks, start line and end, without Slurm or Ray (it stops
before the job, or is driven by hand through its signal handlers).

The seam is how the segment asks Slurm about its job (``query=``): a JobInfo, time limit
included, is handed in instead of running ``scontrol``; tests/lifecycle/test_lifecycle_slurm.py
and tests/job/test_segment_slurm.py run the same code on the real local Slurm cluster.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from beam_hpc.plan.paths import RunPaths
from beam_hpc.run import checkpoint_layout, ledger
from beam_hpc.slurm.client import JobInfo, JobState


@pytest.fixture
def tiny_plan(tmp_path: Path):
    from beam_hpc.backends.registry import plan_for
    from beam_hpc.submission.submit import build_recipe, build_site

    root = Path(__file__).resolve().parents[2]

    def make(*overrides: str):
        recipe = build_recipe(root / "recipes" / "tiny.yaml", overrides=list(overrides),
                              output_dir=str(tmp_path / "run"), base_dir=tmp_path)
        plan = plan_for(recipe, build_site("local", search_dir=root / "env"))
        plan.write()
        return plan, recipe

    return make


def _checkpoint(paths: RunPaths, iteration: int, *, dataset_state: bool = True) -> None:
    checkpoint_layout.iteration_dir(paths.checkpoints, iteration).mkdir(parents=True)
    if dataset_state:
        checkpoint_layout.write_atomic(checkpoint_layout.dataset_state_path(paths.checkpoints, iteration), b"x")
    checkpoint_layout.mark_latest(paths.checkpoints, iteration)


def _deliver(sig: int) -> None:
    os.kill(os.getpid(), sig)
    time.sleep(0.01)  # the handler runs at the next bytecode boundary


def _run_segment(plan, env: dict[str, str] | None = None, **kw) -> tuple[int, dict]:
    from beam_hpc.job.segment import Segment

    code = Segment(plan.paths.plan, env=env or {}, **kw).run()
    segs, _ = ledger.read_ledger(plan.paths.ledger)
    assert not Path(plan.paths.lock).exists()  # released on every path
    return code, segs[-1]


def test_segment_resume_needs_checkpoint_and_dataset_state_and_says_which(tiny_plan) -> None:
    plan, _ = tiny_plan()
    code, seg = _run_segment(plan, resume=True)
    assert code == 2 and seg["end"]["reason"] == "error" and seg["end"]["next"]["action"] == "none"
    assert "no checkpoint" in seg["end"]["detail"] and seg["start"]["resume"]
    _checkpoint(plan.paths, 4, dataset_state=False)
    code, seg = _run_segment(plan, resume=True)
    assert code == 2 and "its dataset state" in seg["end"]["detail"] and "global_dataset_state_dict_4.pt" in seg["end"]["detail"]


def _published(paths: RunPaths, iteration: int) -> Path:
    """A checkpoint as the reference backend publishes it: files, their manifest, dataset state, pointer."""
    _checkpoint(paths, iteration)
    it_dir = checkpoint_layout.iteration_dir(paths.checkpoints, iteration)
    (it_dir / "model.pt").write_bytes(bytes(range(256)) * 8)
    manifest = {"model.pt": checkpoint_layout.file_digest(it_dir / "model.pt")}
    (it_dir / checkpoint_layout.MANIFEST_FILE).write_text(json.dumps(manifest))
    return it_dir


def test_a_segment_passes_over_a_torn_newest_checkpoint_and_counts_from_the_complete_one(tiny_plan) -> None:
    """A file of the newest checkpoint truncated after it was published (between two segments):
    the next segment finds it by the manifest, moves the pointer back to the newest complete
    checkpoint, and its start line counts from there and names what it passed over, so the
    decision after the segment and the GPU-hours (rollouts trained again) see the truth. Found by
    benchmarks/faults.py: the start line used to claim the torn checkpoint's rollouts."""
    from beam_hpc.job.segment import Segment
    from beam_hpc.run import accounting

    plan, _ = tiny_plan("num_rollout=40")
    _published(plan.paths, 4)
    torn = _published(plan.paths, 9) / "model.pt"
    torn.write_bytes(torn.read_bytes()[:100])
    seg = Segment(plan.paths.plan, resume=True, env={"SLURM_JOB_ID": "81"},
                  query=lambda j: JobInfo(j, JobState.RUNNING, 0, time.time() + 3600, None, time_limit_s=3600))
    assert seg._prepare() is None  # resumes (from 4)
    assert checkpoint_layout.latest_iteration(plan.paths.checkpoints) == 4
    start = ledger.read_ledger(plan.paths.ledger)[0][-1]["start"]
    assert start["rollouts_at_start"] == 5
    (passed,) = start["damaged_checkpoints"]
    assert passed["iteration"] == 9 and "model.pt does not match its manifest" in passed["why"]
    # the segment then trains 5.. again and saves at 12: rollouts 5-9 (5 of them) were trained before
    end = ledger.end_record(job_id="81", restart=0, rollouts_at_end=13, reason="walltime", detail="d",
                            next_action="resubmit", next_job_id="82", rollout_s=10.0, save_s=1.0, ready_s=0.0,
                            rollouts_run=8, last_save_at=start["time"] + 99, now=start["time"] + 100)
    hours = accounting.account([{"segment": "81-0", "start": start, "end": end}], 3600, now=start["time"] + 200)
    assert hours.lost_h[accounting.DAMAGED] == pytest.approx(5 * 10.0)
    assert hours.lost_h[accounting.REDONE] == 0


def test_segment_refuses_a_fresh_start_onto_checkpoints_and_a_total_already_reached(tiny_plan) -> None:
    plan, _ = tiny_plan("num_rollout=10")
    _checkpoint(plan.paths, 4)
    code, seg = _run_segment(plan)  # no --resume
    assert code == 2 and "already holds checkpoints" in seg["end"]["detail"]
    code, seg = _run_segment(plan, resume=True, num_rollout=5)  # --num-rollout N counts all rollouts
    assert code == 0 and seg["end"]["reason"] == "completed" and seg["start"]["num_rollout"] == 5
    # the job never writes plan.json: the new total is this segment's (and its resubmissions')
    assert json.loads(Path(plan.paths.plan).read_text())["recipe"]["num_rollout"] == 10


def test_segment_honours_the_cancel_flag_and_max_segments(tiny_plan) -> None:
    plan, _ = tiny_plan("lifecycle.max_segments=1")
    Path(plan.paths.cancel_flag).write_text("x")
    code, seg = _run_segment(plan)
    assert code == 0 and seg["end"]["reason"] == "cancelled" and seg["end"]["next"]["action"] == "none"
    os.unlink(plan.paths.cancel_flag)
    code, seg = _run_segment(plan)
    assert "max_segments (1) reached" in seg["end"]["detail"] and seg["end"]["next"]["action"] == "none"


def test_a_submission_after_the_cancel_flag_clears_it(tiny_plan) -> None:
    """`beam-hpc cancel` then a deliberate `submit --resume`: the new job was submitted after the
    flag, so the flag no longer applies (a job of the old chain, submitted before it, stops)."""
    from beam_hpc.job.segment import Segment

    plan, _ = tiny_plan()
    flag = Path(plan.paths.cancel_flag)
    flag.write_text("x")
    flagged = flag.stat().st_mtime

    def submitted(at: float):
        return lambda job_id: JobInfo(job_id, JobState.RUNNING, 0, None, None, submit_time=at, time_limit_s=3600)

    assert Segment(plan.paths.plan, env={"SLURM_JOB_ID": "55"}, query=submitted(flagged - 60)).run() == 0
    assert flag.exists() and ledger.read_ledger(plan.paths.ledger)[0][-1]["end"]["reason"] == "cancelled"
    code = Segment(plan.paths.plan, env={"SLURM_JOB_ID": "56"}, resume=True, query=submitted(flagged + 60)).run()
    assert not flag.exists()
    end = ledger.read_ledger(plan.paths.ledger)[0][-1]["end"]
    assert code == 2 and end["reason"] == "error" and "no checkpoint" in end["detail"]  # went on to its checks


def test_a_segment_refuses_checkpoints_made_with_another_model_or_topology(tiny_plan) -> None:
    """The submit-time check compares with plan.json; a segment that Slurm requeues (or that a
    hand-edited script starts) after plan.json was rewritten for another model or topology must
    compare with what the checkpoints were made with, refuse before the driver, and end the chain."""
    from beam_hpc.run.identity import identity_path, identity_problem, record_identity

    plan, recipe = tiny_plan("num_rollout=10")
    _checkpoint(plan.paths, 4)
    record_identity(plan.paths, recipe.identity(), "70-0", has_ckpt=False)  # what the first segment records
    recorded = identity_path(plan.paths).read_text()
    _, allowed = tiny_plan("num_rollout=30", "lifecycle.walltime=01:00:00", "lifecycle.lead_s=120")
    assert identity_problem(plan.paths, allowed.identity()) is None  # the seed lets these change
    requeued = {"SLURM_JOB_ID": "71", "SLURM_RESTART_COUNT": "1"}

    def query(job_id: str) -> JobInfo:
        return JobInfo(job_id, JobState.RUNNING, 1, None, None, time_limit_s=3600)

    for overrides, field in ((("model.path=/elsewhere/model",), "model.path (was "),
                             (("topology.trainer.nodes=2",), "topology.trainer.nodes (was 1, now 2)")):
        other, _ = tiny_plan("num_rollout=10", *overrides)  # a consistent plan.json: its own sha matches
        code, seg = _run_segment(other, env=requeued, query=query)
        assert code == 2 and seg["segment"] == "71-1" and seg["start"]["resume"]
        end = seg["end"]
        assert end["reason"] == "error" and end["next"] == {"action": "none", "job_id": None}
        assert field in end["detail"] and "identity: the checkpoints in" in end["detail"], end["detail"]
        assert not Path(other.paths.segment_logs("71", 1), "driver.log").exists()  # refused before the driver
        assert identity_path(plan.paths).read_text() == recorded  # the record is never rewritten
    identity_path(plan.paths).write_text("{torn")
    assert "unreadable" in identity_problem(plan.paths, recipe.identity())
    identity_path(plan.paths).unlink()  # checkpoints from before the record: plan.json's recipe stands in
    plan.write()
    assert identity_problem(plan.paths, allowed.identity()) is None
    assert "topology.trainer.nodes (was 1, now 2)" in identity_problem(plan.paths, other.recipe.identity())
    Path(plan.paths.plan).write_text("{torn")  # nor that: nothing to compare with
    assert identity_problem(plan.paths, other.recipe.identity()) is None
    plan.write()
    record_identity(plan.paths, recipe.identity(), "72-0", has_ckpt=True)
    assert json.loads(identity_path(plan.paths).read_text())["recorded_by"] == "72-0"


def test_without_save_on_request_the_lead_is_ignored_and_the_time_limit_is_recorded(tiny_plan) -> None:
    """The hard time-limit path (lead signal missed, or the backend cannot save on request): the
    walltime USR1 starts no save; SIGTERM at the job's end time is recorded as a walltime stop, and
    the segment resubmits from the last periodic checkpoint. The real signal handlers; Slurm's
    answers come through ``query`` (the run on the real cluster: benchmarks/interruptions.py)."""
    from beam_hpc.job.segment import Segment
    from beam_hpc.lifecycle.stopping import State

    plan, _ = tiny_plan("num_rollout=40", "lifecycle.save_on_request=false")
    _checkpoint(plan.paths, 4)
    end_time = time.time() + 3600
    seg = Segment(plan.paths.plan, resume=True, env={"SLURM_JOB_ID": "80"},
                  query=lambda j: JobInfo(j, JobState.RUNNING, 0, end_time, None, time_limit_s=3600))
    seg.watchdog.install()
    try:
        assert seg._prepare() is None  # the checks a segment makes before its job
        _deliver(signal.SIGUSR1)  # the walltime lead
        assert seg.stopping.interrupt is None and not os.path.exists(plan.paths.sentinel)
        assert seg.stopping.state is State.RUNNING
        _checkpoint(plan.paths, 19)  # the driver ran on and saved periodically
        end_time = time.time()  # the time limit: Slurm sends SIGTERM
        _deliver(signal.SIGTERM)
    finally:
        seg.watchdog.uninstall()
    end = ledger.read_ledger(plan.paths.ledger)[0][-1]["end"]
    assert seg.stopping.state is State.FINISHED and seg.exit_code == 0
    assert end["reason"] == "walltime" and "at the time limit" in end["detail"]
    assert end["rollouts_at_end"] == 20 and "continuing with --resume" in end["detail"]


def test_the_time_limit_is_slurms_and_caps_the_computed_lead(tiny_plan) -> None:
    """The job reads its time limit from Slurm (a hand edit of ``#SBATCH --time`` included), not
    from the plan: the start line records it, the computed lead is at most half of it, and the
    GPU-hour accounting bounds a killed segment by it. Outside Slurm, or when Slurm cannot say,
    the plan's walltime stands in. (The real header edit on the local cluster:
    tests/job/test_segment_slurm.py.)"""
    from beam_hpc.job.segment import Segment
    from beam_hpc.run import accounting

    # a computed lead: the floor, 500 s (the plan allows it in its 30 min walltime)
    plan, _ = tiny_plan("lifecycle.lead_s=null", "lifecycle.lead_floor_s=500")
    assert (plan.walltime_s, plan.lead_s) == (1800, 500)
    for env, limit, expected in (({"SLURM_JOB_ID": "90"}, 600, (600, 300)),  # --time edited to 00:10:00
                                 ({"SLURM_JOB_ID": "91"}, None, (1800, 500)),  # Slurm cannot say
                                 ({}, 600, (1800, 500))):  # beam-hpc execute: no Slurm, the query is not asked
        seg = Segment(plan.paths.plan, env=env,
                      query=lambda j, limit=limit: JobInfo(j, JobState.RUNNING, 0, time.time() + 600, None,
                                                          time_limit_s=limit))
        assert seg._prepare() is None
        start = ledger.read_ledger(plan.paths.ledger)[0][-1]["start"]
        assert (start["walltime_s"], start["lead_s"]) == expected, (env, limit)
        assert seg.watchdog.lead_s == expected[1]
    first = ledger.read_ledger(plan.paths.ledger)[0][0]
    later = {**first["start"], "time": first["start"]["time"] + 5000}  # killed hard; the next one came late
    hours = accounting.account([first, {"segment": "x-0", "start": later}], 3600, now=later["time"] + 1)
    assert hours.segments[0].wall_s == 600  # held at most its time limit, as Slurm had it
