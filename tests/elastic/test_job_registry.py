"""The run's record of its extra rollout jobs (beam_hpc.elastic.registry), and how status and plot show it.

Real files only: the events are appended as the job's processes append them (one line per write),
then read back the way ``status``, ``plot`` and ``rollout list`` read them on a login node.
"""

from __future__ import annotations

import json
from pathlib import Path

from job_plans import make_test_plan

from beam_hpc.elastic import registry
from beam_hpc.observe import status, status_table


def _job(run: Path, job: str = "41", *, nodes: int = 2, gpus: int = 4, t0: float = 1000.0) -> None:
    """A job that served rollouts 5-7 on two nodes (versions 5-7), then was preempted."""
    rec = lambda e: registry.record(run, job, e)  # noqa: E731
    rec({"event": "submitted", "nodes": nodes, "partition": "spot", "gpus_per_node": gpus, "time": t0})
    rec({"event": "start", "restart": 0, "nodes": ["n13", "n14"], "time": t0 + 10})
    for node in ("n13", "n14"):
        rec({"event": "started", "node": node, "restart": 0, "time": t0 + 11})
        rec({"event": "joined", "node": node, "restart": 0, "time": t0 + 20})
    for r in (5, 6, 7):
        for node in ("n13", "n14"):
            rec({"event": "unit", "node": node, "restart": 0, "rollout": r, "version": r, "samples": 16,
                 "time": t0 + 20 + r})
    for node in ("n13", "n14"):
        rec({"event": "left", "node": node, "restart": 0, "reason": registry.LeftReason.PREEMPTED, "time": t0 + 110})
    rec({"event": "left", "reason": registry.LeftReason.PREEMPTED, "restart": 0, "time": t0 + 112})


def test_events_read_back_as_the_job(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _job(run)
    (jobs,) = registry.extra_jobs(run)
    assert (jobs.job_id, jobs.nodes, jobs.partition, jobs.gpus_per_node) == ("41", 2, "spot", 4)
    assert (jobs.state, jobs.reason) == ("left", "preempted") and jobs.reason is registry.LeftReason.PREEMPTED
    assert '"reason": "preempted"' in registry.events_path(run, "41").read_text()  # the enum is written as its text
    assert jobs.rollouts == [5, 6, 7] and jobs.versions == [5, 6, 7]
    assert (jobs.units_served, jobs.samples) == (6, 96)
    assert jobs.node_seconds() == 2 * 99.0  # each node: started +11 .. left +110
    assert jobs.gpu_hours() == 2 * 99.0 * 4 / 3600
    registry.record(run, "41", {"event": "unit", "node": "n13", "rollout": 5, "purpose": "eval", "version": 5,
                                "samples": 8, "time": 1090.0})
    again = registry.extra_job(run, "41")
    assert (again.units_served, again.samples, again.rollouts) == (7, 96, [5, 6, 7])  # eval: a unit, not rollout samples
    assert registry.capacity_changes([jobs]) == [(5, "joined", "41"), (7, "left", "41")]


def test_a_requeued_job_runs_again_and_a_half_line_is_not_read(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _job(run)
    registry.record(run, "41", {"event": "start", "restart": 1, "nodes": ["n15"], "time": 2000.0})
    registry.record(run, "41", {"event": "started", "node": "n15", "restart": 1, "time": 2001.0})
    with open(registry.events_path(run, "41"), "a") as fh:
        fh.write('{"event": "unit", "node": "n15", "rollout": 9')  # a writer's line not finished yet
    job = registry.extra_job(run, "41")
    assert (job.state, job.reason) == ("running", None)
    assert job.rollouts == [5, 6, 7]
    assert job.node_seconds(now=2011.0) == 2 * 99.0 + 10.0


def test_a_pending_job_and_no_jobs(tmp_path: Path) -> None:
    run = tmp_path / "run"
    assert registry.extra_jobs(run) == []
    registry.record(run, "7", {"event": "submitted", "nodes": 1, "partition": None, "gpus_per_node": 0})
    (job,) = registry.extra_jobs(run)
    assert (job.state, job.reason, job.units_served, job.node_seconds()) == ("pending", None, 0, 0.0)
    line = registry.events_path(run, "7").read_text().splitlines()[0]
    assert set(json.loads(line)) == {"event", "nodes", "partition", "gpus_per_node", "time"}


def test_status_shows_each_extra_job_the_share_and_their_gpu_hours(tmp_path: Path) -> None:
    plan = make_test_plan(tmp_path / "run")
    run = Path(plan.output_dir)
    _job(run)
    s = status.gather(run, slurm=False, now=5000.0)
    x = s["extra_rollout"]
    (row,) = x["jobs"]
    assert (row["job_id"], row["state"], row["reason"], row["rollouts"], row["versions"]) == (
        "41", "left", "preempted", [5, 6, 7], [5, 6, 7])
    assert x["samples"] == 96 and x["gpu_hours"] == 2 * 99.0 * 4 / 3600
    assert x["share"] is None  # the run generated nothing yet: no share to speak of
    text = status_table.format_status(s)
    assert "extra job  41: 2 node(s), left (preempted); served rollouts 5-7, versions 5-7 (6 units, 96 samples)" in text
    assert "extra GPU-hours 0.22 (0.06 node-hours), beside the run's own" in text


def test_the_share_is_of_the_samples_the_run_generated(tmp_path: Path) -> None:
    plan = make_test_plan(tmp_path / "run")
    run = Path(plan.output_dir)
    _job(run)
    per_rollout = plan.recipe.batch.prompts * plan.recipe.batch.responses_per_prompt
    x = status._extra_rollout(run, json.loads(Path(plan.paths.plan).read_text()), 10, slurm=False, now=0.0)
    assert x["share"] == 96 / (10 * per_rollout)
    text = "\n".join(status_table._format_extra_rollout(x))
    assert f"{96 / (10 * per_rollout) * 100:.1f}% of the rollout samples served by extra jobs (96 samples)" in text


def test_plot_marks_where_capacity_changed(tmp_path: Path) -> None:
    from beam_hpc.observe.plot import plot_run
    from beam_hpc.run import metric_names

    plan = make_test_plan(tmp_path / "run")
    run = Path(plan.output_dir)
    metrics = run / "dumps" / metric_names.METRICS_FILE
    metrics.parent.mkdir(parents=True)
    with metrics.open("w") as fh:
        for r in range(10):
            fh.write(json.dumps({"rollout_id": r, metric_names.ROLLOUT_REWARD: 0.1 * r}) + "\n")
    without = plot_run(run, tmp_path / "before")
    _job(run)
    with_jobs = plot_run(run, tmp_path / "after")
    assert [p.name for p in with_jobs.written] == [p.name for p in without.written] != []
    for a, b in zip(without.written, with_jobs.written, strict=True):
        assert a.read_bytes() != b.read_bytes()  # the capacity lines are drawn
