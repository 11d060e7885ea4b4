"""benchmarks/faults.py's pure parts: the seeded schedule, and the table, goodput and bar it prints
from a record (the same code ``--reanalyse`` runs). The campaign itself runs on the local Slurm
cluster for 10-15 minutes and is a benchmark, not a test; its results are in benchmarks/results/."""

from __future__ import annotations

import json
import tempfile
from collections import Counter
from pathlib import Path

import benchmark_script
import pytest

from beam_hpc.observe.ettr import ettr
from beam_hpc.run import accounting, ledger

faults = benchmark_script.load("faults")


def test_the_schedule_is_drawn_from_the_seed_and_holds_every_fault_once() -> None:
    drawn = {seed: faults.schedule(seed, hang=True) for seed in range(20)}
    assert drawn[7] == faults.schedule(7, hang=True)  # the seed alone decides
    for plan in drawn.values():
        assert Counter(f.kind for f in plan) == {"walltime": 3, "preemption": 1, "node-kill": 1, "hang": 1,
                                                 faults.TORN: 1}
        assert plan[0].kind != faults.TORN  # a torn checkpoint is found at a boundary, after a stop
        assert all(2 <= f.after <= 4 for f in plan if f.kind != faults.TORN)
    assert len({tuple(f.kind for f in plan) for plan in drawn.values()}) > 10  # orders differ
    assert "hang" not in [f.kind for f in faults.schedule(7, hang=False)]
    with_outage = faults.schedule(7, hang=True, outage=True)  # the eighth kind, where the segment rides one out
    assert Counter(f.kind for f in with_outage)[faults.OUTAGE] == 1 and len(with_outage) == len(drawn[7]) + 1
    assert faults.EXPECTED_END[faults.OUTAGE] == ("walltime", "resubmit")  # saved, then resubmitted after it


def test_the_hang_is_set_after_the_progress_expected_before_its_turn() -> None:
    plan = [faults.Fault("walltime", 3, 0.5), faults.Fault(faults.TORN, 0, 0.5), faults.Fault("preemption", 2, 0.1),
            faults.Fault("hang", 4, 0.2), faults.Fault("node-kill", 2, 0.9)]
    expected = faults.EXPECTED_PROGRESS
    assert faults.hang_rollout(plan) == expected["walltime"] + expected[faults.TORN] + expected["preemption"] + 4
    assert faults.hang_rollout([f for f in plan if f.kind != "hang"]) is None


def _record(tmp_path: Path) -> dict:
    """A campaign of two faults, written through the real ledger writer: segment 1-0 stopped at
    its walltime after rollouts 0-9 (checkpoint 9; 10 trained but not kept), checkpoint 9 torn,
    segment 2-0 passes over it, resumes from 4, is preempted after rollout 12 (its checkpoint)
    and requeued as 2-1, which completes rollouts 13-19."""
    path = tmp_path / "ledger.jsonl"
    s = dict(host="h", num_rollout=20, walltime_s=1200, lead_s=60)
    t = 1000.0
    ledger.append(path, ledger.start_record(job_id="1", restart=0, rollouts_at_start=0, resume=False, now=t, **s))
    ledger.append(path, ledger.end_record(job_id="1", restart=0, rollouts_at_end=10, reason="walltime",
                                          detail="walltime warning (USR1, lead 60 s); saved on request -> continuing",
                                          next_action="resubmit", next_job_id="2", rollout_s=3.0, save_s=1.0,
                                          ready_s=20.0, rollouts_run=11, last_save_at=t + 60, now=t + 65))
    ledger.append(path, ledger.start_record(job_id="2", restart=0, rollouts_at_start=5, resume=True, now=t + 80,
                                            damaged_checkpoints=[{"iteration": 9, "why": "model.pt does not match "
                                                                  "its manifest (truncated or changed)"}], **s))
    ledger.append(path, ledger.end_record(job_id="2", restart=0, rollouts_at_end=13, reason="preempted",
                                          detail="preempted at 10:00:00; saved on request -> requeue",
                                          next_action="requeue", next_job_id="2", rollout_s=3.0, save_s=1.0,
                                          ready_s=15.0, rollouts_run=8, last_save_at=t + 140, now=t + 142))
    ledger.append(path, ledger.start_record(job_id="2", restart=1, rollouts_at_start=13, resume=True, now=t + 160, **s))
    ledger.append(path, ledger.end_record(job_id="2", restart=1, rollouts_at_end=20, reason="completed",
                                          detail="20 of 20 rollouts done -> num_rollout 20 reached",
                                          next_action="none", next_job_id=None, rollout_s=3.0, save_s=1.0,
                                          ready_s=10.0, rollouts_run=7, last_save_at=t + 195, now=t + 196))
    segments, warnings = ledger.read_ledger(path)
    assert not warnings
    trained = ([(k, t + 21 + 3 * k) for k in range(11)] + [(k, t + 100 + 3 * (k - 5)) for k in range(5, 13)]
               + [(k, t + 172 + 3 * (k - 13)) for k in range(13, 20)])
    return {
        "seed": 5, "total": 20, "interval": 5, "gpus": 2, "hang_rollout": None, "planned_faults": 3,
        "schedule": [{"kind": "walltime"}, {"kind": faults.TORN}, {"kind": "preemption"}],
        "faults": [{"kind": "walltime", "segment": "1-0", "at": t + 30, "how": "scontrol update TimeLimit=2",
                    "noticed_at": t + 50, "noticed": "interrupt: walltime (USR1)"},
                   {"kind": faults.TORN, "after_segment": "1-0", "iteration": 9, "at": t + 66, "segment": "2-0",
                    "how": "model.pt of checkpoint 9 cut in half"},
                   {"kind": "preemption", "segment": "2-0", "at": t + 130, "how": "urgent job 3"}],
        "ledger": segments, "rollouts": [[k, at] for k, at in trained], "ended_at": t + 300,
        "checks": {"completed": True, "all_rollouts_trained": True, "final_checkpoint": True, "dataset_cursor": True,
                   "resumed_where_recorded": True},
        "bitwise": {"equal": True, "detail": "71 tensors compared"}, "wall_s": 300.0, "load": [3.5, 4.0],
        "errors": [],
    }


def test_each_faults_row_says_how_it_was_found_what_it_cost_and_the_goodput_is_the_ledgers(tmp_path: Path) -> None:
    record = _record(tmp_path)
    wall, torn, preempt = faults.rows(record)
    h = 2 / 3600
    hours = accounting.account(record["ledger"], 2, now=record["ended_at"])
    by_segment = {s.segment: s for s in hours.segments}
    assert wall["ended"].startswith("walltime -> resubmit: walltime warning (USR1") and wall["ended_after_s"] == 35.0
    assert wall["detected"] == "interrupt: walltime (USR1)" and wall["after_s"] == 20.0
    # rollout 10 was trained in 1-0 and again in 2-0; rollouts 5-9 again because checkpoint 9 was torn
    assert wall["redone"] == 1 and torn["redone"] == 5 and preempt["redone"] == 0
    assert wall["lost_h"][accounting.REDONE] == pytest.approx(by_segment["1-0"].lost_s[accounting.REDONE] * h)
    assert wall["lost_h"][accounting.REDONE] == pytest.approx(1 * 3.0 * h)
    assert wall["lost_h"][accounting.BRINGUP] == pytest.approx(15.0 * h)  # the restart it caused: 2-0's bring-up
    assert torn["ended"].startswith("start line: passed over checkpoint 9 (model.pt does not match")
    assert torn["ended_after_s"] == 14.0 and torn["detected"] == "(no warning logged)" and torn["lost_h"][accounting.DAMAGED] == pytest.approx(5 * 3.0 * h)
    assert preempt["lost_h"][accounting.BRINGUP] == pytest.approx(10.0 * h)
    assert all(r["survived"] for r in (wall, torn, preempt))
    s = faults.summary(record)
    assert s["goodput"] == pytest.approx(hours.goodput) and 0 < s["goodput"] < 1
    assert s["every_fault_survived"] and s["nothing_lost"] and s["bitwise_equal"]
    text = faults.report(record)
    assert "| 2 | torn-checkpoint |" in text and f"goodput {hours.goodput:.3f}" in text
    from beam_hpc.observe.ettr import ettr

    kept = ettr(record["ledger"], now=record["ended_at"])
    assert s["ettr"] == kept.ratio and 0 < kept.ratio < s["goodput"]  # ETTR counts no bring-up, save or re-done step
    assert f"ETTR (training on kept rollouts over wall time held, beam_hpc.observe.ettr): {kept.ratio:.3f}" in text


def test_the_bar_fails_on_a_fault_that_ended_the_wrong_way_or_a_missing_rollout(tmp_path: Path) -> None:
    record = _record(tmp_path)
    record["faults"][2]["kind"] = "node-kill"  # a preempted segment is not what a killed node step does
    assert not faults.summary(record)["every_fault_survived"]
    record = _record(tmp_path)
    record["checks"]["all_rollouts_trained"] = False
    assert not faults.summary(record)["nothing_lost"] and faults.summary(record)["every_fault_survived"]
    record = _record(tmp_path)
    record["planned_faults"] = 4  # a fault never met
    assert not faults.summary(record)["every_fault_survived"]


def test_reanalyse_prints_the_table_from_a_saved_record_without_running(tmp_path: Path, capsys) -> None:
    saved = tmp_path / "record.json"
    saved.write_text(json.dumps(_record(tmp_path)))
    assert faults.main(["--reanalyse", str(saved)]) == 0
    out = capsys.readouterr().out
    assert "| 1 | walltime |" in out and "bar: every fault survived yes; nothing lost yes" in out
    record = _record(tmp_path)
    record["bitwise"] = {"equal": False, "detail": "tensor differs at model.pt/w"}
    saved.write_text(json.dumps(record))
    assert faults.main(["--reanalyse", str(saved)]) == 1
    assert "DIFFERENT (tensor differs at model.pt/w)" in capsys.readouterr().out


def test_the_detection_is_the_first_warning_the_segment_logged_after_the_fault(tmp_path: Path) -> None:
    """segment.log as the segment writes it (beam_hpc.logging_setup's one format, local time)."""
    import logging
    import time

    from beam_hpc.logging_setup import LOG_FORMAT

    log_path = tmp_path / "segment.log"
    handler = logging.FileHandler(log_path)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    log = logging.getLogger("beam_hpc.job.segment.test")
    log.addHandler(handler)
    log.propagate = False
    try:
        log.warning("took over the run lock of job 1")  # before the fault: not its detection
        time.sleep(1.1)
        fault_at = time.time()
        log.info("rollout 7")
        log.warning("interrupt: walltime (USR1): walltime warning")
        log.error("later")
    finally:
        log.removeHandler(handler)
        handler.close()
    at, message = faults.first_alarm(log_path, fault_at)
    assert message == "interrupt: walltime (USR1): walltime warning" and -0.01 <= at - fault_at < 1.0
    assert faults.first_alarm(tmp_path / "missing.log", fault_at) is None


# -- --node-loss: a rollout node lost, in place against full restart ------------------------------------------
# (the campaign runs both policies on a private Slurm cluster for 20-40 minutes: a benchmark, not a test;
# its results are in benchmarks/results/faults-2026-12-07.md)

NODE_LOSS_LEDGER = dict(host="h", num_rollout=20, walltime_s=1200, lead_s=60)


def test_the_loss_is_the_seeds_alone_after_the_first_checkpoint_and_before_half_the_run() -> None:
    drawn = [faults.node_loss_schedule(seed, 40) for seed in range(30)]
    assert faults.node_loss_schedule(7, 40) == drawn[7]  # both policies of a seed meet the same loss
    assert all(faults.NL_INTERVAL < d.after <= 20 and d.worker in (0, 1) for d in drawn)
    assert len({d.after for d in drawn}) > 5 and {d.worker for d in drawn} == {0, 1}
    # RobustRL's 10%: 0.4 of this campaign's 4 group nodes rounds up to one loss; 3 at its 32 machines
    assert faults.losses_per_run(4) == 1 and faults.losses_per_run(32) == 3


def _node_loss_chain(tmp_path: Path, policy: str) -> dict:
    """in_place: one segment that lost n4 after rollout 7 and completed 0-19, a replacement serving.
    restart: the same loss revoked the job after rollout 7 trained (checkpoint 4 the last), the requeued
    segment resumed from 5 and completed: rollouts 5-7 trained twice, a second bring-up."""
    path = Path(tempfile.mkdtemp(prefix=policy, dir=tmp_path)) / "ledger.jsonl"
    t = 1000.0
    ledger.append(path, ledger.start_record(job_id="1", restart=0, rollouts_at_start=0, resume=False, now=t, **NODE_LOSS_LEDGER))
    if policy == "in_place":
        ledger.append(path, ledger.end_record(job_id="1", restart=0, rollouts_at_end=20, reason="completed",
                                              detail="20 of 20 rollouts done", next_action="none", next_job_id=None,
                                              rollout_s=4.0, save_s=0.5, ready_s=20.0, rollouts_run=20, now=t + 110,
                                              failed_nodes=[{"node": "n4", "lost_at": t + 51,  # type: ignore[dict-item]
                                                             "why": "rollout node lost mid-segment (it went on)"}]))
        trained = [(k, t + 22 + 4 * k) for k in range(20)]
        extra = [{"job_id": "2", "replaces": "n4", "units": 9, "gpu_hours": 0.01}]
    else:
        ledger.append(path, ledger.end_record(job_id="1", restart=0, rollouts_at_end=5, reason="preempted",
                                              detail="job revoked", next_action="requeue", next_job_id="1",
                                              rollout_s=4.0, save_s=0.5, ready_s=20.0, rollouts_run=8, now=t + 60))
        ledger.append(path, ledger.start_record(job_id="1", restart=1, rollouts_at_start=5, resume=True, now=t + 75, **NODE_LOSS_LEDGER))
        ledger.append(path, ledger.end_record(job_id="1", restart=1, rollouts_at_end=20, reason="completed",
                                              detail="20 of 20 rollouts done", next_action="none", next_job_id=None,
                                              rollout_s=4.0, save_s=0.5, ready_s=20.0, rollouts_run=15, now=t + 155))
        trained = [(k, t + 22 + 4 * k) for k in range(8)] + [(k, t + 97 + 4 * (k - 5)) for k in range(5, 20)]
        extra = []
    segments, warnings = ledger.read_ledger(path)
    assert not warnings
    return {"policy": policy, "seed": 1, "loss": {"after": 7, "worker": 1}, "job": "1",
            "struck": {"node": "n4", "at": t + 51, "rollouts_at": 8, "killed": 5, "how": "state=down; SIGKILL"},
            "ledger": segments, "rollouts": [[k, at] for k, at in trained], "total": 20, "gpus": 4, "rollout_node_gpus": 1,
            "replacements": [], "extra_jobs": extra, "ended_at": t + 200, "wall_s": 180.0, "errors": [],
            "bitwise": {"equal": True, "detail": "71 tensors"}}


def _node_loss_record(tmp_path: Path) -> dict:
    return {"seeds": [1], "rollouts": 20, "interval": 5, "recipe": [], "policies": list(faults.POLICIES),
            "chains": [_node_loss_chain(tmp_path, p) for p in faults.POLICIES], "wall_s": 400.0, "load": [2.0, 3.0],
            "command": "python benchmarks/faults.py --node-loss --seeds 1"}


def test_each_chain_row_is_the_ledgers_ettr_with_what_the_restart_trained_again(tmp_path: Path) -> None:
    record = _node_loss_record(tmp_path)
    in_place, restart = (faults.chain_row(c, 1) for c in record["chains"])
    for row, chain in ((in_place, record["chains"][0]), (restart, record["chains"][1])):
        assert row["ettr"] == ettr(chain["ledger"], now=chain["ended_at"]).ratio and row["complete"]
    assert in_place["ettr"] == pytest.approx(20 * 4.0 / 110) and in_place["redone"] == 0 and in_place["segments"] == 1
    assert restart["ettr"] == pytest.approx(20 * 4.0 / (60 + 80)) and restart["redone"] == 3
    assert restart["segments"] == 2 and restart["bringup_s"] == 40.0 and restart["reasons"] == ["preempted", "completed"]
    assert in_place["step_before_s"] == pytest.approx(4.0) and in_place["step_after_s"] == pytest.approx(4.0)
    # goodput as status reads it: the lost rollout node's one GPU is held until its loss, 59 s before
    # the segment's end (4 GPUs for 110 s), not to the end
    chain = record["chains"][0]
    as_status = accounting.account(chain["ledger"], 4, now=chain["ended_at"], lost_node_gpus=1)
    assert as_status.held_h == pytest.approx((110 * 4 - 59) / 3600)
    assert in_place["goodput"] == pytest.approx(as_status.goodput)
    assert in_place["goodput"] != pytest.approx(accounting.account(chain["ledger"], 4, now=chain["ended_at"]).goodput)
    text = faults.node_loss_report(record)
    # less the first bring-up (every chain's, no fault's): the restart still pays its second one
    assert in_place["ettr_warm"] == pytest.approx(80 / 90) and restart["ettr_warm"] == pytest.approx(80 / 120)
    assert "| in_place | 1 | n4 lost after 8 rollouts | 1 (completed) | 0.727 | 0.889 |" in text
    assert "| restart | 1 | n4 lost after 8 rollouts | 2 (preempted, completed) | 0.571 | 0.667 |" in text
    assert "2: 9, 0.0100" in text and "ETTR in_place: mean 0.727" in text
    # overheads 30 s and 60 s at 4 s a step: 0.9 needs 9 x 30 / 4 and 9 x 60 / 4 rollouts
    assert "in_place: overhead 30 s, step 4.0 s -> N >= 68 rollouts" in text
    assert "restart: overhead 60 s, step 4.0 s -> N >= 135 rollouts" in text


def test_a_record_saved_before_chains_named_their_rollout_node_gpus_takes_them_from_its_recipe(
        tmp_path: Path, capsys) -> None:
    saved = tmp_path / "old.json"
    record = _node_loss_record(tmp_path)
    for chain in record["chains"]:
        del chain["rollout_node_gpus"]
    old_row = faults.chain_row(record["chains"][0], 1)  # as if every GPU were held to the end
    record["recipe"] = ["eval.interval=0", "topology.rollout.gpus_per_node=1"]
    saved.write_text(json.dumps(record))
    assert faults.main(["--reanalyse", str(saved)]) == 0
    faults.with_rollout_node_gpus(record)
    assert [c["rollout_node_gpus"] for c in record["chains"]] == [1, 1]
    new_row = faults.chain_row(record["chains"][0], 1)
    assert new_row["goodput"] < old_row["goodput"]
    assert f"| {new_row['goodput']:.3f} |" in capsys.readouterr().out


def test_the_verdict_fails_on_different_weights_an_incomplete_chain_or_an_error(tmp_path: Path, capsys) -> None:
    saved = tmp_path / "record.json"
    record = _node_loss_record(tmp_path)
    saved.write_text(json.dumps(record))
    assert faults.main(["--reanalyse", str(saved)]) == 0
    assert "| restart | 1 |" in capsys.readouterr().out
    record["chains"][1]["bitwise"] = {"equal": False, "detail": "tensor differs at model.pt/w"}
    assert not faults.node_loss_ok(record)
    record = _node_loss_record(tmp_path)
    record["chains"][0]["rollouts"] = record["chains"][0]["rollouts"][:-1]  # rollout 19 never trained
    assert not faults.node_loss_ok(record)
    record = _node_loss_record(tmp_path)
    record["chains"][0]["errors"] = ["TimeoutError: timed out waiting for the chain to complete"]
    saved.write_text(json.dumps(record))
    assert faults.main(["--reanalyse", str(saved)]) == 1
    assert "error (in_place, seed 1): TimeoutError" in capsys.readouterr().out
