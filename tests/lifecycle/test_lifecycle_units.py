"""Fast tests of the lifecycle's pieces: ledger, run lock, watchdog (lifecycle.watchdog), save-now
(lifecycle.save), segment metrics, the decision rules (lifecycle.decide), the resubmission line
(lifecycle.actions).

Real files, real signals, real processes. The one seam is the Slurm query (``query=``): these
tests hand the lock and the watchdog a JobInfo instead of running ``scontrol``, so that the rules
can be checked in milliseconds for every state; test_lifecycle_slurm.py runs the same code against
the real local Slurm cluster.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import socket
import threading
import time
from pathlib import Path

import pytest

from beam_hpc.errors import InputError
from beam_hpc.lifecycle.actions import resubmit_command
from beam_hpc.lifecycle.cancel import cancel_run
from beam_hpc.lifecycle.decide import Action, Outcome, decide
from beam_hpc.lifecycle.save import save_and_wait
from beam_hpc.lifecycle.segment_metrics import segment_metrics
from beam_hpc.lifecycle.watchdog import InterruptKind, Watchdog
from beam_hpc.plan.paths import RunPaths
from beam_hpc.run import checkpoint_layout, ledger, metric_names
from beam_hpc.run.lock import Holder, RunLockError, acquire, read_holder, release
from beam_hpc.slurm.client import JobInfo, JobState, SlurmUnavailable

# -- ledger -------------------------------------------------------------------------------------------


def _start(job: str = "100", restart: int = 0, at: int = 0) -> dict:
    return ledger.start_record(job_id=job, restart=restart, host="n1", rollouts_at_start=at, num_rollout=10,
                               resume=at > 0, walltime_s=120, lead_s=60, now=1.0)


def _end(job: str = "100", restart: int = 0, at: int = 4, reason: str = "walltime", action: str = "resubmit",
         nxt: str | None = "101", rollout_s: float | None = 2.0, save_s: float | None = 0.5) -> dict:
    return ledger.end_record(job_id=job, restart=restart, rollouts_at_end=at, reason=reason, detail="d",
                             next_action=action, next_job_id=nxt, rollout_s=rollout_s, save_s=save_s, now=2.0)


def test_ledger_lines_follow_the_contract_and_merge_by_segment(tmp_path: Path) -> None:
    path = tmp_path / "ledger.jsonl"
    ledger.append(path, _start("100", 0, 0))
    ledger.append(path, _end("100", 0, 4))
    ledger.append(path, _start("101", 0, 4))  # killed hard: no end line
    ledger.append(path, _start("101", 1, 4))  # its requeue
    ledger.append(path, _end("101", 1, 10, reason="completed", action="none", nxt=None))
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert set(lines[0]) == {"event", "segment", "job_id", "restart", "time", "host", "rollouts_at_start",
                             "num_rollout", "resume", "walltime_s", "lead_s", "damaged_checkpoints"}
    assert set(lines[1]) == {"event", "segment", "job_id", "restart", "time", "rollouts_at_end", "reason",
                             "detail", "next", "timings", "ready_s", "rollouts_run", "last_save_at",
                             "failed_nodes"}
    assert lines[1]["next"] == {"action": "resubmit", "job_id": "101"}
    assert lines[1]["timings"] == {"rollout_s": 2.0, "save_s": 0.5}
    segs, warnings = ledger.read_ledger(path)
    assert warnings == []
    assert [s["segment"] for s in segs] == ["100-0", "101-0", "101-1"]
    assert "end" not in segs[1] and segs[2]["end"]["reason"] == "completed"


def test_ledger_reader_skips_a_torn_line_and_rejects_bad_records(tmp_path: Path) -> None:
    path = tmp_path / "ledger.jsonl"
    ledger.append(path, _start())
    with open(path, "a") as fh:
        fh.write('{"event": "end", "segm')  # a writer killed mid-line, on a file system without atomic appends
    ledger.append(path, _end())
    segs, warnings = ledger.read_ledger(path)
    assert len(warnings) == 1 and "unreadable" in warnings[0]
    assert segs[0]["start"]["segment"] == "100-0"
    with pytest.raises(ledger.LedgerError, match="reason 'late'"):
        _end(reason="late")
    with pytest.raises(ledger.LedgerError, match="next action"):
        _end(action="retry")
    assert ledger.read_ledger(tmp_path / "absent.jsonl") == ([], [])


def _appender(path: str, tag: int, n: int) -> None:
    for i in range(n):
        ledger.append(path, _start(str(1000 * tag + i)))


def test_ledger_appends_from_many_processes_stay_whole(tmp_path: Path) -> None:
    path = str(tmp_path / "ledger.jsonl")
    procs = [multiprocessing.get_context("fork").Process(target=_appender, args=(path, t, 50)) for t in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
    segs, warnings = ledger.read_ledger(path)
    assert warnings == [] and len(segs) == 200


def test_measured_timings_take_the_slowest_recent_segment() -> None:
    segs = [{"segment": "1-0", "end": _end(rollout_s=9.0, save_s=1.0)},
            {"segment": "2-0", "end": _end(rollout_s=2.0, save_s=None)},
            {"segment": "3-0", "end": _end(rollout_s=3.0, save_s=0.5)},
            {"segment": "4-0", "end": _end(rollout_s=None, save_s=None)},
            {"segment": "5-0", "start": _start()}]
    assert ledger.measured_timings(segs, last=2) == {"rollout_s": 3.0, "save_s": 1.0}
    assert ledger.measured_timings([{"segment": "1-0", "start": _start()}]) is None


# -- run lock -------------------------------------------------------------------------------------------


def _query(states: dict[str, str | None]):
    def query(job_id: str) -> JobInfo | None:
        state = states.get(job_id)
        if state == "UNAVAILABLE":
            raise SlurmUnavailable(["scontrol", "show", "job", job_id], "controller down")
        return None if state is None else JobInfo(job_id, JobState(state), 0, None, None)
    return query


def test_lock_refuses_a_live_job_and_takes_over_a_dead_one(tmp_path: Path) -> None:
    lock = tmp_path / "run.lock"
    first = Holder.me("11")
    assert acquire(lock, first, query=_query({})) is None
    assert read_holder(lock).job_id == "11"
    with pytest.raises(RunLockError, match="in use by job 11 .*beam-hpc cancel"):
        acquire(lock, Holder.me("12"), query=_query({"11": "RUNNING"}))
    with pytest.raises(RunLockError, match="Slurm cannot say"):
        acquire(lock, Holder.me("12"), query=_query({"11": "UNAVAILABLE"}))
    for state in (None, "COMPLETING", "PENDING", "CANCELLED"):  # gone, or anything but RUNNING
        taken = acquire(lock, Holder.me("12"), query=_query({"11": state, "12": "RUNNING"}))
        assert taken is not None and taken.job_id in ("11", "12")
        Path(lock).unlink()
        acquire(lock, first, query=_query({}))


def test_a_requeued_job_takes_over_its_own_lock_and_release_is_owner_only(tmp_path: Path) -> None:
    lock = tmp_path / "run.lock"
    before = Holder("21", 0, "n1", 999_999, 1.0)  # our job before its requeue (another pid, maybe another node)
    acquire(lock, before, query=_query({}))
    again = Holder.me("21", restart=1)
    assert acquire(lock, again, query=_query({"21": "RUNNING"})) == before
    assert not release(lock, before)  # the old incarnation cannot remove its successor's lock
    assert release(lock, again) and not lock.exists()


def test_lock_outside_slurm_is_stale_when_its_pid_is_gone(tmp_path: Path) -> None:
    lock = tmp_path / "run.lock"
    proc = multiprocessing.get_context("fork").Process(target=time.sleep, args=(0,))
    proc.start()
    proc.join()
    acquire(lock, Holder(None, 0, socket.gethostname(), proc.pid, 1.0))
    assert acquire(lock, Holder.me(None)).pid == proc.pid
    with pytest.raises(RunLockError, match="a local run"):
        acquire(lock, Holder(None, 0, socket.gethostname(), 1, 1.0))  # pid 1 is alive: refused
    lock.write_text("{torn")
    assert acquire(lock, Holder.me(None)) is not None  # unreadable: nobody's


# -- acting on a decision ------------------------------------------------------------------------------
# (parsing Slurm's answers: tests/slurm/test_slurm_client.py)


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


# -- watchdog --------------------------------------------------------------------------------------------


class FakeClock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def watchdog_factory(tmp_path: Path):
    made: list[Watchdog] = []

    def make(info: JobInfo | None, restart: int = 0, clock: FakeClock | None = None) -> Watchdog:
        wd = Watchdog("40", restart, 60, query=lambda _j: info, clock=clock or FakeClock(1000.0),
                      cancel_flag=str(tmp_path / "CANCELLED"))
        wd.install()
        made.append(wd)
        return wd

    yield make
    for wd in made:
        wd.uninstall()


def _deliver(sig: int) -> None:
    os.kill(os.getpid(), sig)
    time.sleep(0.01)  # the handler runs at the next bytecode boundary


def test_watchdog_tells_walltime_from_preemption(watchdog_factory) -> None:
    wd = watchdog_factory(JobInfo("40", JobState.RUNNING, 0, 1100.0, None))
    assert wd.check() is None
    _deliver(signal.SIGUSR1)
    intr = wd.check()
    assert intr.kind == "walltime" and intr.source == "USR1" and intr.hard_end == 1100.0
    assert intr.kind is InterruptKind.WALLTIME
    wd2 = watchdog_factory(JobInfo("40", JobState.RUNNING, 0, 1020.0, 1000.0))
    _deliver(signal.SIGUSR1)
    assert wd2.check().kind == "preempted"


def test_watchdog_keeps_its_own_deadline(watchdog_factory) -> None:
    clock = FakeClock(1000.0)
    wd = watchdog_factory(JobInfo("40", JobState.RUNNING, 0, 1100.0, None), clock=clock)
    assert wd.check() is None and wd.deadline == 1040.0
    clock.t = 1040.0
    intr = wd.check()
    assert intr.kind == "walltime" and intr.source == "deadline"
    assert wd.check() is None  # fired once


def test_watchdog_classifies_sigterm(watchdog_factory, tmp_path: Path) -> None:
    wd = watchdog_factory(JobInfo("40", JobState.COMPLETING, 1, 2000.0, None))
    _deliver(signal.SIGTERM)
    assert wd.check().kind == "requeued"
    wd = watchdog_factory(JobInfo("40", JobState.COMPLETING, 0, 1001.0, None))
    _deliver(signal.SIGTERM)
    assert wd.check().kind == "timelimit"
    wd = watchdog_factory(JobInfo("40", JobState.COMPLETING, 0, 1001.0, None, limit_end=1001.0))
    _deliver(signal.SIGTERM)
    assert wd.check().kind == "timelimit"
    # a plain scancel: Slurm shows COMPLETING with EndTime moved to the cancel (measured on the local
    # cluster), while StartTime + TimeLimit is still ahead; it is no time limit (benchmarks/faults.py
    # found this: the segment recorded a walltime stop and would have resubmitted after progress)
    wd = watchdog_factory(JobInfo("40", JobState.COMPLETING, 0, 1000.0, None, limit_end=2200.0))
    _deliver(signal.SIGTERM)
    stop = wd.check()
    assert stop.kind == "cancelled" and "scancel" in stop.detail
    wd = watchdog_factory(JobInfo("40", JobState.RUNNING, 0, 1000.0, 980.0))  # a preemption's grace is over
    _deliver(signal.SIGTERM)
    assert wd.check().kind == "requeued"
    wd = watchdog_factory(JobInfo("40", JobState.RUNNING, 1, 1000.0, 900.0, submit_time=950.0), restart=1)
    _deliver(signal.SIGTERM)  # the PreemptTime of the incarnation before the requeue does not count
    assert wd.check().kind == "timelimit"
    wd = watchdog_factory(JobInfo("40", JobState.COMPLETING, 0, 2000.0, None))
    _deliver(signal.SIGTERM)
    assert wd.check().kind == "cancelled"
    (tmp_path / "CANCELLED").write_text("x")
    wd = watchdog_factory(JobInfo("40", JobState.COMPLETING, 1, 2000.0, None))
    _deliver(signal.SIGTERM)
    assert wd.check().detail.startswith("cancelled with beam-hpc cancel")


def test_sigterm_overrides_a_walltime_save_in_progress(watchdog_factory) -> None:
    wd = watchdog_factory(JobInfo("40", JobState.RUNNING, 0, 1100.0, None))
    _deliver(signal.SIGUSR1)
    assert wd.check().kind == "walltime"
    _deliver(signal.SIGUSR1)
    assert wd.check() is None  # the same thing again: nothing new
    wd._query = lambda _j: JobInfo("40", JobState.COMPLETING, 1, 1100.0, None)
    _deliver(signal.SIGTERM)
    assert wd.check().kind == "requeued"


# -- save now ------------------------------------------------------------------------------------------


def _backend(paths: RunPaths, iteration: int, delay: float, stop: threading.Event) -> None:
    """What a backend does with the sentinel: at its next rollout boundary, save, pointer last,
    then remove the sentinel (the reference backend's order)."""
    while not stop.is_set():
        if os.path.exists(paths.sentinel):
            time.sleep(delay)
            checkpoint_layout.iteration_dir(paths.checkpoints, iteration).mkdir(parents=True)
            checkpoint_layout.mark_latest(paths.checkpoints, iteration)
            os.unlink(paths.sentinel)
            return
        time.sleep(0.02)


def test_save_and_wait_returns_once_the_requested_checkpoint_landed(tmp_path: Path) -> None:
    paths = RunPaths(str(tmp_path))
    checkpoint_layout.mark_latest(paths.checkpoints, 4)
    stop = threading.Event()
    t = threading.Thread(target=_backend, args=(paths, 7, 0.3, stop))
    t.start()
    res = save_and_wait(paths, deadline=time.time() + 10, driver_running=lambda: True, reason="walltime", poll_s=0.05)
    t.join()
    assert res.saved and res.iteration == 7 and 0.25 < res.seconds < 5
    assert not os.path.exists(paths.sentinel)


def test_save_and_wait_gives_up_at_the_deadline_or_when_the_driver_is_gone(tmp_path: Path) -> None:
    paths = RunPaths(str(tmp_path))
    checkpoint_layout.mark_latest(paths.checkpoints, 4)
    res = save_and_wait(paths, deadline=time.time() + 0.3, driver_running=lambda: True, reason="preempted", poll_s=0.05)
    assert not res.saved and res.iteration == 4 and "relying on checkpoint 4" in res.detail
    res = save_and_wait(paths, deadline=time.time() + 10, driver_running=lambda: False, reason="walltime", poll_s=0.05)
    assert not res.saved and "driver exited" in res.detail


def test_segment_metrics_count_only_this_segments_scalars(tmp_path: Path) -> None:
    """The reference backend's metrics mirror (no TensorBoard here): only lines written since the
    segment's mark count; a final save the tracker shows after the last logged step is timed from
    the step's last scalar to the tracker."""
    paths = RunPaths(str(tmp_path))
    metrics = Path(paths.dumps, metric_names.METRICS_FILE)
    metrics.parent.mkdir(parents=True)
    metrics.write_text(json.dumps({"kind": "rollout", "rollout_id": 0, "time": 100.0, metric_names.ROLLOUT_TIME: 50.0}) + "\n")
    mark = 150.0
    with open(metrics, "a") as fh:
        fh.writelines(json.dumps({"kind": "rollout", "rollout_id": k, "time": 200.0 + k, metric_names.ROLLOUT_TIME: t}) + "\n"
                      for k, t in ((1, 2.0), (2, 4.0)))
        fh.write(json.dumps({"kind": "save", "rollout_id": 2, "time": 203.0, metric_names.SAVE_TIME: 0.7}) + "\n")
        fh.write('{"kind": "rollout", "rollout_id": 3, "perf/ste')  # torn by a kill
    m = segment_metrics(paths, mark)
    assert (m.rollouts_run, m.rollout_s, m.save_s) == (2, 3.0, 0.7)
    assert segment_metrics(paths, 0).rollouts_run == 3
    checkpoint_layout.mark_latest(paths.checkpoints, 2)
    os.utime(Path(paths.checkpoints, checkpoint_layout.LATEST_FILE), (210.5, 210.5))
    assert segment_metrics(paths, mark).save_s == 7.5  # 210.5 - 203.0: the step's last scalar
    assert segment_metrics(RunPaths(str(tmp_path / "none")), 0).rollouts_run == 0


# -- decision rules --------------------------------------------------------------------------------------


def _decide(reason: str, start: int, end: int, *, run: int = 3, history: list | None = None, **kw):
    o = Outcome(reason=reason, rollouts_at_start=start, rollouts_at_end=end, num_rollout=20, rollouts_run=run,
                retryable=kw.pop("retryable", True))
    opts = {"history": history or [], "max_segments": 10, "cancelled": False, "requeue_on_preemption": True}
    opts.update(kw)
    return decide(o, **opts)


def _seg(reason: str | None, start: int, end: int) -> dict:
    seg = {"segment": "x", "start": _start(at=start)}
    if reason is not None:
        seg["end"] = _end(at=end, reason=reason)
    return seg


def test_decide_resubmits_after_walltime_progress_and_stops_when_done() -> None:
    assert _decide("walltime", 4, 8).action == "resubmit"
    assert _decide("walltime", 4, 8).action is Action.RESUBMIT  # an enum whose value is the ledger's string
    assert _decide("walltime", 4, 20).action == "none"
    assert "num_rollout 20 reached" in _decide("error", 4, 20).detail


def test_decide_requeues_preemptions_unless_turned_off() -> None:
    assert _decide("preempted", 4, 4).action == "requeue"  # even without progress: it was not our fault
    assert _decide("preempted", 4, 6, requeue_on_preemption=False).action == "none"


def test_decide_guards() -> None:
    assert "no progress" in _decide("walltime", 4, 4).detail
    assert _decide("walltime", 4, 4).action == "none"
    assert _decide("walltime", 4, 8, cancelled=True).action == "none"
    assert _decide("cancelled", 4, 8).action == "none"
    d = _decide("walltime", 4, 8, history=[_seg("walltime", 0, 4)] * 9)
    assert d.action == "none" and "max_segments" in d.detail
    assert _decide("error", 4, 4, retryable=False).action == "none"


def test_decide_retries_a_failure_once_but_not_twice_in_a_row() -> None:
    first = _decide("node-failure", 4, 4, run=0, history=[_seg("walltime", 0, 4)])
    assert first.action == "resubmit" and "before its first rollout" in first.detail
    second = _decide("error", 4, 4, run=0, history=[_seg("walltime", 0, 4), _seg("node-failure", 4, 4)])
    assert second.action == "none" and "failed without progress too" in second.detail
    assert _decide("error", 4, 4, run=0, history=[_seg(None, 4, 4)]).action == "none"  # killed hard before
    assert _decide("error", 4, 6, run=2, history=[_seg("error", 4, 4)]).action == "resubmit"  # progress resets it


# -- a segment's checks before it runs anything (no Slurm, no Ray: it stops before the job) ----------


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
                  query=lambda j: JobInfo(j, JobState.RUNNING, 0, time.time() + 3600, None))
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


def test_cancel_of_a_directory_that_is_no_run_is_an_input_error(tmp_path: Path) -> None:
    from beam_hpc.cli.app import main

    with pytest.raises(InputError, match="no plan.json and no ledger.jsonl"):
        cancel_run(str(tmp_path / "nothing"))
    assert not (tmp_path / "nothing").exists()  # no flag written anywhere
    assert main(["cancel", str(tmp_path / "nothing")]) == 2


def test_segment_honours_the_cancel_flag_and_max_segments(tiny_plan) -> None:
    plan, _ = tiny_plan("lifecycle.max_segments=1")
    Path(plan.paths.cancel_flag).write_text("x")
    code, seg = _run_segment(plan)
    assert code == 0 and seg["end"]["reason"] == "cancelled" and seg["end"]["next"]["action"] == "none"
    os.unlink(plan.paths.cancel_flag)
    code, seg = _run_segment(plan)
    assert "max_segments (1) reached" in seg["end"]["detail"] and seg["end"]["next"]["action"] == "none"


def test_login_node_refuses_a_resume_with_another_model_but_allows_num_rollout(tiny_plan) -> None:
    from beam_hpc.errors import InputError
    from beam_hpc.submission.run_guard import check_before_submit

    plan, recipe = tiny_plan("num_rollout=10")
    _checkpoint(plan.paths, 4)
    check_before_submit(recipe.model_copy(update={"num_rollout": 50}), resume=True)
    other = recipe.model_copy(update={"model": recipe.model.model_copy(update={"path": "/elsewhere/model"})})
    with pytest.raises(InputError, match=r"identity: .* made with another model\.path \(was "):
        check_before_submit(other, resume=True)  # no run_identity.json yet: plan.json's recipe stands in
    with pytest.raises(InputError, match="5 are already done"):
        check_before_submit(recipe.model_copy(update={"num_rollout": 5}), resume=True)


def test_a_submission_after_the_cancel_flag_clears_it(tiny_plan) -> None:
    """`beam-hpc cancel` then a deliberate `submit --resume`: the new job was submitted after the
    flag, so the flag no longer applies (a job of the old chain, submitted before it, stops)."""
    from beam_hpc.job.segment import Segment

    plan, _ = tiny_plan()
    flag = Path(plan.paths.cancel_flag)
    flag.write_text("x")
    flagged = flag.stat().st_mtime

    def submitted(at: float):
        return lambda job_id: JobInfo(job_id, JobState.RUNNING, 0, None, None, submit_time=at)

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
        return JobInfo(job_id, JobState.RUNNING, 1, None, None)

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

    plan, _ = tiny_plan("num_rollout=40", "lifecycle.save_on_request=false")
    _checkpoint(plan.paths, 4)
    end_time = time.time() + 3600
    seg = Segment(plan.paths.plan, resume=True, env={"SLURM_JOB_ID": "80"},
                  query=lambda j: JobInfo(j, JobState.RUNNING, 0, end_time, None))
    seg.watchdog.install()
    try:
        assert seg._prepare() is None  # the checks a segment makes before its job
        _deliver(signal.SIGUSR1)  # the walltime lead
        assert seg.interrupt is None and not os.path.exists(plan.paths.sentinel) and not seg.finished
        _checkpoint(plan.paths, 19)  # the driver ran on and saved periodically
        end_time = time.time()  # the time limit: Slurm sends SIGTERM
        _deliver(signal.SIGTERM)
    finally:
        seg.watchdog.uninstall()
    end = ledger.read_ledger(plan.paths.ledger)[0][-1]["end"]
    assert seg.finished and end["reason"] == "walltime" and "at the time limit" in end["detail"]
    assert end["rollouts_at_end"] == 20 and "continuing with --resume" in end["detail"]


# -- failed-node exclusion ---------------------------------------------------------------------------------
def _failed_on(job: str, t: float, *nodes: str) -> list[dict]:
    start = ledger.start_record(job_id=job, restart=0, host="h", rollouts_at_start=0, num_rollout=10,
                                resume=False, walltime_s=600, lead_s=60, now=t - 10)
    end = ledger.end_record(job_id=job, restart=0, rollouts_at_end=0, reason="node-failure", detail="d",
                            next_action="resubmit", next_job_id=None, rollout_s=None, save_s=None, now=t,
                            failed_nodes=[{"node": n, "why": f"{n} broke"} for n in nodes])
    return [start, end]


def test_exclusions_accumulate_over_the_ledger_and_clearings_undo_them(tmp_path: Path) -> None:
    from beam_hpc.lifecycle import exclusions

    path = tmp_path / "ledger.jsonl"
    for rec in _failed_on("1", 100.0, "n3") + _failed_on("2", 200.0, "n5", "n3"):
        ledger.append(path, rec)
    segs, _ = ledger.read_ledger(path)
    ex = exclusions.from_ledger(segs)
    assert [(e.node, e.segment, e.time) for e in ex] == [("n5", "2-0", 200.0), ("n3", "2-0", 200.0)]
    assert exclusions.names(exclusions.from_ledger(segs, [{"node": "n3", "time": 150.0}])) == ["n5", "n3"]
    assert exclusions.names(exclusions.from_ledger(segs, [{"node": "n3", "time": 250.0}])) == ["n5"]
    assert exclusions.names(exclusions.from_ledger(segs, [{"node": "*", "time": 250.0}])) == []
    # this segment's failures count before its end line is written
    assert exclusions.names(exclusions.effective(tmp_path, segs, [{"node": "n7", "why": "x"}])) == ["n5", "n3", "n7"]
    # submit --resume --include-node: a typo is refused, a real name is cleared and recorded
    with pytest.raises(InputError, match="not excluded"):
        exclusions.for_submission(tmp_path, ["n9"])
    assert exclusions.for_submission(tmp_path, ["n3"]) == ["n5"]
    assert exclusions.for_submission(tmp_path) == ["n5"]
    assert exclusions.for_submission(tmp_path, ["all"]) == []


def test_exclusions_stop_the_chain_when_the_nodes_left_cannot_hold_the_groups() -> None:
    from beam_hpc.lifecycle.exclusions import shortfall

    parts = {"gpu": ["n1", "n2", "n3", "n4"], None: ["n1", "n2", "n3", "n4"]}
    needs = [("trainer", 2, "gpu"), ("rollout", 1, "gpu")]
    assert shortfall(needs, parts, ["n3"]) is None
    why = shortfall(needs, parts, ["n3", "n4"])
    assert why and "partition gpu has 4 nodes, 2 of them excluded after failing (n3, n4): 2 left" in why
    assert "--include-node" in why
    assert shortfall(needs, {}, ["n1", "n2", "n3", "n4"]) is None  # unknown partition: Slurm decides
    out = Outcome(reason="node-failure", rollouts_at_start=0, rollouts_at_end=0, num_rollout=10)
    d = decide(out, history=[], max_segments=10, cancelled=False, requeue_on_preemption=True, nodes_short=why)
    assert d.action == Action.NONE and "retrying once, but partition gpu" in d.detail
    d = decide(out, history=[], max_segments=10, cancelled=False, requeue_on_preemption=True, nodes_short=None)
    assert d.action == Action.RESUBMIT


def test_resubmission_excludes_the_failed_nodes() -> None:
    from beam_hpc.plan.segment_args import SegmentArgs

    cmd = resubmit_command("/r/job.sbatch", SegmentArgs(resume=True), lead_s=75, dependency="afterany:8",
                           exclude=["n3", "n5"])
    assert cmd[:5] == ["sbatch", "--parsable", "--dependency=afterany:8", "--signal=B:USR1@75", "--exclude=n3,n5"]
    assert cmd[5:] == ["/r/job.sbatch", "--resume"]
