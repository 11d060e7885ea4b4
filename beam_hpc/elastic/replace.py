"""A lost rollout node's capacity comes back by itself (issue 42 item 2).

When a segment goes on without a lost rollout node (beam_hpc.job.runner, ``lost_nodes``), it asks
for a replacement with ``beam-hpc rollout add RUN --nodes 1 --exclude NODE``, run as a program
(the submission layer is above the job's, so the job does not import it): one rollout-only job of
the rollout group's shape, the lost node, the run's excluded nodes and the site's quarantine left
out, with every check ``rollout add`` makes. It goes to the site's ``replacement_partition`` when
the site names one (a backfill partition, whose idle nodes bring the capacity back sooner than the
run's own queue), and to the rollout group's own partition when it names none or when that
partition cannot take the job (``rollout add`` refuses it: not a partition of the cluster, down,
too small for the rollout group's shape; or sbatch refuses it). It joins the run as
any extra job does (it registers with the segment's rollout service and serves units) and leaves
when the run ends. A per-run cap (the recipe's ``lifecycle.max_replacements``) keeps a flapping
cluster from submitting without end: the replacements a run has asked for are counted in its
elastic registry (``elastic/jobs/<id>.jsonl``, a ``replacement`` event beside ``submitted``),
across segments. Nothing here raises: a replacement that cannot be submitted is logged, and the
segment goes on with the capacity it has. It runs in a thread of its own, so the job's watch of
its node steps never waits on sbatch.
"""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from beam_hpc.elastic import registry
from beam_hpc.plan.plan import Plan
from beam_hpc.slurm.client import slurm_env_free

log = logging.getLogger(__name__)

REPLACEMENT_EVENT = "replacement"
ADD_TIMEOUT_S = 180.0  # the CLI's start, its Slurm checks and sbatch, on a loaded login or batch node
_SUBMITTED = re.compile(r"submitted extra rollout job (\d+)")
_lock = threading.Lock()  # one replacement at a time: the cap is counted, then the job recorded


@dataclass(frozen=True)
class Reaction:
    """What the product does about a lost node: the segment goes on (or ends), and a replacement
    is asked for (or not). The rule of :func:`on_node_lost`, which benchmarks/ettr.py can call."""

    goes_on: bool
    replace: bool


def on_node_lost(*, survives: bool, others_up: int, replacements: int, cap: int) -> Reaction:
    """The rule: a node of a group that survives a node's loss (beam_hpc.plan.node_loss:
    a reference run's dedicated rollout group of 2+ nodes) is gone on without
    while another node of the group is up, and replaced while the run has asked for fewer than
    ``cap`` replacements; any other loss ends the segment (and is replaced by the next segment's
    allocation, not by an extra job)."""
    goes_on = survives and others_up > 0
    return Reaction(goes_on=goes_on, replace=goes_on and replacements < cap)


def replacements(run_dir: str | Path) -> list[dict]:
    """Every replacement the run has asked for: ``{"job_id", "replaces", "segment", "time"}``."""
    out = []
    for path in sorted(registry.jobs_dir(run_dir).glob("*.jsonl")):
        for e in registry.read_events(path):
            if e.get("event") == REPLACEMENT_EVENT:
                out.append({"job_id": path.stem, **{k: e.get(k) for k in ("replaces", "segment", "time")}})
    return out


def add_command(plan: Plan, node: str, partition: str | None = None) -> list[str]:
    """``beam-hpc rollout add`` for one node of the rollout group's shape, ``node`` left out, in
    ``partition`` (None: the rollout group's own, which ``rollout add`` picks). A Miles run's
    replacement takes ``node``'s place in the running segment's Ray cluster (``--replaces``,
    beam_hpc.elastic.ray_replacement)."""
    where = ["--partition", partition] if partition else []
    takes_place = ["--replaces", node] if plan.recipe.backend == "miles" else []
    return [sys.executable, "-m", "beam_hpc.cli.app", "rollout", "add", plan.output_dir, "--nodes", "1",
            *where, "--exclude", node, *takes_place]


def may_replace(plan: Plan) -> bool:
    """Whether the run may ask for one more replacement (``lifecycle.max_replacements``)."""
    cap = plan.recipe.lifecycle.max_replacements
    return on_node_lost(survives=True, others_up=1, replacements=len(replacements(plan.output_dir)), cap=cap).replace


def asked_for(plan: Plan, node: str, segment: str) -> list[str]:
    """The job ids of the replacements this segment asked for in ``node``'s place."""
    return [r["job_id"] for r in replacements(plan.output_dir) if r.get("replaces") == node and r.get("segment") == segment]


def partitions_to_try(plan: Plan) -> list[str | None]:
    """Where a replacement is asked for, in order: the site's ``replacement_partition`` first when
    it names one, then the rollout group's own partition (None: ``rollout add``'s default)."""
    backfill = plan.site.replacement_partition
    return [backfill, None] if backfill else [None]


def _submit(argv: list[str], node: str, label: str) -> str | None:
    """Run one ``rollout add``; the new job's id, or None with the reason in the log."""
    try:  # without the job's SLURM_* variables: the new job must not inherit this one's
        proc = subprocess.run(argv, env=slurm_env_free(), capture_output=True, text=True, timeout=ADD_TIMEOUT_S,
                              stdin=subprocess.DEVNULL, check=False)
    except (OSError, subprocess.TimeoutExpired) as err:
        log.error("rollout node %s lost: `%s` (%s) did not finish: %s", node, " ".join(argv[2:]), label, err)
        return None
    found = _SUBMITTED.search(proc.stdout)
    if proc.returncode != 0 or found is None:
        why = (proc.stderr.strip() or proc.stdout.strip() or f"exit {proc.returncode}").splitlines()
        log.error("rollout node %s lost: no replacement in %s: `%s` exited %d: %s", node, label, " ".join(argv[2:]),
                  proc.returncode, " / ".join(why[-5:]))
        return None
    return found[1]


def replace_lost(plan: Plan, lost: Mapping[str, str], *, segment: str) -> str | None:
    """Submit one replacement for the lost rollout node ``lost`` (``{"node", "why"}``) unless the
    run's cap is reached; returns the new job's id, or None (and says why in the log)."""
    cap = plan.recipe.lifecycle.max_replacements
    node = str(lost.get("node", "?"))
    with _lock:
        done = replacements(plan.output_dir)
        if not on_node_lost(survives=True, others_up=1, replacements=len(done), cap=cap).replace:
            log.warning("rollout node %s lost: no replacement, the run has asked for %d of "
                        "lifecycle.max_replacements=%d (raise it if the cluster is not flapping)", node, len(done), cap)
            return None
        job_id: str | None = None
        partition: str | None = None
        for partition in partitions_to_try(plan):
            label = (f"site replacement_partition {partition}" if partition
                     else "the rollout group's own partition")
            job_id = _submit(add_command(plan, node, partition), node, label)
            if job_id is not None:
                break
        if job_id is None:
            return None
        registry.record(plan.output_dir, job_id, {"event": REPLACEMENT_EVENT, "replaces": node, "segment": segment,
                                                  "why": str(lost.get("why", ""))})
    log.warning("rollout node %s lost: replacement job %s submitted in %s (%d of lifecycle.max_replacements=%d); it "
                "joins the run as an extra rollout job", node, job_id, partition or "the rollout group's partition",
                len(done) + 1, cap)
    return job_id


def replace_in_background(plan: Plan, lost: Mapping[str, str], *, segment: str) -> threading.Thread:
    """:func:`replace_lost` in a daemon thread (the caller's loop goes on at once)."""
    t = threading.Thread(target=replace_lost, args=(plan, dict(lost)), kwargs={"segment": segment},
                         name=f"replace-{lost.get('node')}", daemon=True)
    t.start()
    return t
