"""What an interruption costs: rollouts re-done and restart overhead, with and without save-on-request.

    python benchmarks/interruptions.py [--json results.json] [--seed N]

The tiny recipe with the reference backend on the local Slurm cluster (tests/support/cluster/slurm_cluster.py),
submitted the user's way (``beam_hpc.submission.submit``: plan, script, sbatch), saving every 20 rollouts as
Miles does by default. Two runs of the same recipe go side by side (at the same time, so that
both see the same machine load):

- ``sentinel``: beam-hpc's lifecycle. On the walltime lead (USR1 or the job's own deadline) and on
  a preemption's USR1 the segment creates the save sentinel, waits for that checkpoint, stops.
- ``none``: ``lifecycle.save_on_request=false``, what a job without the sentinel gets. Walltime is
  the job killed at its time limit (SIGTERM; nothing saved on request); a preemption's grace time
  passes unused. Each resumes from the last periodic checkpoint.

Each run takes three interruptions, then completes:

1. walltime: a 2-minute limit with a 60 s lead (the resubmitted segment runs ``--resume``; its
   limit is then raised to 10 minutes, so that only the benchmark interrupts it);
2. preemption: a job in the ``urgent`` partition takes the segment's nodes (USR1, 20 s
   GraceTime, then Slurm requeues the job), ``P`` rollouts into the segment;
3. requeue: ``scontrol requeue`` (SIGTERM at once; no time to save in either run), ``P`` rollouts
   into the segment. ``P`` is drawn from ``--seed`` (printed) and is the same for both runs.

Measured per interruption, from the ledger and ``dumps/metrics.jsonl`` (whose lines this script
time-stamps as they appear, every 0.1 s):

- re-done: rollouts the interrupted segment trained that the next one trains again (rollout ids
  at or past where the next segment resumed);
- restart overhead: next segment's start (its ledger start line) -> its first rollout line (and
  the part of it that is Ray's bring-up, from the segment's log);
- gap: last rollout line of the interrupted segment -> first rollout line of the next (everything
  the interruption cost in wall time, queueing included).

Targets: 0 re-done at a walltime stop, at most 1 per preemption, overhead under 60 s.
A preemption with a grace time signals first (USR1) and can meet it; ``scontrol requeue`` cannot
(no warning: see :func:`verdict`), in either run.
The machine has 2 cores shared with other work: note the load (printed) when comparing runs.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from itertools import pairwise
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), *(str(ROOT / "tests" / "support" / d)
                             for d in ("builders/runs", "builders/waiting", "cluster", "standins"))]

from polling import poll_until
from reference_harness import SMALL, TinyAssets, build_tiny_assets
from slurm_cluster import LocalSlurmCluster

from beam_hpc.plan.plan import Plan
from beam_hpc.run import checkpoint_layout, ledger, metric_names

INTERVAL = 20  # Miles's default --save-interval
WALLTIME, LEAD_S = "00:02:00", 60
STEP_TIMEOUT_S = 300
MODES = ("sentinel", "none")


def wait(what: str, predicate, timeout: float, poll_s: float = 0.2) -> Any:
    """The first truthy value of ``predicate()``; TimeoutError naming ``what`` after ``timeout`` s
    (benchmarks/faults.py too)."""
    value = poll_until(predicate, timeout, poll_s)
    if not value:
        raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
    return value


def job_state(cluster: LocalSlurmCluster, job: str) -> str:
    """Slurm's JobState of ``job`` (of its first component, for a het job), or GONE (benchmarks/faults.py too)."""
    out = cluster.run("scontrol", "--oneliner", "show", "job", job, check=False).stdout
    fields = dict(tok.split("=", 1) for tok in out.split("\n")[0].split() if "=" in tok)
    return fields.get("JobState", "GONE")


class MetricsTail(threading.Thread):
    """Time-stamps each whole line of dumps/metrics.jsonl as it appears (the file has no times)."""

    def __init__(self, path: Path) -> None:
        super().__init__(daemon=True)
        self.path = path
        self.lines: list[tuple[float, dict[str, Any]]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        offset, partial = 0, b""
        while not self.stop.is_set():
            try:
                with open(self.path, "rb") as fh:
                    fh.seek(offset)
                    data = fh.read()
            except FileNotFoundError:
                data = b""
            now = time.time()
            offset += len(data)
            *whole, partial = (partial + data).split(b"\n")
            self.lines += [(now, json.loads(x)) for x in whole if x.strip()]
            time.sleep(0.1)

    def rollouts(self) -> list[tuple[float, int]]:
        return [(t, m["rollout_id"]) for t, m in list(self.lines) if m.get("kind") == "rollout"]


class Run:
    """One run of the scenario (one mode), driven from its own thread."""

    def __init__(self, mode: str, root: Path, assets: TinyAssets, cluster: LocalSlurmCluster, new_rollouts: int) -> None:
        self.mode, self.cluster, self.assets, self.p = mode, cluster, assets, new_rollouts
        self.dir = root / mode
        self.tail = MetricsTail(self.dir / "dumps" / metric_names.METRICS_FILE)
        self.plan: Plan | None = None
        self.error: BaseException | None = None
        self.events: list[str] = []

    # -- helpers ---------------------------------------------------------------------------------
    def segments(self) -> list[dict]:
        return ledger.read_ledger(self.dir / "ledger.jsonl")[0]

    def wait(self, what: str, predicate, timeout: float = STEP_TIMEOUT_S, poll_s: float = 0.2) -> Any:
        return wait(f"{what} ({self.mode})", predicate, timeout, poll_s)

    def running_segment(self, count: int) -> dict:
        """Wait for segment number ``count`` (1-based) to be running, and return it."""
        segs = self.wait(f"segment {count}", lambda: (s := self.segments()) and len(s) >= count and s)
        return segs[count - 1]

    def ended(self, count: int) -> dict:
        segs = self.wait(f"the end of segment {count}", lambda: (s := self.segments()) and len(s) >= count
                         and "end" in s[count - 1] and s)
        return segs[count - 1]

    def after_new_rollouts(self, n: int) -> None:
        base = len(self.tail.rollouts())
        self.wait(f"{n} new rollouts", lambda: len(self.tail.rollouts()) >= base + n, poll_s=0.05)

    def note(self, text: str) -> None:
        self.events.append(f"{time.strftime('%H:%M:%S')} {text}")
        print(f"[{self.mode}] {text}", flush=True)

    # -- the scenario ----------------------------------------------------------------------------
    def __call__(self) -> None:
        try:
            self.scenario()
        except Exception as err:  # noqa: BLE001 - reported by main, with the run's ledger
            self.error = err
        finally:
            self.tail.stop.set()

    def scenario(self) -> None:
        from beam_hpc.submission.submit import submit

        self.tail.start()
        overrides = [f"model.path={self.assets.model_dir}", f"data.dir={self.assets.data_dir}", *SMALL,
                     f"checkpoint.interval={INTERVAL}", f"lifecycle.walltime={WALLTIME}", f"lifecycle.lead_s={LEAD_S}",
                     f"lifecycle.save_on_request={'true' if self.mode == 'sentinel' else 'false'}"]
        sub = submit(ROOT / "recipes" / "tiny.yaml", ROOT / "env" / "local.yaml", overrides=overrides,
                     output_dir=str(self.dir), num_rollout=100_000, via="sbatch")
        self.plan = sub.plan
        self.note(f"submitted job {sub.job_id}")
        # 1. walltime: the first segment ends by itself (lead or time limit) and resubmits
        first = self.ended(1)
        self.note(f"segment 1 ended: {first['end']['reason']} at {first['end']['rollouts_at_end']} rollouts")
        # the later segments are stopped by the benchmark, not by their walltime: give them room
        self.cluster.run("scontrol", "update", f"jobid={first['end']['next']['job_id']}", "TimeLimit=10", check=False)
        # 2. preemption by a job of the urgent partition on the second segment's nodes
        second = self.running_segment(2)
        job = second["start"]["job_id"]
        self.after_new_rollouts(self.p)
        nodes = self.cluster.run("squeue", "-h", "-j", job, "-o", "%N").stdout.split()
        urgent = self.cluster.run("sbatch", "--parsable", "-p", "urgent", f"--nodelist={','.join(nodes)}",
                                  "--exclusive", "-t", "1", "-o", "/dev/null", "--wrap", "sleep 2").stdout.strip()
        self.note(f"preempting job {job} with job {urgent}")
        seg = self.ended(2)
        self.note(f"segment 2 ended: {seg['end']['reason']} at {seg['end']['rollouts_at_end']} rollouts")
        self.release_requeued(job)
        # 3. scontrol requeue of the third segment (the same job, restart 1)
        self.running_segment(3)
        self.after_new_rollouts(self.p)
        self.cluster.run("scontrol", "requeue", job)
        self.note(f"scontrol requeue {job}")
        seg = self.ended(3)
        self.note(f"segment 3 ended: {seg['end']['reason']} at {seg['end']['rollouts_at_end']} rollouts")
        # the last segment finishes 10 rollouts past its checkpoint (`--num-rollout` semantics)
        target = checkpoint_layout.rollouts_done(self.dir / "checkpoints") + 10
        current = Plan.load(self.dir / "plan.json")
        current.with_num_rollout(target).write()
        self.release_requeued(job)
        last = self.wait("the run to complete", lambda: (s := self.segments()) and len(s) >= 4 and "end" in s[-1]
                         and s[-1]["end"]["next"]["action"] == "none" and s)[-1]
        self.note(f"run ended: {last['end']['reason']} at {last['end']['rollouts_at_end']} of {target}")
        time.sleep(0.5)  # the tail's last poll

    def release_requeued(self, job: str) -> None:
        """A requeued job may start only after cred_expire (10 s here): let it go when it pends,
        as the tests do (a real cluster's queue decides this)."""
        self.wait(f"job {job} to pend", lambda: job_state(self.cluster, job) == "PENDING", timeout=120)
        self.cluster.run("scontrol", "update", f"jobid={job}", "StartTime=now", check=False)

    # -- the numbers -------------------------------------------------------------------------------
    def rows(self) -> list[dict[str, Any]]:
        segs = self.segments()
        lines = self.tail.rollouts()
        kinds = ["walltime", "preemption (urgent job, 20 s grace)", "scontrol requeue"]
        out = []
        for i, (seg, nxt) in enumerate(pairwise(segs)):
            start_next = nxt["start"]["time"]
            start_this = seg["start"]["time"]
            mine = [(t, k) for t, k in lines if start_this <= t < start_next]
            theirs = [(t, k) for t, k in lines if t >= start_next]
            resumed_at = nxt["start"]["rollouts_at_start"]
            out.append({
                "mode": self.mode,
                "interruption": kinds[i] if i < len(kinds) else "?",
                "reason": seg["end"]["reason"] if "end" in seg else "(no end line)",
                "detail": (seg.get("end") or {}).get("detail", ""),
                "rollouts_trained": len(mine),
                "resumed_at": resumed_at,
                "redone": sum(1 for _, k in mine if k >= resumed_at),
                "overhead_s": round(theirs[0][0] - start_next, 1) if theirs else None,
                "ray_ready_s": self.ray_ready_s(nxt["segment"]),
                "gap_s": round(theirs[0][0] - mine[-1][0], 1) if theirs and mine else None,
            })
        return out

    def ray_ready_s(self, segment: str) -> float | None:
        """The part of a restart that is Ray coming up (the job's own measurement, in segment.log)."""
        try:
            text = (self.dir / "logs" / segment / "segment.log").read_text()
        except FileNotFoundError:
            return None
        found = re.search(r"Ray ready after ([0-9.]+) s", text)
        return float(found.group(1)) if found else None


def table(rows: list[dict[str, Any]]) -> str:
    out = [("| interruption | run | ended as | rollouts in segment | resumed at | re-done | restart overhead (s) "
            "| of which Ray bring-up (s) | gap (s) |"),
           "|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (["walltime", "preemption", "scontrol"].index(r["interruption"].split()[0]),
                                         MODES.index(r["mode"]))):
        out.append(f"| {r['interruption']} | {r['mode']} | {r['reason']} | {r['rollouts_trained']} | {r['resumed_at']} "
                   f"| {r['redone']} | {r['overhead_s']} | {r.get('ray_ready_s')} | {r['gap_s']} |")
    return "\n".join(out)


def verdict(rows: list[dict[str, Any]]) -> list[str]:
    """The issue's targets, judged for the sentinel run. ``scontrol requeue`` gives no warning:
    Slurm sends SIGTERM to the batch script and to every step at once (the Ray nodes too), so
    nothing can be saved and the bound is the rollouts since the last periodic checkpoint."""
    out = []
    for r in (r for r in rows if r["mode"] == "sentinel"):
        hard = r["interruption"] == "scontrol requeue"
        limit = INTERVAL - 1 if hard else 0 if r["interruption"] == "walltime" else 1
        why = " (no warning: bounded by the save interval)" if hard else ""
        ok_redone = r["redone"] <= limit
        ok_overhead = r["overhead_s"] is not None and r["overhead_s"] < 60
        out.append(f"{r['interruption']}: re-done {r['redone']} (target <= {limit}{why}: {'met' if ok_redone else 'MISSED'}), "
                   f"overhead {r['overhead_s']} s (target < 60 s: {'met' if ok_overhead else 'MISSED'})")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, help="write the rows, the events and the settings here")
    p.add_argument("--seed", type=int, default=None, help="draws P, the rollouts into a segment before it is interrupted")
    p.add_argument("--keep", action="store_true", help="keep the run directories (printed)")
    args = p.parse_args(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 31)
    new_rollouts = random.Random(seed).randint(3, 12)
    print(f"seed {seed}: interrupting {new_rollouts} rollouts into a segment; load {os.getloadavg()[0]:.2f}", flush=True)
    assets = build_tiny_assets()
    cluster = LocalSlurmCluster()
    cluster.join()
    root = Path(tempfile.mkdtemp(prefix="beam-int-", dir="/tmp"))
    runs: list[Run] = []
    try:
        cluster.up(started_by_tests=True)
        os.environ.update(cluster.env)
        t0 = time.time()
        runs = [Run(mode, root, assets, cluster, new_rollouts) for mode in MODES]
        threads = [threading.Thread(target=r, name=r.mode) for r in runs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.time() - t0
        failed = [r for r in runs if r.error is not None]
        for r in failed:
            print(f"[{r.mode}] FAILED: {r.error}\n{(r.dir / 'ledger.jsonl').read_text() if (r.dir / 'ledger.jsonl').exists() else ''}",
                  file=sys.stderr)
        rows = [row for r in runs for row in r.rows()]
        print(f"\n{table(rows)}\n\n" + "\n".join(verdict(rows)) + f"\n\nwall {wall:.0f} s; load {os.getloadavg()[0]:.2f}")
        if args.json:
            args.json.write_text(json.dumps({
                "seed": seed, "new_rollouts_before_interrupt": new_rollouts, "interval": INTERVAL, "walltime": WALLTIME,
                "lead_s": LEAD_S, "wall_s": round(wall, 1), "rows": rows, "events": {r.mode: r.events for r in runs},
                "errors": {r.mode: repr(r.error) for r in failed}}, indent=2))
        return 1 if failed else 0
    finally:
        clean_up(cluster, root, [r.plan.job_name for r in runs if r.plan is not None], keep=args.keep)


def clean_up(cluster: LocalSlurmCluster, root: Path, job_names: list[str], *, keep: bool) -> None:
    """Nothing of ours left queued, the run directories kept (printed) or removed, the cluster left
    (stopped only if no one else uses it). benchmarks/faults.py ends the same way."""
    for name in job_names:
        subprocess.run(["scancel", f"--name={name}"], env={**os.environ, **cluster.env}, capture_output=True,
                       check=False)
    if keep:
        print(f"run directories: {root}")
    else:
        shutil.rmtree(root, ignore_errors=True)
    cluster.leave()


if __name__ == "__main__":
    sys.exit(main())
