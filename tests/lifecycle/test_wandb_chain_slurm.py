"""One W&B run per chain, on the real local Slurm cluster with the real ``wandb`` offline.

The tiny recipe with ``tracking.wandb`` (offline) runs a chain of three segments: the first and the
second end at their walltime (LocalSlurmCluster.end_soon lowers the limit once each trains) and
resubmit themselves; the third (the user's ``submit --resume`` with a reachable total, as
test_lifecycle_slurm.change_the_total does) completes the run. Read back with wandb's own reader,
the segments' transaction logs hold one run id, every rollout once and in order, and each
evaluation at its step.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
from real_wandb import require_wandb
from run_watch import diagnostics, segments
from test_lifecycle_slurm import (  # noqa: F401  (runs: a fixture)
    change_the_total,
    finished_by,
    rollout_ids,
    runs,
    submit_run,
    wait_for,
)

from beam_hpc.backends.reference.metrics_log import EVAL_STEP, ROLLOUT_STEP
from beam_hpc.run import metric_names, tracking

pytestmark = [pytest.mark.slurm, pytest.mark.ray, pytest.mark.e2e, pytest.mark.slow]

WANDB = ("tracking.wandb.project=beam-test", "tracking.wandb.mode=offline", "eval.interval=2")


def test_a_walltime_chain_logs_to_one_wandb_run(slurm_cluster, tiny_assets, runs) -> None:  # noqa: F811
    require_wandb()
    run = runs / "wandb"
    plan, first = submit_run(run, tiny_assets, num_rollout=100_000, interval=3, lead_s=150, extra=WANDB)
    assert plan.driver_env["WANDB_RESUME"] == "allow" and plan.driver_env["WANDB_MODE"] == "offline"
    wait_for("a first trained rollout", lambda: rollout_ids(run), run)
    slurm_cluster.end_soon(first)
    second = wait_for("the walltime resubmission",
                      lambda: (s := segments(run)) and "end" in s[0] and s[0]["end"]["next"].get("job_id"), run)
    at_walltime = segments(run)[0]["end"]["rollouts_at_end"]
    wait_for("the resubmitted segment to train", lambda: len(segments(run)) > 1 and len(rollout_ids(run)) > at_walltime,
             run)
    slurm_cluster.end_soon(second)
    wait_for("the second walltime", lambda: "end" in segments(run)[1] and segments(run)[1]["end"]["next"].get("job_id"), run)
    n, last = change_the_total(run, tiny_assets, more=2, interval=3, extra=WANDB)
    wait_for("the last segment to finish the run", lambda: finished_by(run, last), run)
    print(diagnostics(run))

    dirs = tracking.segment_dirs(run)  # one per driver that started (a segment cancelled in bring-up has none)
    assert len(dirs) >= 3 and all(d.name.startswith("offline-run-") for d in dirs), [d.name for d in dirs]
    rid = tracking.existing_run_id(run)
    logs = [tracking.transaction_log(d) for d in dirs]
    runs_seen = {r["run"]["run_id"] for log in logs for r in tracking.read_records(log) if r.get("type") == "run"}
    assert runs_seen == {rid}
    rows = [h for log in logs for h in tracking.history(log)]
    steps = [h[ROLLOUT_STEP] for h in rows if metric_names.ROLLOUT_REWARD in h]
    assert steps == list(range(n)), steps  # every rollout once, in order
    tag = metric_names.eval_accuracy_tag(plan.recipe.data.eval_name)
    assert [h[EVAL_STEP] for h in rows if tag in h] == list(range(0, n + 1, 2))
    # the values are TensorBoard's (metrics.jsonl): a re-done rollout keeps what was logged first
    first_logged: dict[int, float] = {}
    for line in (run / "dumps" / metric_names.METRICS_FILE).read_text().splitlines():
        m = json.loads(line)
        if m["kind"] == "rollout":
            first_logged.setdefault(m["rollout_id"], m[metric_names.ROLLOUT_REWARD])
    assert {h[ROLLOUT_STEP]: h[metric_names.ROLLOUT_REWARD] for h in rows if metric_names.ROLLOUT_REWARD in h} == \
        pytest.approx(first_logged)
    assert Counter(rollout_ids(run)).keys() == set(range(n))
    assert tracking.summary(run)["unsynced"] == [d.name for d in dirs]  # for `beam-hpc sync` (tests/run/test_tracking.py)
