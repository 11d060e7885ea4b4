"""One submission request, three schedulers (issue 13 item 5): what --dry-run prints is what
sbatch, submitit and `beam-hpc execute` are given, and refusals come before anything is written.

Fast: nothing here submits, and nothing asks Slurm (no Slurm command is on PATH here, so the
answers do not depend on which cluster this machine reaches); the Slurm paths themselves run in
tests/submission/test_submit_slurm.py.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

import beam_hpc
from beam_hpc.errors import InputError
from beam_hpc.job.segment import main as segment_main
from beam_hpc.plan.segment_args import SegmentArgs
from beam_hpc.slurm.script import component, render_script
from beam_hpc.submission.request import SubmitRequest, Via
from beam_hpc.submission.via_submitit import executor_parameters, submission_text

REPO = Path(__file__).resolve().parents[2]
SITE = REPO / "env" / "example-site.yaml"
GOLDEN = Path(__file__).parent / "golden"  # `submit --dry-run` of the seed configurations


@pytest.fixture(autouse=True)
def no_slurm_here(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """No sinfo, scontrol, sbatch or srun on PATH (bash and python3 only): what a dry run asks Slurm
    (the staging partition's TmpDisk) is answered "cannot say", as on a laptop, whatever cluster
    this machine is configured for."""
    bin_dir = tmp_path_factory.mktemp("no-slurm")
    (bin_dir / "bash").symlink_to(shutil.which("bash") or "/bin/bash")
    (bin_dir / "python3").symlink_to(sys.executable)
    monkeypatch.setenv("PATH", str(bin_dir))


def _submit(tmp_path: Path, name: str = "dedicated", **kw):  # type: ignore[no-untyped-def]
    return beam_hpc.submit(REPO / "recipes" / f"{name}.yaml", SITE, output_dir=str(tmp_path / "run"), **kw)


def test_package_exports_submit_and_a_dry_run_writes_nothing(tmp_path: Path) -> None:
    sub = _submit(tmp_path, dry_run=True, via="sbatch", resume=True, num_rollout=200)
    assert isinstance(sub, beam_hpc.Submission) and isinstance(sub.request, beam_hpc.SubmitRequest)
    assert isinstance(sub.plan, beam_hpc.Plan) and isinstance(sub.plan.recipe, beam_hpc.Recipe)
    assert sub.plan.recipe.num_rollout == 200 and sub.job_id is None
    assert sub.command == ["sbatch", "--parsable", f"--output={tmp_path / 'run' / 'logs' / 'slurm-%j.out'}",
                           str(tmp_path / "run" / "job.sbatch"), "--resume", "--num-rollout", "200"]
    assert "would run: sbatch --parsable" in sub.request.describe()
    assert not (tmp_path / "run").exists()


def test_segment_arguments_round_trip_through_the_batch_scripts_parser() -> None:
    """The arguments sbatch gets are the ones the segment parses back (no second format)."""
    args = SegmentArgs(resume=True, num_rollout=200)
    assert args.argv() == ["--resume", "--num-rollout", "200"]
    assert SegmentArgs(smoke=True).argv() == ["--smoke"] and SegmentArgs().argv() == []


def test_submitit_gets_the_same_components_as_the_script(tmp_path: Path) -> None:
    """submitit's script carries each component's options as the one renderer makes them
    (Component.options): the rollout component's lines are the rendered script's, in its order;
    the trainer's are the same options, written by submitit's own writer (keys sorted, values
    shell-quoted). The walltime is rounded up to submitit's whole minutes, never down."""
    plan = _submit(tmp_path, dry_run=True, overrides=["lifecycle.walltime=01:00:30"]).plan
    request = SubmitRequest(plan=plan, segment=SegmentArgs(), dependency="afterany:7", exclude=("n4", "n9"))
    params = executor_parameters(request)
    assert params["time"] == 61 and plan.walltime_s == 3630
    assert params["additional_parameters"]["dependency"] == "afterany:7"
    assert params["additional_parameters"]["signal"] == f"USR1@{plan.lead_s}"
    first, second = (component(plan, g) for g in plan.groups)
    rendered = render_script(plan).split("#SBATCH hetjob\n")[1].splitlines()
    rollout_lines = [x for x in rendered if x.startswith("#SBATCH ")]
    text = submission_text(request)
    trainer, rollout = text.split("#SBATCH hetjob\n")
    assert [x for x in rollout.splitlines() if x.startswith("#SBATCH ")] == [
        *rollout_lines, "#SBATCH --exclude=n4,n9", "#SBATCH --dependency="]
    quoted = {f"#SBATCH {f}" if "&" not in f else "#SBATCH {}='{}'".format(*f.split("=", 1))
              for f in first.sbatch_flags()}
    assert quoted | {"#SBATCH --exclude=n4,n9", "#SBATCH --time=61"} <= set(trainer.splitlines())
    assert all(f"#SBATCH {f}" in rollout_lines for f in second.sbatch_flags())


def test_the_dry_run_carries_the_exclusions_it_would_submit_and_records_nothing(tmp_path: Path) -> None:
    """Resuming a run whose ledger excluded n3 and n5, with ``--include-node n3`` and a site
    quarantine of n9: the request the dry run returns excludes n5 and n9, on the sbatch line and in
    every component of submitit's script, and the clearing of n3 is not recorded (nothing written)."""
    from beam_hpc.config.recipe import load_yaml
    from beam_hpc.config.site import site_from_dict
    from beam_hpc.lifecycle import quarantine
    from beam_hpc.run import ledger
    from beam_hpc.submission.submit import describe

    run = tmp_path / "run"
    for job, at, nodes in (("1", 100.0, ("n3",)), ("2", 200.0, ("n5",))):
        ledger.append(run / "ledger.jsonl", ledger.start_record(
            job_id=job, restart=0, host="h", rollouts_at_start=0, num_rollout=10, resume=False, walltime_s=600,
            lead_s=60, now=at - 10))
        ledger.append(run / "ledger.jsonl", ledger.end_record(
            job_id=job, restart=0, rollouts_at_end=0, reason="node-failure", detail="d", next_action="resubmit",
            next_job_id=None, rollout_s=None, save_s=None, now=at, failed_nodes=[{"node": n, "why": "x"} for n in nodes]))
    qfile = tmp_path / "quarantine.json"
    quarantine.record(qfile, [{"node": "n9", "why": "test"}], run="other", run_dir="/x", segment="1-0", days=1)
    site = site_from_dict({**load_yaml(SITE), "quarantine": str(qfile)}, "test site")
    before = sorted(p.name for p in tmp_path.rglob("*"))
    for via in ("sbatch", "submitit"):
        sub = beam_hpc.submit(REPO / "recipes" / "dedicated.yaml", site, output_dir=str(run), resume=True,
                              include_nodes=["n3"], via=via, dry_run=True)
        assert sorted(sub.request.exclude) == ["n5", "n9"]
        printed = describe(sub)
        assert "excluded nodes: " in printed
        if via == "sbatch":
            assert any(a.startswith("--exclude=") and sorted(a[10:].split(",")) == ["n5", "n9"] for a in sub.command)
        else:
            trainer, rollout = submission_text(sub.request).split("#SBATCH hetjob")
            assert trainer.count("#SBATCH --exclude=") == rollout.count("#SBATCH --exclude=") == 1
            assert submission_text(sub.request) in printed
    assert sorted(p.name for p in tmp_path.rglob("*")) == before  # no node-exclusions.json
    with pytest.raises(InputError, match="--include-node: n7 not excluded in this run"):
        beam_hpc.submit(REPO / "recipes" / "dedicated.yaml", site, output_dir=str(run), resume=True,
                        include_nodes=["n7"], dry_run=True)


def test_the_dry_run_text_is_the_executors_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The submitit script a dry run prints (made without an executor) is the one beam-hpc's
    executor writes when it submits (an ``srun`` stand-in lets submitit build one here; nothing runs it)."""
    from beam_hpc.submission.via_submitit import make_executor

    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "srun").write_text("#!/bin/sh\nexit 1\n")
    (fake / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", str(fake))
    for name in ("dedicated", "colocated"):
        sub = _submit(tmp_path / name, name, dry_run=True)
        request = SubmitRequest(plan=sub.plan, segment=SegmentArgs(resume=True), exclude=("n2",), dependency="afterany:3")
        executor = make_executor(request)
        assert executor._make_submission_file_text(executor._submitit_command_str, "uid") == submission_text(request)


def test_smoke_with_resume_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="--smoke"):
        _submit(tmp_path, smoke=True, resume=True, via="sbatch")
    with pytest.raises(InputError, match="--via"):
        _submit(tmp_path, via="carrier-pigeon")
    with pytest.raises(InputError, match="execute"):
        _submit(tmp_path, via=Via.LOCAL)
    assert not (tmp_path / "run").exists()


def test_a_plan_is_typed_and_survives_plan_json(tmp_path: Path) -> None:
    plan = _submit(tmp_path, dry_run=True).plan
    again = beam_hpc.Plan.from_dict(__import__("json").loads(plan.to_json()))
    assert again == plan
    assert again.site.name == plan.site.name and again.recipe.lifecycle.walltime == plan.recipe.lifecycle.walltime
    assert plan.with_num_rollout(7).recipe.num_rollout == 7 and plan.recipe.num_rollout != 7


def test_segment_main_refuses_a_missing_plan_with_exit_2(tmp_path: Path) -> None:
    assert segment_main(["--plan", str(tmp_path / "nothing" / "plan.json")]) == 2


def test_dry_run_states_gpu_hours_from_the_recipe_or_the_runs_own_ledger(tmp_path: Path) -> None:
    from beam_hpc.run import checkpoint_layout, ledger

    fresh = _submit(tmp_path, dry_run=True, overrides=["lifecycle.rollout_s_estimate=360"])
    assert fresh.estimate is not None and fresh.estimate.rollout_s == 360
    assert fresh.estimate.gpu_hours == pytest.approx(96 * fresh.estimate.wall_s / 3600)
    assert "lifecycle.rollout_s_estimate" in fresh.estimate.basis
    # resuming: 40 of 100 rollouts done, the ledger measured 200 s a rollout and 100 s to be ready
    run = tmp_path / "run"
    ckpt = run / "checkpoints"
    it = Path(checkpoint_layout.iteration_dir(str(ckpt), 39))
    it.mkdir(parents=True)
    state = Path(checkpoint_layout.dataset_state_path(str(ckpt), 39))
    state.parent.mkdir(parents=True)
    state.write_text("{}")
    checkpoint_layout.mark_latest(str(ckpt), 39)
    ledger.append(run / "ledger.jsonl", ledger.start_record(job_id="5", restart=0, host="h", rollouts_at_start=0,
                                                            num_rollout=100, resume=False, walltime_s=86400, lead_s=600))
    ledger.append(run / "ledger.jsonl", {**ledger.end_record(
        job_id="5", restart=0, rollouts_at_end=40, reason="walltime", detail="", next_action="none",
        next_job_id=None, rollout_s=200.0, save_s=30.0), "ready_s": 100.0})
    again = _submit(tmp_path, dry_run=True, resume=True)
    assert again.estimate is not None and again.estimate.rollouts_left == 100 - checkpoint_layout.rollouts_done(str(ckpt))
    assert again.estimate.rollout_s == 200.0 and "measured" in again.estimate.basis
    assert again.estimate.wall_s == pytest.approx(again.estimate.rollouts_left * 200 + again.estimate.segments * 100)


# -- one materialized request (issue 20 items 1-3) -------------------------------------------------------
SITE_WITH_EVERYTHING = {
    "name": "modsite", "python": "python3", "gpus_per_node": 8, "gres": "gpu", "mem": "0",
    "partitions": {"trainer": "gpu", "rollout": "gpu"}, "module_loads": ["apptainer/1.3"],
    "env": {"NCCL_IB_HCA": "mlx5", "NCCL_NVLS_ENABLE": "0"},
    "setup": ["module() { export LOADEDMODULES=\"${LOADEDMODULES:+$LOADEDMODULES:}$2\"; }"],
    "sbatch_extra": ["--hold", "--reservation=big"],
    "container": {"runtime": "host"},
}


def _site_everything():  # type: ignore[no-untyped-def]
    from beam_hpc.config.site import site_from_dict

    return site_from_dict(dict(SITE_WITH_EVERYTHING), "test site")


def test_submitit_carries_the_sites_lines_through_its_own_parameters(tmp_path: Path) -> None:
    """The site's env, setup, module loads and extra #SBATCH lines reach submitit's script through
    submitit's own `setup` and `additional_parameters`, in the rendered script's order, and the
    script the dry run prints is the one the executor writes."""
    from beam_hpc.slurm.script import site_lines

    sub = beam_hpc.submit(REPO / "recipes" / "dedicated.yaml", _site_everything(), output_dir=str(tmp_path / "run"),
                          dry_run=True)
    text = submission_text(sub.request)
    lines = site_lines(sub.plan.site)
    assert lines == ["export NCCL_IB_HCA=mlx5", "export NCCL_NVLS_ENABLE=0", *SITE_WITH_EVERYTHING["setup"],
                     "module load apptainer/1.3"]
    body = text.split("# setup\n", 1)[1]
    assert body.startswith("\n".join(lines) + "\n")
    trainer, rollout = text.split("#SBATCH hetjob")
    for part in (trainer, rollout):  # every component, as the rendered script repeats them
        assert "#SBATCH --hold\n" in part and "#SBATCH --reservation=big\n" in part
    script = render_script(sub.plan)
    for line in lines + ["#SBATCH --hold", "#SBATCH --reservation=big"]:
        assert line in script
    assert not (tmp_path / "run").exists()
    printed = beam_hpc.submission.submit.describe(sub)
    assert text.rstrip() in printed


def test_sbatch_extra_that_is_not_a_long_option_is_bad_input(tmp_path: Path) -> None:
    from beam_hpc.config.site import site_from_dict

    site = site_from_dict({**SITE_WITH_EVERYTHING, "sbatch_extra": ["-H"]}, "test site")
    with pytest.raises(InputError, match="sbatch_extra: '-H' is not a long sbatch option"):
        beam_hpc.submit(REPO / "recipes" / "dedicated.yaml", site, output_dir=str(tmp_path / "run"), dry_run=True)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("name", ["dedicated", "colocated", "lora"])
def test_submitit_dry_run_matches_golden(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`beam-hpc submit RECIPE --dry-run` (submitit, the default) prints the exact submitit batch
    script; golden/X.submitit.dryrun.txt beside this file holds it, next to the sbatch golden (regenerate:
    `beam-hpc submit recipes/X.yaml --site env/example-site.yaml --dry-run > tests/submission/golden/X.submitit.dryrun.txt`)."""
    from beam_hpc.cli.app import main as cli_main

    assert cli_main(["submit", str(REPO / "recipes" / f"{name}.yaml"), "--site", str(SITE), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out == (GOLDEN / f"{name}.submitit.dryrun.txt").read_text()
    assert "export NCCL_NVLS_ENABLE=0" in out and "submitit.core._submit" in out


def test_a_rendered_script_carries_its_plan(tmp_path: Path) -> None:
    """The plan travels inside the script (a quoted here-document on the segment's stdin), so a
    plain `sbatch x.sbatch` needs no other file; a committed sbatch/*.sbatch is such a script."""
    import subprocess

    from beam_hpc.job.segment import plan_from_text
    from beam_hpc.slurm.script import PLAN_HEREDOC

    plan = _submit(tmp_path, dry_run=True).plan
    script = tmp_path / "x.sbatch"
    script.write_text(render_script(plan))
    # bash itself hands the here-document to the exec'd command: replace the interpreter by `cat`
    text = script.read_text().replace(f"exec {plan.site.python} -m beam_hpc.job.segment",
                                      "exec python3 -c 'import sys; sys.stdout.write(sys.stdin.read())'")
    probe = tmp_path / "probe.sh"
    probe.write_text(text)
    out = subprocess.run(["bash", str(probe)], capture_output=True, text=True, check=True).stdout
    assert plan_from_text(out, str(script)) == plan
    committed = (REPO / "sbatch" / "dedicated.sbatch").read_text()
    assert committed.rstrip().endswith(PLAN_HEREDOC) and "--plan - --script \"$0\"" in committed


def test_an_allocation_that_does_not_match_the_plan_names_the_line(tmp_path: Path) -> None:
    """A user edited `#SBATCH --nodes` of the rollout group: the segment names that line and the
    plan's value; a changed --time is no problem."""
    from beam_hpc.job.context import allocation_problems
    from beam_hpc.slurm.environment import SlurmEnvironment

    plan = _submit(tmp_path, dry_run=True).plan
    text = render_script(plan).replace("#SBATCH --time=1-00:00:00", "#SBATCH --time=2:00:00")
    lines = text.splitlines()
    rollout_nodes = max(i for i, line in enumerate(lines) if line == "#SBATCH --nodes=4")
    lines[rollout_nodes] = "#SBATCH --nodes=3"
    text = "\n".join(lines)
    env = {"SLURM_JOB_ID": "7", "SLURM_HET_SIZE": "2", "SLURM_JOB_NUM_NODES_HET_GROUP_0": "8",
           "SLURM_JOB_NUM_NODES_HET_GROUP_1": "3", "SLURM_GPUS_ON_NODE": "8"}
    problems = allocation_problems(plan, SlurmEnvironment(env), script="x.sbatch", script_text=text)
    assert problems == [f"x.sbatch:{rollout_nodes + 1}: `#SBATCH --nodes=3`: het group 1 (rollout) got 3 node(s), "
                        "but the plan's rollout group has 4; set --nodes=4 there, or render the script again for "
                        "another topology"]
    ok = {**env, "SLURM_JOB_NUM_NODES_HET_GROUP_1": "4"}
    assert allocation_problems(plan, SlurmEnvironment(ok), script="x.sbatch", script_text=text) == []
    gpus = {**ok, "SLURM_GPUS_ON_NODE": "4"}
    [problem] = allocation_problems(plan, SlurmEnvironment(gpus), script="x.sbatch", script_text=text)
    assert "`#SBATCH --gres=gpu:8`" in problem and "got 4 GPU(s) per node" in problem
    one = {"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "8"}  # a plain job: no SLURM_HET_SIZE
    [problem] = allocation_problems(plan, SlurmEnvironment(one), script="x.sbatch", script_text=text)
    assert "1 het component(s)" in problem and "2 group(s)" in problem


def test_slurm_environment_reads_het_groups_from_their_own_variables() -> None:
    from beam_hpc.slurm.environment import SlurmEnvironment

    env = SlurmEnvironment({"SLURM_JOB_ID": "21", "SLURM_HET_SIZE": "2", "SLURM_JOB_ID_HET_GROUP_1": "22",
                            "SLURM_JOB_NODELIST": "n3", "SLURM_JOB_NODELIST_HET_GROUP_0": "n3",
                            "SLURM_JOB_NODELIST_HET_GROUP_1": "n[4-5]", "SLURM_RESTART_COUNT": "2",
                            "SLURM_PROCID": "3"})
    assert (env.job_id, env.het_size, env.restart_count) == ("21", 2, 2)
    assert (env.component_id(0), env.component_id(1), env.nodelist(1)) == ("21", "22", "n[4-5]")
    assert env.node_id == 3 and SlurmEnvironment({}).job_id is None and SlurmEnvironment({}).restart_count == 0


def test_a_segment_refuses_a_damaged_run_directory_before_writing(tmp_path: Path) -> None:
    """A torn plan.json: the segment of a rendered script (its own plan in hand) and one given the
    path both exit 2 naming the file, and write nothing (no lock, no log directory, no ledger)."""
    from beam_hpc.job.segment import run_segment

    plan = _submit(tmp_path, dry_run=True).plan
    run = Path(plan.output_dir)
    run.mkdir(parents=True)
    (run / "plan.json").write_text('{"version": 1, "recip')
    assert run_segment(plan, SegmentArgs(), script=str(tmp_path / "x.sbatch")) == 2
    assert segment_main(["--plan", str(run / "plan.json")]) == 2
    assert sorted(p.name for p in run.iterdir()) == ["plan.json"]


@pytest.mark.parametrize("name", ["dedicated", "colocated", "lora"])
def test_sbatch_dry_run_matches_golden(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`beam-hpc submit RECIPE --dry-run --via sbatch` prints the full Miles command and the exact
    batch script; golden/X.dryrun.txt holds the three seed configurations' (regenerate:
    `beam-hpc submit recipes/X.yaml --site env/example-site.yaml --dry-run --via sbatch >
    tests/submission/golden/X.dryrun.txt`)."""
    from beam_hpc.cli.app import main as cli_main

    assert cli_main(["submit", str(REPO / "recipes" / f"{name}.yaml"), "--site", str(SITE), "--dry-run",
                     "--via", "sbatch"]) == 0
    golden = (GOLDEN / f"{name}.dryrun.txt").read_text()
    assert capsys.readouterr().out == golden
    for seed_value in ("--rollout-batch-size 32", "--n-samples-per-prompt 8", "--rollout-max-prompt-len 1024",
                       "--rollout-max-response-len 4096", "--eval-interval 5", "--n-samples-per-eval-prompt 8",
                       "--save-interval 20", "--eps-clip 0.2", "--eps-clip-high 0.28"):
        assert seed_value in golden, seed_value
