"""A Miles run's lost rollout node, three ways, measured on the local Slurm cluster.

    python benchmarks/miles_node_loss.py [--rollouts 16] [--after 5] [--interval 4] [--rollout-s 6]
                                         [--policies in_place save_then_end restart] [--json FILE]

One chain per policy, each losing the same rollout node (the one serving engine 1) once it has
trained ``--after`` rollouts, as Slurm sees a node failure (FAIL then DOWN, every process of its
node step SIGKILLed, as tests/backends/miles/test_miles_engine_recovery_slurm.py does):

- ``in_place`` (the product's default for the seed's dedicated recipe): the segment saves the
  rollout in flight, a replacement node joins its Ray cluster, Miles restarts the lost engine there
  and the segment trains on (beam_hpc.elastic.ray_replacement);
- ``save_then_end`` (``lifecycle.replacement_wait_s=0``): the segment saves, then ends as a node
  failure and is resubmitted without the node (what beam-hpc did before the replacement);
- ``restart`` (``lifecycle.rollout_node_loss=restart``): no ``--no-kill``, so Slurm revokes the job;
  it is requeued and resumes from the last periodic checkpoint (every ``--interval`` rollouts).

What runs: the user's submission (sbatch), Slurm, the segments, Ray on both groups, beam-hpc's Miles
launcher, and the Miles double (tests/support/standins/miles_standin), whose engines are Ray actors
on the rollout bundles as Miles's are and whose training is a sleep of ``--rollout-s`` seconds plus
a real megatron-core checkpoint save. So the figures are beam-hpc's orchestration around a fake
trainer: detection, saves, the replacement's submission and join, resubmission and bring-up. They
are not Miles's own load and warm-up times, which at the seed's scale are minutes (see
benchmarks/ettr.py for the projection with those).

Per chain: segments, held seconds (start to end line of each segment, beam_hpc.run.accounting's
wall time), training seconds on kept rollouts and ETTR (beam_hpc.observe.ettr, from the ledger),
rollouts trained again (trained but not kept: rollouts_at_start + rollouts_run - rollouts_at_end,
summed over the segments), and (in place) the seconds from the loss to the lost engine's restart
on the replacement. A requeued
job pends until its BeginTime on this cluster; the benchmark releases it at once (kind to
``restart``: a real queue may hold it far longer). Needs root and the local cluster
(tests/support/cluster/slurm_cluster.py); it marks a node DOWN, so run it when no tests use the cluster.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), *(str(ROOT / "tests" / "support" / d)
                             for d in ("builders/miles", "builders/waiting", "cluster", "standins"))]

POLICIES = {
    "in_place": [],
    "save_then_end": ["lifecycle.replacement_wait_s=0"],
    "restart": ["lifecycle.rollout_node_loss=restart"],
}
STEP_TIMEOUT_S = 900.0
HEALTH = ["--rollout-health-check-interval", "0.5", "--rollout-health-check-timeout", "5"]


def note(text: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} [load {os.getloadavg()[0]:.1f}] {text}", flush=True)


def wait(what: str, predicate: Any, timeout: float = STEP_TIMEOUT_S, poll_s: float = 0.3) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(poll_s)


def standin_records(run: Path) -> list[dict[str, Any]]:
    """Every driver's record of the Miles double (one file per driver process)."""
    out = []
    for path in sorted((run / "dumps").glob("standin*.json")):
        try:
            out.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            pass
    return out


def submit(run: Path, policy: str, rollouts: int, interval: int, rollout_s: float) -> tuple[str, Any]:
    from miles_run import local_site, miles_recipe

    from beam_hpc.config.recipe import apply_overrides, recipe_from_dict
    from beam_hpc.config.site import site_from_dict
    from beam_hpc.submission.submit import submit as submit_run

    d = miles_recipe(run.parent)
    d["num_rollout"] = rollouts
    d["checkpoint"] = {"interval": interval}
    d["topology"] = {"trainer": {"nodes": 2, "gpus_per_node": 1},
                     "rollout": {"nodes": 2, "gpus_per_node": 1, "gpus_per_engine": 1}}
    d["backend_options"] = {"extra_args": HEALTH}
    d["lifecycle"]["walltime"] = "00:30:00"
    apply_overrides(d, list(POLICIES[policy]))
    s = local_site()
    s["env"]["BEAM_STANDIN_ROLLOUT_S"] = str(rollout_s)
    sub = submit_run(recipe_from_dict(d, f"miles node loss, {policy}"), site_from_dict(s, "local site, Miles double"),
                     via="sbatch")
    return str(sub.job_id), sub.plan


def strike(cluster: Any, run: Path, job: str) -> dict[str, Any]:
    """Lose the rollout node of engine 1: FAIL then DOWN (FAIL survives this cluster's slurmd
    answering), and every process of its node step SIGKILLed."""
    from beam_hpc.node import procs

    record = standin_records(run)[0]
    engine = next(e for e in record["engine_events"] if e["event"] == "started" and e["engine"] == 1)
    reports = [json.loads(p.read_text()) for p in (run / "logs" / f"{job}-0" / "nodes").glob("rollout-*.json")]
    (step,) = [r for r in reports if r.get("ip") == engine["node"]]
    node = step["hostname"]
    for state in ("fail", "down"):
        cluster.run("scontrol", "update", f"nodename={node}", f"state={state}", "reason=beam-bench-node-lost")
    pids = procs.with_descendants([int(step["pid"])])
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return {"node": node, "at": time.time(), "rollouts_at": len(record["rollouts"]), "killed": len(pids)}


def release_requeued(cluster: Any, name: str) -> None:
    """A requeued job pends until its BeginTime here: let it start now."""
    out = cluster.run("squeue", "-h", "-t", "PD", "-n", name, "-o", "%i %r", check=False).stdout
    for line in out.splitlines():
        job, _, reason = line.partition(" ")
        if "BeginTime" in reason:
            cluster.run("scontrol", "update", f"jobid={job.split('+')[0]}", "StartTime=now", check=False)


def chain(cluster: Any, root: Path, policy: str, args: argparse.Namespace) -> dict[str, Any]:
    from run_watch import chain_finished, segments

    from beam_hpc.observe.ettr import read_ettr

    run = root / policy / "run"
    run.parent.mkdir(parents=True)
    t0 = time.time()
    job, plan = submit(run, policy, args.rollouts, args.interval, args.rollout_s)
    note(f"[{policy}] submitted job {job}")
    struck: dict[str, Any] = {}
    errors: list[str] = []
    try:
        wait("the loss's rollout", lambda: standin_records(run) and len(standin_records(run)[0]["rollouts"]) >= args.after
             and standin_records(run)[0]["generated"][-1].get("update_s") is not None, poll_s=0.1)
        struck = strike(cluster, run, job)
        note(f"[{policy}] lost {struck['node']} after {struck['rollouts_at']} rollouts")

        def done() -> bool:
            release_requeued(cluster, plan.job_name)
            return chain_finished(run)

        wait("the chain to complete", done, poll_s=1.0)
    except (TimeoutError, OSError, KeyError, ValueError, StopIteration) as err:
        errors.append(f"{type(err).__name__}: {err}")
    finally:
        if struck:
            cluster.run("scontrol", "update", f"nodename={struck['node']}", "state=resume", check=False)
    try:
        wait("the chain's jobs to leave the queue",
             lambda: not cluster.run("squeue", "-h", "-n", plan.job_name, "-o", "%i", check=False).stdout.strip()
             and not cluster.run("squeue", "-h", "-n", f"{plan.job_name}-rollout", "-o", "%i", check=False).stdout.strip(),
             180, 1.0)
    except TimeoutError as err:
        errors.append(str(err))
    segs = segments(run)
    e, _ = read_ettr(run)
    again = sum(max(0, s["start"]["rollouts_at_start"] + (s["end"].get("rollouts_run") or 0) - s["end"]["rollouts_at_end"])
                for s in segs if "start" in s and "end" in s)
    # in place: the lost engine restarted on the replacement (the double's recovered event after the loss)
    back = [ev["t"] for rec in standin_records(run) for ev in rec["engine_events"]
            if ev["event"] == "recovered" and struck and ev["t"] > struck["at"]]
    return {"policy": policy, "job": job, "struck": struck, "segments": len(segs), "held_s": round(e.held_s, 1),
            "training_s": round(e.training_s, 1), "ettr": e.ratio, "rollouts_kept": e.rollouts_kept,
            "trained_again": again, "engine_back_s": round(min(back) - struck["at"], 1) if back else None,
            "ends": [(s.get("end") or {}).get("reason") for s in segs], "wall_s": round(time.time() - t0, 1),
            "errors": errors}


def table(rows: list[dict[str, Any]]) -> str:
    head = ("| policy | segments (ends) | held s | training s | ETTR | rollouts trained again | engine back after s |\n"
            "|---|---|---:|---:|---:|---:|---:|")
    lines = [head]
    for r in rows:
        ettr = "-" if r["ettr"] is None else f"{r['ettr']:.3f}"
        lines.append(f"| {r['policy']} | {r['segments']} ({', '.join(str(x) for x in r['ends'])}) | {r['held_s']:.0f} | "
                     f"{r['training_s']:.0f} | {ettr} | {r['trained_again']} | {r['engine_back_s'] or '-'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rollouts", type=int, default=16)
    p.add_argument("--after", type=int, default=5, help="rollouts trained before the node is lost")
    p.add_argument("--interval", type=int, default=4, help="periodic checkpoints (what a restart resumes from)")
    p.add_argument("--rollout-s", type=float, default=6.0, help="the double's training seconds per rollout")
    p.add_argument("--policies", nargs="+", choices=sorted(POLICIES), default=list(POLICIES))
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    from slurm_cluster import LocalSlurmCluster

    cluster = LocalSlurmCluster()
    cluster.join()
    try:
        cluster.up(started_by_tests=False)
        os.environ.update(cluster.env)
        rows = []
        with tempfile.TemporaryDirectory(prefix="beam-mnl-", dir="/tmp") as tmp:
            for policy in args.policies:
                rows.append(chain(cluster, Path(tmp), policy, args))
                note(f"[{policy}] {json.dumps(rows[-1])}")
    finally:
        cluster.leave()
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k != "json"}, "rows": rows},
                                        indent=1))
    return 0 if all(not r["errors"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
