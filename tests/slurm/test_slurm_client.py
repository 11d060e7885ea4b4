"""beam_hpc.slurm.client: the parsers on Slurm's real output (fast), and every call against the
real local Slurm cluster (slow): sbatch -> show_job -> requeue -> cancel, with states as enums.

The fast tests put a stand-in ``scontrol``/``sbatch`` on PATH that prints what the real command
printed on the local cluster (captured strings), so the error paths are checked without a cluster.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from polling import poll_until

from beam_hpc.slurm import client
from beam_hpc.slurm.client import JobState, SlurmError, SlurmUnavailable

# -- captured output ---------------------------------------------------------------------------------

# `scontrol --oneliner show job` of a preempted job on the local cluster (trimmed to the fields that matter)
SCONTROL_PREEMPTED = (
    "JobId=17 JobName=sig.sh UserId=root(0) JobState=RUNNING Reason=None Requeue=1 Restarts=0 "
    "SubmitTime=2026-12-02T16:55:29 StartTime=2026-12-02T16:55:30 EndTime=2026-12-02T16:56:41 "
    "PreemptEligibleTime=2026-12-02T16:55:30 PreemptTime=2026-12-02T16:56:21 NodeList=n[2-3]\n"
)
SCONTROL_GONE = "slurm_load_jobs error: Invalid job id specified\n"
SCONTROL_PING_DOWN = ("Slurmctld(primary) at vm is DOWN\n*****************************************\n"
                      "** RESTORE SLURMCTLD DAEMON TO SERVICE **\n*****************************************\n")
SBATCH_REFUSED = "sbatch: error: Batch job submission failed: Invalid partition name specified\n"


def test_parse_job_reads_the_het_leader_and_slurm_times() -> None:
    info = client.parse_show_job(SCONTROL_PREEMPTED + "JobId=18 JobState=PENDING Restarts=0 EndTime=Unknown PreemptTime=None\n")
    assert info is not None and info.job_id == "17" and info.state == "RUNNING" and info.restarts == 0
    assert info.state is JobState.RUNNING
    assert info.preempt_time is not None and info.end_time - info.preempt_time == 20
    assert client.parse_show_job("") is None
    assert client.parse_show_job("JobId=5 JobState=PENDING EndTime=Unknown PreemptTime=None").end_time is None
    # scancel moves EndTime to the cancel; StartTime + TimeLimit still says when the limit falls
    cancelled = client.parse_show_job("JobId=7 JobState=COMPLETING Restarts=0 TimeLimit=00:20:00 "
                                      "StartTime=2026-12-04T19:52:03 EndTime=2026-12-04T19:52:11 PreemptTime=None")
    assert cancelled is not None and cancelled.limit_end - cancelled.end_time == 20 * 60 - 8
    assert cancelled.time_limit_s == 20 * 60  # the job's own limit: what a segment runs to
    unlimited = client.parse_show_job("JobId=7 JobState=RUNNING TimeLimit=UNLIMITED StartTime=2026-12-04T19:52:03")
    assert unlimited is not None and unlimited.limit_end is None and unlimited.time_limit_s is None
    pending = client.parse_show_job("JobId=7 JobState=PENDING TimeLimit=1-00:00:00 StartTime=Unknown")
    assert pending is not None and pending.limit_end is None and pending.time_limit_s == 86_400
    records = client.parse_show_job_records(SCONTROL_PREEMPTED + "JobId=18 JobState=PENDING HetJobOffset=1\n")
    assert [r["JobId"] for r in records] == ["17", "18"] and records[1]["HetJobOffset"] == "1"


def test_job_state_is_an_enum_with_the_plain_strings_and_an_unknown_that_keeps_the_text() -> None:
    assert JobState("COMPLETED") is JobState.COMPLETED and JobState.COMPLETED == "COMPLETED"
    assert json.dumps({"s": JobState.NODE_FAIL}) == '{"s": "NODE_FAIL"}' and f"{JobState.TIMEOUT}" == "TIMEOUT"
    odd = JobState("SOME_NEW_STATE")
    assert odd.name == "UNKNOWN" and odd.value == "SOME_NEW_STATE" and odd == "SOME_NEW_STATE" and not odd.known
    assert JobState.RUNNING.known and JobState.CANCELLED.terminal and not JobState.PENDING.terminal


def test_slurm_env_free_keeps_only_the_config() -> None:
    env = client.slurm_env_free({"SLURM_JOB_ID": "3", "SLURM_RESTART_COUNT": "1", "SBATCH_PARTITION": "x",
                                 "SLURM_CONF": "/etc/s.conf", "PATH": "/bin"})
    assert env == {"SLURM_CONF": "/etc/s.conf", "PATH": "/bin"}


def test_sbatch_and_squeue_parsers() -> None:
    assert client.parse_sbatch_id("123\n") == "123" and client.parse_sbatch_id("124;beamlab\n") == "124"
    assert client.parse_sbatch_id("Submitted batch job 5\n") is None and client.parse_sbatch_id("") is None
    assert client.sbatch_argv(["--parsable", "x.sh"]) == ["sbatch", "--parsable", "x.sh"]
    assert client.parse_squeue_ids("7+0\n7+1\n9\n\n") == ["7", "9"]  # het components count as their leader
    assert client.gres_counts("gpu:2\ngpu:h200:8(S:0-1),shard:4\n(null)", "gpu") == [2, 8]


def _fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, stdout: str = "", stderr: str = "",
          rc: int = 0) -> None:
    """A stand-in Slurm command on PATH that prints captured output."""
    (tmp_path / f"{name}.out").write_text(stdout)
    (tmp_path / f"{name}.err").write_text(stderr)
    script = tmp_path / name
    script.write_text(f"#!/bin/sh\ncat {tmp_path}/{name}.out\ncat {tmp_path}/{name}.err >&2\nexit {rc}\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")


def test_errors_carry_slurms_words(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake(tmp_path, monkeypatch, "scontrol", stderr=SCONTROL_GONE, rc=1)
    assert client.show_job("999") is None and client.job_state("999") is None
    assert client.show_job_records("999") is None
    _fake(tmp_path, monkeypatch, "scontrol", stdout=SCONTROL_PING_DOWN, rc=1)
    with pytest.raises(SlurmUnavailable) as err:
        client.ping()
    assert err.value.last_line == "Slurmctld(primary) at vm is DOWN" and err.value.transient  # the line naming it
    _fake(tmp_path, monkeypatch, "scontrol", stderr="slurm_load_jobs error: Unable to contact slurm controller\n", rc=1)
    with pytest.raises(SlurmUnavailable, match="Unable to contact"):
        client.show_job("5")
    _fake(tmp_path, monkeypatch, "sbatch", stderr=SBATCH_REFUSED, rc=1)
    with pytest.raises(SlurmError, match="Invalid partition name") as refused:
        client.sbatch(["job.sh"])
    assert refused.value.argv == ["sbatch", "--parsable", "job.sh"]
    _fake(tmp_path, monkeypatch, "sbatch", stdout="Submitted batch job 5\n")
    with pytest.raises(client.NoJobId):
        client.sbatch(["job.sh"])
    _fake(tmp_path, monkeypatch, "scancel", stderr="scancel: error: Kill job error on job id 9: Invalid job id specified\n", rc=1)
    client.cancel(["9"])  # already gone: nothing to do
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(SlurmUnavailable, match="scontrol: not found"):
        client.show_job("5")


# What Slurm 22.05 printed on the local cluster with slurmctld stopped (connect failure), stopped
# with SIGSTOP (socket timeout), and refusing on the merits; the real runs are in
# tests/lifecycle/test_controller_outage.py.
UNREACHABLE_WORDS = [
    "sbatch: error: Batch job submission failed: Unable to contact slurm controller (connect failure)",
    "slurm_load_jobs error: Unable to contact slurm controller (connect failure)",
    "scancel: error: Kill job error on job id 1: Unable to contact slurm controller (connect failure)",
    "slurm_load_partitions: Unable to contact slurm controller (connect failure)",
    "Unexpected message received for job 1",  # scontrol requeue, either way
    "sbatch: error: Batch job submission failed: Socket timed out on send/recv operation",
    "slurm_load_jobs error: Socket timed out on send/recv operation",
    "sbatch: error: Batch job submission failed: Resource temporarily unavailable",
]
REFUSALS = [
    SBATCH_REFUSED,
    "sbatch: error: Batch job submission failed: Job violates accounting/QOS policy (job submit limit, user's size and/or time limits)",
    "sbatch: error: Batch job submission failed: Invalid account or account/partition combination specified",
    "Requested operation is presently disabled for job 41",
    SCONTROL_GONE,
]


def test_unreachable_or_busy_is_told_from_a_refusal_on_the_merits() -> None:
    import subprocess

    for words in UNREACHABLE_WORDS:
        assert client.unreachable(words), words
        err = client.failure(["sbatch"], subprocess.CompletedProcess(["sbatch"], 1, "", words + "\n"))
        assert isinstance(err, SlurmUnavailable) and err.transient and err.detail == words
        # only a refused connection (or a "not now") is sure not to have been carried out
        assert err.may_have_landed == ("connect failure" not in words and "temporarily" not in words), words
    for words in REFUSALS:
        assert not client.unreachable(words), words
        err = client.failure(["sbatch"], subprocess.CompletedProcess(["sbatch"], 1, "", words))
        assert type(err) is SlurmError and err.detail == words.strip()  # Slurm's words, as they were
    killed = client.failure(["sbatch"], subprocess.CompletedProcess(["sbatch"], -15, "", ""))
    assert isinstance(killed, SlurmUnavailable) and killed.transient and killed.may_have_landed
    timed_out = SlurmUnavailable(["sbatch"], "sbatch did not answer within 30 s", timed_out=True)
    assert timed_out.transient and timed_out.may_have_landed
    assert not SlurmUnavailable(["sbatch"], "sbatch: not found").transient  # nothing to wait for


def test_dependents_and_the_controllers_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    squeue = "793201|afterany:793200(unfulfilled)\n793202+0|afterok:9(unfulfilled),afterany:793200(unfulfilled)\n" \
             "793202+1|afterok:9(unfulfilled),afterany:793200(unfulfilled)\n793203|(null)\n793204|afterany:7932000\n"
    assert client.parse_dependents(squeue, "793200") == ["793201", "793202"]
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=x\nSlurmctldHost=ctl1(10.0.0.1)  # primary\nSlurmctldHost=ctl2\n")
    assert client.controller_names({"SLURM_CONF": str(conf)}) == ["ctl1(10.0.0.1)", "ctl2"]
    assert client.controller_names({"SLURM_CONF": str(tmp_path / "none")}) == []
    _fake(tmp_path, monkeypatch, "scontrol", stdout=SCONTROL_PING_DOWN, rc=1)
    err = SlurmUnavailable(["sbatch"], UNREACHABLE_WORDS[0], 1)
    assert client.describe_controller(err) == "Slurmctld(primary) at vm is DOWN"
    monkeypatch.setenv("SLURM_CONF", str(conf))
    _fake(tmp_path, monkeypatch, "scontrol", stderr="scontrol: error: cannot read config\n", rc=1)
    assert client.describe_controller(err).startswith("slurmctld at ctl1(10.0.0.1), ctl2: ")


def test_kill_wait_from_scontrol_show_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = "Configuration data as of 2026-12-05T22:40:01\nJobCompType             = jobcomp/none\n" \
             "KillWait                = 5 sec\nMessageTimeout          = 10 sec\n"  # the local cluster's
    assert client.parse_config_seconds(config, "KillWait") == 5 and client.parse_config_seconds(config, "Nope") is None
    _fake(tmp_path, monkeypatch, "scontrol", stdout=config)
    assert client.kill_wait_s() == 5
    _fake(tmp_path, monkeypatch, "scontrol", stderr="slurm_load_ctl_conf error: Unable to contact slurm controller "
                                                    "(connect failure)\n", rc=1)
    assert client.kill_wait_s() == client.DEFAULT_KILL_WAIT_S == 30


def test_a_requeue_from_inside_the_job_survives_the_sigterm_it_causes(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Slurm answers a job's own requeue with SIGTERM to the job's processes, the asking scontrol
    included; under load that signal lands before scontrol exits (seen in CI: submitit's own
    requeue died of it and the job was recorded as failed). The stand-in does what that race does,
    deterministically: it signals itself before it answers. A real job cannot be made to lose the
    race on demand; the real requeue is in test_sbatch_show_requeue_cancel_on_the_cluster."""
    script = tmp_path / "scontrol"
    script.write_text(f"#!/bin/sh\nkill -TERM $$\necho \"$@\" > {tmp_path}/asked\nexit 0\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    client.requeue("41")
    assert (tmp_path / "asked").read_text().split() == ["requeue", "41"]
    script.write_text("#!/bin/sh\necho 'Requested operation is presently disabled' >&2\nexit 1\n")
    with pytest.raises(SlurmError, match="presently disabled") as refused:
        client.requeue("41")
    assert refused.value.argv == ["scontrol", "requeue", "41"]


# -- against the local cluster ---------------------------------------------------------------------------


def _wait(what: str, cond, timeout: float = 90.0):  # type: ignore[no-untyped-def]
    value = poll_until(cond, timeout, 0.5)
    assert value, f"timed out waiting for {what}"
    return value


def _script(tmp_path: Path) -> Path:
    script = tmp_path / "sleep.sh"
    script.write_text("#!/bin/bash\nsleep 600\n")
    return script


@pytest.mark.slow
@pytest.mark.slurm
def test_sbatch_show_requeue_cancel_on_the_cluster(tmp_path: Path) -> None:
    name = f"beam-client-{os.getpid()}"
    job = client.sbatch([f"--job-name={name}", "--requeue", "--nodes=1", "--time=00:10:00",
                         f"--output={tmp_path}/%j.out", str(_script(tmp_path))])
    assert job.isdigit()
    try:
        assert client.queued_job_ids(name) == [job]
        info = _wait("the job to run", lambda: (i := client.show_job(job)) is not None and i.state is JobState.RUNNING and i)
        assert info.job_id == job and info.restarts == 0 and info.end_time is not None
        client.requeue(job)
        after = _wait("the requeue to count", lambda: (i := client.show_job(job)) is not None and i.restarts == 1 and i)
        assert after.state in (JobState.PENDING, JobState.REQUEUED, JobState.RUNNING, JobState.COMPLETING)
    finally:
        client.cancel([job])
    state = _wait("the cancel to land", lambda: client.job_state(job) in (JobState.CANCELLED, None) and "done")
    assert state == "done"
    assert client.job_state(job) in (JobState.CANCELLED, None)
    with pytest.raises(SlurmError, match="Invalid partition"):
        client.sbatch(["--partition=nosuch", str(_script(tmp_path))])


@pytest.mark.slow
@pytest.mark.slurm
def test_cancel_by_name_and_with_a_signal(tmp_path: Path) -> None:
    name = f"beam-client-name-{os.getpid()}"
    jobs = [client.sbatch([f"--job-name={name}", "--time=00:10:00", f"--output={tmp_path}/%j.out",
                           str(_script(tmp_path))]) for _ in range(2)]
    try:
        assert sorted(client.queued_job_ids(name)) == sorted(jobs)
        _wait("the first job to run", lambda: client.job_state(jobs[0]) is JobState.RUNNING)
        client.cancel([jobs[0]], signal="TERM")  # without -b only the job's steps get it (it has none)
        assert client.job_state(jobs[0]) is not None
    finally:
        client.cancel(name=name)
    _wait("every job of the name to go", lambda: client.queued_job_ids(name) == [] or
          all(client.job_state(j) in (JobState.CANCELLED, JobState.FAILED, None) for j in jobs))


@pytest.mark.slow
@pytest.mark.slurm
def test_controller_partitions_and_hostnames(slurm_cluster) -> None:  # type: ignore[no-untyped-def]
    assert "UP" in client.ping()
    assert set(slurm_cluster.partitions) <= set(client.partition_names())
    debug = client.show_partition("debug")
    assert debug is not None and debug["State"] == "UP"
    assert client.show_partition("nosuch") is None
    assert max(client.gres_counts(client.partition_gres("debug"), "gpu")) == slurm_cluster.spec.gpus_per_node
    assert isinstance(client.partition_features("debug"), set)
    assert client.expand_hostnames("n[1-3],n7") == ["n1", "n2", "n3", "n7"]
    assert client.expand_hostnames("") == []
    spec = slurm_cluster.spec  # TmpDisk as the cluster's slurm.conf declares it
    small = set(spec.node_names[-spec.small_disk_nodes:])
    want = {n: spec.small_tmp_disk_mb if n in small else spec.tmp_disk_mb for n in spec.node_names}
    assert client.tmp_disk("debug") == client.PartitionTmpDisk("debug", want)
    assert client.tmp_disk(None) == client.PartitionTmpDisk("debug", want)  # the default partition, by name
    assert client.tmp_disk("nosuch") is None
    with pytest.raises(SlurmUnavailable, match="slurmdbd"):  # the local cluster keeps no accounts
        client.has_association("root", "nobody")


# `sinfo --noheader --Node --format=%N|%d|%P` as Slurm 22.05 prints it: a node once per partition,
# "*" on the default. `gpu`'s nodes never had TmpDisk set in slurm.conf, as on many sites: 0.
SINFO_TMP_DISK = """n1|3000000|debug*
n1|3000000|urgent
n11|100000|debug*
n11|100000|urgent
g1|0|gpu
g2|0|gpu
"""


def test_parse_tmp_disk_reads_sinfos_node_lines() -> None:
    assert client.parse_tmp_disk(SINFO_TMP_DISK, "debug") == client.PartitionTmpDisk(
        "debug", {"n1": 3_000_000, "n11": 100_000})
    assert client.parse_tmp_disk(SINFO_TMP_DISK, None) == client.parse_tmp_disk(SINFO_TMP_DISK, "debug")
    assert client.parse_tmp_disk(SINFO_TMP_DISK, "gpu") == client.PartitionTmpDisk("gpu", {"g1": 0, "g2": 0})
    assert client.parse_tmp_disk(SINFO_TMP_DISK, "nosuch") is None
    assert client.parse_tmp_disk("", None) is None


def test_srun_each_node_argv() -> None:
    fresh = client.NodeRequest(nodes=2, partition="debug", account="a", gres="gpu:8", immediate_s=60)
    assert client.srun_each_node_argv(["python3", "-V"], fresh, job_name="d") == [
        "srun", "--ntasks-per-node=1", "--job-name=d", "--kill-on-bad-exit=0", "--nodes=2", "--time=00:05:00",
        "--immediate=60", "--partition=debug", "--account=a", "--gres=gpu:8", "python3", "-V"]
    inside = client.NodeRequest(nodes=3, inside=True, partition="ignored")
    assert client.srun_each_node_argv(["x"], inside, job_name="d")[-3:] == ["--nodes=3", "--overlap", "x"]


# `scontrol --oneliner show node n[1-2],n3` on a private local cluster (trimmed): n1 set FAIL, n2 DOWN
# and n3 DRAIN with scontrol; Reason, free text with who set it and when, is the line's last field.
SCONTROL_NODES = (
    "NodeName=n1 Arch=x86_64 CoresPerSocket=1  CPUAlloc=0 Gres=gpu:8 NodeAddr=127.0.0.1 NodeHostName=vm "
    "OS=Linux 6.18.44-fc-v1272 #1 SMP PREEMPT_DYNAMIC @0  RealMemory=4000 State=IDLE+FAIL ThreadsPerCore=1 "
    "Partitions=debug,urgent  ExtSensorsTemp=n/s Reason=health check: gpu 3 lost [root@2026-12-07T11:51:53]\n"
    "NodeName=n2 Arch=x86_64 CoresPerSocket=1  CPUAlloc=0 State=DOWN ThreadsPerCore=1 ExtSensorsTemp=n/s "
    "Reason=beam test [root@2026-12-07T11:51:53]\n"
    "NodeName=n3 Arch=x86_64 CoresPerSocket=1  CPUAlloc=0 State=MIXED ThreadsPerCore=1 ExtSensorsTemp=n/s\n"
)


def test_show_nodes_reads_each_nodes_state_and_its_reason(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert client.parse_show_nodes(SCONTROL_NODES) == [
        client.NodeInfo("n1", "IDLE+FAIL", "health check: gpu 3 lost [root@2026-12-07T11:51:53]"),
        client.NodeInfo("n2", "DOWN", "beam test [root@2026-12-07T11:51:53]"),
        client.NodeInfo("n3", "MIXED", "")]
    assert client.parse_show_nodes("Reason=x State=DOWN Comment=y\n") == []  # no NodeName: not a node line
    assert client.parse_show_nodes("NodeName=n4 State=DOWN Reason=gone [slurm@t] Comment=later\n") == [
        client.NodeInfo("n4", "DOWN", "gone [slurm@t]")]  # a field after Reason ends it
    script = tmp_path / "scontrol"  # the stand-in records what it was asked, answers with the lines above
    (tmp_path / "out").write_text(SCONTROL_NODES)
    script.write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path}/asked\ncat {tmp_path}/out\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert [n.name for n in client.show_nodes(["n[1-2]", "", "n3"])] == ["n1", "n2", "n3"]
    assert (tmp_path / "asked").read_text().split() == ["--oneliner", "show", "node", "n[1-2],n3"]
    assert client.show_nodes([]) == [] and client.show_nodes([""]) == []  # nothing asked of Slurm
    _fake(tmp_path, monkeypatch, "scontrol", stdout="Node n9 not found\n", rc=1)
    with pytest.raises(SlurmError, match="n9 not found"):
        client.show_nodes(["n9"])
