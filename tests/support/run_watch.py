"""Waiting on a run directory in the Slurm end-to-end tests, and what to print when a wait fails.

Jobs on the local cluster finish on their own clock, so the tests poll a condition with a
deadline (never a fixed sleep) and, on timeout, fail with the ledger, the queue and the tails of
the segment and driver logs: the facts one needs to tell a slow machine from a stuck job.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from beam_hpc.run import ledger


def poll_until(predicate: Callable[[], object], timeout: float, poll_s: float) -> object:
    """The first truthy value of ``predicate()``, or None after ``timeout`` s (benchmarks use it too)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    return None


def gone(check: Callable[[], object], timeout: float = 30.0, poll_s: float = 0.2) -> object:
    """``check()`` once it is empty or false, waiting up to ``timeout`` s for it to get there;
    its last value otherwise (so the assertion shows what was left). For "nothing left running"
    checks: processes that were told to stop take a moment to be reaped on a busy machine."""
    deadline = time.monotonic() + timeout
    value = check()
    while value and time.monotonic() < deadline:
        time.sleep(poll_s)
        value = check()
    return value


def wait_for(what: str, predicate: Callable[[], object], run_dir: Path, timeout: float,
             poll_s: float = 0.5) -> object:
    """The first truthy value of ``predicate()``; fails the test with diagnostics after ``timeout`` s."""
    value = poll_until(predicate, timeout, poll_s)
    if not value:
        pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}\n{diagnostics(run_dir)}", pytrace=False)
    return value


def diagnostics(run_dir: Path) -> str:
    """What a failing test prints: the ledger, the queue, and the tails of the segment logs."""
    out = [f"ledger:\n{read_text(run_dir / 'ledger.jsonl')}",
           subprocess.run(["squeue", "-a"], capture_output=True, text=True, check=False).stdout]
    logs = run_dir / "logs"
    for f in sorted(logs.glob("slurm-*.out")) + sorted(logs.glob("*/segment.log")) + sorted(logs.glob("*/driver.log")):
        out.append(f"--- {f.relative_to(run_dir)}\n{read_text(f)[-2500:]}")
    return "\n".join(out)


def read_text(path: Path) -> str:
    """A file's text, or "(missing)": logs appear while the job runs."""
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return "(missing)"


def segments(run_dir: Path) -> list[dict]:
    """The run's ledger, one dict per segment; a warning (a torn or foreign line) fails the test."""
    segs, warnings = ledger.read_ledger(run_dir / "ledger.jsonl")
    assert warnings == []
    return segs


def chain_finished(run_dir: Path) -> bool:
    """The last segment has an end line that starts nothing more."""
    segs = segments(run_dir)
    return bool(segs) and "end" in segs[-1] and segs[-1]["end"]["next"]["action"] == "none"


def segment_rides_out_outages() -> bool:
    """Whether the product's segment gives its resubmission a deadline (it makes a
    beam_hpc.lifecycle.actions.KillClock), so that it rides out a controller outage at its end:
    what the outage chain test and the fault campaign's outage need. Read from the product's
    source, as no behaviour short of a whole chain shows it."""
    root = Path(__file__).resolve().parents[2] / "beam_hpc"
    sources = [p for d in ("job", "lifecycle") for p in (root / d).glob("*.py") if p.name != "actions.py"]
    return any("KillClock(" in p.read_text() for p in sources)
