"""The one batch-script renderer (beam_hpc.slurm.script.render_batch), without a cluster.

Every script beam-hpc writes is a BatchJob: the run's hetjob script, the Miles conversion job and
the tests' own job scripts (tests/support/builders/runs/job_plans.py). Here: the header's layout, the site block's
order, and that all three writers give the very same site block for one site. Against the real
local Slurm cluster the scripts run in tests/slurm/test_render_slurm.py,
tests/backends/miles/test_miles_convert.py and tests/submission/test_submission_launch_parity.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from job_plans import batch_script, make_test_plan

from beam_hpc.backends.miles import convert
from beam_hpc.config.recipe import load_yaml, recipe_from_dict
from beam_hpc.config.site import site_from_dict
from beam_hpc.slurm.script import BatchJob, Component, render_batch, render_script, site_lines

REPO = Path(__file__).resolve().parents[2]
SITE_LINES = {"env": {"B": "two words", "A": "1"}, "setup": ["source /etc/profile.d/modules.sh"],
              "module_loads": ["cuda/12.4"], "sbatch_extra": ["--comment=x"]}


def _site(**changes: object):  # type: ignore[no-untyped-def]
    return site_from_dict({**load_yaml(REPO / "env" / "local.yaml"), **changes}, "test site")


def test_a_hetjob_has_job_flags_once_and_each_components_own_lines() -> None:
    job = BatchJob(name="j", time="01:00:00", output="o-%j.out", site=_site(**SITE_LINES),
                   components=(Component(nodes=2, gres="gpu:8"), Component(nodes=1, partition="p")),
                   body=("exec python3 -m x",), requeue=True, signal="B:USR1@60", open_mode="append",
                   notes=("made by a test",), labels=("first", "second"))
    assert render_batch(job).splitlines() == [
        "#!/bin/bash", "# made by a test",
        "# first",
        "#SBATCH --job-name=j", "#SBATCH --time=01:00:00", "#SBATCH --signal=B:USR1@60", "#SBATCH --open-mode=append",
        "#SBATCH --output=o-%j.out", "#SBATCH --requeue",
        "#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --gres=gpu:8", "#SBATCH --comment=x",
        "#SBATCH hetjob", "# second",
        "#SBATCH --nodes=1", "#SBATCH --ntasks-per-node=1", "#SBATCH --partition=p", "#SBATCH --comment=x",
        # no empty line: sbatch drops a hetjob script's empty lines, so the script is what Slurm keeps
        "set -eo pipefail",
        # the site block: environment, then setup (which may define `module`), then module loads
        "export A=1", "export B='two words'", "source /etc/profile.d/modules.sh", "module load cuda/12.4",
        "exec python3 -m x",
    ]
    one = BatchJob(name="j", time="1", output="o", components=job.components[:1], site=job.site, body=job.body)
    assert "#SBATCH --comment=x\n\nset -eo pipefail\n" in render_batch(one)  # a plain job keeps its empty line


def test_a_job_without_components_or_with_stray_labels_is_a_programming_error() -> None:
    site = _site()
    with pytest.raises(ValueError, match="at least one component"):
        render_batch(BatchJob(name="j", time="1", output="o", components=(), site=site, body=()))
    with pytest.raises(ValueError, match="2 labels for 1 components"):
        render_batch(BatchJob(name="j", time="1", output="o", components=(Component(nodes=1),), site=site,
                              body=(), labels=("a", "b")))


def _site_block(text: str) -> list[str]:
    """The lines between ``set -eo pipefail`` and the body's first line (``cd`` or ``exec``)."""
    lines = text.splitlines()
    start = lines.index("set -eo pipefail") + 1
    end = next(i for i in range(start, len(lines)) if lines[i].startswith(("exec ", "cd ")))
    return lines[start:end]


def test_every_script_beam_hpc_writes_has_one_site_block(tmp_path: Path) -> None:
    """The run's script, the conversion job's and the tests' own: one site, one block, one order."""
    plan = make_test_plan(tmp_path / "run", trainer_nodes=1, rollout_nodes=1, site=SITE_LINES)
    want = site_lines(plan.site)
    assert want[2:] == ["source /etc/profile.d/modules.sh", "module load cuda/12.4"]
    recipe = load_yaml(REPO / "recipes" / "dedicated.yaml")
    recipe["output_dir"] = str(tmp_path / "conv")
    recipe["model"] = {**recipe["model"], "path": str(tmp_path / "hf"), "ref_load": str(tmp_path / "td"),
                       "miles_model_args": ["--num-layers", "2"], "miles_model_script": None}
    recipe["topology"]["trainer"]["gpus_per_node"] = 2
    spec = convert.convert_spec(recipe_from_dict(recipe, "t"), plan.site)
    scripts = {"run": render_script(plan), "convert": convert.render_script(spec),
               "tests": batch_script(plan, "--smoke").read_text()}
    for name, text in scripts.items():
        assert _site_block(text) == want, name
        assert text.count("#SBATCH --comment=x") == len(text.split("#SBATCH hetjob")), name
