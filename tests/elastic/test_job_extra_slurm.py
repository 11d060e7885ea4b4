"""Extra rollout capacity on the real local Slurm cluster: ``beam-hpc rollout add`` joins a running run,
an ``urgent`` job preempts it, and the run ends bitwise as it would have without it.

Everything is real: the run is submitted as a user submits it (sbatch), the extra job through the
CLI, its nodes run the run's worker (beam_hpc.backends.reference.rollouts.outside_worker.serve), the preemption is Slurm's
(``urgent`` outranks ``spot``, PreemptMode=REQUEUE with a grace time), the removal is the CLI's, and
an extra job that outlives its run leaves by itself.
The baseline is the same recipe and seed through the backend alone, while the chain waits on Slurm.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import run_watch
from job_plans import HOST_SITE, make_test_plan
from reference_harness import SMALL, TinyAssets, assert_bitwise_equal, load_checkpoint, run_backend
from run_watch import chain_finished, diagnostics

from beam_hpc.cli.app import main
from beam_hpc.elastic import registry
from beam_hpc.fault_hooks import SLOW_UNITS_VAR
from beam_hpc.lifecycle import quarantine
from beam_hpc.plan.plan import Plan
from beam_hpc.plan.ports import ELASTIC, band_port
from beam_hpc.run import metric_names
from beam_hpc.run.scalars import read_scalars
from beam_hpc.submission import rollout_job

pytestmark = [pytest.mark.slurm, pytest.mark.ray, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "recipes" / "tiny.yaml"
SITE = ROOT / "env" / "local.yaml"
TIMEOUT_S = 300
SLOW_FROM = 10  # the rollout from which the extra job's units are slowed, and it is preempted in one


@pytest.fixture
def runs(slurm_cluster) -> Iterator[Path]:
    """Run directories outside pytest's pruned temp dirs; every job under them is cancelled after."""
    with slurm_cluster.scratch_runs("beam-ej-") as root:
        yield root


def wait_for(what: str, predicate, run_dir: Path, timeout: float = TIMEOUT_S, poll_s: float = 0.5):  # type: ignore[no-untyped-def]
    return run_watch.wait_for(what, predicate, run_dir, timeout, poll_s)


def _events(run: Path, job: str) -> list[dict]:
    return registry.read_events(registry.events_path(run, job))


def _job_state(job: str) -> str:
    out = subprocess.run(["scontrol", "--oneliner", "show", "job", job], capture_output=True, text=True,
                         check=False).stdout
    fields = dict(tok.split("=", 1) for tok in out.split() if "=" in tok)
    return fields.get("JobState", "GONE")


def _trained(run: Path) -> list[int]:
    """The rollouts the run trained so far, as `status` reads them."""
    return [p.step for p in read_scalars(run).series.get(metric_names.ROLLOUT_TIME, [])]


def _served(run: Path, job: str) -> list[dict]:
    return [e for e in _events(run, job) if e["event"] == "unit" and "node" in e]


def _started_slow_unit(run: Path, job: str) -> str | None:
    """The unit (``train:<rollout>:<index>``) the extra job's worker says it started serving, from
    rollout SLOW_FROM on, in its node logs; None before it starts one."""
    for log in sorted(registry.logs_dir(run).glob(f"node-{job}-*.log")):
        for m in re.finditer(r"serving unit (train:(\d+):\d+)", log.read_text(errors="replace")):
            if int(m.group(2)) >= SLOW_FROM:
                return m.group(1)
    return None


def _ends_with_left(run: Path, job: str, reason: str | None = None) -> bool:
    """The job's last event is its own ``left`` (for ``reason``, when given)."""
    ev = _events(run, job)
    return bool(ev) and ev[-1]["event"] == "left" and "node" not in ev[-1] and reason in (None, ev[-1]["reason"])


# -- the shape refusals and a hand sbatch ---------------------------------------------------------------
def test_a_shape_the_partition_cannot_hold_is_refused_before_anything_is_written(
        slurm_cluster, runs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = make_test_plan(runs / "run", trainer_nodes=1, rollout_nodes=1, gpus=8)
    run = plan.output_dir
    cases = [
        (["--nodes", "5", "--partition", "spot"], "--nodes: 5, but partition spot has 4 nodes; ask for at most 4"),
        (["--nodes", "1", "--partition", "nosuch"],
         "--partition: nosuch is not a partition of this cluster; give one of: debug, spot, urgent"),
    ]
    for argv, expect in cases:
        assert main(["rollout", "add", run, *argv]) == 2
        assert expect in capsys.readouterr().err
    wide = make_test_plan(runs / "wide", trainer_nodes=1, rollout_nodes=1, gpus=16,  # the nodes have 8
                          site={"gpus_per_node": 16})
    assert main(["rollout", "add", wide.output_dir, "--nodes", "1", "--partition", "spot"]) == 2
    assert "its nodes have at most 8 gpu GPUs, but the run's rollout group needs 16 per node" in capsys.readouterr().err
    assert not registry.elastic_dir(run).exists() and not registry.elastic_dir(wide.output_dir).exists()


def test_a_hand_sbatch_runs_a_dying_node_is_quarantined_and_remove_drains_the_other(
        slurm_cluster, runs: Path) -> None:
    """The script ``rollout add`` writes, submitted by hand, with the tests' bad-node hook: one node's
    program fails at once (into the site's quarantine, as a segment's failed node would be), the other
    waits for a run that has no segment up, until ``rollout remove`` makes it leave."""
    qfile = runs / "bad-nodes.json"
    plan = make_test_plan(runs / "run", trainer_nodes=1, rollout_nodes=1, gpus=0,
                          site={"quarantine": str(qfile), "partitions": {"trainer": "spot", "rollout": "spot"}})
    run = Path(plan.output_dir)
    req, problems = rollout_job.make_request(plan, plan.site, nodes=2, partition=None, time="00:10:00")
    assert req is not None and not problems and not rollout_job.problems(req)
    script = rollout_job.write_script(req)
    env = {**__import__("os").environ, "BEAM_TEST_BAD_NODE_FILE": str(runs / "bad-node")}
    job = subprocess.run(["sbatch", "--parsable", str(script)], cwd=runs, env=env, capture_output=True, text=True,
                         check=True).stdout.strip().split(";")[0]
    wait_for("one node to fail", lambda: any(e.get("reason") == "failed" for e in _events(run, job)), run)
    wait_for("the other node to wait for the run",
             lambda: len([e for e in _events(run, job) if e["event"] == "started"]) == 2, run)
    bad = next(e["node"] for e in _events(run, job) if e.get("reason") == "failed")
    assert main(["rollout", "remove", str(run), job]) == 0
    wait_for("the job's left", lambda: _ends_with_left(run, job), run, timeout=120)
    lefts = {e["node"]: e["reason"] for e in _events(run, job) if e["event"] == "left" and "node" in e}
    good = next(n for n in lefts if n != bad)
    assert lefts == {bad: "failed", good: "removed"}, _events(run, job)
    assert [e.node for e in quarantine.quarantined(qfile)] == [bad]
    assert _events(run, job)[-1]["reason"] == "failed" and _events(run, job)[-1]["failed_nodes"] == [bad]
    wait_for("the job to end (not requeued)", lambda: _job_state(job) in ("COMPLETED", "FAILED", "GONE"), run, 60)
    assert (runs / f"{plan.job_name}-rollout-{job}.out").is_file()  # a hand sbatch writes where it was run


# -- the whole story ----------------------------------------------------------------------------------------
@pytest.mark.e2e
def test_an_extra_job_joins_is_preempted_and_the_run_ends_bitwise_as_without_it(
        slurm_cluster, tiny_assets: TinyAssets, runs: Path, reference_ray: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    from beam_hpc.submission.submit import submit

    n = 16
    # SMALL, with 16 prompts: 4 units a rollout, so that the extra worker, which needs some seconds to
    # start, import torch and load the policy, joins the run's 2-core rollouts and shares them
    small = [*SMALL, "batch.prompts=16", "checkpoint.interval=8", "training.async_training=false"]
    overrides = [f"model.path={tiny_assets.model_dir}", f"data.dir={tiny_assets.data_dir}", *small,
                 "lifecycle.walltime=00:15:00"]
    run = runs / "elastic"
    submit(TINY, SITE, overrides=overrides, output_dir=str(run), num_rollout=n, via="sbatch")
    whole = runs / "alone"  # the same recipe and seed, the run's own worker only
    whole_plan = make_test_plan(whole, assets=tiny_assets, site=HOST_SITE,
                                overrides=[*small, f"num_rollout={n}"])
    alone = ThreadPoolExecutor(1).submit(run_backend, whole_plan.paths.plan, reference_ray)

    wait_for("rollout 2 trained", lambda: len(_trained(run)) >= 2, run)  # it joins some rollouts later
    # the extra job's units from rollout SLOW_FROM on take seconds (BEAM_TEST_SLOW_UNITS, sbatch passes
    # the environment on): a rollout then waits for the unit it holds, so the preemption that follows
    # lands in the middle of that unit, before the run can end
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(SLOW_UNITS_VAR, f"{SLOW_FROM}:0.5")
        assert main(["rollout", "add", str(run), "--nodes", "1", "--partition", "spot", "--time", "00:10:00"]) == 0
    (job,) = [j.job_id for j in registry.extra_jobs(run)]
    wait_for("the extra job to serve a unit", lambda: _served(run, job), run)
    # preempt it in the middle of a unit: as it starts serving one of rollout >= SLOW_FROM
    held = wait_for(f"the extra job to start a unit of rollout {SLOW_FROM} or later",
                    lambda: _started_slow_unit(run, job), run)
    node = next(e["node"] for e in _events(run, job) if e["event"] == "started")
    urgent = slurm_cluster.run("sbatch", "--parsable", "-p", "urgent", f"--nodelist={node}", "--exclusive",
                               f"--output={runs}/urgent-%j.out", "--wrap", "sleep 25").stdout.strip()
    wait_for("the extra node to leave, preempted",
             lambda: any(e["event"] == "left" and e.get("reason") == "preempted" for e in _events(run, job)), run, 120)
    wait_for("the run to complete", lambda: chain_finished(run), run)
    # the preempted node gave the unit it held back to the run while the run was still going
    chain_end_at = run_watch.segments(run)[-1]["end"]["time"]
    preempted = next(e for e in _events(run, job) if e["event"] == "left" and "node" in e
                     and e.get("reason") == "preempted")
    assert held in preempted.get("given_back", []) and preempted["time"] < chain_end_at, (held, preempted, chain_end_at)
    assert [e["key"] for e in _served(run, job)].count(held) <= 1, _events(run, job)  # served again once, by anyone
    # rejoined after its requeue, or still pending (then it starts and finds the run over): it leaves
    # by itself, well before its own 10-minute limit, and Slurm counts the job completed
    wait_for("the extra job to leave by itself", lambda: _ends_with_left(run, job, "run-ended"), run, timeout=180)
    nodes_left = [e for e in _events(run, job) if e["event"] == "left" and "node" in e]
    assert nodes_left[-1]["reason"] == "run-ended", _events(run, job)
    wait_for("the extra job to end in Slurm", lambda: _job_state(job) in ("COMPLETED", "GONE"), run, timeout=60)
    assert main(["rollout", "add", str(run), "--nodes", "1", "--partition", "spot"]) == 2  # nothing to serve
    assert "the run is over (its chain stopped at segment" in capsys.readouterr().err
    assert [j.job_id for j in registry.extra_jobs(run)] == [job]
    alone.result()

    last = f"iter_{n - 1:07d}"
    compared = assert_bitwise_equal(load_checkpoint(whole / "checkpoints" / last),
                                    load_checkpoint(run / "checkpoints" / last), last)
    assert compared > 50, diagnostics(run)
    for seg in run_watch.segments(run):  # the extra node is never the run's failure, nor waited for
        assert seg["end"]["reason"] == "completed" and not seg["end"].get("failed_nodes"), diagnostics(run)
    served = _served(run, job)
    assert served and min(e["rollout"] for e in served) >= 2, served
    assert _trained(run) == list(range(n)), _trained(run)
    # each unit counted once: every rollout has its fixed number of units, and the units the run
    # counted as served from outside are exactly those the extra job reported accepted
    from beam_hpc.backends.reference.rollouts import unit_service

    last = {}
    for line in (run / "dumps" / metric_names.METRICS_FILE).read_text().splitlines():
        rec = json.loads(line)
        if unit_service.UNITS in rec:
            last[rec["rollout_id"]] = rec
    assert sorted(last) == list(range(n)) and len({r[unit_service.UNITS] for r in last.values()}) == 1, last
    outside = sum(r[unit_service.UNITS_OUTSIDE] for r in last.values())
    assert outside == len([e for e in served if e.get("purpose") == "train"]) > 0, (outside, served)
    # the service the extra job joined is the segment's own: its ledger id, its job's slot of the band
    segs = run_watch.segments(run)
    joined = [e for e in _events(run, job) if e["event"] == "joined"]
    assert joined and {e["segment"] for e in joined} <= {s["segment"] for s in segs}, joined
    first = segs[0]["segment"]
    port = band_port(Plan.load(run / "plan.json").site.ray, ELASTIC, int(segs[0]["start"]["job_id"]))
    assert f":{port} (segment {first})" in (run / "logs" / first / "driver.log").read_text(errors="replace")
    print(f"\nextra job {job} (urgent {urgent}): served {len(served)} units of rollouts "
          f"{sorted({e['rollout'] for e in served})}; events:\n"
          + "\n".join(json.dumps(e) for e in _events(run, job) if e["event"] != "unit"))
