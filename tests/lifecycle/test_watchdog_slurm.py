"""What a segment's watchdog reads from Slurm at the job's SIGTERM, on a real (private) Slurm cluster.

A job Slurm ends because one of its nodes failed, and does not requeue (``--no-requeue``:
``lifecycle.requeue_on_preemption: false``), gets the same SIGTERM as a ``scancel``, and Slurm moves
its EndTime to now in both cases. Read that way the segment recorded a cancel and the chain stopped.
The leader's line tells them apart: ``Reason=NodeDown`` for the node failure, ``Reason=None`` for
the cancel. Each job here is a two-component hetjob, as beam-hpc's are, whose batch script runs the
product's :class:`~beam_hpc.lifecycle.watchdog.Watchdog` and, at the interrupt, the segment's own
question for the failed nodes (:func:`beam_hpc.lifecycle.exclusions.failed_in_slurm`).

The node of the second component is lost the way a node is lost at a site: its ``slurmd`` killed
(no job process runs there: the probe is the batch step), so it stops answering, and Slurm itself
marks it DOWN+NOT_RESPONDING after SlurmdTimeout (30 s here) and fails the job; the node stays
out, as a dead node does. The requeued case fails the node by hand (FAIL, then DOWN: this cluster's
ReturnToService=2 puts a node only DOWN, whose slurmd still answers, back in service within
milliseconds), and the negative control is the same job cancelled with ``scancel``. The unit tests
of the rule: tests/lifecycle/test_watchdog.py; the end of such a segment (resubmit, the node
excluded): tests/lifecycle/test_end_lost_nodes.py.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest
from polling import poll_until
from private_cluster import private_cluster

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

FIRST_JOB_ID = 930000

# The batch script's program: the product's watchdog, polled as a segment's loop does, then the
# segment's question for failed nodes; its verdict as one JSON line.
PROBE = """
import json, os, sys, time
from beam_hpc.lifecycle.exclusions import failed_in_slurm
from beam_hpc.lifecycle.watchdog import Watchdog
wd = Watchdog(os.environ["SLURM_JOB_ID"], 0, 60)
wd.install()
open(sys.argv[1] + ".ready", "w").close()
while (intr := wd.check()) is None:
    time.sleep(0.05)
nodes = [os.environ.get(f"SLURM_JOB_NODELIST_HET_GROUP_{i}", "") for i in range(2)]
verdict = {"kind": str(intr.kind), "reason": str(intr.reason), "detail": intr.detail, "failed": failed_in_slurm(nodes)}
with open(sys.argv[1], "w") as out:
    out.write(json.dumps(verdict))
"""


def _job(cluster, out: Path, requeue: bool) -> tuple[str, str]:  # type: ignore[no-untyped-def]
    """A two-component hetjob (one debug node each, a time limit as beam-hpc's jobs have: without one,
    a cancel's SIGTERM reads as the time limit) running the probe; its id and the node of its
    second component, once the probe's watchdog listens."""
    flag = ("--requeue" if requeue else "--no-requeue") + " --time=00:10:00"  # beam-hpc's jobs have a limit
    script = out.with_suffix(".sh")
    script.write_text(f"#!/bin/bash\n#SBATCH -N1 -p debug {flag}\n#SBATCH hetjob\n#SBATCH -N1 -p debug {flag}\n"
                      f"exec {sys.executable} -c '{PROBE}' {out}\n")
    job = cluster.run("sbatch", "--parsable", f"--output={out}.log", str(script)).stdout.strip().split("+")[0]
    assert poll_until(Path(f"{out}.ready").exists, 60, 0.1), \
        f"the probe never started: {Path(f'{out}.log').read_text(errors='replace')}"
    shown = cluster.run("scontrol", "--oneliner", "show", "job", job).stdout.splitlines()
    second = dict(tok.split("=", 1) for tok in shown[1].split() if "=" in tok)["NodeList"]
    return job, second


def _verdict(out: Path, timeout: float) -> dict:
    text = poll_until(lambda: out.exists() and out.read_text(), timeout, 0.1)
    assert text, f"no verdict: {Path(f'{out}.log').read_text(errors='replace')}"
    return json.loads(text)


def _kill_slurmd(cluster, node: str) -> None:  # type: ignore[no-untyped-def]
    """The node's slurmd gone, as with a node that lost power: SIGKILL, no goodbye to slurmctld."""
    pid = cluster.slurmd_pid(node)
    assert pid is not None, f"no slurmd runs for {node}"
    os.kill(pid, signal.SIGKILL)


def test_sigterm_of_a_node_failure_is_told_from_a_cancel_and_names_the_node(slurm_cluster, tmp_path: Path,
                                                                          monkeypatch) -> None:
    with private_cluster("beamwdog", FIRST_JOB_ID) as cluster:
        monkeypatch.setenv("SLURM_CONF", str(cluster.lab / "etc" / "slurm.conf"))  # the probe's scontrol too
        verdicts = {}
        for case in ("node-failed-requeued", "scancel", "slurmd-gone"):  # the last one keeps its node
            out = tmp_path / case
            job, node = _job(cluster, out, requeue=case == "node-failed-requeued")
            try:
                if case == "scancel":
                    cluster.run("scancel", job)
                elif case == "slurmd-gone":
                    _kill_slurmd(cluster, node)
                else:
                    cluster.run("scontrol", "update", f"nodename={node}", "state=fail", "reason=beam-test-node-lost")
                    cluster.run("scontrol", "update", f"nodename={node}", "state=down", "reason=beam-test-node-lost")
                verdicts[case] = (_verdict(out, timeout=30 if case != "slurmd-gone" else 150), node)
            finally:
                if case != "slurmd-gone":
                    cluster.run("scontrol", "update", f"nodename={node}", "state=resume", check=False)
                cluster.run("scancel", job, check=False)
    (failed, node), (requeued, rnode), (cancelled, _) = (verdicts[c] for c in ("slurmd-gone", "node-failed-requeued",
                                                                               "scancel"))
    # not requeued: a node failure, which decide() resubmits from the checkpoint, the node named with
    # the state Slurm gave it on its own
    assert failed["kind"] == "node-failed" and failed["reason"] == "node-failure", failed
    assert "Reason=NodeDown" in failed["detail"] and [f["node"] for f in failed["failed"]] == [node], failed
    assert "NOT_RESPONDING" in failed["failed"][0]["why"], failed
    # requeued by Slurm: as before, a requeue (preempted), the node named all the same
    assert requeued["kind"] == "requeued" and [f["node"] for f in requeued["failed"]] == [rnode], requeued
    # the negative control: the same SIGTERM from a scancel stays a cancel, with no node to blame
    assert cancelled["kind"] == "cancelled" and cancelled["failed"] == [], cancelled
