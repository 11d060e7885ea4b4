"""A lost rollout node's capacity comes back by itself (issue 42 item 2).

When a segment goes on without a lost rollout node (beam_hpc.job.runner, ``lost_nodes``), it asks
for a replacement the way ``beam-hpc rollout add`` does (beam_hpc.submission.rollout_job): one
rollout-only job of the rollout group's shape, the lost node and every node the run or the site's
quarantine excludes left out, on the site's rollout partition. It joins the run as any extra job
does (it registers with the segment's rollout service and serves units), and leaves when the run
ends. A per-run cap (the recipe's ``lifecycle.max_replacements``) keeps a flapping cluster from
submitting without end: the replacements a run has asked for are counted in its elastic registry
(``elastic/jobs/<id>.jsonl``, a ``replacement`` event beside ``submitted``), across segments.
Nothing here raises: a replacement that cannot be submitted is logged, and the segment goes on
with the capacity it has.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path

from beam_hpc.elastic import registry
from beam_hpc.errors import InputError, RuntimeFailure
from beam_hpc.plan.plan import Plan

log = logging.getLogger(__name__)

REPLACEMENT_EVENT = "replacement"


def replacements(run_dir: str | Path) -> list[dict]:
    """Every replacement the run has asked for: ``{"job_id", "replaces", "segment", "time"}``."""
    out = []
    for path in sorted(registry.jobs_dir(run_dir).glob("*.jsonl")):
        for e in registry.read_events(path):
            if e.get("event") == REPLACEMENT_EVENT:
                out.append({"job_id": path.stem, **{k: e.get(k) for k in ("replaces", "segment", "time")}})
    return out


def excluded_nodes(plan: Plan, lost: Sequence[str]) -> tuple[str, ...]:
    """The run's excluded nodes (its ledger's failed nodes), the site's quarantine, and ``lost``."""
    from beam_hpc.lifecycle import exclusions, quarantine
    from beam_hpc.run import ledger

    segments, _ = ledger.read_ledger(plan.paths.ledger)
    own = exclusions.names(exclusions.from_ledger(segments, exclusions.read_cleared(plan.output_dir)))
    return tuple(quarantine.excluded_in_job(plan.site, [*own, *(n for n in lost if n not in own)]))


def replace_lost(plan: Plan, lost: Mapping[str, str], *, segment: str) -> str | None:
    """Submit one replacement for the lost rollout node ``lost`` (``{"node", "why"}``) unless the
    run's cap is reached; returns the new job's id, or None (and says why in the log)."""
    from beam_hpc.slurm import client
    from beam_hpc.submission import rollout_job

    cap = plan.recipe.lifecycle.max_replacements
    done = replacements(plan.output_dir)
    node = str(lost.get("node", "?"))
    if len(done) >= cap:
        log.warning("rollout node %s lost: no replacement, the run has asked for %d of lifecycle.max_replacements=%d "
                    "(raise it if the cluster is not flapping)", node, len(done), cap)
        return None
    try:
        req, problems = rollout_job.make_request(plan, plan.site, nodes=1, partition=None, time=None,
                                                 exclude=excluded_nodes(plan, [node]))
        if req is not None:
            problems = rollout_job.problems(req)
        if req is None or problems:
            log.error("rollout node %s lost: no replacement can be asked for: %s", node, "; ".join(problems))
            return None
        job_id, script = rollout_job.submit(req)
    except (client.SlurmError, InputError, RuntimeFailure, OSError) as err:
        log.error("rollout node %s lost: the replacement was not submitted: %s", node, err)
        return None
    registry.record(plan.output_dir, job_id, {"event": REPLACEMENT_EVENT, "replaces": node, "segment": segment,
                                              "why": str(lost.get("why", ""))})
    log.warning("rollout node %s lost: replacement job %s submitted (%d of lifecycle.max_replacements=%d; script %s); "
                "it joins the run as an extra rollout job", node, job_id, len(done) + 1, cap, script)
    return job_id
