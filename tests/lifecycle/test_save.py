"""beam_hpc.lifecycle.save: the save sentinel, with a thread doing what a backend does with it."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from beam_hpc.lifecycle.save import save_and_wait
from beam_hpc.plan.paths import RunPaths
from beam_hpc.run import checkpoint_layout


def _backend(paths: RunPaths, iteration: int, delay: float, stop: threading.Event) -> None:
    """What a backend does with the sentinel: at its next rollout boundary, save, pointer last,
    then remove the sentinel (the reference backend's order)."""
    while not stop.is_set():
        if os.path.exists(paths.sentinel):
            time.sleep(delay)
            checkpoint_layout.iteration_dir(paths.checkpoints, iteration).mkdir(parents=True)
            checkpoint_layout.mark_latest(paths.checkpoints, iteration)
            os.unlink(paths.sentinel)
            return
        time.sleep(0.02)


def test_save_and_wait_returns_once_the_requested_checkpoint_landed(tmp_path: Path) -> None:
    paths = RunPaths(str(tmp_path))
    checkpoint_layout.mark_latest(paths.checkpoints, 4)
    stop = threading.Event()
    t = threading.Thread(target=_backend, args=(paths, 7, 0.3, stop))
    t.start()
    res = save_and_wait(paths, deadline=time.time() + 10, driver_running=lambda: True, reason="walltime", poll_s=0.05)
    t.join()
    assert res.saved and res.iteration == 7 and 0.25 < res.seconds < 5
    assert not os.path.exists(paths.sentinel)


def test_save_and_wait_gives_up_at_the_deadline_or_when_the_driver_is_gone(tmp_path: Path) -> None:
    paths = RunPaths(str(tmp_path))
    checkpoint_layout.mark_latest(paths.checkpoints, 4)
    res = save_and_wait(paths, deadline=time.time() + 0.3, driver_running=lambda: True, reason="preempted", poll_s=0.05)
    assert not res.saved and res.iteration == 4 and "relying on checkpoint 4" in res.detail
    res = save_and_wait(paths, deadline=time.time() + 10, driver_running=lambda: False, reason="walltime", poll_s=0.05)
    assert not res.saved and "driver exited" in res.detail
