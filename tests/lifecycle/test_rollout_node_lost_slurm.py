"""A rollout node lost mid-segment on the real local Slurm cluster (issue 42 items 1-3).

The tiny recipe, in turn (no async), two trainer nodes and two rollout nodes of one fake GPU each
(one rollout worker a node). Once two rollouts are trained the test does to one rollout node what
a node failure does, as Slurm sees it: ``scontrol update state=down`` and every process of the
node gone (SIGKILL to its node step, its raylet and the worker, found from the node step's report
and the process tree). The job asked Slurm not to revoke it (``--no-kill`` on every component:
Slurm 22.05 applies a node failure to all of a hetjob's components and keeps a component only with
``--no-kill`` and more than one node, hence the two trainer nodes here), the segment records the
node, asks for a replacement (one extra rollout job, the lost node excluded) and goes on with the
other rollout node; the replacement joins and serves units, and the run completes in that one
segment: every rollout trained once, the final checkpoint bitwise that of the same run left alone.
``status`` shows the loss (the node excluded), the replacement and its GPU-hours. The node is
put back (``state=resume``) whatever happens, so other tests find it. (On this cluster the node's
slurmd still answers, so Slurm returns the node to service within a second of the DOWN; the job
has excised it by then, and the step on it was killed.)

A trainer node's loss still ends the segment and resubmits from the checkpoint with the node
excluded: tests/lifecycle/test_lifecycle_slurm.py::test_a_failed_node_is_excluded_from_the_next_segment_and_the_run_completes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from job_plans import HOST_SITE, make_test_plan
from reference_harness import SMALL, assert_bitwise_equal, load_checkpoint, run_backend
from run_watch import chain_finished, diagnostics, segments
from test_lifecycle_slurm import TINY, rollout_ids, runs, submit_run, timeline, wait_for  # noqa: F401 (fixture)

from beam_hpc.elastic.replace import replacements
from beam_hpc.fault_hooks import SLOW_ROLLOUT_VAR
from beam_hpc.node import procs
from beam_hpc.observe.status import gather
from beam_hpc.observe.status_table import format_status

pytestmark = [pytest.mark.slurm, pytest.mark.ray, pytest.mark.e2e, pytest.mark.slow]

N = 14
TOPOLOGY = ("topology.trainer.nodes=2", "topology.trainer.gpus_per_node=1", "topology.rollout.nodes=2",
            "topology.rollout.gpus_per_node=1", "training.async_training=false", "backend_options.unit_prompts=1")


def _report_of(run: Path, node_ip: str) -> dict:
    """The rollout node step's report (hostname, pid, ray_pid) of the node with this address."""
    for path in run.glob("logs/*/nodes/rollout-*.json"):
        report = json.loads(path.read_text())
        if report.get("ip") == node_ip:
            return report
    raise AssertionError(f"no rollout node report with ip {node_ip}: {sorted(run.glob('logs/*/nodes/*'))}")


def _elastic_story(run: Path) -> str:
    """The extra jobs' events and the tails of their logs (for a failed assertion)."""
    parts = [f"{p.name}:\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(run.glob("elastic/jobs/*.jsonl"))]
    parts += [f"{p}:\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(run.glob("elastic/logs/**/*")) if p.is_file()]
    return "\n".join(parts)


def test_a_lost_rollout_node_leaves_the_segment_running_and_the_run_exact(slurm_cluster, tiny_assets, runs,  # noqa: F811
                                                                          reference_ray, monkeypatch) -> None:
    assert TINY.is_file()
    run = runs / "rollout-node-lost"
    # exported to the job (and to the replacement) by sbatch: room to strike mid-run, and for the
    # replacement to start and serve before the run ends
    monkeypatch.setenv(SLOW_ROLLOUT_VAR, "1.5")
    plan, job = submit_run(run, tiny_assets, num_rollout=N, interval=4, extra=TOPOLOGY)
    script = Path(plan.paths.script).read_text()
    assert script.count("#SBATCH --no-kill") == 2, script  # every component of the hetjob
    whole = runs / "uninterrupted"
    whole_plan = make_test_plan(whole, assets=tiny_assets, site=HOST_SITE,
                                overrides=[*SMALL, *TOPOLOGY, f"num_rollout={N}", "checkpoint.interval=4"])
    alone = ThreadPoolExecutor(1).submit(run_backend, whole_plan.paths.plan, reference_ray)
    wait_for("two trained rollouts", lambda: len(rollout_ids(run)) >= 2, run, timeout=400)
    placement = json.loads((run / "placement.json").read_text())
    worker = placement["rollout"][1]
    assert worker["node_ip"] != placement["rollout"][0]["node_ip"], placement  # one worker a node
    victim = _report_of(run, worker["node_ip"])
    node = victim["hostname"]
    try:
        slurm_cluster.run("scontrol", "update", f"nodename={node}", "state=down", "reason=beam-test-rollout-node-lost")
        gone = procs.with_descendants([int(victim["pid"])]) + [int(worker["pid"])]
        for pid in gone:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        at = len(rollout_ids(run))
        wait_for("the run to complete", lambda: chain_finished(run), run)
    finally:
        # the local cluster's slurmd of the node still answers, so Slurm returns it to service by itself
        # (ReturnToService); resume is for a node that is still DOWN, and refused (harmlessly) otherwise
        subprocess.run(["scontrol", "update", f"nodename={node}", "state=resume"], check=False, capture_output=True)
    segs = segments(run)
    print(f"\nrollout node {node} lost after {at} rollouts:\n{timeline(run)}")
    assert at < N, f"the node was struck after the run ended ({at} rollouts)"
    assert len(segs) == 1 and segs[0]["start"]["job_id"] == job, diagnostics(run)
    end = segs[0]["end"]
    assert end["reason"] == "completed" and end["rollouts_at_end"] == N, diagnostics(run)
    assert [f["node"] for f in end["failed_nodes"]] == [node], end  # recorded: the next segments leave it out
    assert "rollout node lost" in end["failed_nodes"][0]["why"], end
    driver_log = "".join(p.read_text(errors="replace") for p in run.glob("logs/*/driver.log"))
    assert "rollout worker segment:1 lost" in driver_log, driver_log[-3000:]
    assert rollout_ids(run) == list(range(N)), rollout_ids(run)  # every rollout once: nothing trained again
    # the replacement: asked for by the segment, the lost node excluded, and it served
    (rep,) = replacements(run)
    assert rep["replaces"] == node and rep["segment"] == f"{job}-0", rep
    shown = subprocess.run(["scontrol", "--oneliner", "show", "job", rep["job_id"]], capture_output=True, text=True,
                           check=False).stdout
    assert not shown or f"ExcNodeList={node}" in shown, shown  # (Slurm may have forgotten a finished job)
    s = gather(run, slurm=False)
    (row,) = s["extra_rollout"]["jobs"]
    assert row["replaces"] == node and row["units"] > 0 and row["gpu_hours"] > 0, f"{row}\n{_elastic_story(run)}"
    text = format_status(s)
    assert f"replacing lost rollout node {node}" in text and f"excluded   {node}" in text, text
    alone.result()
    last = f"iter_{N - 1:07d}"
    compared = assert_bitwise_equal(load_checkpoint(whole / "checkpoints" / last),
                                    load_checkpoint(run / "checkpoints" / last), last)
    assert compared > 50
