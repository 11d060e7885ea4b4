"""The replacement of a lost rollout node on the real local Slurm cluster (beam_hpc.elastic.replace):
the real ``beam-hpc rollout add RUN --nodes 1 --partition P --exclude NODE`` a segment runs, its
checks asked of Slurm, and the job Slurm queues. The site's ``replacement_partition`` is where it
goes; a partition the cluster does not have is refused by ``rollout add`` (exit 2, the field, the
value and the partitions there are) and the replacement goes to the rollout group's own partition.

The run has no segment up: the extra jobs wait for one, and are cancelled as soon as Slurm has
said where they are (the whole lost-node story, with the replacement serving: tests/lifecycle/
test_rollout_node_lost_slurm.py).
"""

from __future__ import annotations

import logging
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from job_plans import make_test_plan

from beam_hpc.elastic import registry, replace

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

WHY = "rollout node lost mid-segment (it went on): node step failed: exit code 0"


@pytest.fixture
def runs(slurm_cluster) -> Iterator[Path]:
    """Run directories outside pytest's pruned temp dirs; every job under them is cancelled after."""
    with slurm_cluster.scratch_runs("beam-rp-") as root:
        yield root


def _job(job_id: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "--oneliner", "show", "job", job_id], capture_output=True, text=True,
                         check=True).stdout
    return dict(tok.split("=", 1) for tok in out.split() if "=" in tok)


def test_a_replacement_goes_to_the_site_s_replacement_partition_and_falls_back_to_the_group_s_own(
        slurm_cluster, runs: Path, caplog: pytest.LogCaptureFixture) -> None:
    # the rollout group runs in spot; the site sends replacements to debug
    plan = make_test_plan(runs / "run", trainer_nodes=1, rollout_nodes=1, gpus=0,
                          site={"partitions": {"trainer": "spot", "rollout": "spot"}, "replacement_partition": "debug"})
    # the site names a partition the cluster does not have: rollout add refuses it, the group's own takes it
    typo = make_test_plan(runs / "typo", trainer_nodes=1, rollout_nodes=1, gpus=0,
                          site={"partitions": {"trainer": "debug", "rollout": "debug"}, "replacement_partition": "nosuch"})
    jobs = []
    try:
        with caplog.at_level(logging.INFO, logger=replace.__name__):
            jobs.append(replace.replace_lost(plan, {"node": "n3", "why": WHY}, segment="7-0"))
            jobs.append(replace.replace_lost(typo, {"node": "n4", "why": WHY}, segment="8-0"))
        assert None not in jobs, caplog.text
        placed = {j: _job(j) for j in jobs}
    finally:
        ours = [j for j in jobs if j]
        if ours:  # (the fixture waits for them to leave the queue before it removes the run directories)
            slurm_cluster.run("scancel", *ours, check=False)
    first, second = jobs
    assert placed[first]["Partition"] == "debug" and "n3" in placed[first]["ExcNodeList"], placed[first]
    assert placed[second]["Partition"] == "debug" and "n4" in placed[second]["ExcNodeList"], placed[second]
    assert ("no replacement in site replacement_partition nosuch" in caplog.text
            and "--partition: nosuch is not a partition of this cluster; give one of: debug, spot, urgent" in caplog.text)
    # what status reads: the replacement event and the job's own submitted event, with where it went
    for p, job, node in ((plan, first, "n3"), (typo, second, "n4")):
        (rep,) = replace.replacements(p.output_dir)
        assert (rep["job_id"], rep["replaces"]) == (job, node)
        sub = next(e for e in registry.read_events(registry.events_path(p.output_dir, job)) if e["event"] == "submitted")
        assert sub["partition"] == "debug"
