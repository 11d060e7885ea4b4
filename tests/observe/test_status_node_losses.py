"""`beam-hpc status` on a run that lost rollout nodes mid-segment and went on (issue 42): the losses,
their replacements, the GPU-hours each cost, and the run's ETTR.

The run directory is written by the project's own writers: the plan by make_test_plan, the ledger's
lines by beam_hpc.run.ledger (the lost nodes as beam_hpc.job.runner hands them to the end line: the
runner's ``why``), the replacement event by beam_hpc.elastic.replace.replace_lost itself (only its
``rollout add`` subprocess is replaced by a recorder: the real one is tests/elastic/
test_replace_partition_slurm.py), and the replacement job's events as its node program writes them.
The times are set around the replacement event's own clock, so every number below is computed by hand.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from job_plans import make_test_plan

from beam_hpc.elastic import registry, replace
from beam_hpc.observe.status import gather
from beam_hpc.observe.status_table import format_status
from beam_hpc.run import ledger

GPUS = 4  # per rollout node
RUNNER_WHY = "rollout node lost mid-segment (it went on): node step failed: exit code 0"  # job/runner.py's words


def test_status_shows_each_lost_node_its_cost_its_replacement_and_the_ettr(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = tmp_path / "run"
    plan = make_test_plan(run, trainer_nodes=1, rollout_nodes=2, gpus=GPUS, overrides=["lifecycle.max_replacements=1"],
                          site={"replacement_partition": "spot"})
    asked: list[list[str]] = []
    monkeypatch.setattr(replace, "_submit", lambda argv, node, label: asked.append(argv) or "91")
    # segment 78-0 loses n6: the replacement is asked (job 91, in the site's replacement partition)
    assert replace.replace_lost(plan, {"node": "n6", "why": RUNNER_WHY}, segment="78-0") == "91"
    (event,) = replace.replacements(run)
    t = event["time"]  # the loss's time as status knows it today: when the replacement was asked
    assert asked == [replace.add_command(plan, "n6", "spot")] and asked[0][-4:] == ["--partition", "spot", "--exclude", "n6"]
    # segment 79-0 loses n7 once the cap (1) is spent: no replacement; it ends by a node failure of n3
    assert replace.replace_lost(plan, {"node": "n7", "why": RUNNER_WHY}, segment="79-0") is None and len(asked) == 1

    path = Path(plan.paths.ledger)
    for job, start, end, a, b, reason, failed, step in [
        ("78", t - 500, t + 1800, 0, 10, "walltime", [{"node": "n6", "why": RUNNER_WHY}], 100.0),
        ("79", t + 1900, t + 2900, 10, 14, "node-failure",
         [{"node": "n3", "why": "node step failed: exit code 1"}, {"node": "n7", "why": RUNNER_WHY}], 120.0),
    ]:
        ledger.append(path, ledger.start_record(job_id=job, restart=0, host="n1", rollouts_at_start=a,
                                                num_rollout=20, resume=a > 0, walltime_s=3600, lead_s=60, now=start))
        ledger.append(path, ledger.end_record(job_id=job, restart=0, rollouts_at_end=b, reason=reason, detail="",
                                              next_action="resubmit", next_job_id=None, rollout_s=step, save_s=5.0,
                                              ready_s=20.0, rollouts_run=b - a, last_save_at=end - 10,
                                              failed_nodes=failed, now=end))
    # job 91 as rollout add and its node program record it: submitted, started on n9 60 s later, left 900 s on
    for e in [{"event": "submitted", "nodes": 1, "partition": "spot", "gpus_per_node": GPUS, "time": t + 1},
              {"event": "start", "restart": 0, "nodes": ["n9"], "time": t + 60},
              {"event": "started", "node": "n9", "restart": 0, "time": t + 61},
              {"event": "joined", "node": "n9", "restart": 0, "time": t + 70},
              {"event": "unit", "node": "n9", "restart": 0, "rollout": 6, "version": 6, "samples": 8, "time": t + 80},
              {"event": "left", "node": "n9", "restart": 0, "reason": "run-ended", "time": t + 961},
              {"event": "left", "restart": 0, "reason": "run-ended", "time": t + 962}]:
        registry.record(run, "91", e)

    s = gather(run, slurm=False, now=t + 5000)
    nl = s["node_losses"]
    n6, n7 = nl["losses"]  # n3 ended its segment: a node failure, not a loss the run went on without
    assert (n6["node"], n6["segment"], n6["time"], n6["time_basis"]) == ("n6", "78-0", t, "replacement asked")
    assert n6["segment_end"] == pytest.approx(t + 1800) and n6["gpus"] == GPUS and not n6["running"]
    assert n6["idle_gpu_hours"] == pytest.approx(GPUS * 1800 / 3600)  # 2.0: its GPUs, the loss to the end
    assert n6["replacement"] == {"job_id": "91", "partition": "spot", "state": "left",
                                 "gpu_hours": pytest.approx(GPUS * 900 / 3600)}  # 1.0: n9's 900 s
    assert (n7["node"], n7["segment"], n7["time"], n7["idle_gpu_hours"], n7["replacement"]) == \
        ("n7", "79-0", None, None, None)  # no replacement asked, and the ledger does not say when
    assert nl["idle_gpu_hours"] == pytest.approx(2.0) and nl["replacement_gpu_hours"] == pytest.approx(1.0)
    assert (nl["replacements"], nl["max_replacements"], nl["partial"]) == (1, 1, True)
    # ETTR: 10 x 100 s + 4 x 120 s trained and kept, over 2,300 s + 1,000 s held
    e = s["ettr"]
    assert e["value"] == pytest.approx((10 * 100 + 4 * 120) / (2300 + 1000))
    assert (e["rollouts_kept"], e["segments"], e["running_left_out"], e["partial"]) == (14, 2, False, False)
    assert e["span_ratio"] == pytest.approx(1480 / 3400)

    text = format_status(s)
    assert "ETTR       45% (24m40s training 14 kept rollouts / 55m00s held by 2 segment(s); 44% of the span" in text
    assert ("lost node  n6 in segment 78-0 at " in text and "(when its replacement was asked): its 4 GPUs out 2.00 GPU-hours to "
            "the segment's end, no longer held by the run; replaced by job 91 in spot "
            "(left, 1.00 GPU-hours)" in text)
    assert ("lost node  n7 in segment 79-0 at a time not recorded: its cost is unknown (the ledger does not say when it was lost); "
            "no replacement: the run asked for 1 of lifecycle.max_replacements=1") in text
    assert ("node loss  2 rollout node(s) lost, 2.00 GPU-hours of their GPUs out (partial: some losses have "
            "no known cost); replacements 1.00 GPU-hours of their own") in text
    assert "lost node  n3" not in text


def test_a_running_segment_s_loss_shows_from_its_replacement_and_costs_until_now(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No end line yet: the loss is known from the replacement the segment asked for, and its GPUs
    count until now; the running segment is left out of the ETTR."""
    run = tmp_path / "run"
    plan = make_test_plan(run, trainer_nodes=1, rollout_nodes=2, gpus=GPUS)
    monkeypatch.setattr(replace, "_submit", lambda argv, node, label: "95")
    replace.replace_lost(plan, {"node": "n5", "why": RUNNER_WHY}, segment="80-0")
    t = replace.replacements(run)[0]["time"]
    ledger.append(Path(plan.paths.ledger), ledger.start_record(
        job_id="80", restart=0, host="n1", rollouts_at_start=0, num_rollout=20, resume=False, walltime_s=3600,
        lead_s=60, now=t - 100))
    s = gather(run, slurm=False, now=t + 900)
    (loss,) = s["node_losses"]["losses"]
    assert (loss["node"], loss["segment"], loss["running"]) == ("n5", "80-0", True)
    assert loss["idle_gpu_hours"] == pytest.approx(GPUS * 900 / 3600)
    assert loss["replacement"]["job_id"] == "95" and loss["replacement"]["state"] == "pending"  # not started yet
    assert s["ettr"]["value"] is None and s["ettr"]["running_left_out"] is True
    text = format_status(s)
    assert ("its 4 GPUs out 1.00 GPU-hours so far (the segment runs; held until its end line records the loss); "
            "replaced by job 95") in text
    assert "ETTR       - (no segment has ended yet)" in text
