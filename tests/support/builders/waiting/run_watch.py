"""Waiting on a run directory in the Slurm end-to-end tests, and what to print when a wait fails.

Jobs on the local cluster finish on their own clock, so the tests poll a condition with a
deadline (polling.poll_until) and, on timeout, fail with the ledger, the queue and the tails of
the segment and driver logs: the facts one needs to tell a slow machine from a stuck job.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from polling import poll_until

from beam_hpc.run import ledger


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
    for f in (sorted(logs.glob("slurm-*.out")) + sorted(logs.glob("*/segment.log")) + sorted(logs.glob("*/driver.log"))
              + sorted(logs.glob("*/node-*.log"))):  # a node step's own log: why its `ray start` failed
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
