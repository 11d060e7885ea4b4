"""When Slurm itself falters, end to end: the tiny recipe's chain on a private Slurm cluster whose
real slurmctld is stopped at the worst moment (at the walltime save) and, in the same chain, at an
ordinary one (mid segment). The policy and the client's reading of a stopped controller are
test_controller_outage.py's.

The chain has a private cluster of its own (tests/support/cluster/private_cluster.py): stopping the
controller must not touch the other tests' jobs. The rollouts are the small test recipe's, slowed by the
driver's ``BEAM_TEST_SLOW_ROLLOUT_S`` hook (a sleep, not work): the walltime then comes in the middle
of the run however loaded the machine is, without the CPU of long rollouts. The walltime is entered
by lowering the running job's limit (``end_soon``, as ``scontrol update`` does), not by waiting out a
limit long enough for a slow bring-up.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from private_cluster import controller_up_around, log_size, private_cluster, submits_since
from reference_harness import SMALL
from run_watch import chain_finished, diagnostics, segments, wait_for
from slurm_cluster import LocalSlurmCluster

from beam_hpc.fault_hooks import SLOW_ROLLOUT_VAR
from beam_hpc.run import metric_names

pytestmark = [pytest.mark.slow, pytest.mark.slurm, pytest.mark.ray, pytest.mark.e2e]

ROOT = Path(__file__).resolve().parents[2]
FIRST_JOB_ID = 800_000  # far from the shared cluster's ids and from test_controller_outage.py's


@pytest.fixture
def outage(slurm_cluster, monkeypatch: pytest.MonkeyPatch) -> Iterator[LocalSlurmCluster]:  # type: ignore[no-untyped-def]
    """A private cluster of this test's own, SLURM_CONF pointing at it for every client."""
    with private_cluster("beamoutchain", FIRST_JOB_ID) as cluster:
        monkeypatch.setenv("SLURM_CONF", str(cluster.conf))
        with controller_up_around(cluster):
            yield cluster


@pytest.fixture
def runs(outage) -> Iterator[Path]:  # type: ignore[no-untyped-def]
    with outage.scratch_runs("beam-out-") as root:
        yield root


def _private_site(runs: Path) -> Path:
    """env/local.yaml with the private cluster's own Ray port bands (job_plans.PRIVATE_CLUSTER_PORTS):
    on the shared cluster's, a job of this chain can hold the ports of a shared-cluster job."""
    import yaml
    from job_plans import PRIVATE_CLUSTER_PORTS

    data = yaml.safe_load((ROOT / "env" / "local.yaml").read_text())
    data["ray"] = {**data["ray"], **PRIVATE_CLUSTER_PORTS}
    path = runs / "private-site.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _chain(runs: Path, assets, *, num_rollout: int, lead_s: int, recipe: list[str],  # type: ignore[no-untyped-def]
           slow_s: float) -> tuple[Path, str]:
    """The tiny recipe (with ``recipe`` overrides) submitted the user's way; each rollout slowed by
    ``slow_s`` through the environment sbatch exports to the job (and a resubmission passes on)."""
    from beam_hpc.submission.submit import submit

    run = runs / "chain"
    overrides = [f"model.path={assets.model_dir}", f"data.dir={assets.data_dir}", *recipe,
                 "lifecycle.walltime=00:20:00", f"lifecycle.lead_s={lead_s}"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(SLOW_ROLLOUT_VAR, str(slow_s))
        sub = submit(ROOT / "recipes" / "tiny.yaml", _private_site(runs), overrides=overrides,
                     output_dir=str(run), num_rollout=num_rollout, via="sbatch")
    return run, str(sub.job_id)


def _rollouts_done(run: Path) -> int:
    metrics = run / "dumps" / metric_names.METRICS_FILE
    if not metrics.exists():
        return 0
    return sum('"kind": "rollout"' in line for line in metrics.read_text(errors="replace").splitlines())


def test_a_150_s_outage_at_the_walltime_save_loses_nothing_and_a_40_s_one_mid_segment_costs_nothing(  # type: ignore[no-untyped-def]
        outage, tiny_assets, runs, reference_ray) -> None:
    """The issue's case: a 45 s lead, and slurmctld stopped the moment the segment asks for its
    walltime save (its log says so), down for 150 s: the job's limit passes in the outage. The
    segment saves, tears down, and retries its resubmission until the controller is back, which
    takes it first. Then, while the resubmitted segment trains, slurmctld is down again for 40 s:
    that segment trains on through it and completes the run, which is bitwise equal to an
    uninterrupted run.

    Once two rollouts are trained the job's limit is lowered to end 46-106 s later (whole
    minutes), so its save comes 1-61 s later: at 6 s a rollout at most 2 + 61/6 < 13 of the 24
    rollouts are done by then, so the walltime always comes mid-run, and the second segment has at
    least 11 rollouts (66 s) to train, more than the 40 s outage that starts after its first."""
    from job_plans import HOST_SITE, make_test_plan
    from reference_harness import assert_bitwise_equal, load_checkpoint, run_backend

    n, lead_s, recipe = 24, 45, [*SMALL, "checkpoint.interval=4"]
    run, first = _chain(runs, tiny_assets, num_rollout=n, lead_s=lead_s, recipe=recipe, slow_s=6)
    whole = runs / "uninterrupted"
    uninterrupted = ThreadPoolExecutor(1).submit(run_backend, make_test_plan(
        whole, assets=tiny_assets, overrides=[*recipe, f"num_rollout={n}"], site=HOST_SITE).paths.plan,
        reference_ray, timeout=900)
    wait_for("two trained rollouts", lambda: _rollouts_done(run) >= 2, run, timeout=600)
    _, ends_at = outage.end_soon(first, left_s=lead_s + 1)
    seg_log = run / "logs" / f"{first}-0" / "segment.log"
    wait_for("the walltime save request", lambda: seg_log.exists() and "save requested (walltime)" in seg_log.read_text(
        errors="replace"), run, timeout=180, poll_s=0.05)
    outage.stop_controller()
    down_at, offset = time.time(), log_size(outage)
    time.sleep(150)
    assert "end" not in segments(run)[0], f"the segment ended while the controller was down\n{diagnostics(run)}"
    back_at = time.time()  # (start_controller returns once `scontrol ping` says UP: the job may be quicker)
    assert ends_at < back_at, "the job's limit did not pass in the outage"
    outage.start_controller()
    first_end = wait_for("the first segment's end line", lambda: "end" in segments(run)[0] and segments(run)[0]["end"],
                         run, timeout=300)
    print(f"\nfirst segment, down {down_at:.1f} limit {ends_at:.1f} back {back_at:.1f} end {first_end['time']:.1f}: "
          f"{first_end['reason']}: {first_end['detail']}; {first_end['rollouts_at_end']} of {n} rollouts")
    assert first_end["reason"] == "walltime" and "saved on request" in first_end["detail"], diagnostics(run)
    assert 2 <= first_end["rollouts_at_end"] < n, diagnostics(run)
    assert first_end["next"]["action"] == "resubmit" and first_end["time"] > back_at, diagnostics(run)
    second = first_end["next"]["job_id"]
    assert submits_since(outage, offset)[:1] == [second], "not the first thing it got"
    assert "Slurm could not be reached or was busy" in seg_log.read_text(errors="replace")

    # The 40 s outage, once the resubmitted segment has trained a rollout of its own.
    at_start = first_end["rollouts_at_end"]
    wait_for("a rollout trained by the resubmitted segment", lambda: _rollouts_done(run) > at_start, run, timeout=600)
    outage.stop_controller()
    at_stop = _rollouts_done(run)
    time.sleep(40)
    in_outage = _rollouts_done(run)  # read before the controller returns: training went on without it
    print(f"\n40 s outage: {at_stop} rollouts done when slurmctld stopped, {in_outage} before it returned")
    assert at_stop < in_outage < n, (f"{at_stop} rollouts done when the controller stopped, {in_outage} when it "
                                     f"was about to return (of {n}): it did not train through the outage\n"
                                     f"{diagnostics(run)}")
    assert len(segments(run)) == 2 and "end" not in segments(run)[1], diagnostics(run)
    outage.start_controller()
    wait_for("the chain to finish", lambda: chain_finished(run), run, timeout=900)
    segs = segments(run)
    assert [s["segment"] for s in segs] == [f"{first}-0", f"{second}-0"], diagnostics(run)
    assert segs[-1]["end"]["reason"] == "completed" and segs[-1]["end"]["rollouts_at_end"] == n, diagnostics(run)
    for before, after in zip(segs, segs[1:], strict=False):  # nothing lost at any boundary
        assert after["start"]["rollouts_at_start"] == before["end"]["rollouts_at_end"], diagnostics(run)
    uninterrupted.result()
    last = f"iter_{n - 1:07d}"
    assert assert_bitwise_equal(load_checkpoint(whole / "checkpoints" / last),
                                load_checkpoint(run / "checkpoints" / last), last) > 50
