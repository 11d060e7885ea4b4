"""A Miles rollout engine that dies mid-run, on the local Slurm cluster (issue 42 item 3).

Real parts: the user's submission (sbatch), Slurm, the segment, Ray on both groups, beam-hpc's Miles
launcher; the Miles double (tests/support/standins/miles_standin) starts its SGLang engines as Miles
does (Ray actors on the rollout bundles of its placement group, each running the SGLang stand-in)
and, with the ``--use-fault-tolerance`` beam-hpc always passes, checks them and restarts a dead one
on its own bundle before the next weight update (Miles main's behaviour, read at
radixark/miles@31f1ca961: see the double's ``miles/utils/health_monitor.py``).

The first fault: SIGKILL to one engine's SGLang server process, its node left alive. The segment
goes on: every rollout once, the engine restarted in place (same bundle, same GPU, a new process)
and serving the new weights again. Miles's health-check period
(30 s by default) is shortened with its own flags through ``backend_options.extra_args``, which
also shows that Miles's parser flags pass the recipe checks.

When an engine's node is gone (the second fault, later in the same chain), Miles's relaunch would
wait for a bundle that no node of the allocation can hold (the double's docstring gives the lines),
so Miles cannot train on without it. But the rollout in flight finishes on the engine left, and
Miles looks for the save sentinel after each rollout's training, before the weight update that would
wait: so a Miles run whose rollout group keeps a whole engine keeps its job (``--no-kill``,
``beam_hpc.plan.node_loss``: save, then end), saves at the next rollout boundary, and ends as a node
failure; the resubmission leaves the node out, and the chain loses at most the rollout in flight.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import run_watch
from miles_run import PROMPTS, local_site, miles_recipe
from run_watch import chain_finished, diagnostics, segments

from beam_hpc.config.recipe import recipe_from_dict
from beam_hpc.config.site import site_from_dict
from beam_hpc.node import procs

pytestmark = [pytest.mark.slow, pytest.mark.slurm, pytest.mark.ray, pytest.mark.e2e]

N = 8
# The double's "train" time per rollout. Miles checks engines only while its monitor runs (from each
# generate to the next weight update) and every --rollout-health-check-interval: an engine that dies
# after the last check before a weight update fails that update (Miles sends it the weights; the
# driver exits 1 and the segment retries: seen here with 0.6 s). The test strikes just after a weight
# update, so the 6 s of training before the next one hold several checks, and leave the segment time
# to see the node's loss and ask for the save before that rollout's boundary.
ROLLOUT_S = "6.0"
TIMEOUT_S = 300  # a shared 2-core machine; about a minute when it is quiet
HEALTH = ["--rollout-health-check-interval", "0.5", "--rollout-health-check-timeout", "5"]


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


def _submit(run_dir: Path, num_rollout: int) -> str:
    """The Miles chain of tests/support/builders/miles/miles_run.py with two rollout nodes of one
    one-GPU engine each, Miles's health checks every half second, submitted with sbatch. Two trainer
    nodes too: Slurm 22.05 keeps a ``--no-kill`` component only when it has more than one node
    (beam_hpc.slurm.script.asks_no_kill), and Miles wants both groups of one node size."""
    from beam_hpc.submission.submit import submit

    d = miles_recipe(run_dir.parent)
    d["num_rollout"] = num_rollout
    d["topology"] = {"trainer": {"nodes": 2, "gpus_per_node": 1},
                     "rollout": {"nodes": 2, "gpus_per_node": 1, "gpus_per_engine": 1}}
    d["backend_options"] = {"extra_args": HEALTH}
    s = local_site()
    s["env"]["BEAM_STANDIN_ROLLOUT_S"] = ROLLOUT_S
    sub = submit(recipe_from_dict(d, "miles engine faults"), site_from_dict(s, "local site, Miles double"), via="sbatch")
    return str(sub.job_id)


def _timeline(run: Path) -> str:
    """One line per segment and per rollout's engine phases (printed with -s)."""
    segs = segments(run)
    t0 = segs[0]["start"]["time"] if segs else 0.0
    rows = [f"{x['segment']}: +{x['start']['time'] - t0:.1f}s .. +{x.get('end', {}).get('time', t0) - t0:.1f}s "
            f"{x.get('end', {}).get('reason')} {x.get('end', {}).get('detail')}" for x in segs]
    for path in sorted((run / "dumps").glob("standin-*.json")):
        r = json.loads(path.read_text())
        rows += [f"  {path.name} rollout {g['rollout_id']}: generate {g.get('generate_s')} s, weight update "
                 f"{g.get('update_s')} s, retries {g['retries']}" for g in r["generated"]]
        rows += [f"  {path.name} {e['event']} engine {e['engine']} at rollout {e['rollout_id']}" for e in r["engine_events"]]
    return "\n".join(rows)


def _rollout_step(run: Path, job: str, ip: str) -> dict:
    """The report (hostname, pid) of segment ``job``'s rollout node step whose Ray node is at ``ip``."""
    reports = [json.loads(p.read_text()) for p in sorted((run / "logs" / f"{job}-0" / "nodes").glob("rollout-*.json"))]
    (step,) = [r for r in reports if r.get("ip") == ip]
    return step


def _hosts(run: Path, segment: str) -> set[str]:
    """The nodes segment ``segment`` (``<job>-<restart>``) ran on, from its node steps' reports."""
    return {json.loads(p.read_text())["hostname"] for p in (run / "logs" / segment / "nodes").glob("*.json")}


def _excluded_by_job(slurm_cluster, job: str) -> str:  # type: ignore[no-untyped-def]
    """The job's ExcNodeList as Slurm has it ("" once Slurm no longer knows the job)."""
    out = slurm_cluster.run("scontrol", "--oneliner", "show", "job", job, check=False).stdout
    return next((tok.split("=", 1)[1] for tok in out.split() if tok.startswith("ExcNodeList=")), "")


def _strike_node(slurm_cluster, step: dict) -> str:  # type: ignore[no-untyped-def]
    """The rollout node lost, as Slurm sees a node failure (see the test's docstring for FAIL first):
    DOWN, and every process of its node step gone (the raylet, the engines' actors and servers)."""
    node = step["hostname"]
    slurm_cluster.run("scontrol", "update", f"nodename={node}", "state=fail", "reason=beam-test-engine-node-lost")
    slurm_cluster.run("scontrol", "update", f"nodename={node}", "state=down", "reason=beam-test-engine-node-lost")
    for pid in procs.with_descendants([int(step["pid"])]):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return node


def test_a_killed_engine_is_restarted_in_place_and_a_lost_engine_node_is_saved_for_then_left_out(
        slurm_cluster, run_dir: Path) -> None:
    """One chain, two faults (one segment's bring-up for both claims).

    First an engine's SGLang server is killed, its node left alive: Miles's health monitor restarts
    it on its own bundle, the segment goes on, and both engines serve the next rollouts with the
    latest weights, no request lost.

    Then that engine's node itself is lost, as Slurm sees a node failure (DOWN, every process of its
    node step gone: the raylet, the engine's actor and server). The job keeps running (--no-kill):
    the rollout in flight finishes on the other node's engine, the segment asks for a save, Miles
    saves at that rollout's boundary, and the segment ends as a node failure naming the node. The
    resubmitted job leaves the node out and resumes from that checkpoint: of what segment 1 trained,
    at most the rollout in flight is trained again, where a revoked job would start this run over
    (its only periodic checkpoint is at rollout 1000).

    Holding the node out as a real site would: there a lost node's slurmd does not answer, so it stays
    DOWN (NOT_RESPONDING). This cluster's slurmd still answers, and with its ReturnToService=2 any
    answer puts a DOWN node back in service: measured on a private cluster, the node was IDLE again
    20 ms after `scontrol update state=down`. So the test first marks the node FAIL (what a site's
    health check sets on a failing node), which Slurm keeps when the node returns, with its reason;
    then DOWN. Once segment 1 has ended the node is resumed, so that only the resubmission's
    --exclude keeps the next segment off it. (The same loss under --no-requeue, with the node's
    slurmd really gone: tests/lifecycle/test_watchdog_slurm.py.)"""
    run = run_dir
    job = _submit(run, N)

    def two_rollouts_on_two_engines() -> bool:
        """Two rollouts trained and the second one's weight update done: the next rollout's
        generation and training come next, checked by the health monitor every half second (a
        fault during a weight update would fail it: see ROLLOUT_S)."""
        r = _record(run)
        return (len(r.get("rollouts", [])) >= 2 and r["generated"][1].get("update_s") is not None
                and len([e for e in r["engine_events"] if e["event"] == "started"]) == 2)

    run_watch.wait_for("two rollouts on two engines", two_rollouts_on_two_engines, run, TIMEOUT_S, poll_s=0.1)
    before = _record(run)
    started = {e["engine"]: e for e in before["engine_events"] if e["event"] == "started"}
    victim = started[1]
    assert victim["node"] != started[0]["node"]  # one engine a rollout node
    os.kill(victim["pid"], signal.SIGKILL)  # the engine's SGLang server; its node, actor and Ray stay
    killed_at = len(before["rollouts"])

    def served_by_both_after_the_recovery() -> bool:
        r = _record(run)
        back = [e for e in r.get("engine_events", []) if e["event"] == "recovered"]
        return bool(back) and any(g["rollout_id"] > back[0]["rollout_id"] and len(g["served"]) == 2
                                  and g.get("update_s") is not None for g in r["generated"])

    run_watch.wait_for("a rollout served by both engines after the recovery", served_by_both_after_the_recovery, run,
                       TIMEOUT_S, poll_s=0.1)
    node = ""
    try:
        # after that rollout's weight update: the engine's node (the recovered engine runs there too)
        node = _strike_node(slurm_cluster, _rollout_step(run, job, victim["node"]))
        struck = _record(run)
        in_flight = len(struck["rollouts"])  # the rollout being trained (or generated) when the node went
        # segment 1's record (standin-0.json) stays: the next segment's driver starts later and writes its own
        run_watch.wait_for("segment 1 to end", lambda: "end" in (segments(run) or [{}])[0], run, TIMEOUT_S, poll_s=0.3)
        one = _record(run)
        slurm_cluster.run("scontrol", "update", f"nodename={node}", "state=resume")  # free to take, unless excluded
        first_end = segments(run)[0]["end"]
        second_job = first_end["next"].get("job_id") or ""
        run_watch.wait_for("the resubmitted segment to start", lambda: len(segments(run)) > 1, run, TIMEOUT_S,
                           poll_s=0.3)
        excluded_by_job = _excluded_by_job(slurm_cluster, second_job)
        run_watch.wait_for("the run to complete", lambda: chain_finished(run), run, TIMEOUT_S, poll_s=0.5)
    finally:  # the local cluster's slurmd still answers: Slurm returns the node by itself; resume if not
        if node:
            subprocess.run(["scontrol", "update", f"nodename={node}", "state=resume"], check=False, capture_output=True)
    print(f"\nengine killed after {killed_at} rollouts, its node {node} lost with rollout {in_flight} in flight:\n"
          f"{_timeline(run)}")

    # 1. the killed engine, in segment 1: the health monitor killed engine 1, the next weight update
    # started it again where it was
    events = [(e["event"], e["engine"]) for e in one["engine_events"]]
    assert events[:4] == [("started", 0), ("started", 1), ("killed", 1), ("recovered", 1)], one["engine_events"]
    killed, recovered = one["engine_events"][2], one["engine_events"][3]
    assert "health_generate" in killed["why"] or "URLError" in killed["why"], killed
    assert killed_at - 1 <= killed["rollout_id"] <= recovered["rollout_id"], (killed_at, killed, recovered)
    for key in ("bundle", "base_gpu_id", "gpus", "node"):  # in place: the same placement-group bundle
        assert recovered[key] == victim[key], (key, victim, recovered)
    assert recovered["pid"] != victim["pid"] and recovered["url"] != victim["url"]
    assert not _alive(victim["pid"])
    # after the recovery both engines serve, with the weights of the latest update (the new engine
    # was connected to the weight-update group and got the update before it served)
    after = [g for g in struck["generated"] if g["rollout_id"] > recovered["rollout_id"]]  # all before the strike
    assert after and all(recovered["url"] in g["served"] and started[0]["url"] in g["served"] for g in after), after
    done = one["rollouts"]
    assert done == list(range(len(done))) and len(done) < N, done  # segment 1 did not finish
    assert [g["weight_versions"] for g in one["generated"]][:len(done)] == [[str(i)] for i in range(len(done))]
    # no request lost: the dead engine's share went to the engine left (Miles's retries) until the recovery
    argv = one["argv"]
    per_rollout = int(argv[argv.index("--rollout-batch-size") + 1]) * int(argv[argv.index("--n-samples-per-prompt") + 1])
    assert per_rollout == PROMPTS * 2  # miles_run's batch: PROMPTS prompts, 2 responses each
    assert [sum(g["served"].values()) for g in one["generated"]][:len(done)] == [per_rollout] * len(done)

    # 2. the lost node: the segment saved at the in-flight rollout's boundary, then ended
    segs = segments(run)
    assert len(segs) == 2, diagnostics(run)
    first, second = segs
    assert first["start"]["job_id"] == job, diagnostics(run)
    assert (first["end"]["reason"], first["end"]["next"]["action"]) == ("node-failure", "resubmit"), diagnostics(run)
    assert "saved on request" in first["end"]["detail"], first["end"]
    (lost,) = [f for f in first["end"]["failed_nodes"] if f["node"] == node] or [None]
    assert lost is not None, first["end"]
    requested = [x for x in one["saves"] if "sentinel" in x["why"]]
    assert len(requested) == 1 and requested[0]["rollout_id"] == in_flight, (in_flight, one["saves"])
    assert first["end"]["rollouts_at_end"] == in_flight + 1, (in_flight, first["end"])
    # at most the rollout in flight trained again: segment 1 trained nothing after the saved one
    assert max(done) == in_flight, (done, in_flight)
    assert second["start"]["rollouts_at_start"] == in_flight + 1, diagnostics(run)
    assert second["end"]["reason"] == "completed" and second["end"]["rollouts_at_end"] == N, diagnostics(run)
    # the resubmission left the node out, and the next segment ran on four other nodes
    assert second["start"]["job_id"] == second_job != job and node in excluded_by_job.split(","), \
        (excluded_by_job, second)
    assert node not in _hosts(run, second["segment"]) and len(_hosts(run, second["segment"])) == 4, diagnostics(run)
    assert not one.get("finished"), one
    two = json.loads((run / "dumps" / "standin.json").read_text())
    assert two["finished"] and two["rollouts"][-1] == N - 1 and two["pid"] != one["pid"]
    assert two["loaded"]["from"] == "load" and two["loaded"]["iteration"] == in_flight, two["loaded"]
    # the engines went with the drivers (Miles's dispose; the double's servers die with their actors)
    assert not _alive(recovered["pid"])
    print("segment 1 end:", json.dumps(first["end"], indent=1))
