"""A rollout worker lost mid-segment does not end it (issue 42 item 1), on a real Ray cluster.

The reference backend runs with two rollout workers on the shared one-node Ray cluster
(``reference_ray``); mid-run the test SIGKILLs one worker's actor process, as a lost node takes it
(Ray then reports the actor dead, as it does when the raylet or the node goes); one prompt a
unit, so both workers serve every rollout. The segment goes
on with the worker left: the lost worker's unit goes back to the queue, no rollout is trained
twice, and the final checkpoint is bitwise that of the same run left alone, which also shows that
whoever serves a unit computes the same bits.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from job_plans import HOST_SITE, make_test_plan
from reference_harness import SMALL, assert_bitwise_equal, load_checkpoint, metrics, run_backend

from beam_hpc.backends.reference.rollouts.unit_service import WORKERS_LOST
from beam_hpc.fault_hooks import SLOW_ROLLOUT_VAR

pytestmark = [pytest.mark.ray, pytest.mark.slow]

N = 4


def _plan(run: Path, assets) -> str:  # type: ignore[no-untyped-def]
    plan = make_test_plan(run, assets=assets, site=HOST_SITE,
                          overrides=[*SMALL, f"num_rollout={N}", "checkpoint.interval=2", "backend_options.rollout_workers=2",
                                     "backend_options.unit_prompts=1"])
    return plan.paths.plan


def _wait(what: str, predicate, proc: subprocess.Popen, timeout: float = 240):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = predicate()
        if got:
            return got
        assert proc.poll() is None, f"the backend ended ({proc.returncode}) before {what}"
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _rollouts(run: Path) -> list[int]:
    try:
        return [m["rollout_id"] for m in metrics(run, "rollout")]
    except (FileNotFoundError, json.JSONDecodeError):
        return []


def test_a_lost_rollout_worker_leaves_the_segment_running_and_the_weights_exact(tiny_assets, reference_ray, tmp_path) -> None:
    whole, hit = tmp_path / "whole", tmp_path / "lost"
    alone = ThreadPoolExecutor(1).submit(run_backend, _plan(whole, tiny_assets), reference_ray)
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", SLOW_ROLLOUT_VAR: "0.4"}  # room to strike mid-run
    log = (tmp_path / "lost.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "beam_hpc.backends.reference", "--plan", _plan(hit, tiny_assets),
                             "--ray-address", reference_ray], env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        placement = _wait("placement.json", lambda: (hit / "placement.json").is_file()
                          and json.loads((hit / "placement.json").read_text()), proc)
        _wait("rollout 0 to be trained", lambda: len(_rollouts(hit)) >= 1, proc)
        victim = placement["rollout"][1]["pid"]
        os.kill(victim, signal.SIGKILL)
        at = len(_rollouts(hit))
        assert proc.wait(timeout=300) == 0, (tmp_path / "lost.log").read_text()[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    text = (tmp_path / "lost.log").read_text()
    assert at < N, f"the worker was killed after the run ended ({at} rollouts)"
    assert "rollout worker segment:1 lost" in text, text[-4000:]
    trained = _rollouts(hit)
    assert trained == list(range(N)), trained  # every rollout once, none again
    rows = metrics(hit, "rollout")
    assert rows[-1][WORKERS_LOST] == 1.0 and rows[0][WORKERS_LOST] == 0.0
    alone.result()
    name = f"iter_{N - 1:07d}"
    compared = assert_bitwise_equal(load_checkpoint(whole / "checkpoints" / name),
                                    load_checkpoint(hit / "checkpoints" / name), name)
    assert compared > 50
