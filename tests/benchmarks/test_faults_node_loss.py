"""benchmarks/faults.py --node-loss's pure parts: the loss a seed draws (the same for both policies),
and the table and verdict it prints from a record (the same code ``--reanalyse`` runs). The campaign
itself runs both policies on a private Slurm cluster for 20-40 minutes and is a benchmark, not a
test; its results are in benchmarks/results/faults-2026-12-07.md."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import benchmark_script
import pytest

from beam_hpc.observe.ettr import ettr
from beam_hpc.run import ledger

faults = benchmark_script.load("faults")
S = dict(host="h", num_rollout=20, walltime_s=1200, lead_s=60)


def test_the_loss_is_the_seeds_alone_after_the_first_checkpoint_and_before_half_the_run() -> None:
    drawn = [faults.node_loss_schedule(seed, 40) for seed in range(30)]
    assert faults.node_loss_schedule(7, 40) == drawn[7]  # both policies of a seed meet the same loss
    assert all(faults.NL_INTERVAL < d.after <= 20 and d.worker in (0, 1) for d in drawn)
    assert len({d.after for d in drawn}) > 5 and {d.worker for d in drawn} == {0, 1}
    # RobustRL's 10%: 0.4 of this campaign's 4 group nodes rounds up to one loss; 3 at its 32 machines
    assert faults.losses_per_run(4) == 1 and faults.losses_per_run(32) == 3


def _chain(tmp_path: Path, policy: str) -> dict:
    """in_place: one segment that lost n4 after rollout 7 and completed 0-19, a replacement serving.
    restart: the same loss revoked the job after rollout 7 trained (checkpoint 4 the last), the requeued
    segment resumed from 5 and completed: rollouts 5-7 trained twice, a second bring-up."""
    path = Path(tempfile.mkdtemp(prefix=policy, dir=tmp_path)) / "ledger.jsonl"
    t = 1000.0
    ledger.append(path, ledger.start_record(job_id="1", restart=0, rollouts_at_start=0, resume=False, now=t, **S))
    if policy == "in_place":
        ledger.append(path, ledger.end_record(job_id="1", restart=0, rollouts_at_end=20, reason="completed",
                                              detail="20 of 20 rollouts done", next_action="none", next_job_id=None,
                                              rollout_s=4.0, save_s=0.5, ready_s=20.0, rollouts_run=20, now=t + 110))
        trained = [(k, t + 22 + 4 * k) for k in range(20)]
        extra = [{"job_id": "2", "replaces": "n4", "units": 9, "gpu_hours": 0.01}]
    else:
        ledger.append(path, ledger.end_record(job_id="1", restart=0, rollouts_at_end=5, reason="preempted",
                                              detail="job revoked", next_action="requeue", next_job_id="1",
                                              rollout_s=4.0, save_s=0.5, ready_s=20.0, rollouts_run=8, now=t + 60))
        ledger.append(path, ledger.start_record(job_id="1", restart=1, rollouts_at_start=5, resume=True, now=t + 75, **S))
        ledger.append(path, ledger.end_record(job_id="1", restart=1, rollouts_at_end=20, reason="completed",
                                              detail="20 of 20 rollouts done", next_action="none", next_job_id=None,
                                              rollout_s=4.0, save_s=0.5, ready_s=20.0, rollouts_run=15, now=t + 155))
        trained = [(k, t + 22 + 4 * k) for k in range(8)] + [(k, t + 97 + 4 * (k - 5)) for k in range(5, 20)]
        extra = []
    segments, warnings = ledger.read_ledger(path)
    assert not warnings
    return {"policy": policy, "seed": 1, "loss": {"after": 7, "worker": 1}, "job": "1",
            "struck": {"node": "n4", "at": t + 51, "rollouts_at": 8, "killed": 5, "how": "state=down; SIGKILL"},
            "ledger": segments, "rollouts": [[k, at] for k, at in trained], "total": 20, "gpus": 4,
            "replacements": [], "extra_jobs": extra, "ended_at": t + 200, "wall_s": 180.0, "errors": [],
            "bitwise": {"equal": True, "detail": "71 tensors"}}


def _record(tmp_path: Path) -> dict:
    return {"seeds": [1], "rollouts": 20, "interval": 5, "recipe": [], "policies": list(faults.POLICIES),
            "chains": [_chain(tmp_path, p) for p in faults.POLICIES], "wall_s": 400.0, "load": [2.0, 3.0],
            "command": "python benchmarks/faults.py --node-loss --seeds 1"}


def test_each_chain_row_is_the_ledgers_ettr_with_what_the_restart_trained_again(tmp_path: Path) -> None:
    record = _record(tmp_path)
    in_place, restart = (faults.chain_row(c, 1) for c in record["chains"])
    for row, chain in ((in_place, record["chains"][0]), (restart, record["chains"][1])):
        assert row["ettr"] == ettr(chain["ledger"], now=chain["ended_at"]).ratio and row["complete"]
    assert in_place["ettr"] == pytest.approx(20 * 4.0 / 110) and in_place["redone"] == 0 and in_place["segments"] == 1
    assert restart["ettr"] == pytest.approx(20 * 4.0 / (60 + 80)) and restart["redone"] == 3
    assert restart["segments"] == 2 and restart["bringup_s"] == 40.0 and restart["reasons"] == ["preempted", "completed"]
    assert in_place["step_before_s"] == pytest.approx(4.0) and in_place["step_after_s"] == pytest.approx(4.0)
    text = faults.node_loss_report(record)
    # less the first bring-up (every chain's, no fault's): the restart still pays its second one
    assert in_place["ettr_warm"] == pytest.approx(80 / 90) and restart["ettr_warm"] == pytest.approx(80 / 120)
    assert "| in_place | 1 | n4 lost after 8 rollouts | 1 (completed) | 0.727 | 0.889 |" in text
    assert "| restart | 1 | n4 lost after 8 rollouts | 2 (preempted, completed) | 0.571 | 0.667 |" in text
    assert "2: 9, 0.0100" in text and "ETTR in_place: mean 0.727" in text
    # overheads 30 s and 60 s at 4 s a step: 0.9 needs 9 x 30 / 4 and 9 x 60 / 4 rollouts
    assert "in_place: overhead 30 s, step 4.0 s -> N >= 68 rollouts" in text
    assert "restart: overhead 60 s, step 4.0 s -> N >= 135 rollouts" in text


def test_the_verdict_fails_on_different_weights_an_incomplete_chain_or_an_error(tmp_path: Path, capsys) -> None:
    saved = tmp_path / "record.json"
    record = _record(tmp_path)
    saved.write_text(json.dumps(record))
    assert faults.main(["--reanalyse", str(saved)]) == 0
    assert "| restart | 1 |" in capsys.readouterr().out
    record["chains"][1]["bitwise"] = {"equal": False, "detail": "tensor differs at model.pt/w"}
    assert not faults.node_loss_ok(record)
    record = _record(tmp_path)
    record["chains"][0]["rollouts"] = record["chains"][0]["rollouts"][:-1]  # rollout 19 never trained
    assert not faults.node_loss_ok(record)
    record = _record(tmp_path)
    record["chains"][0]["errors"] = ["TimeoutError: timed out waiting for the chain to complete"]
    saved.write_text(json.dumps(record))
    assert faults.main(["--reanalyse", str(saved)]) == 1
    assert "error (in_place, seed 1): TimeoutError" in capsys.readouterr().out
