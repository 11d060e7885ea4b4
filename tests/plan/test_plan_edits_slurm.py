"""A hand edit of a rendered script's plan, submitted with a plain ``sbatch`` on the local Slurm cluster.

- ``checkpoint.interval`` edited in the embedded JSON (a text edit, as a user makes it): the job
  stops in its first seconds, exit 2, with a line that names ``recipe.checkpoint`` and says to
  render again; no run directory is created, so nothing is half applied;
- ``output_dir`` edited (both of its lines): the run happens in the new directory (plan, ledger,
  checkpoints, the driver's ``--plan``), and nothing is written in the rendered one.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from run_watch import diagnostics, segments

from beam_hpc.cli.app import main as cli_main
from beam_hpc.plan.plan import Plan, run_id_for
from beam_hpc.run import checkpoint_layout
from beam_hpc.slurm.client import parse_key_values, slurm_time

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.slurm]


def render(tmp_path: Path, run: Path, *sets: str) -> Path:
    script = tmp_path / "x.sbatch"
    args = [f"--set={s}" for s in sets]
    assert cli_main(["render", str(REPO / "recipes" / "tiny.yaml"), "--site", str(REPO / "env" / "local.yaml"),
                     "--output-dir", str(run), *args, "-o", str(script)]) == 0
    return script


def text_edit(script: Path, pattern: str, replacement: str, count: int) -> None:
    """What a user does in an editor: change the script's text, nothing else."""
    text, n = re.subn(pattern, replacement, script.read_text())
    assert n == count, f"{pattern!r} matched {n} times, not {count}"
    script.write_text(text)


def sbatch(cluster, script: Path, *args: str) -> str:  # type: ignore[no-untyped-def]
    out = subprocess.run(["sbatch", "--parsable", str(script), *args], capture_output=True, text=True, check=True,
                         cwd=script.parent, env=cluster.client_env()).stdout
    return out.strip().split(";")[0]


def finished(cluster, job: str, timeout: float) -> dict[str, str]:  # type: ignore[no-untyped-def]
    """The leader's ``scontrol show job`` record once every component has ended."""
    cluster.wait_for_job(job, timeout=timeout)
    shown = cluster.run("scontrol", "--oneliner", "show", "job", job).stdout.splitlines()
    return parse_key_values(shown[0])


def test_an_edited_recipe_field_is_refused_in_the_jobs_first_seconds(slurm_cluster, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    run = tmp_path / "run"
    script = render(tmp_path, run, f"model.path={tmp_path}/model", f"data.dir={tmp_path}/data")
    text_edit(script, r'("checkpoint": \{\n\s*"interval": )10,', r"\g<1>3,", count=1)
    job = sbatch(slurm_cluster, script)
    record = finished(slurm_cluster, job, timeout=180)
    out = (tmp_path / f"{record['JobName']}-{job}.out").read_text()
    assert record["JobState"] == "FAILED" and record["ExitCode"] == "2:0", (record, out)
    ran_s = slurm_time(record["EndTime"]) - slurm_time(record["StartTime"])  # type: ignore[operator]
    assert ran_s <= 30, f"refused after {ran_s} s, not in the job's first seconds:\n{out}"
    [line] = [x for x in out.splitlines() if "recipe.checkpoint: edited after the plan was made" in x]
    assert "apply only in part" in line and "beam-hpc render" in line and "--set checkpoint.FIELD=VALUE" in line
    assert "Traceback" not in out
    assert not run.exists(), "a refused plan must leave no run directory behind"


def test_an_edited_output_dir_runs_the_job_in_the_new_directory(slurm_cluster, tiny_assets, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from reference_harness import SMALL

    rendered, moved = tmp_path / "rendered", tmp_path / "moved"
    script = render(tmp_path, rendered, f"model.path={tiny_assets.model_dir}", f"data.dir={tiny_assets.data_dir}",
                    "num_rollout=3", *SMALL)
    text_edit(script, re.escape(f'"output_dir": "{rendered}"'), f'"output_dir": "{moved}"', count=2)
    job = sbatch(slurm_cluster, script, "--num-rollout", "1")
    record = finished(slurm_cluster, job, timeout=600)
    assert record["JobState"] == "COMPLETED" and record["ExitCode"] == "0:0", diagnostics(moved)
    assert not rendered.exists(), "the rendered run directory was written to"
    plan = Plan.load(moved)
    assert plan.output_dir == str(moved) and plan.run_id == run_id_for(str(moved))
    [segment] = segments(moved)
    assert segment["start"]["num_rollout"] == 1 and segment["end"]["rollouts_at_end"] == 1
    assert segment["end"]["next"]["action"] == "none"
    assert checkpoint_layout.rollouts_done(moved / "checkpoints") == 1
    [driver] = [json.loads(p.read_text()) for p in (moved / "logs").glob("*/driver.json")]
    assert driver["argv"][driver["argv"].index("--plan") + 1] == str(moved / "plan.json")
    kept = [x for x in (moved / "job.sbatch").read_text().splitlines() if x.strip()]
    assert kept == [x for x in script.read_text().splitlines() if x.strip()]  # resubmissions run the edited script
