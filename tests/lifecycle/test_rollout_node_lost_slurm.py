"""A rollout node lost mid-segment on the real local Slurm cluster (issue 42 items 1-3).

The tiny recipe, in turn (no async), two trainer nodes and two rollout nodes of one fake GPU each
(one rollout worker a node). Once two rollouts are trained the test does to one rollout node what
a node failure does, as Slurm sees it: ``scontrol update state=down`` and every process of the
node gone (SIGKILL to its node step, its raylet and the worker, found from the node step's report
and the process tree). The job asked Slurm not to revoke it (``--no-kill`` on every component:
Slurm 22.05 applies a node failure to all of a hetjob's components and keeps a component only with
``--no-kill`` and more than one node, hence the two trainer nodes here), the segment records the
node, asks for a replacement (one extra rollout job, the lost node excluded) and goes on with the
other rollout node, training every rollout once (the lost worker counted in the rollouts' metrics).
``status`` shows the loss (the node excluded), the replacement and its GPU-hours. The node is
put back (``state=resume``) whatever happens, so other tests find it. (On this cluster the node's
slurmd still answers, so Slurm returns the node to service within a second of the DOWN; the job
has excised it by then, and the step on it was killed.)

The same run then loses a trainer node the same way (DOWN, its node step and raylet SIGKILLed),
two rollouts later: that ends the segment as a node failure, as before issue 42, and
the chain resubmits from the last checkpoint with both lost nodes excluded; the second segment
completes the run (the replacement joins it and serves), and its final weights are bitwise those
of the run left alone. One run for both, so the suite pays one bring-up less than two tests would.
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
from reference_harness import SMALL, assert_bitwise_equal, load_checkpoint, metrics, run_backend
from run_watch import chain_finished, diagnostics, segments
from test_lifecycle_slurm import TINY, rollout_ids, runs, submit_run, timeline, wait_for  # noqa: F401 (fixture)

from beam_hpc.backends.reference.rollouts.unit_service import WORKERS_LOST
from beam_hpc.elastic.replace import replacements
from beam_hpc.fault_hooks import SLOW_ROLLOUT_VAR
from beam_hpc.node import procs
from beam_hpc.observe.status import gather
from beam_hpc.observe.status_table import format_status

pytestmark = [pytest.mark.slurm, pytest.mark.ray, pytest.mark.e2e, pytest.mark.slow]

N = 12
INTERVAL = 4
TOPOLOGY = ("topology.trainer.nodes=2", "topology.trainer.gpus_per_node=1", "topology.rollout.nodes=2",
            "topology.rollout.gpus_per_node=1", "training.async_training=false", "backend_options.unit_prompts=1")


def _report_of(run: Path, group: str, node_ip: str | None = None, index: int | None = None) -> dict:
    """A node step's report (hostname, pid, ray_pid, ip) of ``group``: the one with this address,
    or the one of this index (``nodes/<group>-<index>.json``)."""
    for path in sorted(run.glob(f"logs/*/nodes/{group}-*.json")):
        report = json.loads(path.read_text())
        if report.get("ip") == node_ip or path.stem == f"{group}-{index}":
            return report
    raise AssertionError(f"no {group} node report (ip {node_ip}, index {index}): {sorted(run.glob('logs/*/nodes/*'))}")


def _strike(slurm_cluster, node: str, pids: list[int]) -> None:  # type: ignore[no-untyped-def]
    """What a node failure does, as Slurm and the job see it: the node DOWN, its processes gone."""
    slurm_cluster.run("scontrol", "update", f"nodename={node}", "state=down", "reason=beam-test-node-lost")
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _excluded(job_id: str) -> list[str] | None:
    """The nodes Slurm holds the job away from (its ExcNodeList, expanded), or None when Slurm has
    forgotten the finished job."""
    shown = subprocess.run(["scontrol", "--oneliner", "show", "job", job_id], capture_output=True, text=True,
                           check=False).stdout
    if "ExcNodeList=" not in shown:
        return None
    names = shown.split("ExcNodeList=")[1].split()[0]
    return [] if names == "(null)" else subprocess.run(["scontrol", "show", "hostnames", names], capture_output=True,
                                                       text=True, check=True).stdout.split()


def _elastic_story(run: Path) -> str:
    """The extra jobs' events and the tails of their logs (for a failed assertion)."""
    parts = [f"{p.name}:\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(run.glob("elastic/jobs/*.jsonl"))]
    parts += [f"{p}:\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(run.glob("elastic/logs/**/*")) if p.is_file()]
    return "\n".join(parts)


def test_a_lost_rollout_node_leaves_the_segment_running_and_a_lost_trainer_node_ends_it(
        slurm_cluster, tiny_assets, runs, reference_ray, monkeypatch) -> None:  # noqa: F811
    assert TINY.is_file()
    run = runs / "rollout-node-lost"
    # exported to the job (and to the replacement) by sbatch: room to strike mid-run twice, and for
    # the replacement to start and serve
    monkeypatch.setenv(SLOW_ROLLOUT_VAR, "1.5")
    # two segments' bring-ups in one walltime each: on a slow host a node's `ray start` may need its
    # retries (minutes), and the walltime must not be what ends the second segment
    plan, job = submit_run(run, tiny_assets, num_rollout=N, interval=INTERVAL, extra=TOPOLOGY, walltime="00:25:00")
    script = Path(plan.paths.script).read_text()
    assert script.count("#SBATCH --no-kill") == 2, script  # every component of the hetjob
    whole = runs / "uninterrupted"
    whole_plan = make_test_plan(whole, assets=tiny_assets, site=HOST_SITE,
                                overrides=[*SMALL, *TOPOLOGY, f"num_rollout={N}", f"checkpoint.interval={INTERVAL}"])
    alone = ThreadPoolExecutor(1).submit(run_backend, whole_plan.paths.plan, reference_ray)
    wait_for("two trained rollouts", lambda: len(rollout_ids(run)) >= 2, run, timeout=400)
    placement = json.loads((run / "placement.json").read_text())
    worker = placement["rollout"][1]
    assert worker["node_ip"] != placement["rollout"][0]["node_ip"], placement  # one worker a node
    victim = _report_of(run, "rollout", node_ip=worker["node_ip"])
    node = victim["hostname"]
    trainer_node = ""
    try:
        _strike(slurm_cluster, node, procs.with_descendants([int(victim["pid"])]) + [int(worker["pid"])])
        at = len(rollout_ids(run))
        # the segment goes on; two rollouts later a trainer node (not the batch host, whose loss
        # Slurm answers itself) is lost: the segment must end (the replacement serves the next one)
        wait_for("two more rollouts", lambda: len(rollout_ids(run)) >= at + 2 or chain_finished(run), run)
        trainer = _report_of(run, "trainer", index=1)
        trainer_node, trainer_at = trainer["hostname"], len(rollout_ids(run))
        assert trainer_at < N - INTERVAL, f"the run reached {trainer_at} of {N} rollouts: no room to lose a trainer node"
        _strike(slurm_cluster, trainer_node, procs.with_descendants([int(trainer["pid"])]))
        wait_for("the run to complete", lambda: chain_finished(run), run)
    finally:
        # the local cluster's slurmd of a node still answers, so Slurm returns it to service by itself
        # (ReturnToService); resume is for a node that is still DOWN, and refused (harmlessly) otherwise
        for name in filter(None, (node, trainer_node)):
            subprocess.run(["scontrol", "update", f"nodename={name}", "state=resume"], check=False, capture_output=True)
    segs = segments(run)
    print(f"\nrollout node {node} lost after {at} rollouts, trainer node {trainer_node} after {trainer_at}:\n"
          f"{timeline(run)}")
    assert at < N, f"the node was struck after the run ended ({at} rollouts)"
    assert len(segs) == 2 and segs[0]["start"]["job_id"] == job, diagnostics(run)
    # the first segment went on without the rollout node, and ended at the trainer node's loss
    first, second = segs[0]["end"], segs[1]
    assert first["reason"] == "node-failure", diagnostics(run)
    lost = {f["node"]: f["why"] for f in first["failed_nodes"]}
    srun_said = "".join(p.read_text(errors="replace")[-2000:] for p in run.glob("logs/*-0/srun-trainer.log"))
    reported = "".join(p.read_text() for p in sorted(run.glob("logs/*/nodes/trainer-*.json")))
    assert set(lost) == {node, trainer_node}, f"{first}\n{srun_said}\n{reported}"  # both: the next segments leave them out
    assert "rollout node lost" in lost[node] and "rollout node lost" not in lost[trainer_node], lost
    assert first["next"]["action"] == "resubmit", first
    driver_log = "".join(p.read_text(errors="replace") for p in run.glob("logs/*/driver.log"))
    assert "rollout worker segment:1 lost" in driver_log, driver_log[-3000:]
    lost_counts = [m[WORKERS_LOST] for m in metrics(run, "rollout")]  # per rollout, in training order
    assert lost_counts[0] == 0.0 and 1.0 in lost_counts[:trainer_at], lost_counts
    # resumed from the last checkpoint before the trainer's loss: only the rollouts after it again
    resumed_at = second["start"]["rollouts_at_start"]
    assert resumed_at == first["rollouts_at_end"] and resumed_at % INTERVAL == 0 and resumed_at <= trainer_at, \
        timeline(run)
    assert {node, trainer_node} <= set(_excluded(second["start"]["job_id"]) or {node, trainer_node})
    assert second["end"]["reason"] == "completed" and second["end"]["rollouts_at_end"] == N, diagnostics(run)
    ids = rollout_ids(run)  # in training order: the first segment's, then the second's
    cut = next((i for i in range(1, len(ids)) if ids[i] <= ids[i - 1]), resumed_at)  # (none again: no cut)
    assert ids[:cut] == list(range(cut)) and ids[cut:] == list(range(resumed_at, N)), ids
    assert trainer_at <= cut, (trainer_at, ids)  # trained again: only those after the checkpoint resumed from
    # the replacement: asked for by the segment, the lost node excluded, and it served
    (rep,) = replacements(run)
    assert rep["replaces"] == node and rep["segment"] == f"{job}-0", rep
    assert node in (_excluded(rep["job_id"]) or [node])
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
