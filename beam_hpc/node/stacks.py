"""Stack dumps of a segment's Python processes, taken when the segment stalls.

Why: a hung segment is only worth stopping if the next one can avoid the hang, and what a hung
process was doing is only visible while it still hangs. So before the segment stops a stalled
driver (:mod:`beam_hpc.lifecycle.stall`), every Python process of the job writes its threads'
stacks to ``logs/<job>-<restart>/stacks/<host>-<pid>.txt``: with ``py-spy dump --pid`` where the
image has ``py-spy`` (it reads any Python process and needs nothing from it), otherwise through
:mod:`faulthandler` in the processes that :func:`register` set up. Dumps run in parallel, each
within :data:`DUMP_TIMEOUT_S`, so a node with many hung processes still answers in about that time.

The batch host dumps the driver's own process tree (:func:`process_tree`); each node step dumps
its node's Ray processes (found by the job's tag, :func:`beam_hpc.node.ray_node.tagged_pids`) when
the segment asks through ``stacks/request.json`` (:func:`answer_request`, called from the node
step's loop; the shared run directory is how the job already reaches every node step).
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import shutil
import signal
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any

from beam_hpc.node import procs
from beam_hpc.plan.paths import SegmentPaths

# SIGWINCH, because its default action is to ignore it: a process that did not register is left as it
# was (and it is signalled only when /proc/<pid>/status shows the signal caught, anyway).
DUMP_SIGNAL = signal.SIGWINCH
# A dump not done by then is skipped and its record says why, with the process's state (``T``
# stopped, ``D`` stuck in the kernel, e.g. on a dead filesystem).
DUMP_TIMEOUT_S = 5.0
SEGMENT_DIR_VAR = "BEAM_SEGMENT_DIR"  # the segment directory: the driver and every Ray worker get it
_SETTLE_S = 0.2  # a faulthandler dump is written in a burst; done once the file stops growing this long
_registered: list[IO[str]] = []  # keep the file objects alive: faulthandler holds only their fd


def host_name() -> str:
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def register(segment_dir: str | None = None) -> Path | None:
    """Make this process dump all its threads' stacks on :data:`DUMP_SIGNAL`, into its file in the
    segment's ``stacks/`` (``segment_dir``, default ``$BEAM_SEGMENT_DIR``; nothing when neither is
    set, e.g. a backend run by hand). Returns the file.

    The processes that may hang (the reference backend's driver and actors, the node steps) call it
    at start. faulthandler's dump runs in C inside the signal handler, so it answers even when the
    Python code is stuck in a lock, a sleep or a collective."""
    root = segment_dir or os.environ.get(SEGMENT_DIR_VAR)
    if not root:
        return None
    path = SegmentPaths(root).stack_file(host_name(), os.getpid())
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fh = open(path, "a")  # noqa: SIM115 - held for the process's lifetime
    except OSError:
        return None
    _registered.append(fh)
    faulthandler.register(DUMP_SIGNAL, file=fh, all_threads=True, chain=False)
    return path


# -- processes (read through beam_hpc.node.procs) --------------------------------------------------
process_state = procs.state  # the kernel's one-letter state, or "gone"


def _name(pid: int) -> str:
    return " ".join(procs.cmdline(pid))[:160] or "?"


def is_python(pid: int) -> bool:
    """The process runs a Python interpreter (by its executable; Ray renames its workers' titles)."""
    return "python" in os.path.basename(procs.executable(pid) or "")


def catches(pid: int, sig: int = DUMP_SIGNAL) -> bool:
    """The process has a handler for ``sig`` (``SigCgt`` in /proc/<pid>/status)."""
    return procs.catches(pid, sig)


def process_tree(root: int) -> list[int]:
    """``root`` and every process below it (by parent pid), alive now."""
    children: dict[int, list[int]] = {}
    for pid in procs.pids():
        ppid = procs.parent(pid)
        if ppid is not None:
            children.setdefault(ppid, []).append(pid)
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        if pid in out or process_state(pid) == procs.GONE:
            continue
        out.append(pid)
        todo.extend(children.get(pid, []))
    return sorted(out)


# -- dumping ----------------------------------------------------------------------------------------
def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def dump_one(pid: int, segment_dir: str, *, host: str | None = None, timeout_s: float = DUMP_TIMEOUT_S,
             py_spy: str | None = None) -> dict[str, Any]:
    """One process's stacks into its file; the record says where, how, or why not."""
    host = host or host_name()
    path = SegmentPaths(segment_dir).stack_file(host, pid)
    rec: dict[str, Any] = {"host": host, "pid": pid, "name": _name(pid), "file": None}
    header = f"--- stacks of pid {pid} on {host}, {time.strftime('%Y-%m-%d %H:%M:%S')} ({{how}})\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    if py_spy:
        try:
            done = subprocess.run([py_spy, "dump", "--pid", str(pid)], capture_output=True, text=True,
                                  timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired:
            return {**rec, "method": "py-spy", "state": process_state(pid),
                    "skipped": f"py-spy dump did not finish within {timeout_s:.0f} s"}
        if done.returncode == 0:
            with open(path, "a") as fh:
                fh.write(header.format(how="py-spy dump") + done.stdout)
            return {**rec, "method": "py-spy", "file": str(path)}
        rec["py_spy_error"] = (done.stderr or done.stdout).strip()[-300:]
    if not catches(pid):
        why = (f"py-spy failed ({rec['py_spy_error']}) and it registered no stack-dump signal" if py_spy
               else "it registered no stack-dump signal, and py-spy is not on PATH")
        return {**rec, "method": None, "skipped": why, "unregistered": True}
    with open(path, "a") as fh:
        fh.write(header.format(how=f"faulthandler on {DUMP_SIGNAL.name}"))
    before = _size(path)
    try:
        os.kill(pid, DUMP_SIGNAL)
    except ProcessLookupError:
        return {**rec, "method": "faulthandler", "skipped": "the process ended before its dump"}
    deadline = time.monotonic() + timeout_s
    last, settled_at = before, None
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = _size(path)
        if now != last:
            last, settled_at = now, time.monotonic()
        elif settled_at is not None and time.monotonic() - settled_at >= _SETTLE_S:
            return {**rec, "method": "faulthandler", "file": str(path)}
    if last > before:  # still writing at the deadline: keep what it wrote
        return {**rec, "method": "faulthandler", "file": str(path), "note": "still writing at the deadline"}
    return {**rec, "method": "faulthandler", "state": process_state(pid),
            "skipped": f"no dump within {timeout_s:.0f} s of {DUMP_SIGNAL.name} (process state {process_state(pid)})"}


def dump_all(pids: list[int], segment_dir: str, *, host: str | None = None,
             timeout_s: float = DUMP_TIMEOUT_S) -> list[dict[str, Any]]:
    """Every Python process of ``pids`` dumped at once (py-spy when on PATH, else faulthandler)."""
    py_spy = shutil.which("py-spy")
    targets = [p for p in pids if p != os.getpid() and is_python(p)]
    if not targets:
        return []
    with ThreadPoolExecutor(max_workers=min(32, len(targets))) as pool:
        return list(pool.map(lambda p: dump_one(p, segment_dir, host=host, timeout_s=timeout_s, py_spy=py_spy),
                             targets))


# -- the request the segment sends the node steps ---------------------------------------------------
def request(segment_dir: str) -> str:
    """Ask every node step of the segment to dump its node (returns the request's id)."""
    from beam_hpc.node.ray_node import write_json_atomic

    rid = f"{time.time():.6f}"
    write_json_atomic(SegmentPaths(segment_dir).stacks_request, {"id": rid, "time": time.time()})
    return rid


def pending_request(segment_dir: str, answered: str | None) -> str | None:
    """The id of a request this node step has not answered yet (None: none)."""
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        rid = str(json.loads(SegmentPaths(segment_dir).stacks_request.read_text())["id"])
        return None if rid == answered else rid
    return None


def answer_request(segment_dir: str, rid: str, *, group: str, index: int, pids: list[int],
                   timeout_s: float = DUMP_TIMEOUT_S) -> None:
    """A node step's answer: its node's processes dumped, the records beside them."""
    from beam_hpc.node.ray_node import write_json_atomic

    records = dump_all(pids, segment_dir, timeout_s=timeout_s)
    write_json_atomic(SegmentPaths(segment_dir).stacks_answer(group, index),
                      {"id": rid, "host": host_name(), "group": group, "index": index, "dumps": records})


def read_answer(segment_dir: str, rid: str, group: str, index: int) -> list[dict[str, Any]] | None:
    """A node step's records for request ``rid``; None until it answered."""
    with contextlib.suppress(OSError, ValueError):
        data = json.loads(SegmentPaths(segment_dir).stacks_answer(group, index).read_text())
        if data.get("id") == rid:
            return list(data.get("dumps") or [])
    return None


def drop_empty(segment_dir: str) -> None:
    """Remove the files of processes that registered and were never dumped (most of them)."""
    d = SegmentPaths(segment_dir).stacks
    with contextlib.suppress(OSError):
        for f in d.glob("*.txt"):
            with contextlib.suppress(OSError):
                if f.stat().st_size == 0:
                    f.unlink()
        if not any(d.iterdir()):
            d.rmdir()
