"""When Slurm itself falters: the real slurmctld stopped (or SIGSTOPped) and started again.

The slow tests run on a private cluster of their own (tests/support/cluster/private_cluster.py),
never on the shared one, whose controller every other test's jobs need.

- (a) the client classifies what sbatch, squeue, scontrol and scancel really say with the
  controller stopped or stopped dead (SIGSTOP) as unreachable, and a bad partition as a refusal;
- (b) a resubmission rides out an outage and is the first thing the controller gets when it is
  back, also from a job whose time limit passed during the outage; an answer that was lost is
  found again instead of submitting twice; when the deadline comes first, ResubmissionPending
  names the command, and that command works;
- (c) the login commands against an absent controller: one line, exit 1, nothing half-written;
- (d) a job's teardown with the controller down stays within a walltime lead.

The full chains (a 150 s outage at the walltime save; a 40 s outage mid-segment) are
test_controller_outage_chain.py's.
"""

from __future__ import annotations

import json
import logging
import re
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from private_cluster import controller_up_around, log_size, private_cluster, submits_since
from run_watch import poll_until
from slurm_cluster import LocalSlurmCluster

from beam_hpc.lifecycle import actions
from beam_hpc.lifecycle.actions import KillClock, ResubmissionPending
from beam_hpc.plan.segment_args import SegmentArgs
from beam_hpc.run import ledger
from beam_hpc.slurm import client
from beam_hpc.slurm.client import SlurmError, SlurmUnavailable

ROOT = Path(__file__).resolve().parents[2]
BEAM_HPC = Path(sys.executable).with_name("beam-hpc")
FIRST_JOB_ID = 700_000  # the private cluster's ids: far from the shared cluster's (which restart at 1)


# -- the policy, without a cluster ------------------------------------------------------------------
# What Slurm 22.05 printed on the local cluster (sbatch and scontrol with slurmctld stopped).
CONNECT_FAILURE = "sbatch: error: Batch job submission failed: Unable to contact slurm controller (connect failure)"
SOCKET_TIMEOUT = "sbatch: error: Batch job submission failed: Socket timed out on send/recv operation"


def _unavailable(words: str) -> SlurmUnavailable:
    return SlurmUnavailable(["sbatch", "--parsable", "x.sh"], words, 1)


class _Script:
    """Plays a sequence of outcomes (an exception to raise, or a value to return) to ``retry`` on a
    virtual clock, so that its policy (when it retries, looks, gives up) is checked exactly."""

    def __init__(self, outcomes: list[object], landed: list[object] | None = None) -> None:
        self.outcomes, self.landed_answers = list(outcomes), list(landed or [])
        self.now, self.sent, self.looked, self.timeouts = 1000.0, 0, 0, []

    def attempt(self, timeout: float) -> object:
        self.sent += 1
        self.timeouts.append(timeout)
        self.now += 9  # sbatch tries to connect for about 9 s before it says so
        out = self.outcomes.pop(0)
        if isinstance(out, BaseException):
            raise out
        return out

    def landed(self) -> object:
        self.looked += 1
        out = self.landed_answers.pop(0)
        if isinstance(out, BaseException):
            raise out
        return out

    def sleep(self, s: float) -> None:
        self.now += s


def _down(timeout: float) -> None:
    raise SlurmUnavailable(["scontrol", "ping"], "Slurmctld(primary) at vm is DOWN", 1)


def _retry(script: _Script, deadline: actions.Deadline, **kw: object) -> object:
    kw.setdefault("probe", _down)
    return actions.retry(script.attempt, command=["sbatch", "x.sh"], deadline=deadline, landed=script.landed,
                         sleep=script.sleep, clock=lambda: script.now, **kw)


def test_retry_rides_out_unreachable_and_stops_at_a_refusal() -> None:
    script = _Script([_unavailable(CONNECT_FAILURE), _unavailable(CONNECT_FAILURE), "42"])
    assert _retry(script, 2000.0) == "42" and script.sent == 3 and script.looked == 0  # connect: never landed
    refused = SlurmError(["sbatch"], "sbatch: error: Batch job submission failed: Invalid partition name specified", 1)
    script = _Script([_unavailable(CONNECT_FAILURE), refused])
    with pytest.raises(SlurmError, match="Invalid partition name") as err:
        _retry(script, 2000.0)
    assert not isinstance(err.value, SlurmUnavailable) and script.sent == 2  # Slurm's words, at once
    missing = SlurmUnavailable(["sbatch"], "sbatch: not found")  # no Slurm here: nothing to wait for
    script = _Script([missing])
    with pytest.raises(SlurmUnavailable, match="not found"):
        _retry(script, 2000.0)
    assert script.sent == 1
    script = _Script([_unavailable(CONNECT_FAILURE)])  # no deadline: one attempt, as before
    with pytest.raises(SlurmUnavailable) as one:
        _retry(script, None)
    assert not isinstance(one.value, ResubmissionPending) and script.timeouts == [actions.SINGLE_TIMEOUT_S]


def test_a_lost_answer_is_looked_for_before_the_request_goes_out_again() -> None:
    # a timed-out sbatch may have created the job: look (Slurm cannot say yet: look again) and take it
    script = _Script([_unavailable(SOCKET_TIMEOUT)], landed=[_unavailable(SOCKET_TIMEOUT), "77"])
    assert _retry(script, 5000.0) == "77" and script.sent == 1 and script.looked == 2
    # not there: send again, and stop looking until another answer is lost
    script = _Script([_unavailable(SOCKET_TIMEOUT), _unavailable(CONNECT_FAILURE), "78"], landed=[None])
    assert _retry(script, 5000.0) == "78" and script.sent == 3 and script.looked == 1


def test_the_deadline_ends_the_retries_with_the_command_to_run() -> None:
    script = _Script([_unavailable(CONNECT_FAILURE)] * 50)
    with pytest.raises(ResubmissionPending) as err:
        _retry(script, 1060.0)
    pending = err.value
    assert pending.command == ["sbatch", "x.sh"] and pending.transient and 3 <= pending.attempts <= 6
    assert script.now <= 1060.0 + 9 and all(t <= 60 for t in script.timeouts)
    assert pending.record() == {"command": "sbatch x.sh", "why": pending.why}
    assert "Unable to contact slurm controller" in pending.why and "sbatch x.sh" in str(pending)
    script = _Script([_unavailable(SOCKET_TIMEOUT)] + [_unavailable(CONNECT_FAILURE)] * 50,
                     landed=[_unavailable(CONNECT_FAILURE)] * 50)
    with pytest.raises(ResubmissionPending) as unsure:  # a lost answer never settled: say so
        _retry(script, 1060.0)
    assert unsure.value.may_have_landed and "squeue --me" in unsure.value.why and script.sent == 1


def test_no_attempt_is_cut_short_against_an_absent_controller() -> None:
    # 5 s left after the first attempt: sbatch could not finish trying, and a cut attempt may have
    # landed; so it goes out only when `scontrol ping` says the controller is up
    script = _Script([_unavailable(CONNECT_FAILURE), "43"])
    with pytest.raises(ResubmissionPending) as err:
        _retry(script, 1015.0)
    assert script.sent == 1 and "Unable to contact" in err.value.why and not err.value.may_have_landed
    script = _Script([_unavailable(CONNECT_FAILURE), "43"])
    assert _retry(script, 1015.0, probe=lambda timeout: "Slurmctld(primary) at vm is UP") == "43"
    assert script.timeouts[-1] == pytest.approx(5.0)
    script = _Script(["44"])  # no attempt yet and no controller: the ping's words
    with pytest.raises(ResubmissionPending, match="DOWN"):
        _retry(script, 1005.0)
    assert script.sent == 0


def test_a_lost_request_carried_out_late_is_withdrawn_or_counted() -> None:
    # the look said "not there", the resend went through, and the lost one was carried out after
    # all: settle keeps one
    settled: list[object] = []
    script = _Script([_unavailable(SOCKET_TIMEOUT), "81"], landed=[None])
    assert _retry(script, 5000.0, settle=lambda job: settled.append(job) or job) == "81" and settled == ["81"]
    script = _Script([_unavailable(CONNECT_FAILURE), "82"])  # nothing in doubt: nothing to settle
    assert _retry(script, 5000.0, settle=lambda job: settled.append(job) or job) == "82" and settled == ["81"]
    # Slurm refuses the repeat because the lost one went through (a requeue of a requeued job)
    refused = SlurmError(["scontrol", "requeue", "5"], "Requested operation is presently disabled for job 5", 1)
    script = _Script([_unavailable(SOCKET_TIMEOUT), refused], landed=[None, True])
    assert _retry(script, 5000.0) is True and script.looked == 2
    script = _Script([_unavailable(SOCKET_TIMEOUT), refused], landed=[None, None])
    with pytest.raises(SlurmError, match="presently disabled"):
        _retry(script, 5000.0)


def test_the_kill_clock_waits_for_the_sigterm_then_gives_killwait_less_a_reserve() -> None:
    now = [100.0]
    clock = KillClock(kill_wait_s=30, reserve_s=2, clock=lambda: now[0])
    assert clock() == float("inf")  # the controller enforces the limit: no SIGTERM, no kill
    now[0] = 500.0
    clock.sigterm()
    clock.sigterm(at=900.0)  # the first one counts
    assert clock() == 528.0
    assert KillClock(kill_wait_s=5, reserve_s=2, cap=120.0)() == 120.0
    assert KillClock(kill_wait_s=1, reserve_s=2, term_at=10.0)() == 10.0


def test_resubmit_command_is_the_runs_own_line() -> None:
    cmd = actions.resubmit_command("/runs/x/job.sbatch", SegmentArgs(resume=True, num_rollout=60), lead_s=45,
                                   dependency="afterany:41", output="/runs/x/logs/slurm-%j.out", exclude=["n3"])
    assert cmd == ["sbatch", "--parsable", "--dependency=afterany:41", "--signal=B:USR1@45",
                   "--output=/runs/x/logs/slurm-%j.out", "--exclude=n3", "/runs/x/job.sbatch", "--resume",
                   "--num-rollout", "60"]


def _run_dir(tmp: Path, *, pending: dict | None = None, open_segment: bool = False) -> Path:
    """A run directory as a chain leaves it: plan-less (status reads the ledger), one segment."""
    run = tmp / "run"
    (run / "checkpoints").mkdir(parents=True)
    ledger.append(run / "ledger.jsonl", ledger.start_record(job_id="700041", restart=0, host="n1", rollouts_at_start=0,
                                                            num_rollout=60, resume=False, walltime_s=105, lead_s=45))
    if not open_segment:
        end = ledger.end_record(job_id="700041", restart=0, rollouts_at_end=42, reason="walltime",
                                detail="walltime warning; saved on request -> resubmission pending",
                                next_action="none", next_job_id=None, rollout_s=1.0, save_s=2.0)
        if pending is not None:
            end["resubmission_pending"] = pending
        ledger.append(run / "ledger.jsonl", end)
    return run


def test_status_says_what_to_run_when_the_resubmission_is_pending(tmp_path: Path) -> None:
    from beam_hpc.observe.status import gather
    from beam_hpc.observe.status_table import format_status

    cmd = "sbatch --parsable --dependency=afterany:700041 --signal=B:USR1@45 /r/job.sbatch --resume"
    run = _run_dir(tmp_path, pending={"command": cmd, "why": "Slurm did not take it in 9 attempt(s) over 150 s"})
    s = gather(run, slurm=False)
    assert s["state"] == "resubmission-pending" and s["resubmission_pending"]["command"] == cmd
    assert s["segments"][-1]["resubmission_pending"]["why"].startswith("Slurm did not take it")
    text = format_status(s)
    assert f"run: {cmd}" in text and "the resubmission is pending" in text
    plain = gather(_run_dir(tmp_path / "b"), slurm=False)  # no field: as before
    assert plain["state"] == "stopped" and plain["resubmission_pending"] is None
    bad = gather(_run_dir(tmp_path / "c", pending={"command": 5}), slurm=False)  # malformed: ignored
    assert bad["resubmission_pending"] is None


# -- the private cluster --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def outage_cluster(slurm_cluster) -> Iterator[LocalSlurmCluster]:  # type: ignore[no-untyped-def]
    """A private cluster that only this module's tests use and stop (tests/support/cluster/private_cluster.py)."""
    with private_cluster("beamoutage", FIRST_JOB_ID) as cluster:
        yield cluster


@pytest.fixture
def outage(outage_cluster, monkeypatch: pytest.MonkeyPatch) -> Iterator[LocalSlurmCluster]:
    """The private cluster for one test: its SLURM_CONF for every client, its controller up again
    and its jobs cancelled afterwards, whatever the test did."""
    monkeypatch.setenv("SLURM_CONF", str(outage_cluster.conf))
    with controller_up_around(outage_cluster) as cluster:
        yield cluster


def _sleeper(tmp: Path, name: str = "sleeper") -> Path:
    script = tmp / f"{name}.sh"
    script.write_text("#!/bin/bash\nsleep 600\n")
    return script


def _running_job(cluster: LocalSlurmCluster, tmp: Path) -> str:
    job = client.sbatch(["--job-name=sleeper", "--time=00:10:00", f"--output={tmp}/%j.out", str(_sleeper(tmp))])
    _until(f"job {job} to run", lambda: client.job_state(job) == client.JobState.RUNNING, 60)
    return job


def _until(what: str, cond: Callable[[], object], timeout: float, poll_s: float = 0.5) -> object:
    value = poll_until(cond, timeout, poll_s)
    if not value:
        raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
    return value


def _timed(call: Callable[[], object]) -> tuple[BaseException | object, float]:
    t0 = time.monotonic()
    try:
        out: BaseException | object = call()
    except BaseException as err:  # noqa: BLE001 - the outcome is what the test looks at
        out = err
    return out, time.monotonic() - t0


# -- (a) the client's classification against the real daemon ---------------------------------------------
@pytest.mark.slow
@pytest.mark.slurm
def test_a_stopped_controller_reads_as_unreachable_and_a_bad_partition_as_a_refusal(outage, tmp_path) -> None:
    with pytest.raises(SlurmError) as refused:
        client.sbatch(["--partition=nosuch", str(_sleeper(tmp_path))])
    assert not isinstance(refused.value, SlurmUnavailable) and "Invalid partition name specified" in refused.value.detail
    job = _running_job(outage, tmp_path)
    assert client.kill_wait_s() == 5  # the cluster's KillWait, which a segment reads at its start
    outage.stop_controller()
    calls: dict[str, Callable[[], object]] = {
        "sbatch": lambda: client.sbatch(["--job-name=sleeper", f"--output={tmp_path}/%j.out", str(_sleeper(tmp_path))]),
        "squeue": lambda: client.queued_job_ids("sleeper"),
        "scontrol show job": lambda: client.show_job(job),
        "scontrol requeue": lambda: client.requeue(job),
        "scancel": lambda: client.cancel([job]),
        "scancel --signal step": lambda: client.cancel([f"{job}.0"], signal="TERM"),
        "dependents": lambda: client.dependents(job),
    }
    with ThreadPoolExecutor(len(calls)) as pool:  # each waits about 9-18 s on the absent controller
        results = dict(zip(calls, pool.map(_timed, calls.values()), strict=True))
    ping, ping_s = _timed(client.ping)
    print("\n" + "\n".join(f"{name}: {out} ({s:.1f} s)" for name, (out, s) in results.items()))
    for name, (out, _s) in results.items():
        assert isinstance(out, SlurmUnavailable) and out.transient, f"{name}: {out!r}"
    sbatch_err = results["sbatch"][0]
    assert isinstance(sbatch_err, SlurmUnavailable)
    assert "Unable to contact slurm controller (connect failure)" in sbatch_err.detail and not sbatch_err.may_have_landed
    assert "Unexpected message received" in results["scontrol requeue"][0].detail  # slurm_requeue2's words
    assert isinstance(ping, SlurmUnavailable) and re.fullmatch(r"Slurmctld\(primary\) at \S+ is DOWN", ping.detail)
    assert ping_s < 3, "scontrol ping answers at once with slurmctld stopped"
    assert client.expand_hostnames("n[1-2]") == ["n1", "n2"]  # parsed locally: needs no controller
    assert "Slurmctld(primary)" in client.describe_controller(sbatch_err)
    outage.start_controller()
    assert client.job_state(job) == client.JobState.RUNNING  # the outage touched no job
    assert client.queued_job_ids("sleeper") == [job]  # and nothing of the failed sbatch landed


@pytest.mark.slow
@pytest.mark.slurm
def test_a_hung_controller_reads_as_busy_and_a_lost_answer_is_found_not_sent_twice(outage, tmp_path, caplog) -> None:
    caplog.set_level(logging.INFO, logger=actions.__name__)
    job = _running_job(outage, tmp_path)
    outage.pause_controller()  # accepts connections, answers nothing: an overloaded controller
    try:
        lost, took = _timed(lambda: client.sbatch([f"--dependency=afterany:{job}", f"--output={tmp_path}/%j.out",
                                                   str(_sleeper(tmp_path, "lost"))]))
    finally:
        outage.resume_controller()
    assert isinstance(lost, SlurmUnavailable) and lost.transient and lost.may_have_landed, repr(lost)
    assert "Socket timed out on send/recv operation" in lost.detail and took < 30
    landed = _until("the lost submission to show", lambda: client.dependents(job), 30)
    assert len(landed) == 1  # Slurm carried out the request whose answer timed out
    client.cancel(landed)
    # The same through resubmit, with its first answer lost for certain: that sbatch goes to the
    # paused controller and times out. Resubmit's own pause between attempts (its ``sleep`` hook)
    # resumes the controller and returns only once the lost request has landed, so the look that
    # comes next has a lost answer to find, and must find it rather than send the job again.
    outage.pause_controller()
    offset, waits = log_size(outage), []

    def resume_and_let_it_land(delay: float) -> None:
        waits.append(delay)
        if len(waits) == 1:
            outage.resume_controller()
            _until("the resubmission whose answer was lost to land", lambda: client.dependents(job), 30)
        time.sleep(delay)

    try:
        out, _ = _timed(lambda: actions.resubmit(
            str(_sleeper(tmp_path, "next")), SegmentArgs(resume=True), lead_s=45, dependency=f"afterany:{job}",
            output=f"{tmp_path}/%j.out", deadline=time.time() + 180, sleep=resume_and_let_it_land))
    finally:
        outage.resume_controller()
    print("\n" + "\n".join(caplog.messages))
    assert isinstance(out, str) and out.isdigit(), repr(out)
    assert len(waits) == 1, f"attempts after the lost one: {waits}"  # one lost attempt, then the look
    assert any("went through after all" in m for m in caplog.messages), caplog.messages
    assert not any("withdrawing job" in m for m in caplog.messages), caplog.messages
    assert client.dependents(job) == [out], "the lost submission was sent again"
    assert submits_since(outage, offset) == [out], "the controller got the submission twice"


# -- (b) the resubmission rides out the outage ------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.slurm
def test_a_resubmission_rides_out_a_stopped_controller_and_is_the_first_thing_it_gets(outage, tmp_path) -> None:
    job = _running_job(outage, tmp_path)
    outage.stop_controller()
    offset = log_size(outage)
    box: dict[str, object] = {}
    worker = threading.Thread(target=lambda: box.update(out=_timed(lambda: actions.resubmit(
        str(_sleeper(tmp_path, "next")), SegmentArgs(resume=True, num_rollout=60), lead_s=45,
        dependency=f"afterany:{job}", output=f"{tmp_path}/%j.out", deadline=time.time() + 240))))
    worker.start()
    time.sleep(20)
    assert worker.is_alive(), f"gave up while the controller was down: {box}"
    back = time.time()
    outage.start_controller()
    worker.join(timeout=120)
    out, took = box["out"]  # type: ignore[misc]
    assert isinstance(out, str) and out.isdigit(), repr(out)
    info = client.show_job(out)
    assert info is not None and info.submit_time is not None
    print(f"\nresubmitted as {out} after {took:.1f} s; {info.submit_time - back:.1f} s after the controller came back")
    assert client.dependents(job) == [out]
    assert submits_since(outage, offset) == [out]  # the first (and only) submission it got
    assert info.submit_time - back < 12  # within one attempt of its return (sbatch retries each second)


@pytest.mark.slow
@pytest.mark.slurm
def test_when_the_deadline_comes_first_the_pending_command_is_exact_and_works(outage, tmp_path) -> None:
    job = _running_job(outage, tmp_path)
    script, args = str(_sleeper(tmp_path, "next")), SegmentArgs(resume=True, num_rollout=60)
    kw = {"lead_s": 45, "dependency": f"afterany:{job}", "output": f"{tmp_path}/%j.out", "exclude": ["n3"]}
    outage.stop_controller()
    t0 = time.monotonic()
    with pytest.raises(ResubmissionPending) as err:
        actions.resubmit(script, args, deadline=time.time() + 15, **kw)
    took = time.monotonic() - t0
    pending = err.value
    assert took < 15 + actions.ATTEMPT_TIMEOUT_S and pending.attempts >= 1
    assert pending.command == actions.resubmit_command(script, args, **kw)
    assert pending.record()["command"] == shlex.join(pending.command)
    assert "Unable to contact slurm controller" in pending.record()["why"] and not pending.may_have_landed
    outage.start_controller()
    assert client.dependents(job) == []  # nothing landed
    ran = subprocess.run(shlex.split(pending.record()["command"]), env=client.slurm_env_free(),
                         capture_output=True, text=True, timeout=60, check=False)  # what status tells a person
    assert ran.returncode == 0 and client.dependents(job) == [ran.stdout.strip()], ran.stderr


_IN_JOB = """
import json, signal, sys, time
from pathlib import Path
from beam_hpc.lifecycle import actions
from beam_hpc.plan.segment_args import SegmentArgs
from beam_hpc.slurm.environment import SlurmEnvironment
out, go, successor = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
clock = actions.KillClock(kill_wait_s=5, reserve_s=2)  # the local cluster's KillWait
signal.signal(signal.SIGTERM, lambda *_: clock.sigterm())
while not go.exists():
    time.sleep(0.2)
job = SlurmEnvironment.current().job_id
try:
    res = {"job": actions.resubmit(successor, SegmentArgs(resume=True), lead_s=45, dependency=f"afterany:{job}",
                                   output=str(out.parent / "%j.out"), deadline=clock), "at": time.time()}
except actions.ResubmissionPending as err:
    res = {"pending": err.record()}
res["term_at"] = clock.term_at
out.write_text(json.dumps(res))
"""


@pytest.mark.slow
@pytest.mark.slurm
def test_a_job_whose_limit_passes_in_the_outage_submits_before_the_returning_controller_ends_it(
        outage, tmp_path) -> None:
    """Slurm's controller enforces time limits: while it is down, a job past its limit runs on; when
    it is back, the job's resubmission (retrying all along) must land before the job is ended."""
    prog, go, result = tmp_path / "in_job.py", tmp_path / "go", tmp_path / "result.json"
    prog.write_text(_IN_JOB)
    batch = tmp_path / "job.sh"
    batch.write_text(f"#!/bin/bash\ncd {ROOT}\nexec {sys.executable} {prog} {result} {go} {_sleeper(tmp_path, 'next')}\n")
    job = client.sbatch(["--time=00:01:00", f"--output={tmp_path}/%j.out", str(batch)])
    info = _until("the job to run", lambda: (i := client.show_job(job)) and i.state == client.JobState.RUNNING and i, 60)
    assert info.limit_end is not None
    time.sleep(max(0.0, info.limit_end - 30 - time.time()))
    outage.stop_controller()
    go.touch()  # the job starts resubmitting into the outage
    time.sleep(max(0.0, info.limit_end + 20 - time.time()))  # its limit passes while the controller is down
    assert not result.exists(), result.read_text()
    back = time.time()
    outage.start_controller()
    res = json.loads(_until("the job's answer", lambda: result.exists() and result.read_text(), 120))
    print(f"\nin-job resubmission: {res}; controller back at {back:.1f}, limit was {info.limit_end:.1f}")
    assert "job" in res, res
    final = _until("the job to end", lambda: (i := client.show_job(job)) and i.state.terminal and i, 120)
    nxt = client.show_job(res["job"])
    assert nxt is not None and nxt.submit_time is not None and final.end_time is not None
    assert final.state == client.JobState.TIMEOUT  # ended by its limit, once the controller could
    assert nxt.submit_time <= final.end_time, "the controller ended the job before taking its resubmission"


# -- (c) the login commands ---------------------------------------------------------------------------------
def _beam(*argv: str, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([str(BEAM_HPC), *argv], env=env, capture_output=True, text=True, timeout=timeout,
                          check=False, cwd=ROOT)


@pytest.mark.slow
@pytest.mark.slurm
def test_login_commands_against_an_absent_controller_say_one_line_and_write_nothing(outage, tmp_path) -> None:
    env = {**client.slurm_env_free(), "SLURM_CONF": str(outage.conf), "XDG_STATE_HOME": str(tmp_path / "state")}
    run = _run_dir(tmp_path, open_segment=True)
    driver_log = run / "logs" / "700041-0" / "driver.log"
    driver_log.parent.mkdir(parents=True)
    driver_log.write_text("rollout 41 done\n")
    (run / "plan.json").write_text(json.dumps({"job_name": "beam-outage-test"}))
    data = tmp_path / "data"
    data.mkdir()
    for name in ("dapo-math-17k.jsonl", "tiny-add.jsonl"):  # submit's login checks see the data files
        (data / name).write_text("")
    fresh = tmp_path / "fresh-run"
    outage.stop_controller()
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    t0 = time.monotonic()
    with ThreadPoolExecutor(4) as pool:
        status, submit, cancel, doctor = pool.map(lambda argv: _beam(*argv, env=env), [
            ["status", str(run)],
            ["submit", "recipes/tiny.yaml", "--via", "sbatch", "--output-dir", str(fresh), "--set", f"data.dir={data}",
             "--set", f"model.path={tmp_path / 'model'}"],
            ["cancel", str(run)],
            ["doctor"],
        ])
    logs = _beam("logs", str(run), env=env)
    took = time.monotonic() - t0
    print(f"\n({took:.1f} s)\n{status.stdout}\n{doctor.stdout}\n" + "\n".join(f"--- {name}: exit {p.returncode}\n{p.stderr}" for name, p in
                                            (("status", status), ("submit", submit), ("cancel", cancel),
                                             ("doctor", doctor), ("logs", logs))))
    controller = re.compile(r"Slurmctld\(primary\) at \S+ is DOWN")
    for name, p in (("status", status), ("submit", submit), ("cancel", cancel)):
        lines = p.stderr.strip().splitlines()
        assert p.returncode == 1 and len(lines) == 1, f"{name}: {p.returncode} {p.stderr}"
        assert controller.search(lines[0]) and "once `scontrol ping` says UP" in lines[0], f"{name}: {lines[0]}"
        assert "Traceback" not in p.stderr + p.stdout
    assert f"retry `beam-hpc status {run}`" in status.stderr and f"retry `beam-hpc cancel {run}`" in cancel.stderr
    assert "retry `beam-hpc submit recipes/tiny.yaml --via sbatch" in submit.stderr
    assert "may have acted" not in submit.stderr  # nothing was sent: the controller was found down first
    # status still shows everything the run directory knows, and one line says Slurm was not asked
    assert "700041-0" in status.stdout and "slurm      could not be asked (Slurmctld(primary)" in status.stdout
    assert not fresh.exists(), f"submit wrote {sorted(fresh.rglob('*'))}"  # nothing half-written
    assert (run / "CANCELLED").is_file()  # the cancel flag holds without Slurm: no segment resubmits
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == sorted([*before, Path("CANCELLED")])
    assert "jobs named beam-outage-test were not scancelled" in cancel.stderr or "700041" in cancel.stderr
    assert doctor.returncode == 1 and controller.search(doctor.stdout) and "retry `beam-hpc doctor`" in doctor.stdout
    assert logs.returncode == 0 and "rollout 41 done" in logs.stdout  # logs never asks Slurm
    assert took < 60, "each command asks `scontrol ping` first, which answers at once"


# -- (d) teardown ---------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.slurm
@pytest.mark.ray
def test_teardown_with_the_controller_down_fits_in_a_walltime_lead(outage, tmp_path) -> None:
    """A real job (Ray on two nodes, node steps under srun) ends its driver while slurmctld is
    down: its node steps stop cleanly through their srun, and the teardown takes seconds, not the
    ~60 s of scancels waiting on the absent controller."""
    from job_plans import batch_script, hold_driver, make_test_plan

    marker, release = tmp_path / "driver-up.json", tmp_path / "release"
    plan = make_test_plan(tmp_path / "run", trainer_nodes=1, rollout_nodes=1, gpus=2,
                          driver=hold_driver(marker, release), local_run=True)
    job = client.sbatch([str(batch_script(plan, "--ready-timeout", "300"))])
    _until("the job's driver", marker.exists, 420, poll_s=1)
    outage.stop_controller()
    release.touch()  # the driver ends: the job tears down with no controller
    seg = Path(plan.paths.segment_logs(job, 0))
    outcome = json.loads(_until("the job's outcome", lambda: (seg / "outcome.json").exists() and
                                (seg / "outcome.json").read_text(), 120))
    batch_log = Path(plan.paths.logs, f"slurm-{job}.out").read_text(errors="replace")
    print(f"\nteardown {outcome['teardown_s']} s\n{batch_log[-1500:]}")
    assert outcome["status"] == "completed", outcome
    assert outcome["teardown_s"] < 30, "a 45 s lead holds the save and this"
    assert "stopping the node steps through their srun" in batch_log
    reports = {p.stem: json.loads(p.read_text())["state"] for p in (seg / "nodes").glob("*.json")}
    assert reports == {"trainer-0": "stopped", "rollout-0": "stopped"}  # SIGINT through slurmd: a clean stop
    outage.start_controller()
    _until("the job to end", lambda: client.job_state(job) in (None, client.JobState.COMPLETED), 120)
