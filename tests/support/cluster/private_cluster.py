"""A private local Slurm cluster for tests that stop or pause slurmctld.

Stopping the shared cluster's controller (slurm_cluster.py) would take it from every other test's
jobs, and another session's ``up`` would take it for stopped and start it afresh on wiped state. A
private cluster is one slurmctld and a few slurmd on ports and a LAB of its own, with job ids far
above the shared cluster's (Ray temp dirs are named by job id); it borrows the shared cluster's
munged and stops only its own daemons. Starting one costs about half a second.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from slurm_cluster import ClusterSpec, LocalSlurmCluster


def free_ctld_port(slurmds: int = 4) -> int:
    """A slurmctld port whose ``slurmds`` slurmd ports (17001 + port - 6817 ...) are free too (also
    benchmarks/faults.py's private cluster); candidates ``slurmds`` apart, so two never share one."""
    start = 6900 + (os.getpid() % 200) * slurmds
    for port in range(start, start + 100 * slurmds, slurmds):
        spec = ClusterSpec(ctld_port=port)
        wanted = [port] + [spec.first_slurmd_port + i for i in range(slurmds)]
        try:
            with contextlib.ExitStack() as stack:
                for p in wanted:
                    s = stack.enter_context(socket.socket())
                    s.bind(("127.0.0.1", p))
            return port
        except OSError:
            continue
    raise RuntimeError("no free port range for a private Slurm cluster")


@contextlib.contextmanager
def private_cluster(name: str, first_job_id: int) -> Iterator[LocalSlurmCluster]:
    """2 debug nodes + 1 spot node named ``name``, up for the ``with`` block (needs the shared
    cluster up first, for munged); its controller started again before it is taken down."""
    lab = Path(tempfile.mkdtemp(prefix=f"beam-{name[:6]}-", dir="/tmp"))
    cluster = LocalSlurmCluster(ClusterSpec(lab=lab, nodes=2, small_disk_nodes=0, spot_nodes=1,
                                            ctld_port=free_ctld_port(), cluster_name=name, link_etc=False,
                                            first_job_id=first_job_id + (os.getpid() % 1000) * 100))
    t0 = time.monotonic()
    cluster.up(started_by_tests=True)
    print(f"\nprivate Slurm cluster in {lab} up in {time.monotonic() - t0:.2f} s")
    try:
        yield cluster
    finally:
        cluster.resume_controller()
        with contextlib.suppress(Exception):
            cluster.start_controller(timeout=30)
        cluster.down()
        shutil.rmtree(lab, ignore_errors=True)


@contextlib.contextmanager
def controller_up_around(cluster: LocalSlurmCluster) -> Iterator[LocalSlurmCluster]:
    """One test's use of a private cluster: its controller up before and after (whatever the test
    did to it) and the test's jobs cancelled afterwards. The caller points SLURM_CONF at it."""
    cluster.resume_controller()
    cluster.start_controller()
    try:
        yield cluster
    finally:
        cluster.resume_controller()
        cluster.start_controller()
        cluster.run("scancel", "--me", check=False)


def log_size(cluster: LocalSlurmCluster) -> int:
    """Where slurmctld's log ends now: an offset for :func:`submits_since`."""
    return len((cluster.lab / "log" / "slurmctld.log").read_text(errors="replace"))


def submits_since(cluster: LocalSlurmCluster, offset: int) -> list[str]:
    """Job ids slurmctld logged as submitted (``_slurm_rpc_submit_batch_job``, or ``..._het_job`` for
    a heterogeneous one) past ``offset`` of its log."""
    text = (cluster.lab / "log" / "slurmctld.log").read_text(errors="replace")[offset:]
    return re.findall(r"_slurm_rpc_submit_batch_(?:het_)?job: JobId=(\d+)", text)
