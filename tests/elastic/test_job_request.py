"""``beam-hpc rollout add``'s request and script, its refusals, and the extra job's own bookkeeping
(why a node left, what the batch side records, the quarantine) without Slurm.

Real recipe, site, plan, renderer, quarantine file and ledger; what needs the Slurm cluster (the
partition's shape, a hand sbatch of the script, the job itself) is in test_job_slurm.py.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
from job_plans import make_test_plan

from beam_hpc.cli.app import main
from beam_hpc.elastic import extra_node, registry
from beam_hpc.lifecycle import quarantine
from beam_hpc.run import ledger
from beam_hpc.slurm.client import JobInfo, JobState
from beam_hpc.submission import rollout_job

SITE_LINES = {"env": {"NCCL_DEBUG": "WARN"}, "setup": ["source /etc/profile.d/modules.sh"],
              "module_loads": ["cuda/12.4"], "partitions": {"trainer": "debug", "rollout": "spot"}}


def _plan(tmp_path: Path, **site):  # type: ignore[no-untyped-def]
    return make_test_plan(tmp_path / "run", trainer_nodes=1, rollout_nodes=2, gpus=4, site={**SITE_LINES, **site})


def test_the_script_has_the_rollout_groups_shape_requeue_lead_site_lines_and_excludes(tmp_path: Path) -> None:
    qfile = tmp_path / "bad-nodes.json"
    plan = _plan(tmp_path, quarantine=str(qfile))
    quarantine.record(qfile, [{"node": "n9", "why": "test"}], run="other", run_dir="/x", segment="1-0", days=1)
    ledger.append(plan.paths.ledger, {"event": "end", "segment": "3-0", "time": 1.0,
                                      "failed_nodes": [{"node": "n4", "why": "ray died"}]})
    from beam_hpc.cli.rollout import _excluded

    req, problems = rollout_job.make_request(plan, plan.site, nodes=3, partition=None, time="01:00:00",
                                           exclude=_excluded(plan, plan.site))
    assert problems == [] and req is not None
    text = rollout_job.render(req)
    sbatch = [line.removeprefix("#SBATCH ") for line in text.splitlines() if line.startswith("#SBATCH ")]
    assert "hetjob" not in sbatch  # one component
    assert {"--nodes=3", "--ntasks-per-node=1", "--partition=spot", "--gres=gpu:4", "--requeue", "--time=01:00:00",
            f"--signal=USR1@{req.lead_s}", "--exclude=n4,n9", f"--cpus-per-task={req.group.cpus_per_node}"} <= set(sbatch)
    assert req.lead_s <= plan.lead_s
    lines = text.splitlines()
    order = [lines.index(x) for x in ("export NCCL_DEBUG=WARN", "source /etc/profile.d/modules.sh",
                                      "module load cuda/12.4")]
    assert order == sorted(order)
    assert lines[-1] == f"exec {plan.site.python} -m beam_hpc.elastic.extra_node --run-dir {plan.output_dir}"
    assert lines[-1].startswith("exec") and order[-1] < len(lines) - 1


def test_dry_run_prints_the_script_and_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    plan = _plan(tmp_path)
    before = sorted(p.name for p in Path(plan.output_dir).rglob("*"))
    # the partition's shape is asked of Slurm: here no Slurm command is on PATH, so whichever cluster
    # this machine reaches is not asked and the question is left to sbatch (what Slurm answers is
    # tested on the local cluster, in test_job_slurm.py)
    (tmp_path / "no-slurm").mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "no-slurm"))
    assert main(["rollout", "add", plan.output_dir, "--nodes", "1", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "#SBATCH --requeue" in out and "dry run: nothing written, nothing submitted" in out
    assert sorted(p.name for p in Path(plan.output_dir).rglob("*")) == before
    assert not registry.elastic_dir(plan.output_dir).exists()


@pytest.mark.parametrize(("argv", "expect"), [
    (["--nodes", "0"], "--nodes: 0 is not a node count; give 1 or more"),
    (["--nodes", "1", "--time", "soon"], "--time: 'soon' is not a Slurm time; write HH:MM:SS or D-HH:MM:SS"),
])
def test_bad_input_exits_2_with_one_line_per_problem(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                      argv: list[str], expect: str) -> None:
    plan = _plan(tmp_path)
    assert main(["rollout", "add", plan.output_dir, *argv]) == 2
    err = capsys.readouterr().err
    assert expect in err and "Traceback" not in err
    assert not registry.elastic_dir(plan.output_dir).exists()


def test_two_problems_are_two_lines(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = _plan(tmp_path)
    assert main(["rollout", "add", plan.output_dir, "--nodes", "-1", "--time", "x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and err[0].startswith("beam-hpc: error: --nodes: -1") and err[1].startswith("--time: 'x'")


def test_a_directory_that_is_not_a_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["rollout", "add", str(tmp_path), "--nodes", "1"]) == 2
    assert "is not a run directory (no plan.json)" in capsys.readouterr().err
    assert main(["rollout", "list", str(tmp_path / "nope")]) == 2
    assert "no such run directory" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_a_model_the_extra_nodes_cannot_reach(tmp_path: Path) -> None:
    plan = make_test_plan(tmp_path / "run", trainer_nodes=1, rollout_nodes=1, gpus=0,
                          site={"shared_paths": [str(tmp_path / "shared")]},
                          overrides=[f"model.path={tmp_path / 'home' / 'model'}"])
    req, _ = rollout_job.make_request(plan, plan.site, nodes=1, partition=None, time=None)
    assert req is not None
    (problem,) = rollout_job.model_problems(req)
    assert problem.startswith(f"model.path: {plan.recipe.model.path!r} is not under the site's shared_paths")
    on_shared = make_test_plan(tmp_path / "run2", trainer_nodes=1, rollout_nodes=1, gpus=0,
                               site={"shared_paths": [str(tmp_path)]},
                               overrides=[f"model.path={tmp_path / 'home' / 'model'}"])
    req2, _ = rollout_job.make_request(on_shared, on_shared.site, nodes=1, partition=None, time=None)
    assert req2 is not None and rollout_job.model_problems(req2) == []  # the tiny model is built by the backend


def _info(*, preempt: float | None = None, submit: float = 100.0, limit: float | None = 10_000.0) -> JobInfo:
    return JobInfo(job_id="5", state=JobState.RUNNING, restarts=0, end_time=None, preempt_time=preempt,
                   submit_time=submit, limit_end=limit)


def test_why_a_node_leaves() -> None:
    assert extra_node.classify(signal.SIGUSR2, _info()) == "removed"  # rollout remove
    assert extra_node.classify(signal.SIGUSR1, _info(), now=9_900) == "walltime"  # the lead
    assert extra_node.classify(signal.SIGUSR1, _info(preempt=200.0)) == "preempted"  # the grace time's signal
    assert extra_node.classify(signal.SIGUSR1, _info(preempt=50.0)) == "walltime"  # an earlier incarnation's
    assert extra_node.classify(signal.SIGTERM, _info(preempt=200.0)) == "preempted"
    assert extra_node.classify(signal.SIGTERM, _info(), now=9_990) == "walltime"  # the time limit
    assert extra_node.classify(signal.SIGTERM, _info(), now=500) == "removed"  # a plain scancel
    assert extra_node.classify(signal.SIGTERM, None) == "removed"


def test_the_batch_side_quarantines_a_node_that_died_and_records_the_job_left(tmp_path: Path) -> None:
    qfile = tmp_path / "bad-nodes.json"
    plan = _plan(tmp_path, quarantine=str(qfile))
    run = plan.output_dir
    for node in ("n13", "n14"):
        registry.record(run, "77", {"event": "started", "node": node, "restart": 1})
    registry.record(run, "77", {"event": "left", "node": "n13", "restart": 1, "reason": "preempted"})
    reason = extra_node.finish(plan, "77", 1, srun_rc=9)  # n14 never said it left
    assert reason == "failed"
    assert [e.node for e in quarantine.quarantined(qfile)] == ["n14"]
    (entry,) = quarantine.quarantined(qfile)
    assert (entry.run, entry.segment) == (plan.run_id, "77-1") and "srun exit 9" in entry.why
    events = registry.read_events(registry.events_path(run, "77"))
    assert events[-1]["event"] == "left" and "node" not in events[-1] and events[-1]["failed_nodes"] == ["n14"]
    assert {"event": "left", "node": "n14", "reason": "failed"}.items() <= events[-2].items()


def test_the_batch_side_takes_the_nodes_reason_when_all_left(tmp_path: Path) -> None:
    qfile = tmp_path / "bad-nodes.json"
    plan = _plan(tmp_path, quarantine=str(qfile))
    for node in ("n13", "n14"):
        registry.record(plan.output_dir, "78", {"event": "started", "node": node, "restart": 0})
        registry.record(plan.output_dir, "78", {"event": "left", "node": node, "restart": 0, "reason": "removed"})
    assert extra_node.finish(plan, "78", 0, srun_rc=0) == "removed"
    assert not qfile.exists()
    job = registry.extra_job(plan.output_dir, "78")
    assert (job.state, job.reason) == ("left", "removed")
    assert json.loads(registry.events_path(plan.output_dir, "78").read_text().splitlines()[-1])["failed_nodes"] == []


def test_a_node_sees_the_run_over_once_its_chain_stopped_and_slurm_holds_no_job_of_it(tmp_path: Path) -> None:
    """What the Slurm test (an extra job that outlives its run) meets once, case by case: the ledger
    says whether the chain stopped; Slurm, asked at most every QUEUE_ASK_S, whether a job of the run waits."""
    from beam_hpc.slurm.client import SlurmError

    plan = _plan(tmp_path)
    now = [0.0]
    answers: list[list[str] | Exception] = []
    asked: list[str] = []

    def queued(name: str) -> list[str]:
        asked.append(name)
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    watch = extra_node.RunEndWatch(plan, queued=queued, clock=lambda: now[0])
    ledger_file = plan.paths.ledger
    assert watch.over() is None  # no segment yet
    ledger.append(ledger_file, ledger.start_record(job_id="40", restart=0, host="n1", rollouts_at_start=0,
                                                   num_rollout=8, resume=False, walltime_s=600, lead_s=60))
    ledger.append(ledger_file, ledger.end_record(job_id="40", restart=0, rollouts_at_end=4, reason="walltime",
                                                 detail="lead", next_action="resubmit", next_job_id="41",
                                                 rollout_s=1.0, save_s=1.0))
    assert watch.over() is None and asked == []  # the chain goes on: Slurm is not asked
    ledger.append(ledger_file, ledger.start_record(job_id="41", restart=0, host="n1", rollouts_at_start=4,
                                                   num_rollout=8, resume=True, walltime_s=600, lead_s=60))
    ledger.append(ledger_file, ledger.end_record(job_id="41", restart=0, rollouts_at_end=8, reason="completed",
                                                 detail="8 of 8 rollouts done", next_action="none",
                                                 next_job_id=None, rollout_s=1.0, save_s=1.0))
    answers.append(["41", "57"])  # job 41 is still finishing; 57 is a resubmission by hand, not started yet
    assert watch.over() is None and asked == [plan.job_name]
    assert watch.over() is None and len(asked) == 1  # not asked again within QUEUE_ASK_S
    now[0] += extra_node.QUEUE_ASK_S
    answers.append(SlurmError(["squeue"], "slurm_load_jobs error: Unable to contact slurm controller"))
    assert watch.over() is None and len(asked) == 2  # Slurm cannot say: not over
    now[0] += extra_node.QUEUE_ASK_S
    answers.append(["41"])  # only the job that wrote the end line
    why = watch.over()
    assert why is not None and "segment 41-0, completed: 8 of 8 rollouts done" in why and plan.job_name in why

    program = extra_node.NodeProgram(plan, job_id="90", restart=0, node="n13", index=0)
    answers.append([])
    now[0] += extra_node.QUEUE_ASK_S
    program.leave_when_over(watch)  # returns once it stopped the node
    assert program.stopper.event.is_set() and program.reason == extra_node.RUN_ENDED
    program.on_event({"event": "left", "units_served": 0, "given_back": []})
    (left,) = registry.read_events(registry.events_path(plan.output_dir, "90"))
    assert (left["event"], left["reason"], left["node"]) == ("left", "run-ended", "n13")
    registry.record(plan.output_dir, "90", {"event": "left", "node": "n14", "restart": 0, "reason": "run-ended"})
    assert extra_node.finish(plan, "90", 0, srun_rc=0) == "run-ended"  # the job's reason: its nodes'
    assert registry.extra_job(plan.output_dir, "90").reason == "run-ended"
