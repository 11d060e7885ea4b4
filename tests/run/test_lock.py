"""beam_hpc.run.lock: one segment holds a run; a killed job's lock is taken over.

The one seam is the Slurm query (``query=``): the lock is handed a JobInfo instead of running
``scontrol``, so that every state is checked in milliseconds (tests/lifecycle/test_lifecycle_slurm.py
takes a killed job's lock over on the real cluster).
"""

from __future__ import annotations

import multiprocessing
import socket
import time
from pathlib import Path

import pytest

from beam_hpc.run.lock import Holder, RunLockError, acquire, read_holder, release
from beam_hpc.slurm.client import JobInfo, JobState, SlurmUnavailable


def _query(states: dict[str, str | None]):
    def query(job_id: str) -> JobInfo | None:
        state = states.get(job_id)
        if state == "UNAVAILABLE":
            raise SlurmUnavailable(["scontrol", "show", "job", job_id], "controller down")
        return None if state is None else JobInfo(job_id, JobState(state), 0, None, None)
    return query


def test_lock_refuses_a_live_job_and_takes_over_a_dead_one(tmp_path: Path) -> None:
    lock = tmp_path / "run.lock"
    first = Holder.me("11")
    assert acquire(lock, first, query=_query({})) is None
    assert read_holder(lock).job_id == "11"
    with pytest.raises(RunLockError, match="in use by job 11 .*beam-hpc cancel"):
        acquire(lock, Holder.me("12"), query=_query({"11": "RUNNING"}))
    with pytest.raises(RunLockError, match="Slurm cannot say"):
        acquire(lock, Holder.me("12"), query=_query({"11": "UNAVAILABLE"}))
    for state in (None, "COMPLETING", "PENDING", "CANCELLED"):  # gone, or anything but RUNNING
        taken = acquire(lock, Holder.me("12"), query=_query({"11": state, "12": "RUNNING"}))
        assert taken is not None and taken.job_id in ("11", "12")
        Path(lock).unlink()
        acquire(lock, first, query=_query({}))


def test_a_requeued_job_takes_over_its_own_lock_and_release_is_owner_only(tmp_path: Path) -> None:
    lock = tmp_path / "run.lock"
    before = Holder("21", 0, "n1", 999_999, 1.0)  # our job before its requeue (another pid, maybe another node)
    acquire(lock, before, query=_query({}))
    again = Holder.me("21", restart=1)
    assert acquire(lock, again, query=_query({"21": "RUNNING"})) == before
    assert not release(lock, before)  # the old incarnation cannot remove its successor's lock
    assert release(lock, again) and not lock.exists()


def test_lock_outside_slurm_is_stale_when_its_pid_is_gone(tmp_path: Path) -> None:
    lock = tmp_path / "run.lock"
    proc = multiprocessing.get_context("fork").Process(target=time.sleep, args=(0,))
    proc.start()
    proc.join()
    acquire(lock, Holder(None, 0, socket.gethostname(), proc.pid, 1.0))
    assert acquire(lock, Holder.me(None)).pid == proc.pid
    with pytest.raises(RunLockError, match="a local run"):
        acquire(lock, Holder(None, 0, socket.gethostname(), 1, 1.0))  # pid 1 is alive: refused
    lock.write_text("{torn")
    assert acquire(lock, Holder.me(None)) is not None  # unreadable: nobody's
