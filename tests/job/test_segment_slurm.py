"""beam_hpc.job.segment on the real local Slurm cluster: what the ``#SBATCH`` header says, the job
reads from Slurm.

A rendered script whose ``--time`` is edited by hand is submitted with a plain ``sbatch``: the
segment's start line records the edited limit, not the plan's, and the computed lead is capped
by it (half of it). The job is then cancelled (the lead is what is checked, not a walltime stop;
those are tests/lifecycle/test_lifecycle_slurm.py's).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from reference_harness import SMALL
from run_watch import read_text, segments, wait_for

from beam_hpc.cli.app import main as cli_main

pytestmark = [pytest.mark.slurm, pytest.mark.ray, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 420  # a shared 2-core machine: bring-up alone can take 30-60 s under load


@pytest.fixture
def root(slurm_cluster) -> Iterator[Path]:
    """A directory outside pytest's numbered temp dirs (other sessions prune those)."""
    path = Path(tempfile.mkdtemp(prefix="beam-seg-", dir="/tmp"))
    yield path
    slurm_cluster.cancel_jobs_under(path)
    shutil.rmtree(path, ignore_errors=True)


def test_a_hand_edited_time_limit_is_recorded_and_caps_the_lead(slurm_cluster, tiny_assets, root: Path) -> None:
    run, script = root / "run", root / "x.sbatch"
    sets = [f"model.path={tiny_assets.model_dir}", f"data.dir={tiny_assets.data_dir}", *SMALL,
            # a computed lead (the floor, 500 s), which the recipe's 30 min walltime allows
            "lifecycle.lead_s=null", "lifecycle.lead_floor_s=500"]
    assert cli_main(["render", str(ROOT / "recipes" / "tiny.yaml"), "--site", str(ROOT / "env" / "local.yaml"),
                     "--output-dir", str(run), *[a for s in sets for a in ("--set", s)], "-o", str(script)]) == 0
    text = script.read_text()
    assert '"walltime_s": 1800' in text and '"lead_s": 500' in text  # what the plan inside says
    edited, count = re.subn(r"^#SBATCH --time=\S+$", "#SBATCH --time=00:10:00", text, flags=re.MULTILINE)
    assert count == 1
    script.write_text(edited)
    job = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, check=True,
                         cwd=root).stdout.strip().split(";")[0]
    wait_for("the segment's start line", lambda: segments(run), run, TIMEOUT_S)
    start = segments(run)[0]["start"]
    assert start["job_id"] == job
    assert (start["walltime_s"], start["lead_s"]) == (600, 300)  # not the plan's 1800 s and 500 s
    log = read_text(run / "logs" / f"{job}-0" / "segment.log")
    assert "time limit 600 s (the job's, from Slurm), lead 300 s" in log, log
    slurm_cluster.run("scancel", job)
    slurm_cluster.wait_for_job(job, timeout=TIMEOUT_S)
    end = segments(run)[0]["end"]
    assert end["reason"] == "cancelled" and end["next"]["action"] == "none", end
