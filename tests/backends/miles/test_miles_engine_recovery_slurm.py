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

When an engine's node is gone (the second fault, later in the same chain), Miles's restart waits
for the engine's bundle, which Ray places again only on a node that joins the segment's Ray
cluster (the double's docstring gives the lines). The rollout in flight finishes on the engine left,
and Miles looks for the save sentinel after each rollout's training, before the weight update that
would wait: so a Miles run whose rollout group keeps a whole engine keeps its job (``--no-kill``,
``beam_hpc.plan.node_loss``: save first), saves at the next rollout boundary, and asks for a node
to take the lost one's place in its Ray cluster (``beam_hpc.elastic.ray_replacement``). It joins,
Ray places the bundle there, Miles's restart returns, and the segment trains on to the end.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Callable, Iterator
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


def test_a_killed_engine_is_restarted_in_place_and_a_lost_engine_node_is_saved_for_then_replaced(
        slurm_cluster, run_dir: Path) -> None:
    """One chain, two faults (one segment's bring-up for both claims).

    First an engine's SGLang server is killed, its node left alive: Miles's health monitor restarts
    it on its own bundle, the segment goes on, and both engines serve the next rollouts with the
    latest weights, no request lost.

    Then that engine's node itself is lost, as Slurm sees a node failure (DOWN, every process of its
    node step gone: the raylet, the engine's actor and server). The job keeps running (--no-kill):
    the rollout in flight finishes on the other node's engine, the segment asks for a save, Miles
    saves at that rollout's boundary, and the segment asks for a replacement: a one-node job (the
    lost node excluded) whose node step joins the segment's Ray cluster in the lost node's place.
    Ray places the lost engine's bundle there, Miles's restart of the engine returns, and the same
    segment trains every rollout once to the end, both engines serving again.

    Holding the node out as a real site would: there a lost node's slurmd does not answer, so it stays
    DOWN (NOT_RESPONDING). This cluster's slurmd still answers, and with its ReturnToService=2 any
    answer puts a DOWN node back in service: measured on a private cluster, the node was IDLE again
    20 ms after `scontrol update state=down`. So the test first marks the node FAIL (what a site's
    health check sets on a failing node), which Slurm keeps when the node returns, with its reason;
    then DOWN, and resumes it at the end. (The same loss under --no-requeue, with the node's slurmd
    really gone: tests/lifecycle/test_watchdog_slurm.py.)"""
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

    def recoveries() -> list[dict]:
        return [e for e in _record(run).get("engine_events", []) if e["event"] == "recovered"]

    def served_by_both_after(recovery: int) -> Callable[[], bool]:
        def check() -> bool:
            r = _record(run)
            back = [e for e in r.get("engine_events", []) if e["event"] == "recovered"]
            return len(back) > recovery and any(
                g["rollout_id"] > back[recovery]["rollout_id"] and len(g["served"]) == 2
                and g.get("update_s") is not None for g in r["generated"])
        return check

    run_watch.wait_for("a rollout served by both engines after the recovery", served_by_both_after(0), run,
                       TIMEOUT_S, poll_s=0.1)
    node = ""
    try:
        # after that rollout's weight update: the engine's node (the recovered engine runs there too)
        node = _strike_node(slurm_cluster, _rollout_step(run, job, victim["node"]))
        struck = _record(run)
        in_flight = len(struck["rollouts"])  # the rollout being trained (or generated) when the node went
        run_watch.wait_for("a rollout served by both engines after the replacement joined", served_by_both_after(1),
                           run, TIMEOUT_S, poll_s=0.3)
        (replacement,) = [r["job_id"] for r in _replacements(run)]
        excluded_by_job = _excluded_by_job(slurm_cluster, replacement)
        run_watch.wait_for("the run to complete", lambda: chain_finished(run), run, TIMEOUT_S, poll_s=0.5)
    finally:  # the local cluster's slurmd still answers: Slurm returns the node by itself; resume if not
        if node:
            subprocess.run(["scontrol", "update", f"nodename={node}", "state=resume"], check=False, capture_output=True)
    print(f"\nengine killed after {killed_at} rollouts, its node {node} lost with rollout {in_flight} in flight:\n"
          f"{_timeline(run)}")
    record = _record(run)

    # 1. the killed engine: the health monitor killed engine 1, the next weight update started it
    # again where it was
    events = [(e["event"], e["engine"]) for e in record["engine_events"]]
    assert events[:4] == [("started", 0), ("started", 1), ("killed", 1), ("recovered", 1)], record["engine_events"]
    killed, recovered = record["engine_events"][2], record["engine_events"][3]
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

    # 2. the lost node: saved at the in-flight rollout's boundary, replaced in the same segment
    segs = segments(run)
    assert len(segs) == 1, diagnostics(run)
    (only,) = segs
    assert only["start"]["job_id"] == job, diagnostics(run)
    assert only["end"]["reason"] == "completed" and only["end"]["rollouts_at_end"] == N, diagnostics(run)
    requested = [x for x in record["saves"] if "sentinel" in x["why"]]
    assert len(requested) == 1 and requested[0]["rollout_id"] == in_flight, (in_flight, record["saves"])
    # every rollout trained once, by one driver, and every one of them fully served
    assert record["finished"] and record["rollouts"] == list(range(N)), record["rollouts"]
    assert [g["weight_versions"] for g in record["generated"]] == [[str(i)] for i in range(N)]
    argv = record["argv"]
    per_rollout = int(argv[argv.index("--rollout-batch-size") + 1]) * int(argv[argv.index("--n-samples-per-prompt") + 1])
    assert per_rollout == PROMPTS * 2  # miles_run's batch: PROMPTS prompts, 2 responses each
    assert [sum(g["served"].values()) for g in record["generated"]] == [per_rollout] * N
    # the lost engine was killed by the health monitor, then restarted on its own bundle, now on the
    # replacement's Ray node, after the save
    lost_kill, back = record["engine_events"][4], record["engine_events"][5]
    assert (lost_kill["event"], lost_kill["engine"], back["event"], back["engine"]) == ("killed", 1, "recovered", 1), \
        record["engine_events"]
    assert back["bundle"] == victim["bundle"] and back["rollout_id"] >= in_flight and _alive(back["pid"]) is False
    # on the replacement's own Ray node: another address than the lost node's (this loopback site gives
    # each node of a job its own, as a real cluster's hosts have), where the engine's new server listens
    assert back["node"] != victim["node"] and back["url"] != recovered["url"], (victim, back)
    # the end line names the lost node and the job that took its place
    (lost,) = [x for x in only["end"]["failed_nodes"] if x["node"] == node] or [None]
    assert lost is not None and lost["replaced_by"] == replacement, only["end"]
    # the replacement: submitted by the segment with the lost node excluded, on another node, its
    # node step's report in the segment's directory, and gone once the run ended
    assert node in excluded_by_job.split(","), excluded_by_job
    reports = [json.loads(p.read_text()) for p in (run / "logs" / f"{job}-0" / "nodes").glob("rollout-*-replacement-*.json")]
    assert len(reports) == 1 and reports[0]["slurm_job_id"] == replacement and reports[0]["hostname"] != node, reports
    assert reports[0]["ip"] == back["node"] and reports[0]["index"] == 4, reports  # a place past the job's 4 nodes
    assert lost["replaced_on"] == reports[0]["hostname"]
    events = _replacement_events(run, replacement)
    assert [e["event"] for e in events if e["event"] in ("replacement", "joined")] == ["replacement", "joined"], events
    run_watch.wait_for("the replacement to leave", lambda: any(
        e["event"] == "left" and "node" not in e for e in _replacement_events(run, replacement)), run, TIMEOUT_S,
        poll_s=0.5)
    left = [e for e in _replacement_events(run, replacement) if e["event"] == "left" and "node" in e]
    assert left and left[0]["reason"] in ("run-ended", "segment-ended"), left
    # status: the loss, the node excluded, the replacement and its GPU-hours
    from beam_hpc.observe.status import gather
    from beam_hpc.observe.status_table import format_status

    s = gather(run, slurm=False)
    (row,) = s["extra_rollout"]["jobs"]
    assert row["job_id"] == replacement and row["replaces"] == node and row["gpu_hours"] > 0, row
    text = format_status(s)
    assert f"replacing lost rollout node {node}" in text and f"excluded   {node}" in text, text
    # the engines went with the driver (Miles's dispose; the double's servers die with their actors)
    assert not _alive(recovered["pid"])
    print("segment end:", json.dumps(only["end"], indent=1))


def _replacements(run: Path) -> list[dict]:
    from beam_hpc.elastic.replace import replacements

    return replacements(run)


def _replacement_events(run: Path, job: str) -> list[dict]:
    from beam_hpc.elastic import registry

    return registry.read_events(registry.events_path(run, job))
