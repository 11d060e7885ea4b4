"""beam_hpc.run.ledger: the append-only start and end lines, their reader, the reasons, the measured timings."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

import pytest

from beam_hpc.run import ledger


def _start(job: str = "100", restart: int = 0, at: int = 0) -> dict:
    return ledger.start_record(job_id=job, restart=restart, host="n1", rollouts_at_start=at, num_rollout=10,
                               resume=at > 0, walltime_s=120, lead_s=60, now=1.0)


def _end(job: str = "100", restart: int = 0, at: int = 4, reason: str = "walltime", action: str = "resubmit",
         nxt: str | None = "101", rollout_s: float | None = 2.0, save_s: float | None = 0.5) -> dict:
    return ledger.end_record(job_id=job, restart=restart, rollouts_at_end=at, reason=reason, detail="d",
                             next_action=action, next_job_id=nxt, rollout_s=rollout_s, save_s=save_s, now=2.0)


def test_ledger_lines_follow_the_contract_and_merge_by_segment(tmp_path: Path) -> None:
    path = tmp_path / "ledger.jsonl"
    ledger.append(path, _start("100", 0, 0))
    ledger.append(path, _end("100", 0, 4))
    ledger.append(path, _start("101", 0, 4))  # killed hard: no end line
    ledger.append(path, _start("101", 1, 4))  # its requeue
    ledger.append(path, _end("101", 1, 10, reason="completed", action="none", nxt=None))
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert set(lines[0]) == {"event", "segment", "job_id", "restart", "time", "host", "rollouts_at_start",
                             "num_rollout", "resume", "walltime_s", "lead_s", "damaged_checkpoints"}
    assert set(lines[1]) == {"event", "segment", "job_id", "restart", "time", "rollouts_at_end", "reason",
                             "detail", "next", "timings", "ready_s", "rollouts_run", "last_save_at",
                             "failed_nodes"}
    assert lines[1]["next"] == {"action": "resubmit", "job_id": "101"}
    assert lines[1]["timings"] == {"rollout_s": 2.0, "save_s": 0.5}
    segs, warnings = ledger.read_ledger(path)
    assert warnings == []
    assert [s["segment"] for s in segs] == ["100-0", "101-0", "101-1"]
    assert "end" not in segs[1] and segs[2]["end"]["reason"] == "completed"


def test_ledger_reader_skips_a_torn_line_and_rejects_bad_records(tmp_path: Path) -> None:
    path = tmp_path / "ledger.jsonl"
    ledger.append(path, _start())
    with open(path, "a") as fh:
        fh.write('{"event": "end", "segm')  # a writer killed mid-line, on a file system without atomic appends
    ledger.append(path, _end())
    segs, warnings = ledger.read_ledger(path)
    assert len(warnings) == 1 and "unreadable" in warnings[0]
    assert segs[0]["start"]["segment"] == "100-0"
    with pytest.raises(ledger.LedgerError, match="reason 'late'"):
        _end(reason="late")
    # the reasons are an enum whose values are the strings in the file
    assert ledger.REASONS == ("completed", "walltime", "preempted", "node-failure", "error", "cancelled", "stalled")
    line = json.dumps(_end(reason=ledger.Reason.NODE_FAILURE))
    assert '"reason": "node-failure"' in line and json.loads(line)["reason"] == ledger.Reason.NODE_FAILURE
    with pytest.raises(ledger.LedgerError, match="next action"):
        _end(action="retry")
    assert ledger.read_ledger(tmp_path / "absent.jsonl") == ([], [])


def _appender(path: str, tag: int, n: int) -> None:
    for i in range(n):
        ledger.append(path, _start(str(1000 * tag + i)))


def test_ledger_appends_from_many_processes_stay_whole(tmp_path: Path) -> None:
    path = str(tmp_path / "ledger.jsonl")
    procs = [multiprocessing.get_context("fork").Process(target=_appender, args=(path, t, 50)) for t in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
    segs, warnings = ledger.read_ledger(path)
    assert warnings == [] and len(segs) == 200


def test_measured_timings_take_the_slowest_recent_segment() -> None:
    segs = [{"segment": "1-0", "end": _end(rollout_s=9.0, save_s=1.0)},
            {"segment": "2-0", "end": _end(rollout_s=2.0, save_s=None)},
            {"segment": "3-0", "end": _end(rollout_s=3.0, save_s=0.5)},
            {"segment": "4-0", "end": _end(rollout_s=None, save_s=None)},
            {"segment": "5-0", "start": _start()}]
    assert ledger.measured_timings(segs, last=2) == {"rollout_s": 3.0, "save_s": 1.0}
    assert ledger.measured_timings([{"segment": "1-0", "start": _start()}]) is None


def test_chain_end_is_a_last_end_line_that_starts_nothing_and_leaves_nothing_pending(tmp_path: Path) -> None:
    path = tmp_path / "ledger.jsonl"
    read = lambda: ledger.chain_end(ledger.read_ledger(path)[0])  # noqa: E731
    assert read() is None  # no segment yet
    ledger.append(path, _start("100", 0, 0))
    assert read() is None  # running (or killed hard)
    ledger.append(path, _end("100", 0, 4, action="resubmit", nxt="101"))
    assert read() is None  # the chain goes on
    ledger.append(path, _start("101", 0, 4))
    ledger.append(path, _end("101", 0, 6, reason="preempted", action="requeue", nxt="101"))
    assert read() is None
    ledger.append(path, _start("101", 1, 6))
    pending = ledger.end_record(job_id="101", restart=1, rollouts_at_end=8, reason="walltime", detail="d",
                                next_action="none", next_job_id=None, rollout_s=None, save_s=None,
                                resubmission_pending={"command": "sbatch ...", "why": "slurmctld down"}, now=3.0)
    ledger.append(path, pending)
    assert read() is None  # the run waits for that command, it is not over
    ledger.append(path, _start("102", 0, 8))
    ledger.append(path, _end("102", 0, 10, reason="completed", action="none", nxt=None))
    end = read()
    assert end is not None and end["segment"] == "102-0" and end["reason"] == "completed"
    ledger.append(path, _start("103", 0, 10))  # resubmitted with --resume and a larger num_rollout
    assert read() is None
