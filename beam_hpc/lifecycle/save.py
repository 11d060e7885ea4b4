"""Save now: the save sentinel, and waiting until the checkpoint it asked for is complete.

Why: Miles has no signal handler of its own; the one way to make it save on demand is its
``--save-trigger-sentinel`` file, honoured at the next rollout boundary (the reference backend
honours the same file). So "save now" means: create the sentinel, then wait until the backend has
consumed it *and* the checkpoint pointer (``latest_checkpointed_iteration.txt``, written last) has
advanced. Only then is the rollout in flight safe, and only then is the driver stopped. Miles looks
only at whether the file exists and trains on after the save until the segment stops it (its
rollouts take minutes; the segment notices within ``SENTINEL_POLL_S``). The file's JSON also says
``"then": "stop"``, a beam-hpc extension: the reference backend, whose tiny rollouts take a
fraction of a second, exits right after that save, so no rollout is trained that nobody keeps.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from beam_hpc.files import write_json_atomic
from beam_hpc.lifecycle.watchdog import fmt_clock
from beam_hpc.plan.paths import RunPaths
from beam_hpc.run import checkpoint_layout

log = logging.getLogger(__name__)

SENTINEL_POLL_S = 0.2  # a rollout trained after the save is lost work: notice the save promptly
# Seconds kept free before the hard end for stopping the driver, tearing Ray down and writing the
# ledger (measured teardown on the local cluster: 4 s, up to 26 s with a freshly joined worker).
TEARDOWN_RESERVE_S = 15.0


@dataclass(frozen=True)
class SaveResult:
    saved: bool
    iteration: int | None  # latest complete checkpoint after the wait
    seconds: float
    detail: str


def request_save(paths: RunPaths, reason: str) -> None:
    """Create the save sentinel (Miles's --save-trigger-sentinel file), atomically, asking the
    backend to exit after the save (``"then": "stop"``, see above): the segment stops it anyway."""
    body = {"reason": reason, "time": time.time(), **checkpoint_layout.THEN_STOP}
    write_json_atomic(paths.sentinel, body, indent=None)


def clear_save_request(paths: RunPaths) -> bool:
    """Remove a sentinel nobody consumed (so that a later segment does not save at its first
    boundary for a reason that no longer holds). Returns True if one was there."""
    try:
        os.unlink(paths.sentinel)
        return True
    except FileNotFoundError:
        return False


def save_and_wait(
    paths: RunPaths,
    *,
    deadline: float,
    driver_running: Callable[[], bool],
    reason: str,
    interrupted: Callable[[], bool] = lambda: False,
    clock: Callable[[], float] = time.time,
    poll_s: float = SENTINEL_POLL_S,
) -> SaveResult:
    """Ask the backend to save at its next rollout boundary and wait until that checkpoint is
    complete: the sentinel consumed and the pointer advanced past where it was. Gives up at
    ``deadline``, when the driver exits, or when ``interrupted()`` says something more urgent
    came; then the last complete checkpoint is what a later segment resumes from."""
    t0 = clock()
    ckpt = paths.checkpoints
    before = checkpoint_layout.latest_iteration(ckpt)
    request_save(paths, reason)
    log.info("save requested (%s); last complete checkpoint %s; waiting until %s", reason, before, fmt_clock(deadline))
    while True:
        now_it = checkpoint_layout.latest_iteration(ckpt)
        advanced = now_it is not None and (before is None or now_it > before)
        if advanced and not Path(paths.sentinel).exists():
            return SaveResult(True, now_it, clock() - t0, f"checkpoint {now_it} saved on request")
        if not driver_running():
            why = "the driver exited before the checkpoint landed"
            break
        if interrupted():
            why = "interrupted by a more urgent signal"
            break
        if clock() >= deadline:
            why = f"no checkpoint within the save deadline ({deadline - t0:.0f} s)"
            break
        time.sleep(poll_s)
    now_it = checkpoint_layout.latest_iteration(ckpt)
    advanced = now_it is not None and (before is None or now_it > before)
    if advanced:  # landed at the last instant (the sentinel may go a moment later)
        return SaveResult(True, now_it, clock() - t0, f"checkpoint {now_it} saved on request")
    return SaveResult(False, now_it, clock() - t0, f"{why}; relying on checkpoint {now_it}")
