"""Extra rollout capacity, measured: the rollout phase with and without one extra worker, join and leave.

    python benchmarks/elastic.py [--rollouts 28] [--block 4] [--markdown FILE] [--json FILE]

One sync tiny-recipe run (the reference backend) on the local Slurm cluster
(tests/support/cluster/slurm_cluster.py), submitted the user's way (sbatch), with a batch big enough
for several units per rollout. While it trains, blocks of ``--block`` rollouts alternate, in one
run: the run's own worker alone, then the same worker plus one extra job (``beam-hpc rollout add
--nodes 1 --partition spot``), removed again (``beam-hpc rollout remove``) at the block's end. Every
unit runs with the run's one torch thread (the recipe's ``threads``), so the run's worker and the
extra worker each hold one of the machine's two cores.

- rollout phase: ``perf/rollout_wait_s`` of each rollout (the trainer's wait for its rollout in a
  sync run); a rollout counts as "alone" when no unit of it came from outside and no outside worker
  was registered, "plus one" when the extra worker served part of it; rollouts in between (the
  worker joining or leaving mid-rollout) are left out;
- join: from the ``rollout add`` command to the extra job's first accepted unit (Slurm's start,
  Python and torch imports, the policy's verified load, registration and one unit);
- leave: from ``rollout remove`` (the signal to the job's tasks) to the node's ``left`` event,
  which the worker writes after it deregistered and gave its unit back.

The machine's load is printed: the numbers are only comparable between runs on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), *(str(ROOT / "tests" / "support" / d)
                             for d in ("builders/runs", "builders/waiting", "cluster"))]

from reference_harness import SMALL, build_tiny_assets  # noqa: E402
from slurm_cluster import LocalSlurmCluster  # noqa: E402

from beam_hpc.cli.app import main as cli  # noqa: E402
from beam_hpc.elastic import registry  # noqa: E402
from beam_hpc.run import metric_names  # noqa: E402

WAIT = "perf/rollout_wait_s"
UNITS_OUTSIDE = "elastic/units_outside"
OUTSIDE_WORKERS = "elastic/outside_workers"
TIMEOUT_S = 600


def metrics(run: Path) -> dict[int, dict]:
    """The last line of each rollout in dumps/metrics.jsonl."""
    out: dict[int, dict] = {}
    try:
        lines = (run / "dumps" / metric_names.METRICS_FILE).read_text().splitlines(keepends=True)
    except FileNotFoundError:
        return out
    for line in lines:
        if line.endswith("\n"):
            rec = json.loads(line)
            if "rollout_id" in rec and rec.get("kind", "rollout") == "rollout":
                out[int(rec["rollout_id"])] = rec
    return out


def wait(what: str, predicate, timeout: float = TIMEOUT_S, poll_s: float = 0.1):  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = predicate()
        if got:
            return got
        time.sleep(poll_s)
    raise SystemExit(f"timed out waiting for {what}")


def events(run: Path, job: str) -> list[dict]:
    return registry.read_events(registry.events_path(run, job))


def run_benchmark(rollouts: int, block: int, root: Path) -> dict:
    from beam_hpc.submission.submit import submit

    assets = build_tiny_assets()
    run = root / "run"
    overrides = [f"model.path={assets.model_dir}", f"data.dir={assets.data_dir}", *SMALL, "batch.prompts=16",
                 "checkpoint.interval=1000", "training.async_training=false", "lifecycle.walltime=00:20:00"]
    sub = submit(ROOT / "recipes" / "tiny.yaml", ROOT / "env" / "local.yaml", overrides=overrides,
                 output_dir=str(run), num_rollout=rollouts, via="sbatch")
    print(f"run job {sub.job_id}: {rollouts} rollouts, blocks of {block}", flush=True)
    done = lambda: len(metrics(run)) >= rollouts  # noqa: E731
    joins, leaves, jobs = [], [], []

    def leave(job: str) -> None:
        t_signal = time.time()
        assert cli(["rollout", "remove", str(run), job]) == 0
        left = wait("the extra worker's left", lambda: next(
            (e for e in events(run, job) if e["event"] == "left" and "node" in e), None))
        leaves.append(left["time"] - t_signal)

    k = block  # rollouts 0..block-1: the run's worker alone (and warm)
    while k + 2 * block <= rollouts:
        wait(f"rollout {k - 1}", lambda k=k: len(metrics(run)) >= k)
        t_add = time.time()
        assert cli(["rollout", "add", str(run), "--nodes", "1", "--partition", "spot", "--time", "00:10:00"]) == 0
        job = registry.extra_jobs(run)[-1].job_id
        jobs.append(job)
        first = wait("the extra worker's first unit", lambda job=job: done() or next(
            (e for e in events(run, job) if e["event"] == "unit"), None))
        if first is True:  # the run ended before the extra worker served anything
            leave(job)
            break
        joins.append(first["time"] - t_add)
        k = int(first["rollout"]) + block  # a block with the extra worker, from the rollout it joined
        wait(f"rollout {k - 1}", lambda k=k: len(metrics(run)) >= min(k, rollouts))
        leave(job)
        print(f"job {job}: joined in {joins[-1]:.2f} s at rollout {first['rollout']}, left in {leaves[-1]:.2f} s",
              flush=True)
        k += block  # a block alone
    wait("the run's last rollout", done)
    m = metrics(run)
    alone = [r[WAIT] for i, r in sorted(m.items()) if i >= block // 2 and r.get(UNITS_OUTSIDE) == 0
             and r.get(OUTSIDE_WORKERS) == 0]
    plus = [r[WAIT] for r in m.values() if (r.get(UNITS_OUTSIDE) or 0) > 0]
    return {"rollouts": rollouts, "block": block, "run_job": sub.job_id, "extra_jobs": jobs, "alone_s": alone,
            "plus_one_s": plus, "join_s": joins, "leave_s": leaves, "load": os.getloadavg()}


def _row(name: str, xs: list[float]) -> str:
    if not xs:
        return f"| {name} | 0 | - | - | - |"
    return f"| {name} | {len(xs)} | {statistics.median(xs):.2f} | {min(xs):.2f} | {max(xs):.2f} |"


def table(r: dict) -> str:
    lines = ["| measure (seconds) | n | median | min | max |", "|---|---|---|---|---|",
             _row("rollout phase, run's worker alone", r["alone_s"]),
             _row("rollout phase, plus one extra worker", r["plus_one_s"]),
             _row("join: rollout add -> first unit served", r["join_s"]),
             _row("leave: signal -> deregistered", r["leave_s"])]
    if r["alone_s"] and r["plus_one_s"]:
        lines.append(f"\nspeed-up of the rollout phase: {statistics.median(r['alone_s']) / statistics.median(r['plus_one_s']):.2f}x "
                     f"(medians); load average at the end {', '.join(f'{x:.1f}' for x in r['load'])}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=28)
    parser.add_argument("--block", type=int, default=4)
    parser.add_argument("--json", default=None)
    parser.add_argument("--markdown", default=None)
    args = parser.parse_args()
    cluster = LocalSlurmCluster()
    cluster.join()
    root = Path(tempfile.mkdtemp(prefix="beam-elastic-bench-", dir="/tmp"))
    try:
        cluster.up(started_by_tests=True)
        os.environ.update(cluster.env)
        result = run_benchmark(args.rollouts, args.block, root)
    finally:
        cluster.cancel_jobs_under(root)
        cluster.leave()
        shutil.rmtree(root, ignore_errors=True)
    text = table(result)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    if args.markdown:
        Path(args.markdown).write_text(f"# benchmarks/elastic.py ({time.strftime('%Y-%m-%d')})\n\n{text}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
