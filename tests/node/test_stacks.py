"""Stack dumps of real processes (beam_hpc.node.stacks): a child Python that registered the dump
signal writes its stacks into the segment's stacks/ when asked; one that is stopped is skipped
within the timeout and the record says why; one that registered nothing is left alone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from beam_hpc.node import stacks
from beam_hpc.plan.paths import SegmentPaths

CHILD = """
import sys, time
from beam_hpc.node import stacks
registered = sys.argv[1] == "yes"
if registered:
    stacks.register(sys.argv[2])
def hung_in_a_distinctive_function():
    print("ready", flush=True)
    while True:
        time.sleep(60)
hung_in_a_distinctive_function()
"""


@pytest.fixture
def child(tmp_path: Path) -> Iterator:
    procs: list[subprocess.Popen] = []

    def start(registered: bool = True) -> subprocess.Popen:
        p = subprocess.Popen([sys.executable, "-c", CHILD, "yes" if registered else "no", str(tmp_path)],
                             stdout=subprocess.PIPE, text=True)
        procs.append(p)
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        return p

    yield start
    for p in procs:
        p.kill()
        p.wait()


def test_a_registered_process_dumps_all_its_threads_into_its_file(tmp_path: Path, child) -> None:
    p = child()
    assert stacks.catches(p.pid) and stacks.is_python(p.pid)
    rec = stacks.dump_one(p.pid, str(tmp_path), timeout_s=5.0)
    path = SegmentPaths(str(tmp_path)).stack_file(stacks.host_name(), p.pid)
    assert rec["file"] == str(path) and rec["method"] == "faulthandler" and "skipped" not in rec
    text = path.read_text()
    assert f"stacks of pid {p.pid}" in text and "most recent call first" in text
    assert "in hung_in_a_distinctive_function" in text
    assert p.poll() is None  # it dumps and goes on (hanging, here)
    second = stacks.dump_one(p.pid, str(tmp_path), timeout_s=5.0)
    assert second["file"] == str(path) and path.read_text().count("in hung_in_a_distinctive_function") == 2


def test_a_stopped_process_is_skipped_within_the_timeout_and_the_record_says_why(tmp_path: Path, child) -> None:
    p = child()
    os.kill(p.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        rec = stacks.dump_one(p.pid, str(tmp_path), timeout_s=1.0)
        assert time.monotonic() - t0 < 3.0
    finally:
        os.kill(p.pid, signal.SIGCONT)
    assert rec["file"] is None and "no dump within 1 s" in rec["skipped"] and "state T" in rec["skipped"]


def test_a_process_that_registered_nothing_is_not_signalled(tmp_path: Path, child, monkeypatch) -> None:
    p = child(registered=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no py-spy, wherever this runs
    assert not stacks.catches(p.pid)
    (rec,) = stacks.dump_all([p.pid], str(tmp_path), timeout_s=1.0)
    assert rec["unregistered"] and "registered no stack-dump signal" in rec["skipped"]
    assert not SegmentPaths(str(tmp_path)).stack_file(stacks.host_name(), p.pid).exists()


def test_a_node_step_answers_the_segments_request_once(tmp_path: Path, child, monkeypatch) -> None:
    p, q = child(), child(registered=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no py-spy: the faulthandler path
    seg = str(tmp_path)
    assert stacks.pending_request(seg, None) is None
    rid = stacks.request(seg)
    assert stacks.pending_request(seg, None) == rid and stacks.pending_request(seg, rid) is None
    assert stacks.read_answer(seg, rid, "rollout", 0) is None
    stacks.answer_request(seg, rid, group="rollout", index=0, pids=[p.pid, q.pid, os.getpid()])
    records = stacks.read_answer(seg, rid, "rollout", 0)
    assert records is not None and sorted(r["pid"] for r in records) == sorted([p.pid, q.pid])  # never itself
    dumped = [r for r in records if r.get("file")]
    assert [r["pid"] for r in dumped] == [p.pid] and "hung_in_a_distinctive" in Path(dumped[0]["file"]).read_text()
    assert stacks.read_answer(seg, "another request", "rollout", 0) is None
    assert p.pid in stacks.process_tree(os.getpid()) and q.pid in stacks.process_tree(os.getpid())
    stacks.drop_empty(seg)
    assert Path(dumped[0]["file"]).exists()  # kept: it holds a dump


def test_py_spy_dumps_any_python_process_where_it_is_on_path(tmp_path: Path, child, monkeypatch) -> None:
    """With py-spy on PATH (the image has it) even a process that registered nothing is dumped,
    and no signal is sent. Skipped where py-spy is not installed (`pip install py-spy`)."""
    import shutil

    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    if shutil.which("py-spy") is None:
        pytest.skip("py-spy is not installed here")
    p = child(registered=False)
    (rec,) = stacks.dump_all([p.pid], str(tmp_path), timeout_s=10.0)
    assert rec["method"] == "py-spy" and rec["file"], rec
    text = Path(rec["file"]).read_text()
    assert "py-spy dump" in text and "hung_in_a_distinctive_function" in text
