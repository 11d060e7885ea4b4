"""Fault injection for the tests: the one place where beam-hpc misbehaves on purpose.

Some faults come from hardware at random (a broken node, a node that hangs on a stuck filesystem,
a driver stuck in a deadlock); the lifecycle's answer to each is tested on a real chain only if
the fault can be made to happen where and when a test needs it. Each hook below does nothing
unless its environment variable is set, and nothing in beam-hpc sets one: a test (or
``benchmarks/faults.py``) exports it to the job. The product calls the hooks at the one point
where each fault would show (node/step.py, node/ray_node.py, backends/reference/loop/driver.py,
backends/reference/rollouts/outside_worker.py).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from beam_hpc.files import write_json_atomic

log = logging.getLogger(__name__)

# A file path. The first node step that reaches the check claims the file (writes its host name
# into it, atomically) and fails; later node steps fail only on the node named there. So exactly
# one node of the cluster goes bad, whichever the first allocation got, as a node with a broken
# disk or GPU does. Used by tests/lifecycle/test_lifecycle_slurm.py (the failed-node exclusion).
BAD_NODE_FILE_VAR = "BEAM_TEST_BAD_NODE_FILE"

# Node indices (comma-separated) whose `ray start` is replaced by a process that never starts Ray,
# as a node hangs on a stuck filesystem or network. Used by tests/job/test_job_local.py (the
# readiness deadline names the node).
HANG_RAY_START_VAR = "BEAM_TEST_HANG_RAY_START"

# A rollout id k. The reference driver that finishes rollout k (its step, eval and checkpoint
# included) then hangs, alive and idle, as a driver stuck in a deadlock does. At most
# HANG_TIMES_VAR times per run (default 1), counted by the marker each hang leaves in its segment
# directory: with a checkpoint at k the resumed segment never finishes k again; without one it
# re-does k and, allowed a second hang, stalls at the same rollout twice. Used by
# tests/lifecycle/test_lifecycle_stall.py (the stall watchdog) and benchmarks/faults.py.
HANG_AFTER_ROLLOUT_VAR = "BEAM_TEST_HANG_AFTER_ROLLOUT"
HANG_TIMES_VAR = "BEAM_TEST_HANG_TIMES"
HANG_MARKER_FILE = "test-hang.json"  # in the segment directory of a driver that hung on purpose

# Seconds (a float). The reference driver waits this long after each rollout, as a run whose
# rollouts take long does (long responses, a slow shared filesystem), without their CPU. A chain
# test then meets its walltime in the middle of a run of a few small rollouts however loaded the
# machine is. Used by tests/lifecycle/test_controller_outage_chain.py.
SLOW_ROLLOUT_VAR = "BEAM_TEST_SLOW_ROLLOUT_S"

# "K:S": an outside rollout worker (beam_hpc.backends.reference.rollouts.outside_worker) waits S seconds before every token of
# the units of rollout K and later, as a worker on a slow node does, so that a test can stop it in
# the middle of a unit. Used by tests/elastic/test_core_join.py.
SLOW_UNITS_VAR = "BEAM_TEST_SLOW_UNITS"


class InjectedFault(RuntimeError):
    """A hook made this node bad; the caller turns it into its own error."""


def check_bad_node(hostname: str) -> None:
    """BAD_NODE_FILE_VAR: raise InjectedFault on the node that claimed the file."""
    path = os.environ.get(BAD_NODE_FILE_VAR)
    if not path:
        return
    tmp = f"{path}.{hostname}.{os.getpid()}"
    Path(tmp).write_text(hostname)
    try:
        os.link(tmp, path)  # atomic, and fails if the file exists: only one node step claims it
    except FileExistsError:
        pass
    finally:
        os.unlink(tmp)
    if Path(path).read_text().strip() == hostname:
        raise InjectedFault(f"node {hostname} is the bad node of {BAD_NODE_FILE_VAR} (test hook)")


def hangs_ray_start(node_index: int) -> bool:
    """HANG_RAY_START_VAR: this node's `ray start` is to hang instead."""
    return str(node_index) in os.environ.get(HANG_RAY_START_VAR, "").split(",")


def unit_token_delay(rollout_id: int) -> float:
    """SLOW_UNITS_VAR: the seconds to wait before each token of a unit of ``rollout_id`` (0: none)."""
    want = os.environ.get(SLOW_UNITS_VAR)
    if not want:
        return 0.0
    first, _, delay = want.partition(":")
    return float(delay) if rollout_id >= int(first) else 0.0


def hang_markers(logs_dir: str | Path) -> list[Path]:
    """The markers of the hangs so far in a run (``logs_dir``: the run's logs/), oldest segment first."""
    return sorted(Path(logs_dir).glob(f"*/{HANG_MARKER_FILE}"))


def slow_rollout() -> None:
    """SLOW_ROLLOUT_VAR: sleep that many seconds (after a rollout)."""
    pause = os.environ.get(SLOW_ROLLOUT_VAR)
    if pause:
        time.sleep(float(pause))


def hang_after_rollout(k: int, logs_dir: str | Path, segment_dir: str | None) -> None:
    """HANG_AFTER_ROLLOUT_VAR: sleep forever after rollout ``k`` when the run has hung fewer times
    than allowed, leaving a marker in ``segment_dir``."""
    want = os.environ.get(HANG_AFTER_ROLLOUT_VAR)
    if want is None or want.strip() != str(k):
        return
    if len(hang_markers(logs_dir)) >= int(os.environ.get(HANG_TIMES_VAR) or 1):
        return
    if segment_dir:
        write_json_atomic(Path(segment_dir, HANG_MARKER_FILE), {"rollout": k, "time": time.time(), "pid": os.getpid()})
    log.warning("%s=%d: hanging after rollout %d (test hook)", HANG_AFTER_ROLLOUT_VAR, k, k)
    while True:
        time.sleep(3600)
