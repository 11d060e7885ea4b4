"""The tests' shared local Ray head (tests/support/builders/runs/reference_harness.py, LocalRayHead): the
xdist workers of one run use one head, a worker that leaves while another holds a lease leaves it
running, and the last one out stops it and leaves nothing in /tmp."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from reference_harness import HEAD_FILE, LocalRayHead

from beam_hpc.node import procs

pytestmark = [pytest.mark.slow, pytest.mark.ray]

BUILDERS = Path(__file__).resolve().parents[2] / "support" / "builders"
HARNESS_PATH = [str(BUILDERS / "runs"), str(BUILDERS / "waiting")]  # reference_harness and the polling it uses


def test_workers_of_one_run_share_a_head_and_the_last_one_out_stops_it() -> None:
    key = f"test-{uuid.uuid4().hex}"
    first = LocalRayHead(share=key)
    address = first.__enter__()
    try:
        assert first.lab is not None
        head = json.loads((first.lab / HEAD_FILE).read_text())
        assert head["address"] == address and procs.running(head["pid"])
        # another worker (another process) with the run's key: the same head, and leaving it
        # while this process still holds its lease stops nothing
        other = subprocess.run(
            [sys.executable, "-c", f"import sys; sys.path[:0] = {HARNESS_PATH!r}\n"
             "from reference_harness import LocalRayHead\n"
             f"h = LocalRayHead(share={key!r})\nprint(h.__enter__())\nh.__exit__(None, None, None)"],
            capture_output=True, text=True, timeout=120)
        assert other.returncode == 0, other.stderr[-2000:]
        assert other.stdout.split()[-1] == address
        assert procs.running(head["pid"])
    finally:
        first.__exit__(None, None, None)
    assert not procs.running(head["pid"])
    assert not first.lab.exists() and not Path(head["temp_dir"]).exists()
