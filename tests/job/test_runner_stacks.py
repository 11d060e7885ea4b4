"""The runner's side of a stall, fast and real: the driver's process tree is dumped, a driver that
answers no signal (stopped) is skipped within the dump timeout, named with its node as the suspect,
and still ended by the teardown. (The whole flow, nodes included: tests/lifecycle/test_lifecycle_stall.py.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from job_plans import make_test_plan

from beam_hpc.job.launchers import for_job
from beam_hpc.job.runner import JobRunner
from beam_hpc.node import stacks

DRIVER = """
import sys, time
from beam_hpc.node import stacks
stacks.register()
def driver_waiting_on_a_collective():
    print("ready", flush=True)  # from inside: a dump taken after this line must show this frame
    while True:
        time.sleep(60)
driver_waiting_on_a_collective()
"""


def _runner(tmp_path: Path) -> JobRunner:
    plan = make_test_plan(tmp_path / "run", trainer_nodes=1, rollout_nodes=1, local_run=True)
    ctx, launcher = for_job(plan, srun=False)
    runner = JobRunner(plan, launcher, ctx, stop_grace_s=1.0)
    runner.segment_dir.mkdir(parents=True, exist_ok=True)
    return runner


def _driver(runner: JobRunner) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", DRIVER], stdout=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, stacks.SEGMENT_DIR_VAR: str(runner.segment_dir)})
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    runner.driver = proc
    return proc


def test_a_hung_driver_is_dumped_and_the_record_lists_its_file(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no py-spy: faulthandler through the registered signal
    runner = _runner(tmp_path)
    proc = _driver(runner)
    try:
        rec = runner.dump_stacks(wait_s=5.0)
    finally:
        runner.stop()
    assert rec["skipped"] == [] and rec["suspects"] == [] and len(rec["dumps"]) == 1, rec
    assert "in driver_waiting_on_a_collective" in Path(rec["dumps"][0]).read_text()
    assert runner.seg.stacks_index.is_file() and proc.poll() is not None


def test_a_driver_that_answers_no_signal_is_skipped_named_and_still_ended(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    runner = _runner(tmp_path)
    proc = _driver(runner)
    os.kill(proc.pid, signal.SIGSTOP)  # as a debugger or a frozen cgroup leaves it: no handler runs
    t0 = time.monotonic()
    try:
        rec = runner.dump_stacks(wait_s=2.0, dump_timeout_s=1.0)
        dumped_s = time.monotonic() - t0
        runner.stop()  # SIGTERM stays pending on a stopped process; the SIGKILL after the grace ends it
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
    assert dumped_s < 10.0
    (skipped,) = rec["skipped"]
    assert skipped["pid"] == proc.pid and "state T" in skipped["why"], rec
    assert rec["dumps"] == [] and rec["suspects"] == [stacks.host_name()]
    assert proc.returncode == -signal.SIGKILL
