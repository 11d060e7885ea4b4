"""A hand edit of a rendered script's plan, submitted with a plain ``sbatch`` on the local Slurm cluster.

- ``checkpoint.interval`` edited in the embedded JSON (a text edit, as a user makes it): the job
  stops in its first seconds, exit 2, with a line that names ``recipe.checkpoint`` and says to
  render again; no run directory is created, so nothing is half applied;
- derived fields edited in another script, submitted beside it (the trainer group's ``nodes``,
  ``lead_s``, ``walltime_s``) and the driver's argv: that job stops the same way, one line per
  field naming its value and the input to change instead (the job runs make_plan again on the
  plan's inputs and compares);
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
from beam_hpc.plan.plan import Plan, run_id_for, to_json
from beam_hpc.run import checkpoint_layout
from beam_hpc.slurm.client import parse_key_values, slurm_time
from beam_hpc.slurm.script import PLAN_HEREDOC

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


def plan_edit(script: Path, edit) -> None:  # type: ignore[no-untyped-def]
    """Edit the plan embedded in ``script`` as JSON (``edit`` changes the mapping in place) and
    write it back in the renderer's layout; the #SBATCH header stays as rendered."""
    head, rest = script.read_text().split(f"<<'{PLAN_HEREDOC}'\n", 1)
    text, tail = rest.split(f"\n{PLAN_HEREDOC}\n", 1)
    d = json.loads(text)
    edit(d)
    script.write_text(f"{head}<<'{PLAN_HEREDOC}'\n{to_json(d)}\n{PLAN_HEREDOC}\n{tail}")


def refused(cluster, tmp_path: Path, job: str) -> str:  # type: ignore[no-untyped-def]
    """The job's output once it has failed with exit 2 in its first seconds, without a traceback."""
    record = finished(cluster, job, timeout=180)
    out = (tmp_path / f"{record['JobName']}-{job}.out").read_text()
    assert record["JobState"] == "FAILED" and record["ExitCode"] == "2:0", (record, out)
    ran_s = slurm_time(record["EndTime"]) - slurm_time(record["StartTime"])  # type: ignore[operator]
    assert ran_s <= 30, f"refused after {ran_s} s, not in the job's first seconds:\n{out}"
    assert "Traceback" not in out
    return out


def test_an_edited_recipe_field_or_derived_field_is_refused_in_the_jobs_first_seconds(slurm_cluster, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    run = tmp_path / "run"
    script = render(tmp_path, run, f"model.path={tmp_path}/model", f"data.dir={tmp_path}/data")
    derived = tmp_path / "derived.sbatch"
    derived.write_text(script.read_text())
    text_edit(script, r'("checkpoint": \{\n\s*"interval": )10,', r"\g<1>3,", count=1)

    def edit(d: dict) -> None:  # type: ignore[type-arg]
        d["groups"][0]["nodes"], d["lead_s"], d["walltime_s"] = 99, 5, 99999
        d["driver_argv"] = [*d["driver_argv"], "--extra"]

    plan_edit(derived, edit)
    jobs = [sbatch(slurm_cluster, script), sbatch(slurm_cluster, derived)]  # side by side: one wait
    out = refused(slurm_cluster, tmp_path, jobs[0])
    [line] = [x for x in out.splitlines() if "recipe.checkpoint: edited after the plan was made" in x]
    assert "apply only in part" in line and "beam-hpc render" in line and "--set checkpoint.FIELD=VALUE" in line
    out = refused(slurm_cluster, tmp_path, jobs[1])
    found = {f: [x for x in out.splitlines() if x.startswith(f"{f}: ") or f"slurm_script: {f}: " in x]
             for f in ("driver_argv", "groups[0].nodes", "lead_s", "walltime_s")}
    assert all(len(v) == 1 for v in found.values()), out  # one line per edited field
    lines = {f: v[0] for f, v in found.items()}
    assert "groups[0].nodes: 99 in the plan, but its recipe and site make it 1" in lines["groups[0].nodes"]
    assert "--set topology.trainer.nodes=VALUE" in lines["groups[0].nodes"]
    assert "lead_s: 5 in the plan, but its recipe and site make it 60" in lines["lead_s"]
    assert "walltime_s: 99999 in the plan, but its recipe and site make it 1800" in lines["walltime_s"]
    assert "edited after the plan was made" in lines["driver_argv"] and "change the recipe" in lines["driver_argv"]
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
