"""Launching is one thing (issue 20): five ways in, then a walltime resubmission and a preemption
requeue, all run the same plan, site and segment arguments.

On the real local Slurm cluster, with a site that has everything a site can give the job: a
``module`` shell function defined by its ``setup`` (as ``source /etc/profile.d/modules.sh`` would),
``module_loads``, ``env``, and an extra ``#SBATCH`` line (``--comment``). The tiny recipe is
launched by, one test each (so that xdist runs them side by side):

1. ``beam-hpc submit --via sbatch``: the chain of test_lifecycle_slurm.py (a walltime
   resubmission, a preemption requeue, a new total) runs on this site and holds each of its
   segments to the same record, so that one chain, not two, pays for those four segments;
2. a hand ``sbatch x.sbatch --num-rollout 1`` of a ``beam-hpc render -o`` script (the run directory
   does not exist yet; the plan's own total is 3),
3. ``beam-hpc submit --num-rollout 1`` (submitit): held to the same plan and task, then cancelled
   (it calls the same submit as 4, whose job runs),
4. ``beam_hpc.submit(..., num_rollout=1)`` from Python (submitit): its submitit Job handle's state,
   done() and result() follow the job without sacct, and the run it drives is checkpointed,
5. ``beam-hpc execute --num-rollout 1`` (no Slurm) with the laptop site plus the same site lines:
   with no batch script, execute runs those lines in a bash before the segment
   (beam_hpc.cli.execute.apply_site_lines), so its driver must see the same variables and modules.

Every segment writes ``driver.json`` in its segment directory (beam_hpc.job.runner): the driver's
argv, the total it runs to, the site's variables and ``LOADEDMODULES`` as the driver got them. Each
test holds every segment of its run to the same record: the driver command of the plan a dry run of
the same submission makes (run directory, Ray address and total aside; so all five agree with each
other), the segment arguments' total (1 here; the chain's passed on through the resubmission and
the requeue), the site's variables with the module function's mark, and the module loaded once. plan.json
stays as submitted, the ledger's start lines say the same totals, and every Slurm job carries the
extra line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from parity_site import (
    MODULE,
    SEEN_ENV,
    SITE_LINES,
    check_driver_record,
    driver_records,
    has_extra_line,
    laptop_parity_site,
    normalized,
    parity_site,
)
from run_watch import diagnostics, segments, wait_for
from submitit.core.utils import DelayedSubmission

import beam_hpc
from beam_hpc.cli.app import main as cli_main
from beam_hpc.cli.execute import LAPTOP_SITE
from beam_hpc.job.segment import run_segment
from beam_hpc.run import checkpoint_layout

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "recipes" / "tiny.yaml")

PLAN_TOTAL, SEGMENT_TOTAL = 3, 1
TIMEOUT_S = 900.0


def launch(test):  # type: ignore[no-untyped-def]
    """The marks of a test that runs the tiny recipe for real (all but the unit test at the end); those
    that go through Slurm are marked ``slurm`` as well."""
    for mark in (pytest.mark.slow, pytest.mark.ray, pytest.mark.e2e):
        test = mark(test)
    return test


def recipe_args(assets, run: Path, *, gpus: bool = True) -> list[str]:  # type: ignore[no-untyped-def]
    from reference_harness import SMALL

    out = ["--output-dir", str(run), "--set", f"num_rollout={PLAN_TOTAL}"]
    gpu_items = ["topology.trainer.gpus_per_node=2", "topology.rollout.gpus_per_node=1"] if gpus else []
    for item in [f"model.path={assets.model_dir}", f"data.dir={assets.data_dir}", *gpu_items, *SMALL]:
        out += ["--set", item]
    return out


def overrides(args: list[str]) -> list[str]:
    """The ``--set`` items of recipe_args, as Python's ``overrides``."""
    return [args[i + 1] for i, a in enumerate(args) if a == "--set"]


def submitted_id(capsys) -> str:  # type: ignore[no-untyped-def]
    return capsys.readouterr().out.split("submitted job ")[1].split()[0]


@pytest.fixture
def reference(tiny_assets, tmp_path: Path) -> list[str]:  # type: ignore[no-untyped-def]
    """The driver command every launch must run, normalized: the one in the plan that a dry run of
    the submission makes (its ``{ray_address}`` and ``{num_rollout}`` placeholders normalize as the
    filled values do). Nothing is written or submitted."""
    run = tmp_path / "reference"
    sub = beam_hpc.submit(TINY, str(parity_site(tmp_path / "reference-site.yaml")), output_dir=str(run),
                          overrides=overrides(recipe_args(tiny_assets, run)), via="sbatch", dry_run=True)
    assert not run.exists()
    return normalized(sub.plan.driver_argv, run)


def ended(run: Path) -> bool:
    segs = segments(run)
    return bool(segs) and all("end" in x for x in segs)


def check_segments(run: Path, reference: list[str], *, total: int, plan_total: int) -> dict[str, dict]:
    """What every segment of ``run`` saw, against the reference; plan.json and the ledger's totals.
    Returns the segments' driver records."""
    recs = driver_records(run)
    assert recs, f"no driver.json\n{diagnostics(run)}"
    for seg, rec in recs.items():
        check_driver_record(seg, rec, run, reference, total)
    plan = json.loads((run / "plan.json").read_text())  # as submitted: a segment argument never rewrites it
    assert plan["recipe"]["num_rollout"] == plan_total
    starts = [s["start"]["num_rollout"] for s in segments(run)]
    assert starts and set(starts) == {total}, starts
    return recs


def completed(run: Path) -> None:
    """The run completed (a bring-up that failed on a loaded machine is retried by the lifecycle)."""
    reasons = [s["end"]["reason"] for s in segments(run)]
    assert reasons[-1] == "completed" and set(reasons[:-1]) <= {"node-failure"}, diagnostics(run)


@launch
@pytest.mark.slurm
def test_a_hand_sbatch_of_a_rendered_script_runs_the_same_job(slurm_cluster, tiny_assets, tmp_path: Path,
                                                               monkeypatch, reference) -> None:  # type: ignore[no-untyped-def]
    """Render, then a plain sbatch with the script's own arguments: nothing else prepared."""
    run = tmp_path / "hand"
    monkeypatch.chdir(tmp_path)  # the hand-submitted job's output lands in the submit directory
    script = tmp_path / "hand.sbatch"
    assert cli_main(["render", TINY, "--site", str(parity_site(tmp_path / "parity.yaml")),
                     *recipe_args(tiny_assets, run), "-o", str(script)]) == 0
    assert not run.exists()
    hand = subprocess.run(["sbatch", "--parsable", str(script), "--num-rollout", str(SEGMENT_TOTAL)], capture_output=True,
                          text=True, check=True, cwd=tmp_path).stdout.strip().split(";")[0]
    has_extra_line(hand)
    wait_for("the hand-submitted run to end", lambda: ended(run), run, timeout=TIMEOUT_S)
    check_segments(run, reference, total=SEGMENT_TOTAL, plan_total=PLAN_TOTAL)
    completed(run)
    # its output in the submit directory, linked from the run's logs/
    hand_out = tmp_path / f"{json.loads((run / 'plan.json').read_text())['job_name']}-{hand}.out"
    assert hand_out.is_file() and "segment ended: completed" in hand_out.read_text()
    assert (run / "logs" / f"slurm-{hand}.out").resolve() == hand_out.resolve()

    # the script the resubmissions run: the one submitted (Slurm keeps a het job's script without blank lines)
    def lines(text: str) -> list[str]:
        return [line for line in text.splitlines() if line.strip()]

    assert lines((run / "job.sbatch").read_text()) == lines(script.read_text())


@pytest.mark.slurm
def test_submit_through_submitit_submits_the_same_job(slurm_cluster, tiny_assets, tmp_path: Path, capsys,
                                                      reference) -> None:  # type: ignore[no-untyped-def]
    """``beam-hpc submit`` (submitit, the CLI's default) hands its arguments to the same
    ``beam_hpc.submission.submit.submit`` that ``beam_hpc.submit`` calls, whose submitit job runs
    end to end in the next test; so this one holds the CLI's submission to the same plan (the
    driver command, the total) and Slurm's job to the site's extra line, and cancels the job rather
    than run the same segment twice."""
    run = tmp_path / "via-submitit"
    assert cli_main(["submit", TINY, "--site", str(parity_site(tmp_path / "parity.yaml")),
                     *recipe_args(tiny_assets, run), "--num-rollout", str(SEGMENT_TOTAL)]) == 0
    job = submitted_id(capsys)
    try:
        has_extra_line(job)
        plan = json.loads((run / "plan.json").read_text())
        assert normalized(plan["driver_argv"], run) == reference and plan["recipe"]["num_rollout"] == SEGMENT_TOTAL
        # what the job's task will run: submitit's pickle of run_segment and the segment's arguments
        (pickled,) = run.rglob(f"{job}_submitted.pkl")
        task = DelayedSubmission.load(pickled)
        assert task.function is run_segment and task.args[1].num_rollout == SEGMENT_TOTAL, task.args
    finally:
        subprocess.run(["scancel", job], check=False, capture_output=True)


@launch
@pytest.mark.slurm
def test_python_submit_runs_the_same_job_and_its_handle_follows_it(slurm_cluster, tiny_assets, tmp_path: Path,
                                                                    reference) -> None:  # type: ignore[no-untyped-def]
    run = tmp_path / "python"
    sub = beam_hpc.submit(TINY, str(parity_site(tmp_path / "parity.yaml")), output_dir=str(run),
                          num_rollout=SEGMENT_TOTAL, overrides=overrides(recipe_args(tiny_assets, run)))
    assert sub.job is not None and str(sub.job.job_id) == sub.job_id  # a submitit Job handle
    has_extra_line(str(sub.job_id))
    states = set()  # what the handle said while it ran (from squeue: the local cluster keeps no accounts)
    wait_for("the Python-submitted run to end", lambda: states.add(sub.job.state) or ended(run), run, timeout=TIMEOUT_S)
    wait_for("the handle to say done", lambda: states.add(sub.job.state) or sub.job.done(), run, timeout=TIMEOUT_S)
    # the handle follows the first segment: its task returns the segment's exit status (0 = completed; a
    # bring-up the lifecycle retried is 1), so the job itself is COMPLETED either way
    first_end = segments(run)[0]["end"]
    first_completed = first_end["reason"] == "completed"
    assert sub.job.task(0).result() == (0 if first_completed else 1), diagnostics(run)
    assert sub.job.state == "COMPLETED" and {"PENDING", "RUNNING"} & states, states
    assert checkpoint_layout.rollouts_done(run / "checkpoints") == SEGMENT_TOTAL
    check_segments(run, reference, total=SEGMENT_TOTAL, plan_total=SEGMENT_TOTAL)
    completed(run)


@launch
def test_execute_runs_the_same_job_with_the_sites_lines(tiny_assets, tmp_path: Path,
                                                         reference) -> None:  # type: ignore[no-untyped-def]
    """On this machine, no Slurm: the laptop site (no GPUs, so none asked for) with the parity site's
    lines, which execute runs in a bash before the segment (there is no batch script)."""
    run = tmp_path / "execute"
    out = tmp_path / "execute.out"
    with out.open("w") as fh:
        execute = subprocess.Popen([sys.executable, "-m", "beam_hpc.cli.app", "execute", TINY, "--quiet",
                                    "--site", str(laptop_parity_site(tmp_path / "parity-laptop.yaml")),
                                    *recipe_args(tiny_assets, run, gpus=False), "--num-rollout", str(SEGMENT_TOTAL)],
                                   stdout=fh, stderr=subprocess.STDOUT)
        wait_for("execute to end", lambda: execute.poll() is not None, run, timeout=TIMEOUT_S)
    assert execute.returncode == 0, out.read_text()[-3000:]
    check_segments(run, reference, total=SEGMENT_TOTAL, plan_total=SEGMENT_TOTAL)
    completed(run)


def test_execute_takes_the_environment_the_sites_lines_leave(tmp_path: Path) -> None:
    """apply_site_lines on its own: the lines run in the batch script's order (env, setup that defines
    ``module``, module loads), what they export or unset reaches this process, and a failing line
    is a runtime failure naming the site."""
    from beam_hpc.cli.execute import apply_site_lines
    from beam_hpc.config.site import site_from_dict
    from beam_hpc.errors import RuntimeFailure

    saved = dict(os.environ)
    os.environ["BEAM_PARITY_GONE"] = "set before"
    try:
        lines = {**SITE_LINES, "setup": [*SITE_LINES["setup"], "unset BEAM_PARITY_GONE", "echo chatter"]}
        apply_site_lines(site_from_dict({**LAPTOP_SITE, "name": "p", "python": sys.executable, **lines}, "<test>"))
        assert {k: os.environ.get(k) for k in SEEN_ENV} == SEEN_ENV and os.environ["LOADEDMODULES"].endswith(MODULE)
        assert "BEAM_PARITY_GONE" not in os.environ and os.environ["PWD"] == saved.get("PWD", os.environ["PWD"])
        broken = site_from_dict({**LAPTOP_SITE, "name": "broken", "python": sys.executable,
                                 "module_loads": [MODULE]}, "<test>")  # no setup: `module` is not defined
        with pytest.raises(RuntimeFailure, match=r"site broken\) failed with exit code 127"):
            apply_site_lines(broken)
    finally:
        os.environ.clear()
        os.environ.update(saved)
