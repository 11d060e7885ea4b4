"""The computer-algebra tier of answer checking: math-verify/sympy in persistent worker processes.

Why processes and not math-verify's own timeout: math-verify bounds parse/verify time with
SIGALRM, which only works in a process's main thread, so it raises in thread pools and Ray
async actors; and with its timeout switched off a hostile input such as ``10^{10^{10^{10}}}``
runs for ever. Here every check runs in a small worker process that the caller kills when the
check exceeds its time bound; the next check starts a fresh worker. Each worker also caps its
own CPU time per request (RLIMIT_CPU, enforced by the kernel even inside a long C call) and its
address space, so an orphaned worker cannot spin or swell if its parent dies mid-check, and it
exits on end of input when its parent goes away while it is idle.

Protocol (one JSON object per line): the worker writes ``{"ready": true}`` (or ``{"error": ...}``)
once its imports are warm, then answers each ``{"a": answer, "b": label, "t": seconds}`` with
``{"equal": bool}``. Run as ``python -m beam_hpc.reward.worker``.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import select
import subprocess
import sys
import threading
import time
from pathlib import Path

from beam_hpc.errors import RuntimeFailure

log = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 120.0  # importing sympy on a loaded login node can be slow; not a check's time
_MEMORY_LIMIT_ENV = "BEAM_HPC_REWARD_WORKER_MEM_MB"
_WORKERS_ENV = "BEAM_HPC_REWARD_WORKERS"


class RewardWorkerError(RuntimeFailure):
    """The checker process cannot start (e.g. math-verify is not installed)."""


class _WorkerGone(Exception):
    """The worker was dead before it accepted a request: retry on a fresh one."""


class _Worker:
    """One checker process and its pipes. Used by one thread at a time (the pool sees to it)."""

    def __init__(self) -> None:
        env = dict(os.environ)
        package_root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "beam_hpc.reward.worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,  # math-verify warns on stderr; errors come back on stdout
            env=env,
            bufsize=0,
            start_new_session=True,  # a terminal's Ctrl-C must not kill the checker mid-check
        )
        self._buf = b""
        try:
            line = self._readline(time.monotonic() + STARTUP_TIMEOUT_S)
        except EOFError:
            line = None
        reply = json.loads(line) if line else {}
        if not reply.get("ready"):
            self.kill()
            why = reply.get("error") or f"no answer within {STARTUP_TIMEOUT_S:.0f} s"
            raise RewardWorkerError(
                f"the reward checker process did not start: {why}. "
                "Install the data extra (pip install 'beam-hpc[data]') for sympy and math-verify."
            )

    def ask(self, answer: str, label: str, timeout_s: float) -> bool | None:
        """The verdict, or None when the check timed out or the worker died while checking."""
        if self._proc.poll() is not None:
            raise _WorkerGone
        request = (json.dumps({"a": answer, "b": label, "t": timeout_s}) + "\n").encode()
        try:
            self._write_all(request)
        except (BrokenPipeError, OSError):
            raise _WorkerGone from None
        try:
            line = self._readline(time.monotonic() + timeout_s)
        except EOFError:
            return None
        return None if line is None else bool(json.loads(line)["equal"])

    def kill(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait()
        for pipe in (self._proc.stdin, self._proc.stdout):
            if pipe is not None:
                pipe.close()

    def _write_all(self, data: bytes) -> None:
        assert self._proc.stdin is not None
        view = memoryview(data)
        while view:
            view = view[self._proc.stdin.write(view) or 0 :]

    def _readline(self, deadline: float) -> str | None:
        """One line, or None at the deadline. poll(), not select(): a Ray worker may hold fds
        beyond select's limit of 1024."""
        assert self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        while b"\n" not in self._buf:
            remaining_ms = (deadline - time.monotonic()) * 1000
            if remaining_ms <= 0 or not poller.poll(remaining_ms):
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                raise EOFError
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return line.decode()


class SymbolicChecker:
    """A small pool of checker processes shared by every thread of one process.

    A check waits for an idle worker (or starts one, up to ``max_workers``); only the check itself
    is timed. A timed-out or dead worker is killed and replaced on demand.
    """

    def __init__(self, max_workers: int) -> None:
        self.max_workers = max(1, max_workers)
        self._idle: list[_Worker] = []
        self._all: set[_Worker] = set()
        self._count = 0
        self._cond = threading.Condition()

    def check(self, answer: str, label: str, timeout_s: float) -> bool:
        for _ in range(2):
            worker = self._acquire()
            try:
                verdict = worker.ask(answer, label, timeout_s)
            except _WorkerGone:
                self._discard(worker)
                continue
            except BaseException:
                self._discard(worker)
                raise
            if verdict is None:
                log.warning("answer check exceeded %.1f s (%.60r vs %.60r): counted wrong", timeout_s, answer, label)
                self._discard(worker)
                return False
            with self._cond:
                self._idle.append(worker)
                self._cond.notify()
            return verdict
        raise RewardWorkerError("the reward checker process died twice before accepting a check")

    def close(self) -> None:
        with self._cond:
            workers, self._idle, self._all, self._count = list(self._all), [], set(), 0
        for worker in workers:
            worker.kill()

    def _acquire(self) -> _Worker:
        with self._cond:
            while not self._idle and self._count >= self.max_workers:
                self._cond.wait()
            if self._idle:
                return self._idle.pop()
            self._count += 1
        try:
            worker = _Worker()
        except BaseException:
            with self._cond:
                self._count -= 1
                self._cond.notify()
            raise
        with self._cond:
            self._all.add(worker)
        return worker

    def _discard(self, worker: _Worker) -> None:
        worker.kill()
        with self._cond:
            self._all.discard(worker)
            self._count -= 1
            self._cond.notify()


_checker: SymbolicChecker | None = None
_checker_pid = 0
_checker_lock = threading.Lock()


def _shared_checker() -> SymbolicChecker:
    """The process's checker pool; a forked child builds its own (the parent's pipes are not its)."""
    global _checker, _checker_pid
    with _checker_lock:
        if _checker is None or _checker_pid != os.getpid():
            workers = int(os.environ.get(_WORKERS_ENV) or 0) or min(4, os.cpu_count() or 1)
            _checker, _checker_pid = SymbolicChecker(workers), os.getpid()
            atexit.register(_checker.close)
        return _checker


def symbolic_equal(answer: str, label: str, timeout_s: float = 2.0) -> bool:
    """math-verify's verdict on two normalised answers, within ``timeout_s`` seconds of checking."""
    return _shared_checker().check(answer, label, timeout_s)


# ---------------------------------------------------------------------------------------------
# The worker side


def _verify(parse, verify, answer: str, label: str) -> bool:  # type: ignore[no-untyped-def]
    """Gold first, as math-verify documents; both wrapped in $...$ (a bare ``\\sqrt{18}`` parses
    to nothing). Its timeouts are off: this process is the timeout."""
    gold = parse(f"${label}$", parsing_timeout=None)
    pred = parse(f"${answer}$", parsing_timeout=None)
    if not gold or not pred:
        return False
    return bool(verify(gold, pred, timeout_seconds=None))


def _limit_memory() -> None:
    import resource

    limit = int(os.environ.get(_MEMORY_LIMIT_ENV) or 4096) * 2**20
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def _limit_cpu(seconds: float) -> None:
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    soft = int(usage.ru_utime + usage.ru_stime + seconds) + 2
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    if hard == resource.RLIM_INFINITY or soft <= hard:
        resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))


def _reply(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def serve() -> None:
    """The worker's loop: one verdict per request line until end of input."""
    logging.disable(logging.CRITICAL)  # math-verify warns on every call with its timeouts off
    try:
        from math_verify import parse, verify

        _verify(parse, verify, "1", "1")  # warm sympy up before saying ready
        _limit_memory()
    except Exception as err:  # noqa: BLE001 - any start-up failure goes to the parent, which raises it
        _reply({"error": f"{type(err).__name__}: {err}"})
        return
    _reply({"ready": True})
    for line in sys.stdin:
        request = json.loads(line)
        _limit_cpu(float(request.get("t", 2.0)))
        try:
            equal = _verify(parse, verify, request["a"], request["b"])
        except (Exception, MemoryError, RecursionError):  # noqa: BLE001 - unparsable or too big: not equal
            equal = False
        _reply({"equal": equal})


if __name__ == "__main__":
    serve()
