"""beam-hpc's submitit plugin (beam_hpc.slurm.submitit_het) against the real local Slurm cluster.

The slurm-marked tests submit real heterogeneous jobs through submitit to the cluster that
tests/support/cluster/slurm_cluster.py starts (no slurmdbd, so every state comes from the squeue watcher). The
unmarked tests check the script writer and state logic without a cluster.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path

import cloudpickle
import pytest
import submitit
from polling import poll_until
from submitit.core import utils

from beam_hpc.slurm.submitit_het import (
    CLUSTER_NAME,
    VANISHED,
    HetSlurmExecutor,
    HetSlurmInfoWatcher,
    HetSlurmJob,
    aggregate_state,
    make_het_sbatch_text,
    validate_het_components,
)

# Task functions below are shipped by value: the job's Python cannot import this test module.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

def report_task(marker: str) -> dict:
    """Runs in every task: says where it ran, as the het environment sees it."""
    env = submitit.JobEnvironment()
    print(f"{marker} rank={env.global_rank} host={socket.gethostname()}", flush=True)
    return {
        "env": type(env).__name__,
        "cluster": env.cluster,
        "rank": env.global_rank,
        "group": env.het_group,
        "group_rank": env.het_group_rank,
        "group_node": env.het_group_node,
        "host": socket.gethostname(),
        "slurm_node": os.environ["SLURMD_NODENAME"],
        "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }


def fail_in_task(message: str) -> None:
    raise ValueError(message)


def sleep_in_task(seconds: float) -> tuple[float, float]:
    start = time.time()
    time.sleep(seconds)
    return start, time.time()


class WaitForRequeue(submitit.helpers.Checkpointable):
    """First run: say it started, then wait to be interrupted. After a requeue: return
    (SLURM_RESTART_COUNT, het group). submitit's checkpoint() resubmits the same call."""

    def __call__(self, started_flag: str) -> tuple[int, int]:
        env = submitit.JobEnvironment()
        restarts = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
        if restarts == 0:
            Path(f"{started_flag}.{env.global_rank}").touch()
            time.sleep(120)
        return restarts, env.het_group


def one_plus_one_node_executor(folder: Path, **parameters) -> HetSlurmExecutor:
    """A hetjob of two 1-node components: the smallest one that still has a second group."""
    executor = HetSlurmExecutor(folder=folder)
    executor.update_parameters(nodes=1, time=3, het_components=[{"nodes": 1}], **parameters)
    return executor


def wait_for_state(job: HetSlurmJob, wanted: set[str], timeout: float = 60) -> str:
    if job.state in wanted:
        return job.state
    seen: list[str] = []

    def state() -> str | None:
        seen.append(job.watcher.get_state(job.job_id, mode="force"))
        return seen[-1] if seen[-1] in wanted else None

    return poll_until(state, timeout, 0.5) or seen[-1]


# -- a real 2-group hetjob (trainer: 2 nodes, rollout: 1 node; 1 GPU per node) ----------------
@pytest.fixture(scope="module")
def het_run(slurm_cluster, tmp_path_factory):
    """One hetjob shared by the tests that inspect it. The folder has a space in it on purpose:
    each task's self-redirection must quote it."""
    folder = tmp_path_factory.mktemp("het run") / "%j"
    executor = HetSlurmExecutor(folder=folder)
    executor.update_parameters(nodes=2, gpus_per_node=1, time=15, job_name="beam-het-test",
                               het_components=[{"nodes": 1, "gpus_per_node": 1}])
    t0 = time.monotonic()
    job = executor.submit(report_task, "marker-7f3a")
    results = job.results()
    return job, results, time.monotonic() - t0


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_hetjob_tasks_land_on_their_groups_nodes(het_run):
    job, results, seconds = het_run
    assert job.num_tasks == 3
    assert [r["rank"] for r in results] == [0, 1, 2]
    assert {r["env"] for r in results} == {"HetSlurmJobEnvironment"}
    assert [r["group"] for r in results] == [0, 0, 1]
    assert [r["group_rank"] for r in results] == [0, 1, 0]
    assert [r["group_node"] for r in results] == [0, 1, 0]
    trainer_hosts = {r["host"] for r in results[:2]}
    assert len(trainer_hosts) == 2, "trainer group must span 2 distinct nodes"
    assert results[2]["host"] not in trainer_hosts, "rollout group must be on a third node"
    assert all(r["host"] == r["slurm_node"] for r in results)  # per-node UTS hostname
    assert [r["cuda"] for r in results] == ["0", "0", "0"]  # 1 GPU per node in both groups
    assert seconds < 60


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_stdout_of_second_group_task_lands_in_its_own_file(het_run):
    job, results, _ = het_run
    log = job.paths.folder / f"{job.job_id}_2_log.out"
    line = f"marker-7f3a rank=2 host={results[2]['host']}"
    assert line in log.read_text()
    assert job.task(2).stdout() == log.read_text()
    for other in (0, 1):
        assert "rank=2" not in (job.paths.folder / f"{job.job_id}_{other}_log.out").read_text()
    assert not list(job.paths.folder.parent.glob(f"{int(job.job_id) + 1}*")), \
        "nothing may be written under the second component's own job id"


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_without_components_it_runs_an_ordinary_job(slurm_cluster, tmp_path):
    """A colocated run is one component: same executor, no hetjob, group 0 everywhere."""
    executor = HetSlurmExecutor(folder=tmp_path)
    executor.update_parameters(nodes=2, ntasks_per_node=1, time=3)
    assert "hetjob" not in executor._make_submission_file_text("python", "uid")
    results = executor.submit(report_task, "plain").results()
    assert [(r["group"], r["group_node"]) for r in results] == [(0, 0), (0, 1)]
    assert len({r["host"] for r in results}) == 2


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_auto_executor_finds_plugin_and_passes_job_level_flags(slurm_cluster, tmp_path):
    executor = submitit.AutoExecutor(folder=tmp_path / "%j", cluster=CLUSTER_NAME)
    assert isinstance(executor._executor, HetSlurmExecutor)
    executor.update_parameters(
        timeout_min=3, name="beam-auto", nodes=1,
        **{f"{CLUSTER_NAME}_het_components": [{"nodes": 1}],
           f"{CLUSTER_NAME}_signal_delay_s": 45,
           f"{CLUSTER_NAME}_dependency": "singleton",
           f"{CLUSTER_NAME}_additional_parameters": {"requeue": True}})
    job = executor.submit(report_task, "auto")
    results = job.results()
    assert [(r["cluster"], r["group"]) for r in results] == [(CLUSTER_NAME, 0), (CLUSTER_NAME, 1)]
    script = job.paths.submission_file.read_text()
    for flag in ("--time=3", "--job-name=beam-auto", "--signal=USR2@45",
                 "--dependency=singleton", "--requeue"):
        assert script.count(flag) == 1, flag
    # Slurm itself applied the job-level flags to both components (MinJobAge keeps them 30 s).
    shown = slurm_cluster.run("scontrol", "--oneliner", "show", "job", job.job_id).stdout
    components = shown.strip().splitlines()
    assert len(components) == 2
    for record in components:
        assert "JobName=beam-auto" in record and "Requeue=1" in record
        assert "TimeLimit=00:03:00" in record


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_failing_function_gives_failed_state_and_exception(slurm_cluster, tmp_path):
    executor = one_plus_one_node_executor(tmp_path)
    job = executor.submit(fail_in_task, "boom-31c")
    with pytest.raises(utils.FailedJobError, match="boom-31c"):
        job.results()
    assert wait_for_state(job, {"FAILED"}) == "FAILED"
    assert job.done()


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_scancel_gives_cancelled_and_done(slurm_cluster, tmp_path):
    executor = one_plus_one_node_executor(tmp_path)
    job = executor.submit(sleep_in_task, 120)
    assert wait_for_state(job, {"RUNNING"}) == "RUNNING"
    job.cancel()
    deadline = time.monotonic() + 30
    while not job.done(force_check=True) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert job.done()
    assert job.state == "CANCELLED"
    assert slurm_cluster.wait_for_job(job.job_id, timeout=30) in {"CANCELLED", "PURGED"}


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_singleton_hetjobs_run_one_after_the_other(slurm_cluster, tmp_path):
    """`--dependency=singleton` (how a run chains its segments) must neither deadlock a hetjob
    on its own second component nor let two segments of one run overlap."""
    executor = one_plus_one_node_executor(tmp_path, job_name=f"beam-singleton-{os.getpid()}",
                                          dependency="singleton")
    first = executor.submit(sleep_in_task, 3)
    second = executor.submit(sleep_in_task, 0)
    first_spans, second_spans = first.results(), second.results()
    assert min(start for start, _ in second_spans) >= max(end for _, end in first_spans)


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_usr2_checkpoints_and_requeues_the_whole_hetjob(slurm_cluster, tmp_path):
    """submitit's preemption path on a hetjob: USR2 reaches the tasks, rank 0 checkpoints and
    requeues the leader id, both groups run again; the squeue state never says done between."""
    executor = one_plus_one_node_executor(tmp_path / "%j", signal_delay_s=30,
                                          additional_parameters={"requeue": True})
    flag = tmp_path / "started"
    job = executor.submit(WaitForRequeue(), str(flag))
    deadline = time.monotonic() + 60
    while not all(Path(f"{flag}.{rank}").exists() for rank in (0, 1)):
        assert time.monotonic() < deadline and not job.done(), job.stderr()
        time.sleep(0.5)
    job._interrupt()  # what a preemption sends: SIGTERM (ignored by submitit), then USR2
    assert job.results() == [(1, 0), (1, 1)]


@pytest.mark.slurm
@pytest.mark.slow  # slurm implies slow: it joins (and may start) the local cluster; the fast tier needs no Slurm
def test_job_that_left_the_queue_is_done(monkeypatch, tmp_path):
    """A job id squeue no longer lists: done() from the result pickle, VANISHED without one."""
    monkeypatch.setattr(HetSlurmJob.watcher, "vanish_grace_s", 0.0)
    lost = HetSlurmJob(folder=tmp_path, job_id="987654")
    assert lost.done(force_check=True)
    assert lost.state == VANISHED
    failed = HetSlurmJob(folder=tmp_path, job_id="987655")
    failed.paths.folder.mkdir(parents=True, exist_ok=True)
    utils.cloudpickle_dump(("error", "Traceback: boom"), failed.paths.result_pickle)
    failed.watcher.update()
    assert failed.state == "FAILED"


# -- without a cluster ---------------------------------------------------------------------------
def test_script_has_job_flags_once_then_one_block_per_component(tmp_path):
    text = make_het_sbatch_text(
        "python -u -m submitit.core._submit /f", tmp_path / "%j",
        {"nodes": 2, "gpus_per_node": 8, "time": 60, "job_name": "beam", "signal_delay_s": 120,
         "dependency": "singleton", "additional_parameters": {"requeue": True},
         "het_components": [{"nodes": 1, "gpus_per_node": 8, "partition": "gen",
                             "additional_parameters": {"tmp": "2T"}},
                            {"nodes": 3, "constraint": "h100"}]})
    lines = text.splitlines()
    flags = [line for line in lines if line.startswith("#SBATCH")]
    het = [i for i, line in enumerate(flags) if line == "#SBATCH hetjob"]
    assert len(het) == 2
    job_level = flags[:het[0]]
    for flag in ("--time=60", "--job-name=beam", "--signal=USR2@120", "--dependency=singleton",
                 "--requeue", "--output=", "--nodes=2", "--gpus-per-node=8", "--ntasks-per-node=1"):
        assert sum(flag in line for line in job_level) == 1, flag
    for flag in ("--time", "--job-name", "--signal", "--requeue", "--output"):  # job-level only
        assert not any(flag in line for line in flags[het[0]:]), flag
    # a propagated dependency is cleared in later components (see test_singleton_hetjobs_...)
    assert flags[het[0] + 1:het[1]] == ["#SBATCH --nodes=1", "#SBATCH --ntasks-per-node=1",
                                        "#SBATCH --gpus-per-node=8", "#SBATCH --partition=gen",
                                        "#SBATCH --tmp=2T", "#SBATCH --dependency="]
    assert flags[het[1] + 1:] == ["#SBATCH --nodes=3", "#SBATCH --ntasks-per-node=1",
                                  "#SBATCH --constraint=h100", "#SBATCH --dependency="]
    assert "export SUBMITIT_EXECUTOR=beamhet" in lines
    srun = next(line for line in lines if line.startswith("srun "))
    assert "--het-group=0,1,2" in srun and "--output" not in srun
    assert '"${SLURM_JOB_ID}"_"${SLURM_PROCID}"_log.out' in srun


@pytest.mark.parametrize("components, words", [
    ({"nodes": 1}, ["list of dicts"]),
    ([{"nodes": 0}], ["het_components[0].nodes", ">= 1"]),
    ([{"nodes": 1}, {"gpus": 2}], ["het_components[1]", "'gpus'", "additional_parameters"]),
    ([{"nodes": 1, "additional_parameters": ["--exclusive"]}], ["additional_parameters", "dict"]),
])
def test_bad_components_are_refused_with_the_field_named(components, words):
    with pytest.raises(ValueError) as err:
        validate_het_components(components)
    for word in words:
        assert word in str(err.value)


def test_component_states_aggregate_to_the_most_significant():
    assert aggregate_state(["COMPLETING", "CANCELLED"]) == "CANCELLED"
    assert aggregate_state(["COMPLETED", "RUNNING"]) == "RUNNING"
    assert aggregate_state(["COMPLETED", "COMPLETED"]) == "COMPLETED"
    watcher = HetSlurmInfoWatcher()
    watcher.register_job("7")
    info = watcher.read_info("7+0|COMPLETED|n[1-2]\n7+1|FAILED|n3\n8|RUNNING|n4\n")
    assert info["7"]["State"] == "FAILED" and info["7"]["NodeList"] == "n[1-2],n3"
    assert info["8"]["State"] == "RUNNING"
