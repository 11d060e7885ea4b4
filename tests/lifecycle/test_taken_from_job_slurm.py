"""A node Slurm takes from a running ``--no-kill`` job, read from the job's own record, on a real
(private) Slurm cluster: :func:`beam_hpc.lifecycle.exclusions.taken_from_job`.

When a node of a ``--no-kill`` job fails, Slurm keeps the job and takes the node out of the
component that held it (its NodeList shrinks at once); the steps on the node end seconds later, and
the driver often dies before they do. The runner asks this after a driver failure that no node
step's end explained (beam_hpc.job.runner, ``_raise_if_slurm_took_a_node``); the whole flow, where
a trainer node's loss ends the segment as a node failure naming it:
tests/lifecycle/test_rollout_node_lost_slurm.py.
"""

from __future__ import annotations

import pytest
from polling import poll_until
from private_cluster import private_cluster

from beam_hpc.lifecycle.exclusions import nodes_taken, taken_from_job

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

FIRST_JOB_ID = 940000


def test_nodes_taken_compares_each_group_with_its_allocation() -> None:
    allocated = {"trainer": ["n1", "n2"], "rollout": ["n3", "n4"]}
    assert nodes_taken(allocated, {"trainer": ["n1"], "rollout": ["n3", "n4"]}) == ["n2"]
    assert nodes_taken(allocated, {"trainer": ["n1", "n2"]}) == []  # a group Slurm did not answer for: no blame


def test_a_node_slurm_takes_from_a_no_kill_job_is_named(slurm_cluster, tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    with private_cluster("beamtake", FIRST_JOB_ID) as cluster:
        monkeypatch.setenv("SLURM_CONF", str(cluster.lab / "etc" / "slurm.conf"))
        script = tmp_path / "job.sh"
        # one component of two nodes: Slurm 22.05 keeps a --no-kill hetjob only while each component
        # keeps a node (beam_hpc.slurm.script), which this three-node cluster cannot give two groups
        script.write_text("#!/bin/bash\n#SBATCH -N2 -p debug --no-kill --no-requeue -t 5\nsleep 300\n")
        job = cluster.run("sbatch", "--parsable", "-o", "/dev/null", str(script)).stdout.strip().split("+")[0]
        try:
            assert poll_until(lambda: "JobState=RUNNING" in cluster.run("scontrol", "--oneliner", "show", "job",
                                                                        job).stdout, 60), "the job never started"
            components, allocated = {"trainer": job}, {"trainer": ["n1", "n2"]}
            assert taken_from_job(job, components, allocated) == []  # nothing taken yet: the control
            cluster.run("scontrol", "update", "nodename=n2", "state=down", "reason=beam-test-node-lost")
            taken = taken_from_job(job, components, allocated)
            # the job itself goes on (--no-kill): only the node left it
            assert "JobState=RUNNING" in cluster.run("scontrol", "--oneliner", "show", "job", job).stdout
        finally:
            cluster.run("scontrol", "update", "nodename=n2", "state=resume", check=False)
            cluster.run("scancel", job, check=False)
    assert [f["node"] for f in taken] == ["n2"] and "--no-kill" in taken[0]["why"], taken
