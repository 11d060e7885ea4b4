"""The /proc reader (beam_hpc.node.procs) on real processes: this one, a child that names itself
like a stat line, a zombie, and a pid that does not exist."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
from polling import poll_until

from beam_hpc.node import procs

# A command name with ") S 1 " in it: a parser that splits at the first ")" reads its state and
# parent from the name.
CHILD = """
import sys, time
open("/proc/self/comm", "w").write("x) Z 1 y")
print("ready", flush=True)
time.sleep(60)
"""


@pytest.fixture
def child() -> Iterator[subprocess.Popen]:
    p = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "BEAM_PROCS_TEST": "child"})
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        yield p
    finally:
        p.kill()
        p.wait()


def test_a_live_process_whose_name_looks_like_stat_fields(child: subprocess.Popen) -> None:
    assert procs.state(child.pid) in ("R", "S") and procs.running(child.pid)  # not the name's "Z"
    assert procs.parent(child.pid) == os.getpid()
    assert procs.cmdline(child.pid)[:2] == [sys.executable, "-c"]
    assert os.path.realpath(procs.executable(child.pid) or "") == os.path.realpath(sys.executable)
    assert b"BEAM_PROCS_TEST=child" in (procs.environ(child.pid) or [])
    assert child.pid in procs.pids() and os.getpid() in procs.pids()
    started = procs.start_time(child.pid)
    assert started is not None and abs(started - time.time()) < 60
    assert procs.start_ticks(child.pid) is not None and procs.start_ticks(child.pid) >= procs.start_ticks("self")  # type: ignore[operator]
    assert procs.open_files(child.pid)[1].startswith("pipe:")  # its stdout is our pipe


def test_usage_counts_what_the_process_burns(tmp_path) -> None:  # type: ignore[no-untyped-def]
    before = procs.usage("self")
    deadline = time.process_time() + 0.3
    while time.process_time() < deadline:  # burn 0.3 s of this process's CPU
        pass
    after = procs.usage("self")
    assert before is not None and after is not None and 0.2 <= after.cpu_s - before.cpu_s <= 5.0
    assert after.start_ticks == before.start_ticks == procs.start_ticks("self")
    with open(tmp_path / "held", "w"):
        assert str(tmp_path / "held") in procs.open_files("self").values()


def test_this_process() -> None:
    assert procs.state("self") == "R" and procs.parent(os.getpid()) == os.getppid()
    started = procs.start_time()
    assert started is not None and started <= time.time() + 1
    assert procs.boot_time() is not None and procs.boot_time() < started  # type: ignore[operator]


def test_a_zombie_has_ended_and_a_missing_pid_is_gone() -> None:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    poll_until(lambda: procs.state(p.pid) == "Z", 30, 0.05)  # exited, not reaped yet
    assert procs.state(p.pid) == "Z" and not procs.running(p.pid) and procs.parent(p.pid) == os.getpid()
    p.wait()
    assert procs.state(p.pid) == procs.GONE and not procs.running(p.pid)
    assert procs.parent(p.pid) is None and procs.start_time(p.pid) is None
    assert procs.usage(p.pid) is None and procs.start_ticks(p.pid) is None and procs.open_files(p.pid) == {}
    assert procs.cmdline(p.pid) == [] and procs.executable(p.pid) is None and procs.environ(p.pid) is None
    assert not procs.catches(p.pid, 2)
