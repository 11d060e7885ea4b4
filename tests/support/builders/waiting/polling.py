"""Waiting in the tests and their tools: the one polling loop (a condition, a deadline, a pause),
never a fixed sleep.

Jobs, daemons and processes finish on their own clock, the more so on a busy 2-core machine, so a
test asks again until the answer comes or the deadline passes, and then shows what it saw last.
No pytest and no beam_hpc here: the local Slurm cluster's developer CLI and the benchmarks use it
too. What a run's wait prints when it fails is run_watch.wait_for's.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def poll_until(predicate: Callable[[], T], timeout: float, poll_s: float = 0.2) -> T | None:
    """The first truthy value of ``predicate()``, or None after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            return None
        time.sleep(poll_s)


def gone(check: Callable[[], T], timeout: float = 30.0, poll_s: float = 0.2) -> T:
    """``check()`` once it is empty or false, waiting up to ``timeout`` s for it to get there; its
    last value otherwise (so that the assertion shows what was left). For "nothing left running"
    checks: processes that were told to stop take a moment to be reaped on a busy machine."""
    last: list[T] = []

    def empty() -> bool:
        last[:] = [check()]
        return not last[0]

    poll_until(empty, timeout, poll_s)
    return last[0]
