"""A fault campaign: one tiny-recipe chain meets every fault beam-hpc claims to survive.

    python benchmarks/faults.py --seed N [--json FILE] [--keep] [--reference DIR]
    python benchmarks/faults.py --reanalyse FILE
    python benchmarks/faults.py --node-loss --seeds 1 2 [--rollouts N] [--json FILE] [--keep]

(``--node-loss``: the "rollout node lost" fault under both lifecycle.rollout_node_loss policies,
in place and full restart, side by side on a private Slurm cluster, with their ETTR: see the
section of that name below.)

The tiny recipe (its own batch, evaluation off) with the reference backend on the local Slurm
cluster (tests/support/cluster/slurm_cluster.py), submitted once, the user's way (``beam_hpc.submission.submit``,
``via="sbatch"``), with its total of :data:`ROLLOUTS` rollouts: plan.json is never touched again. The
chain then meets, in an order drawn from ``--seed`` (printed, with the schedule):

- 3 walltime stops: the running job's TimeLimit is lowered with ``scontrol update`` (which users may
  do to their own jobs) so that its end comes 60-120 s later; the product's walltime path does the
  rest (USR1 or its own deadline, the lead's save, a resubmission with ``--resume``);
- a preemption: a job on the ``urgent`` partition takes the segment's nodes (USR1, 20 s grace, the
  save, the requeue of the same job id);
- a killed node step: SIGKILL to the node step process of one node (a node failure: the node is
  excluded, the chain resubmits);
- a hung driver, when the stall watchdog is there (``stalled`` is a ledger reason): the reference
  backend's tests-only hook ``BEAM_TEST_HANG_AFTER_ROLLOUT=k`` in the job's environment at
  submission, so the driver stops making progress after rollout ``k``;
- a torn latest checkpoint: between two segments (the next one held with ``scontrol hold``), a
  file of the newest checkpoint is cut to half its size; the next segment must find it by the
  manifest and resume from the previous checkpoint;
- a controller outage at the walltime save, when the segment rides one out (its resubmission
  retries while Slurm cannot be reached, beam_hpc.lifecycle.actions): a walltime stop as above,
  and slurmctld stopped (by its pidfile) the moment the segment asks for its save, for
  :data:`OUTAGE_S` seconds. The segment must save, resubmit once the controller is back, and the
  chain go on. This stops the cluster's controller: run the campaign on a cluster no one else uses.

The torn checkpoint is drawn into one of the boundaries after a stop (it is only ever found by the
segment that resumes). The hang's ``k`` is fixed at submission from the drawn order and the
expected progress of the stops before it (:data:`EXPECTED_PROGRESS`); where the chain runs faster
than that, the driver hangs in an earlier segment and the table shows the order that happened.

Per fault it prints how it was detected (the ledger line of the segment that noticed it) and after
how many seconds (from the fault to that line), the rollouts re-done (from ``dumps/metrics.jsonl``:
rollouts trained before the next segment that it trains again), and the GPU-hours lost by cause
as :mod:`beam_hpc.run.accounting` attributes them (the struck segment's re-done rollouts, walltime
tail and failed time, the next segment's bring-up, and the rollouts trained again after a
damaged checkpoint). Then the campaign's goodput (useful / held GPU-hours, the same module), its
ETTR (:mod:`beam_hpc.observe.ettr`: training on kept rollouts over the wall time held), and
whether the final checkpoint equals an uninterrupted run's bitwise (the reference backend alone,
on a local Ray head: ``--reference DIR`` reuses one, since it depends on the recipe only).

The bar: every fault survived (each struck segment ended as that fault should end it and the chain
went on to complete), nothing lost (every rollout trained, the final checkpoint at the total, the
dataset cursor exact, each segment resumed where its start line says), and the final weights bitwise
equal. The machine is shared: its load (``os.getloadavg``) is sampled and printed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), *(str(ROOT / "tests" / "support" / d)
                             for d in ("builders/runs", "builders/waiting", "cluster", "standins")),
                str(ROOT / "benchmarks")]

ROLLOUTS = 80  # the chain's total: room for every stop's progress, and a last segment that completes
INTERVAL = 5  # periodic checkpoints
WALLTIME, LEAD_S = "00:20:00", 60  # only the campaign's faults stop a segment
MAX_SEGMENTS = 30
STALL_TIMEOUT_S, STARTUP_TIMEOUT_S = 45, 400  # the stall watchdog's (when there is one)
HANG_VAR = "BEAM_TEST_HANG_AFTER_ROLLOUT"  # the reference backend's tests-only hook
GPUS_PER_NODE = 1  # the local cluster's fake GPUs, one per group node: GPU-hours are counted
RECIPE_OVERRIDES = ["eval.interval=0", f"checkpoint.interval={INTERVAL}",
                    f"topology.trainer.gpus_per_node={GPUS_PER_NODE}", f"topology.rollout.gpus_per_node={GPUS_PER_NODE}"]
STEP_TIMEOUT_S = 900  # any one wait; generous: the machine has 2 shared cores
STOPS = ("walltime", "walltime", "walltime", "preemption", "node-kill", "hang", "controller-outage")
TORN = "torn-checkpoint"
OUTAGE = "controller-outage"
OUTAGE_S = 150  # the issue's: longer than the 45-60 s lead, so the job's limit passes in the outage
# Rollouts a chain is expected to keep per stop (on the loaded 2-core machine a rollout takes 3.5-6 s
# and a walltime stop comes 0-90 s after the lowered limit, about 45 s; the others strike within a
# few rollouts): where the hang's k is set at submission
EXPECTED_PROGRESS = {"walltime": 12, "preemption": 6, "node-kill": 7, "hang": 5, TORN: -3, OUTAGE: 12}
# How each fault should end the segment that meets it (ledger reason, next action)
# How long each fault takes to end a segment once struck (a walltime stop: 0-90 s): a driver that
# would reach the hang's rollout within it is left to hang first, alone in its segment
STRIKE_WINDOW_S = {"walltime": 100, "preemption": 30, "node-kill": 20, OUTAGE: 100}
EXPECTED_END = {"walltime": ("walltime", "resubmit"), OUTAGE: ("walltime", "resubmit"), "preemption": ("preempted", "requeue"),
                "node-kill": ("node-failure", "resubmit"), "hang": ("stalled", "resubmit")}


@dataclass(frozen=True)
class Fault:
    """One planned fault. ``after``: new rollouts the segment trains before it strikes (a
    node kill also waits for the segment's first new checkpoint, so that the failure is one
    after progress); ``pick``: a draw in [0, 1) for the fault's own choice (the node step's group,
    the checkpoint file to tear)."""

    kind: str
    after: int
    pick: float


def schedule(seed: int, *, hang: bool, outage: bool = False) -> list[Fault]:
    """The faults in the order the chain meets them, from ``seed`` alone: the stops shuffled, the
    torn checkpoint at one of the boundaries after a stop. ``hang``/``outage``: whether the
    product has a stall watchdog / rides out a controller outage (else those are left out)."""
    rng = random.Random(seed)
    stops = [k for k in STOPS if (hang or k != "hang") and (outage or k != OUTAGE)]
    rng.shuffle(stops)
    faults = [Fault(k, rng.randint(2, 4), round(rng.random(), 3)) for k in stops]
    faults.insert(rng.randint(1, len(faults)), Fault(TORN, 0, round(rng.random(), 3)))
    return faults


def hang_rollout(faults: list[Fault]) -> int | None:
    """The rollout after which the driver hangs: the progress expected before the hang's turn,
    plus its own ``after`` (None without a hang in the schedule)."""
    before = 0
    for f in faults:
        if f.kind == "hang":
            return max(INTERVAL, before + f.after)
        before += EXPECTED_PROGRESS[f.kind]
    return None


# -- the record's analysis (pure: --reanalyse prints it again from a saved record) ---------------------------


def _segments_by_name(record: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {s["segment"]: s for s in record["ledger"]}


def _next_segment(record: dict[str, Any], name: str) -> dict[str, Any] | None:
    names = [s["segment"] for s in record["ledger"]]
    i = names.index(name)
    return record["ledger"][i + 1] if i + 1 < len(names) else None


def redone_at(record: dict[str, Any], nxt: dict[str, Any]) -> int:
    """Rollouts trained before segment ``nxt`` started that it trains again (from metrics.jsonl)."""
    t = nxt["start"]["time"]
    before = [k for k, at in record["rollouts"] if at < t]
    after = [k for k, at in record["rollouts"] if at >= t]
    if not before or not after:
        return 0
    return max(0, max(before) + 1 - after[0])


def _hours(record: dict[str, Any]):  # -> accounting.RunHours
    from beam_hpc.run import accounting

    return accounting.account(record["ledger"], record["gpus"], now=record["ended_at"])


def rows(record: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per fault met: detection (how, seconds), rollouts re-done, GPU-hours lost by cause."""
    from beam_hpc.run import accounting

    segs = _segments_by_name(record)
    times = {t.segment: t for t in _hours(record).segments}
    per_h = record["gpus"] / 3600.0
    torn_at = {f["segment"]: f for f in record["faults"] if f["kind"] == TORN and f.get("segment")}
    out = []
    for f in record["faults"]:
        row: dict[str, Any] = {"fault": f["kind"], "injected": f.get("how", ""), "segment": f.get("segment"),
                               "detected": None, "after_s": None, "ended": None, "ended_after_s": None, "redone": None,
                               "lost_h": {c: 0.0 for c in accounting.CAUSES}, "survived": False}
        seg = segs.get(f.get("segment") or "")
        if seg is None:
            row["detected"] = f.get("error", "not met")
            out.append(row)
            continue
        nxt = _next_segment(record, seg["segment"])
        if f["kind"] == TORN:  # met by the segment that resumes: seg is that one
            passed = seg["start"].get("damaged_checkpoints") or []
            row["ended"] = (f"start line: passed over checkpoint {', '.join(str(d['iteration']) for d in passed)}"
                            f" ({_short(passed[0]['why'])})" if passed else "not detected")
            row["ended_after_s"] = round(seg["start"]["time"] - f["at"], 1)
            _noticed(row, f)
            struck = segs.get(f.get("after_segment") or "")
            row["redone"] = (struck["end"]["rollouts_at_end"] - seg["start"]["rollouts_at_start"]) if struck else None
            t = times.get(seg["segment"])
            if t is not None:
                row["lost_h"][accounting.DAMAGED] = t.lost_s.get(accounting.DAMAGED, 0.0) * per_h
            row["survived"] = bool(passed) and any(d["iteration"] == f["iteration"] for d in passed)
            out.append(row)
            continue
        end = seg.get("end") or {}
        row["ended"] = (f"{end.get('reason')} -> {(end.get('next') or {}).get('action')}: {_short(end.get('detail', ''))}"
                        if end else "no end line")
        row["ended_after_s"] = round(end["time"] - f["at"], 1) if end and f.get("at") is not None else None
        _noticed(row, f)
        if nxt is not None:
            row["redone"] = redone_at(record, nxt)
            if nxt["segment"] in torn_at:  # the torn checkpoint's share of this boundary is its own row
                row["redone"] -= max(0, end.get("rollouts_at_end", 0) - nxt["start"]["rollouts_at_start"])
        t = times.get(seg["segment"])
        if t is not None:  # what the struck segment lost (its own bring-up and damage were earlier faults')
            for cause in accounting.CAUSES:
                if cause not in (accounting.BRINGUP, accounting.DAMAGED):
                    row["lost_h"][cause] = t.lost_s.get(cause, 0.0) * per_h
        t_next = times.get(nxt["segment"]) if nxt is not None else None
        if t_next is not None:  # the restart this fault caused
            row["lost_h"][accounting.BRINGUP] = t_next.lost_s.get(accounting.BRINGUP, 0.0) * per_h
        want = EXPECTED_END.get(f["kind"])
        row["survived"] = (end.get("reason"), (end.get("next") or {}).get("action")) == want and nxt is not None
        if f["kind"] == "node-kill":
            row["survived"] = row["survived"] and f.get("node") in [n["node"] for n in end.get("failed_nodes", [])]
        out.append(row)
    return out


def _noticed(row: dict[str, Any], f: dict[str, Any]) -> None:
    """The detection: the first warning the segment logged after the fault (see :func:`first_alarm`)."""
    if f.get("noticed_at") is not None and f.get("at") is not None:
        row["detected"] = _short(f["noticed"])
        row["after_s"] = round(f["noticed_at"] - f["at"], 1)
    else:
        row["detected"] = "(no warning logged)"


def first_alarm(log_path: Path, since: float) -> tuple[float, str] | None:
    """The first WARNING or ERROR line of a segment.log (``asctime name level message``, local
    time) at or after ``since``: when and how the segment noticed a fault."""
    from datetime import datetime

    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split(" ", 4)
        if len(parts) < 5 or parts[3] not in ("WARNING", "ERROR"):
            continue
        try:
            at = datetime.strptime(f"{parts[0]} {parts[1]}", "%Y-%m-%d %H:%M:%S,%f").timestamp()
        except ValueError:
            continue
        if at >= since - 0.01:  # asctime keeps milliseconds (truncated)
            return at, parts[4]
    return None


def _short(text: str, width: int = 70) -> str:
    """The first clause of a ledger detail or log message, without the run directory's paths."""
    first = re.sub(r"\S*/(?=(checkpoints|logs)/)", "", text.split(" -> ")[0].split("; log:")[0])
    return first if len(first) <= width else first[: width - 3] + "..."


def table(record: dict[str, Any]) -> str:
    from beam_hpc.run import accounting

    causes = [c for c in accounting.CAUSES]
    head = ("| # | fault | injected | segment | detected (first warning) | after (s) | recorded in the ledger as "
            "| after (s) | rollouts re-done | " + " | ".join(f"GPU-h lost: {c}" for c in causes) + " | survived |")
    out = [head, "|" + "---|" * (10 + len(causes))]
    for i, r in enumerate(rows(record), 1):
        lost = " | ".join(f"{r['lost_h'][c]:.4f}" for c in causes)
        out.append(f"| {i} | {r['fault']} | {r['injected']} | {r['segment']} | {r['detected']} | {r['after_s']} "
                   f"| {r['ended']} | {r['ended_after_s']} | {r['redone']} | {lost} | {'yes' if r['survived'] else 'NO'} |")
    return "\n".join(out)


def summary(record: dict[str, Any]) -> dict[str, Any]:
    """Goodput and the bar's three parts, from the record."""
    from beam_hpc.observe.ettr import ettr

    h = _hours(record)
    e = ettr(record["ledger"], now=record["ended_at"])
    rs = rows(record)
    checks = record["checks"]
    return {
        "held_h": h.held_h, "useful_h": h.useful_h, "goodput": h.goodput, "lost_h": dict(h.lost_h),
        "ettr": e.ratio, "ettr_span": e.span_ratio,
        "partial": h.partial,
        "every_fault_survived": bool(rs) and all(r["survived"] for r in rs) and checks.get("completed", False)
                                and len(rs) == record["planned_faults"],
        "nothing_lost": all(checks.get(k, False) for k in ("all_rollouts_trained", "final_checkpoint",
                                                              "dataset_cursor", "resumed_where_recorded")),
        "bitwise_equal": bool(record["bitwise"].get("equal")),
    }


def first_bringup(record: dict[str, Any]) -> float:
    """GPU-hours of the first segment's bring-up: lost, but to starting at all, not to a fault."""
    from beam_hpc.run import accounting

    segs = _hours(record).segments
    return segs[0].lost_s.get(accounting.BRINGUP, 0.0) * record["gpus"] / 3600.0 if segs else 0.0


def report(record: dict[str, Any]) -> str:
    s = summary(record)
    loads = record["load"]
    lines = [
        f"seed {record['seed']}: {record['total']} rollouts, checkpoint every {record['interval']}, "
        f"{record['gpus']} GPUs; drawn order: {', '.join(f['kind'] for f in record['schedule'])}"
        + (f"; hang after rollout {record['hang_rollout']}" if record.get("hang_rollout") is not None else "")
        + " (the table is the order met)",
        "", table(record), "",
        f"GPU-hours: held {s['held_h']:.4f}, useful {s['useful_h']:.4f}, goodput {s['goodput']:.3f}"
        + (" (partial: some ledger lines lack fields)" if s["partial"] else ""),
        f"ETTR (training on kept rollouts over wall time held, beam_hpc.observe.ettr): {s['ettr'] or 0:.3f}"
        f" ({s['ettr_span'] or 0:.3f} over the chain's wall span, queue waits included)",
        "lost by cause: " + "; ".join(f"{c} {v:.4f}" for c, v in s["lost_h"].items())
        + f" (of which no fault's: the first segment's bring-up {first_bringup(record):.4f})",
        f"final weights vs an uninterrupted run: {'bitwise equal' if s['bitwise_equal'] else 'DIFFERENT'} "
        f"({record['bitwise'].get('detail', '')})",
        "checks: " + ", ".join(f"{k} {'ok' if v else 'FAILED'}" for k, v in record["checks"].items()),
        f"bar: every fault survived {'yes' if s['every_fault_survived'] else 'NO'}; nothing lost "
        f"{'yes' if s['nothing_lost'] else 'NO'}; final weights bitwise equal {'yes' if s['bitwise_equal'] else 'NO'}",
        f"wall {record['wall_s']:.0f} s; load (1-min average) min {min(loads):.2f} mean {sum(loads) / len(loads):.2f} "
        f"max {max(loads):.2f} over {len(loads)} samples" if loads else f"wall {record['wall_s']:.0f} s",
    ]
    if record.get("errors"):
        lines.append("errors: " + "; ".join(record["errors"]))
    return "\n".join(lines)


# -- the campaign --------------------------------------------------------------------------------------------


def trained_rollouts(run_dir: Path) -> list[tuple[int, float]]:
    """(rollout id, wall time) of every rollout a run trained, in order (a re-done one twice)."""
    from beam_hpc.run import metric_names

    try:
        lines = (run_dir / "dumps" / metric_names.METRICS_FILE).read_text().splitlines(keepends=True)
    except FileNotFoundError:
        return []
    rows_ = [json.loads(x) for x in lines if x.endswith("\n")]
    return [(m["rollout_id"], m["time"]) for m in rows_ if m.get("kind") == "rollout"]


class LoadSampler(threading.Thread):
    """os.getloadavg() every 10 s while the campaign runs (the machine is shared)."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.samples: list[float] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            self.samples.append(round(os.getloadavg()[0], 2))
            self.stop.wait(10)


class Campaign:
    """One chain and its faults, driven from the main thread."""

    def __init__(self, run_dir: Path, faults: list[Fault], cluster: Any, seed: int) -> None:
        self.dir, self.faults, self.cluster, self.seed = run_dir, faults, cluster, seed
        self.rng = random.Random(seed + 1)
        self.met: list[dict[str, Any]] = []
        self.errors: list[str] = []
        self.plan: Any = None

    # -- reading the run -------------------------------------------------------------------------
    def segments(self) -> list[dict[str, Any]]:
        from beam_hpc.run import ledger

        return ledger.read_ledger(self.dir / "ledger.jsonl")[0]

    def rollouts(self) -> list[tuple[int, float]]:
        return trained_rollouts(self.dir)

    def wait(self, what: str, predicate, timeout: float = STEP_TIMEOUT_S, poll_s: float = 0.2) -> Any:
        from interruptions import wait

        return wait(what, predicate, timeout, poll_s)

    def note(self, text: str) -> None:
        print(f"{time.strftime('%H:%M:%S')} [load {os.getloadavg()[0]:.1f}] {text}", flush=True)

    # -- the chain -------------------------------------------------------------------------------
    def submit(self, hang_k: int | None, with_stall: bool) -> str:
        from reference_harness import build_tiny_assets

        from beam_hpc.submission.submit import submit

        assets = build_tiny_assets()
        overrides = [f"model.path={assets.model_dir}", f"data.dir={assets.data_dir}", *RECIPE_OVERRIDES,
                     f"lifecycle.walltime={WALLTIME}", f"lifecycle.lead_s={LEAD_S}",
                     f"lifecycle.max_segments={MAX_SEGMENTS}"]
        if with_stall:
            overrides += [f"lifecycle.stall_timeout_s={STALL_TIMEOUT_S}",
                          f"lifecycle.startup_timeout_s={STARTUP_TIMEOUT_S}"]
        saved = os.environ.get(HANG_VAR)
        if hang_k is not None:  # exported to the job by sbatch (and from it to its resubmissions)
            os.environ[HANG_VAR] = str(hang_k)
        try:
            sub = submit(ROOT / "recipes" / "tiny.yaml", ROOT / "env" / "local.yaml", overrides=overrides,
                         output_dir=str(self.dir), num_rollout=ROLLOUTS, via="sbatch")
        finally:
            if saved is None:
                os.environ.pop(HANG_VAR, None)
            else:
                os.environ[HANG_VAR] = saved
        self.plan = sub.plan
        self.note(f"submitted job {sub.job_id}: {ROLLOUTS} rollouts into {self.dir}")
        return str(sub.job_id)

    def running(self, index: int) -> dict[str, Any]:
        """Segment number ``index`` (0-based) once it has a start line."""
        return self.wait(f"segment {index + 1} to start",
                         lambda: (s := self.segments()) and len(s) > index and s[index])

    def ended(self, index: int, timeout: float = STEP_TIMEOUT_S) -> dict[str, Any]:
        return self.wait(f"the end line of segment {index + 1}",
                         lambda: (s := self.segments()) and len(s) > index and "end" in s[index] and s[index],
                         timeout=timeout)

    def new_rollouts(self, seg: dict[str, Any]) -> int:
        return sum(1 for _, t in self.rollouts() if t >= seg["start"]["time"])

    def strike_point(self, index: int, fault: Fault, hang_k: int | None) -> tuple[str, dict[str, Any]]:
        """Wait until segment ``index`` has trained ``fault.after`` new rollouts (and, for a node
        kill, written a new checkpoint): ``("strike", segment)``. ``("hang", segment)`` instead
        when the driver is about to reach the hang's rollout ``hang_k`` (None: no hang pending)
        before this fault would have ended the segment: that segment is then the hang's alone, and
        the fault waits for the next one. ``("ended", segment)`` when it ended by itself."""
        from beam_hpc.run import checkpoint_layout

        seg = self.running(index)
        start_at = seg["start"]["rollouts_at_start"]

        def ready() -> Any:
            now = self.segments()[index]
            if "end" in now:
                return ("ended", now)
            if hang_k is not None and self.hang_imminent(seg, fault, hang_k):
                return ("hang", now)
            if self.new_rollouts(seg) < fault.after:
                return None
            if fault.kind == "node-kill" and checkpoint_layout.rollouts_done(self.dir / "checkpoints") <= start_at:
                return None
            return ("strike", now)

        return self.wait(f"{fault.after} new rollouts in segment {seg['segment']}", ready, poll_s=0.1)

    def hang_imminent(self, seg: dict[str, Any], fault: Fault, hang_k: int) -> bool:
        """The driver may reach rollout ``hang_k`` within the time ``fault`` takes to end a segment
        (:data:`STRIKE_WINDOW_S`), at the pace of its last rollouts."""
        mine = [(k, t) for k, t in self.rollouts() if t >= seg["start"]["time"]]
        if not mine:
            return False
        recent = mine[-4:]
        step_s = (recent[-1][1] - recent[0][1]) / (len(recent) - 1) if len(recent) > 1 else 5.0
        return mine[-1][0] + STRIKE_WINDOW_S[fault.kind] / max(step_s, 0.1) >= hang_k

    def hung_in(self) -> str | None:
        """The segment whose driver the hook hung (its marker), if one did."""
        from beam_hpc.fault_hooks import hang_markers

        found = hang_markers(self.dir / "logs")
        return found[0].parent.name if found else None

    def hang_time(self, segment: str) -> float | None:
        from beam_hpc.fault_hooks import HANG_MARKER_FILE

        marker = self.dir / "logs" / segment / HANG_MARKER_FILE
        return json.loads(marker.read_text())["time"] if marker.is_file() else None

    def job_nodes(self, job: str) -> list[str]:
        out = self.cluster.run("squeue", "-h", "-j", job, "-o", "%N", check=False).stdout
        return [x.strip() for x in out.split() if x.strip()]

    def inject(self, fault: Fault, seg: dict[str, Any]) -> dict[str, Any]:
        job = seg["start"]["job_id"]
        met: dict[str, Any] = {"kind": fault.kind, "segment": seg["segment"]}
        if fault.kind in ("walltime", OUTAGE):
            minutes, ends = self.cluster.end_soon(job, left_s=LEAD_S)  # the end 60-120 s from now
            met["how"] = f"scontrol update TimeLimit={minutes} (ends in {ends - time.time():.0f} s)"
            if fault.kind == OUTAGE:
                met["how"] += f"; slurmctld stopped at the save request for {OUTAGE_S} s"
                threading.Thread(target=self.outage_at_save, args=(met,), daemon=True).start()
        elif fault.kind == "preemption":
            nodes = self.job_nodes(job)
            urgent = self.cluster.run("sbatch", "--parsable", "-p", "urgent", f"--nodelist={','.join(nodes)}",
                                      "--exclusive", "-t", "1", "-o", "/dev/null", "--wrap", "sleep 2").stdout.strip()
            met["how"] = f"urgent job {urgent} on {','.join(nodes)}"
        elif fault.kind == "node-kill":
            steps = self.wait("the node steps", self.node_steps, timeout=30)
            group = sorted(steps)[int(fault.pick * len(steps))]
            pid, node = steps[group]
            os.kill(pid, signal.SIGKILL)
            met["how"], met["node"] = f"SIGKILL node step of group {group} on {node}", node
        met["at"] = time.time()
        return met

    def outage_at_save(self, met: dict[str, Any]) -> None:
        """Stop slurmctld the moment the segment asks for its walltime save (the sentinel), start
        it again :data:`OUTAGE_S` seconds later (in a thread: the chain is watched meanwhile)."""
        try:
            self.wait("the walltime save request", Path(self.plan.paths.sentinel).exists, poll_s=0.05)
            self.cluster.stop_controller()
            met["outage_from"] = time.time()
            self.note(f"{OUTAGE}: slurmctld stopped for {OUTAGE_S} s")
            time.sleep(OUTAGE_S)
        except (TimeoutError, RuntimeError, OSError) as err:
            self.errors.append(f"{OUTAGE}: {type(err).__name__}: {err}")
        finally:
            self.cluster.start_controller()
            met["outage_to"] = time.time()
            self.note(f"{OUTAGE}: slurmctld back")

    def node_steps(self) -> dict[str, tuple[int, str]]:
        """{group: (pid, node)} of this run's node step processes (the fake nodes share this host)."""
        found: dict[str, tuple[int, str]] = {}
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                argv = [a.decode() for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")]
                env = dict(e.split("=", 1) for e in Path(f"/proc/{pid}/environ").read_bytes().decode(
                    errors="replace").split("\0") if "=" in e)
            except OSError:
                continue
            if argv[1:3] == ["-m", "beam_hpc.node.step"] and self.plan.paths.plan in argv and "--group" in argv:
                found[argv[argv.index("--group") + 1]] = (int(pid), env.get("SLURMD_NODENAME", "?"))
        return found

    def hold_and_tear(self, fault: Fault, after: dict[str, Any]) -> dict[str, Any]:
        """Between segments: hold the next job, cut a file of the newest checkpoint to half its size."""
        from beam_hpc.run import checkpoint_layout

        nxt = after["end"]["next"]
        if nxt["action"] == "resubmit" and nxt["job_id"]:
            self.cluster.run("scontrol", "hold", nxt["job_id"], check=False)
        ckpt = self.dir / "checkpoints"
        it = checkpoint_layout.latest_iteration(ckpt)
        files = sorted(checkpoint_layout.iteration_dir(ckpt, it).glob("*.pt"))
        victim = files[int(fault.pick * len(files))]
        size = victim.stat().st_size
        with open(victim, "r+b") as fh:
            fh.truncate(size // 2)
        met = {"kind": TORN, "after_segment": after["segment"], "iteration": it, "at": time.time(),
               "how": f"{victim.name} of checkpoint {it} cut to {size // 2} of {size} bytes"}
        if nxt["action"] == "resubmit" and nxt["job_id"]:
            self.cluster.run("scontrol", "release", nxt["job_id"], check=False)
        return met

    def release_requeued(self, job: str) -> None:
        """A requeued job may start only after cred_expire (10 s here): let it go once it pends,
        as the tests do (a real cluster's queue decides this)."""
        from interruptions import job_state

        self.wait(f"job {job} to pend", lambda: job_state(self.cluster, job) == "PENDING", timeout=180)
        self.cluster.run("scontrol", "update", f"jobid={job}", "StartTime=now", check=False)

    def run(self, hang_k: int | None, with_stall: bool) -> None:
        from run_watch import chain_finished

        self.submit(hang_k, with_stall)
        pending = list(self.faults)
        index = 0
        torn_pending: dict[str, Any] | None = None
        while pending:
            if pending[0].kind == TORN:  # its stop went to the hang, met earlier: it follows the next stop
                if len(pending) == 1:
                    self.errors.append("the torn checkpoint was not met: no segment boundary was left for it")
                    pending.pop()
                    break
                pending[0], pending[1] = pending[1], pending[0]
            fault = pending[0]
            seg_started = self.running(index)
            if torn_pending is not None:  # the segment that had to find the torn checkpoint
                torn_pending["segment"] = seg_started["segment"]
                torn_pending = None
            hang = next((f for f in pending if f.kind == "hang"), None)
            if fault.kind == "hang" and self.hung_in() is not None:  # it hung in an earlier fault's segment
                pending.pop(0)
                done = self.hung_in()
                self.met.append({"kind": "hang", "segment": done, "how": f"{HANG_VAR}={hang_k} (hung in the segment "
                                 "of an earlier fault)", "at": self.hang_time(done)})
                continue
            if fault.kind == "hang":
                what = "hang"
            else:
                what, _ = self.strike_point(index, fault, hang_k if hang is not None else None)
            if what in ("hang", "ended"):  # this segment is the hang's (what ended it is in the table)
                if hang is not None:
                    pending.remove(hang)
                early = "" if fault.kind == "hang" else f" (reached before the {fault.kind} drawn first)"
                met = {"kind": "hang" if hang is not None else "unplanned", "segment": seg_started["segment"],
                       "how": f"{HANG_VAR}={hang_k}{early}"}
            else:
                met = self.inject(fault, self.segments()[index])
                pending.pop(0)
            self.note(f"{met['kind']}: {met.get('how', '')} -> segment {met['segment']}")
            seg = self.ended(index)
            if met["kind"] == "hang":  # the fault's moment: when the driver hung (the hook's marker)
                met["at"] = self.hang_time(seg["segment"])
            self.met.append(met)
            end = seg["end"]
            self.note(f"segment {seg['segment']} ended: {end['reason']} ({_short(end['detail'], 120)}); "
                      f"next {end['next']['action']} {end['next']['job_id'] or ''}")
            if pending and pending[0].kind == TORN:
                torn_pending = self.hold_and_tear(pending.pop(0), seg)
                self.met.append(torn_pending)
                self.note(f"{TORN}: {torn_pending['how']}")
            if end["next"]["action"] == "requeue":
                self.release_requeued(end["next"]["job_id"])
            elif end["next"]["action"] == "none":
                if pending:
                    self.errors.append(f"the chain ended ({end['reason']}) with {len(pending)} fault(s) not met: "
                                       + ", ".join(f.kind for f in pending))
                break
            index += 1
        if torn_pending is not None:  # torn after the last stop: the last segment finds it
            torn_pending["segment"] = self.running(index)["segment"]
        self.wait("the chain to complete", lambda: chain_finished(self.dir))
        last = self.segments()[-1]
        self.note(f"chain ended: {last['end']['reason']} at {last['end']['rollouts_at_end']} of {ROLLOUTS}")


def check_run(run_dir: Path, plan: Any, segments: list[dict[str, Any]], rollouts: list[tuple[int, float]]) -> dict[str, bool]:
    """Nothing lost: what a complete, exact run directory shows."""
    import torch

    from beam_hpc.run import checkpoint_layout

    ckpt = run_dir / "checkpoints"
    cursor_ok = False
    with_state = checkpoint_layout.dataset_state_path(ckpt, ROLLOUTS - 1)
    if with_state.is_file():
        cursor = torch.load(with_state, weights_only=True)
        cursor_ok = cursor["sample_offset"] == ROLLOUTS * plan.recipe.batch.prompts
    resumed_ok = True
    for seg in segments:  # each segment's first rollout is where its start line says it resumed
        t0 = seg["start"]["time"]
        t1 = seg["end"]["time"] if "end" in seg else float("inf")
        mine = [k for k, t in rollouts if t0 <= t <= t1]
        if mine and mine[0] != seg["start"]["rollouts_at_start"]:
            resumed_ok = False
    last = segments[-1] if segments else {}
    return {
        "completed": bool(last) and last.get("end", {}).get("reason") == "completed",
        "all_rollouts_trained": sorted({k for k, _ in rollouts}) == list(range(ROLLOUTS)),
        "final_checkpoint": checkpoint_layout.latest_iteration(ckpt) == ROLLOUTS - 1,
        "dataset_cursor": cursor_ok,
        "resumed_where_recorded": resumed_ok,
    }


def reference_run(ref_dir: Path) -> Path:
    """The uninterrupted run (the reference backend alone, on a local Ray head), or the one already
    in ``ref_dir`` when it was made with the same total and overrides."""
    from job_plans import HOST_SITE, make_test_plan
    from reference_harness import LocalRayHead, build_tiny_assets, run_backend

    from beam_hpc.run import checkpoint_layout

    marker = ref_dir / "faults-reference.json"
    want = {"rollouts": ROLLOUTS, "overrides": RECIPE_OVERRIDES}
    if marker.is_file() and json.loads(marker.read_text()) == want and \
            checkpoint_layout.latest_iteration(ref_dir / "checkpoints") == ROLLOUTS - 1:
        print(f"reusing the uninterrupted run in {ref_dir}", flush=True)
        return ref_dir
    shutil.rmtree(ref_dir, ignore_errors=True)
    assets = build_tiny_assets()
    t0 = time.time()
    with LocalRayHead() as address:
        plan = make_test_plan(ref_dir, assets=assets, site=HOST_SITE, overrides=[*RECIPE_OVERRIDES, f"num_rollout={ROLLOUTS}"])
        run_backend(Path(plan.paths.plan), address, timeout=3000)
    marker.write_text(json.dumps(want))
    print(f"uninterrupted run: {time.time() - t0:.0f} s in {ref_dir}", flush=True)
    return ref_dir


def compare(run_dir: Path, ref_dir: Path, rollouts: int = ROLLOUTS) -> dict[str, Any]:
    """The final checkpoint of ``run_dir`` against ``ref_dir``'s, tensor by tensor (torch.equal)."""
    from reference_harness import assert_bitwise_equal, load_checkpoint

    last = f"iter_{rollouts - 1:07d}"
    try:
        n = assert_bitwise_equal(load_checkpoint(ref_dir / "checkpoints" / last),
                                 load_checkpoint(run_dir / "checkpoints" / last), last)
    except (AssertionError, OSError, RuntimeError) as err:
        return {"equal": False, "detail": str(err)[:300]}
    return {"equal": n > 0, "detail": f"{n} tensors of {last} compared with torch.equal"}


def stall_watchdog_available() -> bool:
    from beam_hpc.run import ledger

    return "stalled" in ledger.REASONS


def outage_ridden_out() -> bool:
    """Whether this beam-hpc's segment records a resubmission that waits on Slurm (an older one
    gave up on an unreachable controller at once, so the campaign leaves the outage out there)."""
    import inspect

    from beam_hpc.run import ledger

    return "resubmission_pending" in inspect.signature(ledger.end_record).parameters


# -- rollout node lost: in place against full restart (issue 42 items 4-5) ----------------------------------
#
#   python benchmarks/faults.py --node-loss --seeds 1 2 [--rollouts N] [--json FILE] [--keep]
#   python benchmarks/faults.py --reanalyse FILE   (a --node-loss record is told by its "chains")
#
# One fault, "rollout node lost", met by the same run under both of lifecycle.rollout_node_loss's
# policies: in_place (the default: --no-kill, the segment goes on and asks for a replacement) and
# restart (no --no-kill: Slurm revokes the job, it is requeued and resumes from its checkpoint). Per
# seed both chains meet the same loss (the same rollout node, after the same number of trained
# rollouts) injected the same way, as Slurm sees a node failure: the node set DOWN with scontrol and
# its node step, raylet and rollout worker SIGKILLed (the way of
# tests/lifecycle/test_rollout_node_lost_slurm.py). Each campaign first runs the same recipe with
# no fault: its final checkpoint is the uninterrupted run the others are compared with bitwise,
# and its ETTR is what bring-up alone leaves (the ceiling of either policy at this length).
#
# The rate: RobustRL (arXiv 2512.22492) reports ETTR "under 10% failure injection" on 256 GPUs
# (32 machines) without defining it further in its abstract; read as 10% of the run's machines lost
# over a run, that is ~3 losses there and 0.4 here (4 group nodes), so each chain here loses one
# rollout node: 25% of its nodes, i.e. one loss per chain of --rollouts rollouts, 2.5x RobustRL's
# rate read that way (harsher on both policies, never kinder).
#
# It runs on a private Slurm cluster of its own (the node is marked DOWN: never on the shared one),
# with the private clusters' Ray port bands (tests/support/builders/runs/job_plans.py).

NODE_LOSS = "rollout node lost"
POLICIES = ("in_place", "restart")
NO_FAULT = "none"  # the uninterrupted chain's row
NL_ROLLOUTS, NL_INTERVAL = 40, 5
NL_RECIPE = ["eval.interval=0", "topology.trainer.nodes=2", "topology.trainer.gpus_per_node=1",
             "topology.rollout.nodes=2", "topology.rollout.gpus_per_node=1", "training.async_training=false",
             "backend_options.unit_prompts=1"]
NL_NODES = 6  # 2 trainer + 2 rollout nodes, a replacement, and one spare while the lost one is DOWN
NL_FIRST_JOB_ID = 640_000  # far from the shared cluster's ids and the lifecycle tests' private ones
FAILURE_SHARE = 0.10  # RobustRL's injection, read as a share of the run's nodes lost over a run


@dataclass(frozen=True)
class NodeLoss:
    """The loss a seed draws: after ``after`` trained rollouts, rollout worker ``worker`` (its
    index in placement.json) loses its node."""

    after: int
    worker: int


def node_loss_schedule(seed: int, rollouts: int, rollout_nodes: int = 2) -> NodeLoss:
    """The seed's loss: in the run's second quarter (room for the replacement to join before the
    end; after the first checkpoint, so a restart has one to resume from), on a drawn rollout node."""
    rng = random.Random(seed)
    return NodeLoss(after=rng.randint(max(NL_INTERVAL + 1, rollouts // 4), max(NL_INTERVAL + 2, rollouts // 2)),
                    worker=rng.randrange(rollout_nodes))


def losses_per_run(group_nodes: int) -> int:
    """Nodes lost per chain at :data:`FAILURE_SHARE` of ``group_nodes``: at least one."""
    return max(1, round(FAILURE_SHARE * group_nodes))


class NodeLossChain:
    """One chain of the tiny recipe under one policy, on the private ``cluster``; ``loss`` (or
    None: the uninterrupted chain) struck once."""

    def __init__(self, cluster: Any, site: Path, run_dir: Path, policy: str, loss: NodeLoss | None,
                 rollouts: int) -> None:
        self.cluster, self.site, self.dir, self.policy, self.loss = cluster, site, run_dir, policy, loss
        self.rollouts_total = rollouts
        self.plan: Any = None
        self.errors: list[str] = []
        self.struck: dict[str, Any] = {}

    def note(self, text: str) -> None:
        print(f"{time.strftime('%H:%M:%S')} [load {os.getloadavg()[0]:.1f}] [{self.policy}] {text}", flush=True)

    def trained(self) -> list[tuple[int, float]]:
        return trained_rollouts(self.dir)

    def submit(self) -> str:
        from reference_harness import build_tiny_assets

        from beam_hpc.submission.submit import submit

        assets = build_tiny_assets()
        overrides = [f"model.path={assets.model_dir}", f"data.dir={assets.data_dir}", *NL_RECIPE,
                     f"checkpoint.interval={NL_INTERVAL}", f"lifecycle.walltime={WALLTIME}",
                     f"lifecycle.max_segments={MAX_SEGMENTS}", f"lifecycle.rollout_node_loss={self.policy}"]
        sub = submit(ROOT / "recipes" / "tiny.yaml", self.site, overrides=overrides, output_dir=str(self.dir),
                     num_rollout=self.rollouts_total, via="sbatch")
        self.plan = sub.plan
        self.note(f"submitted job {sub.job_id}: {self.rollouts_total} rollouts, rollout_node_loss={self.policy}")
        return str(sub.job_id)

    def victim(self) -> tuple[str, list[int]]:
        """The hostname of the drawn rollout worker's node and the processes a lost node takes with
        it: its node step and everything below it (raylet, workers), and the rollout worker."""
        from beam_hpc.node import procs

        assert self.loss is not None
        placement = json.loads((self.dir / "placement.json").read_text())
        worker = placement["rollout"][self.loss.worker]
        for path in self.dir.glob("logs/*/nodes/rollout-*.json"):
            report = json.loads(path.read_text())
            if report.get("ip") == worker["node_ip"]:
                return report["hostname"], procs.with_descendants([int(report["pid"])]) + [int(worker["pid"])]
        raise RuntimeError(f"no rollout node report with ip {worker['node_ip']}")

    def strike(self) -> None:
        from interruptions import wait

        assert self.loss is not None
        wait("placement and the loss's rollout", lambda: (self.dir / "placement.json").is_file()
             and len({k for k, _ in self.trained()}) >= self.loss.after, STEP_TIMEOUT_S, 0.1)
        node, pids = self.victim()
        at = len({k for k, _ in self.trained()})
        self.cluster.run("scontrol", "update", f"nodename={node}", "state=down", "reason=beam-faults-node-lost")
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.struck = {"node": node, "at": time.time(), "rollouts_at": at, "killed": len(pids),
                       "how": f"scontrol update nodename={node} state=down; SIGKILL to its node step, raylet, "
                              f"workers ({len(pids)} processes)"}
        self.note(f"{NODE_LOSS}: {node} after {at} rollouts ({len(pids)} processes killed)")

    def release_requeued(self) -> None:
        """A job Slurm requeued pends until its BeginTime (cred_expire here): let it go, as the
        restart path's tests do. Kind to the full restart (a real queue may hold it far longer)."""
        out = self.cluster.run("squeue", "-h", "-t", "PD", "-n", self.plan.job_name, "-o", "%i %r", check=False).stdout
        for line in out.splitlines():
            job, _, reason = line.partition(" ")
            if "BeginTime" in reason:
                self.cluster.run("scontrol", "update", f"jobid={job.split('+')[0]}", "StartTime=now", check=False)

    def run(self) -> dict[str, Any]:
        from interruptions import wait
        from run_watch import chain_finished

        t0 = time.time()
        job = self.submit()
        try:
            if self.loss is not None:
                self.strike()

            def done() -> bool:
                self.release_requeued()
                return chain_finished(self.dir)

            wait("the chain to complete", done, STEP_TIMEOUT_S, 1.0)
        except (TimeoutError, RuntimeError, OSError, KeyError, ValueError) as err:
            self.errors.append(f"{type(err).__name__}: {err}")
        finally:
            if self.struck:
                self.cluster.run("scontrol", "update", f"nodename={self.struck['node']}", "state=resume", check=False)
        ended = time.time()
        # the replacement leaves when the run ends; every job of this chain gone before the next one
        try:
            wait("the chain's jobs to leave the queue",
                 lambda: not self.cluster.run("squeue", "-h", "-o", "%i", check=False).stdout.strip(), 180, 1.0)
        except TimeoutError as err:
            self.errors.append(str(err))
            self.cluster.run("scancel", "--me", check=False)  # the private cluster holds this campaign's jobs only
        return self.record(job, t0, ended)

    def record(self, job: str, t0: float, ended: float) -> dict[str, Any]:
        from beam_hpc.elastic.replace import replacements
        from beam_hpc.observe.status import gather
        from beam_hpc.run import ledger

        extra: list[dict[str, Any]] = []
        try:
            extra = [{k: r.get(k) for k in ("job_id", "replaces", "units", "gpu_hours")}
                     for r in gather(self.dir, slurm=False)["extra_rollout"]["jobs"]]
        except (OSError, KeyError, ValueError) as err:
            self.errors.append(f"status: {type(err).__name__}: {err}")
        return {"policy": self.policy, "loss": asdict(self.loss) if self.loss else None, "job": job,
                "struck": self.struck, "ledger": ledger.read_ledger(self.dir / "ledger.jsonl")[0],
                "rollouts": [[k, round(t, 3)] for k, t in self.trained()], "total": self.rollouts_total,
                "gpus": sum(g.nodes * g.gpus_per_node for g in self.plan.groups) if self.plan else 0,
                "rollout_node_gpus": next((g.gpus_per_node for g in self.plan.groups if g.name == "rollout"), 0)
                if self.plan else 0,
                "replacements": replacements(self.dir), "extra_jobs": extra, "ended_at": ended,
                "wall_s": round(ended - t0, 1), "errors": self.errors}


def with_rollout_node_gpus(record: dict[str, Any]) -> None:
    """Give each chain of a --node-loss record saved before chains carried ``rollout_node_gpus``
    the rollout node's GPUs its campaign's recipe set (``topology.rollout.gpus_per_node=N`` among
    the overrides), so that its goodput is read as status reads a run's today."""
    sets = dict(o.split("=", 1) for o in record.get("recipe") or [] if "=" in o)
    gpus = sets.get("topology.rollout.gpus_per_node")
    for chain in record["chains"]:
        if "rollout_node_gpus" not in chain and gpus is not None:
            chain["rollout_node_gpus"] = int(gpus)


def step_s(rollouts: list[list[float]], lo: float, hi: float) -> float | None:
    """Mean seconds between consecutive trained rollouts stamped in [lo, hi) (the pace of training)."""
    ts = sorted(t for _, t in rollouts if lo <= t < hi)
    return (ts[-1] - ts[0]) / (len(ts) - 1) if len(ts) > 2 else None


def chain_row(chain: dict[str, Any], seed: int | None) -> dict[str, Any]:
    """One chain's figures, from its record alone: ETTR (beam_hpc.observe.ettr), goodput
    (beam_hpc.run.accounting), where the held time went, and the replacement."""
    from beam_hpc.observe.ettr import ettr
    from beam_hpc.run import accounting

    e = ettr(chain["ledger"], now=chain["ended_at"])
    # held as Slurm bills it, and as status counts it: a rollout node lost in place is held until its loss
    h = accounting.account(chain["ledger"], chain["gpus"], now=chain["ended_at"],
                           lost_node_gpus=int(chain.get("rollout_node_gpus") or 0))
    ends = [s["end"] for s in chain["ledger"] if s.get("end")]
    bringup = sum(float(x.get("ready_s") or 0.0) for x in ends)
    first_up = float(ends[0].get("ready_s") or 0.0) if ends else 0.0  # no fault's: every chain pays it once
    ids = [k for k, _ in chain["rollouts"]]
    at = (chain["struck"] or {}).get("at")
    return {
        "policy": chain["policy"], "seed": seed, "struck": chain["struck"], "segments": e.segments,
        "reasons": [x.get("reason") for x in ends], "ettr": e.ratio, "ettr_span": e.span_ratio,
        "ettr_warm": e.training_s / (e.held_s - first_up) if e.held_s > first_up else None,
        "training_s": e.training_s, "held_s": e.held_s, "bringup_s": bringup, "goodput": h.goodput,
        "kept": e.rollouts_kept, "trained": len(ids), "redone": len(ids) - len(set(ids)),
        "complete": sorted(set(ids)) == list(range(chain["total"])) and bool(ends) and ends[-1].get("reason") == "completed",
        "step_before_s": step_s(chain["rollouts"], 0, at) if at else step_s(chain["rollouts"], 0, float("inf")),
        "step_after_s": step_s(chain["rollouts"], at, float("inf")) if at else None,
        "replacement": chain["extra_jobs"], "bitwise": chain.get("bitwise", {}), "wall_s": chain["wall_s"],
        "errors": chain["errors"],
    }


def _f(x: float | None, fmt: str = ".3f") -> str:
    return "-" if x is None else format(x, fmt)


def node_loss_table(record: dict[str, Any]) -> str:
    head = ("| policy | seed | fault | segments (how each ended) | ETTR | ETTR less the first bring-up "
            "| ETTR over span | training s / held s "
            "| bring-up s | goodput | rollouts kept / trained (re-done) | step s before / after the loss "
            "| replacement (job: units, GPU-h) | final weights vs uninterrupted | wall s |")
    out = [head, "|" + "---|" * 15]
    for c in record["chains"]:
        r = chain_row(c, c.get("seed"))
        s = r["struck"] or {}
        fault = f"{s['node']} lost after {s['rollouts_at']} rollouts" if s else "none"
        rep = "; ".join(f"{x['job_id']}: {x['units']}, {_f(x['gpu_hours'], '.4f')}" for x in r["replacement"]) or "-"
        b = r["bitwise"]
        bit = "(the reference)" if b.get("reference") else ("bitwise equal" if b.get("equal") else
                                                             f"DIFFERENT: {b.get('detail', '')[:60]}")
        out.append(f"| {r['policy']} | {r['seed'] if r['seed'] is not None else '-'} | {fault} "
                   f"| {r['segments']} ({', '.join(str(x) for x in r['reasons'])}) | {_f(r['ettr'])} | {_f(r['ettr_warm'])} "
                   f"| {_f(r['ettr_span'])} | {r['training_s']:.0f} / {r['held_s']:.0f} | {r['bringup_s']:.0f} "
                   f"| {_f(r['goodput'])} | {r['kept']} / {r['trained']} ({r['redone']}) "
                   f"| {_f(r['step_before_s'], '.2f')} / {_f(r['step_after_s'], '.2f')} | {rep} | {bit} "
                   f"| {r['wall_s']:.0f} |")
    return "\n".join(out)


def node_loss_report(record: dict[str, Any]) -> str:
    rows_ = [(c.get("seed"), chain_row(c, c.get("seed"))) for c in record["chains"]]
    lines = [f"{NODE_LOSS}: {record['rollouts']} rollouts a chain, checkpoint every {record['interval']}, "
             f"2 trainer + 2 rollout nodes (one fake GPU each); one loss per chain "
             f"({losses_per_run(4)} = max(1, round({FAILURE_SHARE} x 4 group nodes))); seeds "
             f"{', '.join(str(s) for s in record['seeds'])}", "", node_loss_table(record), ""]
    for policy in POLICIES:
        for key, what in (("ettr", "ETTR"), ("ettr_warm", "ETTR less the first bring-up")):
            got = [r[key] for seed, r in rows_ if r["policy"] == policy and seed is not None and r[key] is not None]
            if got:
                lines.append(f"{what} {policy}: mean {sum(got) / len(got):.3f} over {len(got)} chain(s) with a loss "
                             f"(min {min(got):.3f}, max {max(got):.3f})")
    lines += ["", "Projected, not measured: the rollouts a chain needs for ETTR 0.9 if its overhead (held - training "
              "seconds: bring-ups, saves, teardown, and for a restart the re-done rollouts and the wait) stays what "
              "these chains measured and the step time too: N >= 9 x overhead / step."]
    for label, pick in (("uninterrupted", lambda seed, r: seed is None),
                        *((p_, lambda seed, r, p_=p_: seed is not None and r["policy"] == p_) for p_ in POLICIES)):
        chosen = [r for seed, r in rows_ if pick(seed, r) and r["kept"]]
        if chosen:
            over = sum(r["held_s"] - r["training_s"] for r in chosen) / len(chosen)
            step = sum(r["training_s"] / r["kept"] for r in chosen) / len(chosen)
            lines.append(f"  {label}: overhead {over:.0f} s, step {step:.1f} s -> N >= {math.ceil(9 * over / step)} "
                         f"rollouts ({len(chosen)} chain(s))")
    loads = record["load"]
    if loads:
        lines.append(f"wall {record['wall_s']:.0f} s; load (1-min average) min {min(loads):.2f} mean "
                     f"{sum(loads) / len(loads):.2f} max {max(loads):.2f} over {len(loads)} samples")
    for seed, r in rows_:
        for err in r["errors"]:
            lines.append(f"error ({r['policy']}, seed {seed}): {err}")
    return "\n".join(lines)


def node_loss_ok(record: dict[str, Any]) -> bool:
    """Every chain complete with nothing lost and its weights bitwise equal to the uninterrupted run's."""
    return all((r := chain_row(c, c.get("seed")))["complete"] and (r["bitwise"].get("equal") or r["bitwise"].get("reference"))
               and not r["errors"] for c in record["chains"])


def node_loss_campaign(seeds: list[int], rollouts: int, *, keep: bool, json_path: Path | None,
                       policies: tuple[str, ...] = POLICIES) -> int:
    import yaml
    from job_plans import PRIVATE_CLUSTER_PORTS
    from private_cluster import free_ctld_port
    from slurm_cluster import ClusterSpec, LocalSlurmCluster

    shared = LocalSlurmCluster()  # up for its munged, which a private cluster borrows
    shared.join()
    root = Path(tempfile.mkdtemp(prefix="beam-nl-", dir="/tmp"))
    cluster = LocalSlurmCluster(ClusterSpec(lab=root / "lab", nodes=NL_NODES, small_disk_nodes=0, spot_nodes=1,
                                            ctld_port=free_ctld_port(NL_NODES + 1), cluster_name="beamnodeloss",
                                            link_etc=False,
                                            first_job_id=NL_FIRST_JOB_ID + (os.getpid() % 1000) * 100))
    load = LoadSampler()
    load.start()
    t0 = time.time()
    record: dict[str, Any] = {"seeds": seeds, "rollouts": rollouts, "interval": NL_INTERVAL, "recipe": NL_RECIPE,
                              "policies": list(policies), "chains": [],
                              "command": "python benchmarks/faults.py " + " ".join(sys.argv[1:])}
    try:
        shared.up(started_by_tests=True)
        cluster.up(started_by_tests=True)
        os.environ["SLURM_CONF"] = str(cluster.conf)  # every client (submit, sbatch, the job's own) here
        data = yaml.safe_load((ROOT / "env" / "local.yaml").read_text())
        data["ray"] = {**data["ray"], **PRIVATE_CLUSTER_PORTS}
        site = root / "private-site.yaml"
        site.write_text(yaml.safe_dump(data))
        print(f"private Slurm cluster {cluster.spec.cluster_name}: {NL_NODES} nodes, lab {cluster.lab}; "
              f"load {os.getloadavg()[0]:.2f}", flush=True)
        reference = NodeLossChain(cluster, site, root / "uninterrupted", "in_place", None, rollouts).run()
        reference["bitwise"] = {"reference": True}
        record["chains"].append({**reference, "seed": None})
        for seed in seeds:
            loss = node_loss_schedule(seed, rollouts)
            print(f"seed {seed}: rollout worker {loss.worker}'s node lost after {loss.after} rollouts", flush=True)
            for policy in policies:
                chain = NodeLossChain(cluster, site, root / f"{policy}-{seed}", policy, loss, rollouts).run()
                chain["bitwise"] = compare(root / f"{policy}-{seed}", root / "uninterrupted", rollouts)
                record["chains"].append({**chain, "seed": seed})
        record["wall_s"] = round(time.time() - t0, 1)
        record["load"] = load.samples
        print("\n" + node_loss_report(record), flush=True)
        if json_path:
            json_path.write_text(json.dumps(record, indent=1))
        return 0 if node_loss_ok(record) else 1
    finally:
        load.stop.set()
        cluster.down()
        os.environ.pop("SLURM_CONF", None)
        if keep:
            print(f"run directories: {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
        shared.leave()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=None, help="draws the fault order and points (printed)")
    p.add_argument("--json", type=Path, help="write the raw record here (for --reanalyse)")
    p.add_argument("--reanalyse", type=Path, help="print the table again from a saved record; runs nothing")
    p.add_argument("--keep", action="store_true", help="keep the run directory (printed)")
    p.add_argument("--reference", type=Path, help="the uninterrupted run's directory: reused when it matches, "
                                                  "else made there (default: a temporary one)")
    p.add_argument("--node-loss", action="store_true",
                   help=f"the '{NODE_LOSS}' campaign: both lifecycle.rollout_node_loss policies side by side, on a "
                        "private Slurm cluster")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2], help="--node-loss: one loss drawn per seed")
    p.add_argument("--rollouts", type=int, default=NL_ROLLOUTS, help="--node-loss: rollouts a chain")
    p.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES), help="--node-loss: which")
    args = p.parse_args(argv)
    if args.reanalyse and "chains" in (record := json.loads(args.reanalyse.read_text())):
        with_rollout_node_gpus(record)
        print(node_loss_report(record))
        return 0 if node_loss_ok(record) else 1
    if args.node_loss:
        return node_loss_campaign(args.seeds, args.rollouts, keep=args.keep, json_path=args.json,
                                  policies=tuple(args.policies))
    if args.reanalyse:
        print(report(record))
        return 0 if all(summary(record)[k] for k in ("every_fault_survived", "nothing_lost", "bitwise_equal")) else 1
    from slurm_cluster import LocalSlurmCluster

    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 31)
    with_stall, with_outage = stall_watchdog_available(), outage_ridden_out()
    faults = schedule(seed, hang=with_stall, outage=with_outage)
    hang_k = hang_rollout(faults)
    print(f"seed {seed}: " + ", ".join(f"{f.kind}" + (f" after {f.after}" if f.kind != TORN else "") for f in faults)
          + (f"; the driver hangs after rollout {hang_k}" if hang_k is not None else
             "; no hung driver (this beam-hpc has no stall watchdog)")
          + ("" if with_outage else "; no controller outage (this beam-hpc's segment does not ride one out)")
          + f"; load {os.getloadavg()[0]:.2f}", flush=True)
    root = Path(tempfile.mkdtemp(prefix="beam-faults-", dir="/tmp"))
    ref_dir = args.reference or root / "uninterrupted"
    cluster = LocalSlurmCluster()
    cluster.join()
    campaign = Campaign(root / "chain", faults, cluster, seed)
    load = LoadSampler()
    load.start()
    t0 = time.time()
    try:
        cluster.up(started_by_tests=True)
        os.environ.update(cluster.env)
        reference_run(ref_dir)
        try:
            campaign.run(hang_k, with_stall)
        except (TimeoutError, RuntimeError, OSError) as err:
            campaign.errors.append(f"{type(err).__name__}: {err}")
        segments = campaign.segments()
        rollouts = campaign.rollouts()
        for met in campaign.met:
            found = first_alarm(campaign.dir / "logs" / str(met.get("segment")) / "segment.log", met["at"]) \
                if met.get("at") is not None else None
            if found is not None:
                met["noticed_at"], met["noticed"] = found
        record = {
            "seed": seed, "total": ROLLOUTS, "interval": INTERVAL, "walltime": WALLTIME, "lead_s": LEAD_S,
            "overrides": RECIPE_OVERRIDES, "stall_timeout_s": STALL_TIMEOUT_S if with_stall else None,
            "schedule": [asdict(f) for f in faults], "planned_faults": len(faults), "hang_rollout": hang_k,
            "gpus": sum(g.nodes * g.gpus_per_node for g in campaign.plan.groups) if campaign.plan else 0,
            "faults": campaign.met, "ledger": segments, "rollouts_trained": len(rollouts),
            "rollouts": [[k, round(t, 3)] for k, t in rollouts], "ended_at": time.time(),
            "checks": check_run(campaign.dir, campaign.plan, segments, rollouts) if campaign.plan else {},
            "bitwise": compare(campaign.dir, ref_dir), "wall_s": round(time.time() - t0, 1),
            "load": load.samples, "errors": campaign.errors,
            "command": "python benchmarks/faults.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        }
        print("\n" + report(record), flush=True)
        if args.json:
            args.json.write_text(json.dumps(record, indent=1))
        s = summary(record)
        return 0 if s["every_fault_survived"] and s["nothing_lost"] and s["bitwise_equal"] else 1
    finally:
        from interruptions import clean_up

        load.stop.set()
        if cluster.controller_pid() is None and (cluster.lab / "etc" / "slurm.conf").exists():
            cluster.start_controller()  # an outage cut short by an error: the controller comes back
        clean_up(cluster, root, [campaign.plan.job_name] if campaign.plan is not None else [], keep=args.keep)


if __name__ == "__main__":
    sys.exit(main())
