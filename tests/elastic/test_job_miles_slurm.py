"""``beam-hpc rollout add`` on a Miles run: refused (exit 2) before Slurm is asked anything and before
anything is written, with one line naming Miles's limitation and its code line.

Why refused: Miles (radixark/miles@31f1ca961) starts no engine it did not launch itself. With
``--rollout-external`` its placement gives the rollout an empty slice of the trainer's group
(``miles/ray/placement_group.py:97-99``) and its server group indexes that slice for every engine
(``miles/ray/rollout/server_group.py:90-91``), colocated or not; ``tests/backends/miles/
test_miles_placement.py`` shows it on Ray, and miles-rl 0.0.2's real placement putting attached
engines only on the trainer job's own GPUs. A segment of a Miles run that finds engines registered
(by an older beam-hpc) leaves them out with the same line in its log: the Miles chain on the local
Slurm cluster, ``tests/backends/miles/test_miles_slurm.py``.

The run here is the one the Miles chain submits (``miles_run``), planned and written as ``submit``
writes it; the command runs as a user runs it, in a process of its own, with the Slurm commands on
its ``PATH`` replaced by ones that record being called and fail: none may be called.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from miles_run import local_site, miles_recipe

from beam_hpc.backends.registry import plan_for
from beam_hpc.config.recipe import recipe_from_dict
from beam_hpc.config.site import site_from_dict

SLURM_COMMANDS = ("sbatch", "squeue", "sinfo", "scontrol", "sacct", "scancel", "srun")


def slurm_that_records(where: Path) -> tuple[Path, Path]:
    """A directory of Slurm commands that append their argv to ``calls`` and exit 1."""
    bin_dir, calls = where / "bin", where / "slurm-calls"
    bin_dir.mkdir()
    for name in SLURM_COMMANDS:
        cmd = bin_dir / name
        cmd.write_text(f'#!/bin/sh\necho "{name} $*" >> {calls}\nexit 1\n')
        cmd.chmod(0o755)
    return bin_dir, calls


@pytest.mark.slow  # two CLI processes that plan a Miles run: about 5 s each
@pytest.mark.parametrize("colocated", [False, True], ids=["dedicated", "colocated"])
def test_rollout_add_on_a_miles_run_exits_2_naming_the_miles_line_and_asks_slurm_nothing(
        tmp_path: Path, colocated: bool) -> None:
    d = miles_recipe(tmp_path)
    if colocated:
        d["training"].update(colocated=True, async_training=False)
        d["topology"] = {"trainer": {"nodes": 1, "gpus_per_node": 1}}
    plan = plan_for(recipe_from_dict(d, "miles test recipe"), site_from_dict(local_site(), "local site"))
    plan.write()  # the run directory as submit leaves it
    run = Path(plan.output_dir)
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    bin_dir, calls = slurm_that_records(tmp_path)
    env = {**os.environ, "PATH": os.pathsep.join([str(bin_dir), os.environ["PATH"]])}
    done = subprocess.run([sys.executable, "-m", "beam_hpc.cli.app", "rollout", "add", str(run), "--nodes", "1"],
                          env=env, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.strip().splitlines()
    field = "training.colocated: true" if colocated else "backend: miles"
    assert field in line and "Traceback" not in done.stderr
    assert "miles/ray/placement_group.py:97-99" in line and "miles/ray/rollout/server_group.py:90-91" in line
    assert not calls.exists(), calls.read_text()  # no Slurm command ran: nothing asked, nothing submitted
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before  # and nothing written
    assert json.loads((run / "plan.json").read_text())["run_id"] == plan.run_id
