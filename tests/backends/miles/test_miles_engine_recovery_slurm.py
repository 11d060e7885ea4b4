"""A Miles rollout engine that dies mid-run, on the local Slurm cluster (issue 42 item 3).

Real parts: the user's submission (sbatch), Slurm, the segment, Ray on both groups, beam-hpc's Miles
launcher; the Miles double (tests/support/standins/miles_standin) starts its SGLang engines as Miles
does (Ray actors on the rollout bundles of its placement group, each running the SGLang stand-in)
and, with the ``--use-fault-tolerance`` beam-hpc always passes, checks them and restarts a dead one
on its own bundle before the next weight update (Miles main's behaviour, read at
radixark/miles@31f1ca961: see the double's ``miles/utils/health_monitor.py``).

The fault: SIGKILL to one engine's SGLang server process, its node left alive. The segment goes
on and completes on its own: one segment, every rollout once, the engine restarted in place (same
bundle, same GPU, a new process) and serving the new weights again. Miles's health-check period
(30 s by default) is shortened with its own flags through ``backend_options.extra_args``, which
also shows that Miles's parser flags pass the recipe checks.

When an engine's node is gone instead, Miles's relaunch waits for a bundle that no node of the
allocation can hold (the double's docstring gives the lines); beam-hpc ends such a segment as a
node failure (``beam_hpc.plan.node_loss``: only a reference run's rollout group goes on without
a node), covered for the reference backend by tests/lifecycle/test_lifecycle_slurm.py.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import run_watch
from miles_run import PROMPTS, local_site, miles_recipe
from run_watch import chain_finished, diagnostics, segments

from beam_hpc.config.recipe import recipe_from_dict
from beam_hpc.config.site import site_from_dict

pytestmark = [pytest.mark.slow, pytest.mark.slurm, pytest.mark.ray, pytest.mark.e2e]

N = 12
ROLLOUT_S = "1.0"  # the double's "train" time per rollout: room to strike and recover mid-run
TIMEOUT_S = 300  # a shared 2-core machine; about a minute when it is quiet
HEALTH = ["--rollout-health-check-interval", "1", "--rollout-health-check-timeout", "5"]


@pytest.fixture
def run_dir(slurm_cluster) -> Iterator[Path]:
    """Outside pytest's numbered temp dirs (other sessions prune those), kept short for Ray; a chain
    the test left behind (it failed, say) is cancelled before its directory goes."""
    with slurm_cluster.scratch_runs("beam-mft-") as root:
        yield root / "run"


def _record(run: Path) -> dict:
    try:
        return json.loads((run / "dumps" / "standin-0.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_killed_engine_is_restarted_in_place_and_the_segment_completes(slurm_cluster, run_dir: Path) -> None:
    from beam_hpc.submission.submit import submit

    d = miles_recipe(run_dir.parent)
    d["num_rollout"] = N
    d["topology"] = {"trainer": {"nodes": 1, "gpus_per_node": 2},  # Miles: both groups of the same node size
                     "rollout": {"nodes": 1, "gpus_per_node": 2, "gpus_per_engine": 1}}  # two engines, one node
    d["backend_options"] = {"extra_args": HEALTH}
    s = local_site()
    s["env"]["BEAM_STANDIN_ROLLOUT_S"] = ROLLOUT_S
    sub = submit(recipe_from_dict(d, "miles engine recovery"), site_from_dict(s, "local site, Miles double"),
                 via="sbatch")
    run = run_dir

    def two_rollouts_on_two_engines() -> bool:
        r = _record(run)
        return len(r.get("rollouts", [])) >= 2 and len([e for e in r["engine_events"] if e["event"] == "started"]) == 2

    run_watch.wait_for("two rollouts on two engines", two_rollouts_on_two_engines, run, TIMEOUT_S, poll_s=0.3)
    before = _record(run)
    started = {e["engine"]: e for e in before["engine_events"] if e["event"] == "started"}
    victim = started[1]
    os.kill(victim["pid"], signal.SIGKILL)  # the engine's SGLang server; its node, actor and Ray stay
    struck_at = len(before["rollouts"])
    run_watch.wait_for("the run to complete", lambda: chain_finished(run), run, TIMEOUT_S, poll_s=0.5)

    segs = segments(run)
    assert len(segs) == 1 and segs[0]["start"]["job_id"] == str(sub.job_id), diagnostics(run)
    assert segs[0]["end"]["reason"] == "completed" and segs[0]["end"]["rollouts_at_end"] == N, diagnostics(run)
    assert segs[0]["end"]["failed_nodes"] == [], segs[0]["end"]
    r = _record(run)
    assert r["finished"] and r["rollouts"] == list(range(N)), r["rollouts"]  # every rollout once, in this segment
    assert struck_at < N - 2, f"struck too late to see a recovery ({struck_at} of {N} rollouts)"
    # the health monitor killed engine 1, the next weight update started it again where it was
    events = [(e["event"], e["engine"]) for e in r["engine_events"]]
    assert events == [("started", 0), ("started", 1), ("killed", 1), ("recovered", 1)], r["engine_events"]
    killed, recovered = r["engine_events"][2], r["engine_events"][3]
    assert "health_generate" in killed["why"] or "URLError" in killed["why"], killed
    assert struck_at - 1 <= killed["rollout_id"] <= recovered["rollout_id"], (struck_at, killed, recovered)
    for key in ("bundle", "base_gpu_id", "gpus", "node"):  # in place: the same placement-group bundle
        assert recovered[key] == victim[key], (key, victim, recovered)
    assert recovered["pid"] != victim["pid"] and recovered["url"] != victim["url"]
    assert not _alive(victim["pid"])
    # after the recovery both engines serve, with the weights of the latest update (the new engine
    # was connected to the weight-update group and got the update before it served)
    after = [g for g in r["generated"] if g["rollout_id"] > recovered["rollout_id"]]
    assert after and all(recovered["url"] in g["served"] and started[0]["url"] in g["served"] for g in after), after
    assert [g["weight_versions"] for g in r["generated"]] == [[str(i)] for i in range(N)], r["generated"]
    # no request lost: the dead engine's share went to the engine left (Miles's retries) until the recovery
    per_rollout = PROMPTS * d["batch"]["responses_per_prompt"]
    assert [sum(g["served"].values()) for g in r["generated"]] == [per_rollout] * N, r["generated"]
    assert all(victim["url"] not in g["served"] for g in after), after
    # the engines went with the driver (Miles's dispose; the double's servers die with their actors)
    assert not _alive(recovered["pid"])
