"""HF -> torch_dist conversion as a Slurm job of its own (beam_hpc.backends.miles.convert).

Fast tests: the pure parts (spec, sbatch script, converter command, the done/partial/foreign rules)
against the facts of Miles's converter (radixark/miles@31f1ca961 ``tools/convert_hf_to_torch_dist.py``
and its launch helper: ``torchrun --nproc-per-node <GPUs> tools/convert_hf_to_torch_dist.py <model
args> --hf-checkpoint HF --save DST``; success = ``release`` in the tracker, written last).

Slow test: ``beam-hpc prepare --convert`` on the real local Slurm cluster with the launch-parity site
(its ``setup`` defines ``module``): the job gets past the site's lines as the run's jobs do. Real
parts: the CLI, sbatch, the rendered script, a trainer-partition node with fake GPUs, torchrun with
one gloo process per GPU, megatron-core writing a real torch_dist checkpoint. The seam: Miles's
converter needs CUDA and mbridge, so ``MILES_DIR`` points at ``tests/support/standins/miles_standin/``, whose
converter is a contract double (see its docstring). A second ``prepare --convert`` submits nothing.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from parity_site import COMMENT, MODULE, SEEN_ENV, parity_site

from beam_hpc.backends.miles import convert as mc
from beam_hpc.config.recipe import load_yaml, recipe_from_dict
from beam_hpc.config.site import site_from_dict
from beam_hpc.errors import InputError
from beam_hpc.run import lock as run_lock

ROOT = Path(__file__).resolve().parents[3]
STANDIN = ROOT / "tests" / "support" / "standins" / "miles_standin"
MODEL_ARGS = ["--num-layers", "2", "--hidden-size", "8", "--num-attention-heads", "2", "--swiglu"]


def recipe_dict(base: Path, **changes: object) -> dict:
    d = load_yaml(ROOT / "recipes" / "dedicated.yaml")
    d["output_dir"] = str(base / "run")
    d["model"] = {**d["model"], "path": str(base / "hf"), "ref_load": str(base / "torch_dist"),
                  "miles_model_args": MODEL_ARGS, "miles_model_script": None}
    d.update(changes)
    return d


def example_site() -> dict:
    return load_yaml(ROOT / "env" / "example-site.yaml")


def spec_for(base: Path, site: dict | None = None, **changes: object) -> mc.ConvertSpec:
    return mc.convert_spec(recipe_from_dict(recipe_dict(base, **changes), "t"), site_from_dict(site or example_site(), "s"))


# -- pure ----------------------------------------------------------------------------------------------
def test_script_asks_for_one_trainer_node_with_its_gpus(tmp_path: Path) -> None:
    spec = spec_for(tmp_path)
    assert (spec.hf_checkpoint, spec.output, spec.gpus) == (str(tmp_path / "hf"), str(tmp_path / "torch_dist"), 8)
    text = mc.render_script(spec)
    sbatch = [line.split(" ", 1)[1] for line in text.splitlines() if line.startswith("#SBATCH ")]
    assert sbatch == ["--job-name=beam-convert-torch_dist", "--time=04:00:00",
                      f"--output={tmp_path}/run/convert/logs/convert-%j.out", "--no-requeue",
                      "--nodes=1", "--ntasks-per-node=1", "--partition=gpu-h200", "--account=my-project",
                      "--qos=normal", "--gres=gpu:8", "--cpus-per-task=96", "--mem=0", "--constraint=h200&nvme",
                      "--exclusive"]
    assert "export NCCL_SOCKET_IFNAME=ib0" in text
    assert text.rstrip().endswith(
        f"exec /shared/software/beam-hpc/venv/bin/python -m beam_hpc.backends.miles.convert run "
        f"--spec {tmp_path}/run/convert/convert.json")


def test_script_has_the_sites_lines_in_the_run_scripts_order(tmp_path: Path) -> None:
    """The conversion job's site block is the run's (beam_hpc.slurm.script.site_lines: env, then
    setup, which may define ``module``, then module loads), and the site's extra #SBATCH lines come
    after the node's request, as in the run's script."""
    from beam_hpc.slurm.script import site_lines

    site = {**example_site(), "env": {"B": "2", "A": "1"}, "setup": ["source /etc/profile.d/modules.sh"],
            "module_loads": ["cuda/12.4"], "sbatch_extra": ["--comment=x"]}
    spec = spec_for(tmp_path, site)
    lines = mc.render_script(spec).splitlines()
    block = lines[lines.index("set -eo pipefail") + 1:-1]
    assert block == site_lines(spec.site_obj()) == [
        "export A=1", "export B=2", "source /etc/profile.d/modules.sh", "module load cuda/12.4"]
    sbatch = [line for line in lines if line.startswith("#SBATCH ")]
    assert sbatch[-2:] == ["#SBATCH --exclusive", "#SBATCH --comment=x"]
    assert lines[-1].startswith("exec ")


def test_converter_command_is_miles_own(tmp_path: Path) -> None:
    """torchrun over the node's GPUs, Miles's converter, the recipe's architecture flags, then
    --hf-checkpoint and --save; beam-hpc's own flags are names Miles's parser accepts."""
    spec = spec_for(tmp_path)
    argv = mc.converter_argv(spec, "python3", "/root/miles")
    assert argv == ["python3", "-m", "torch.distributed.run", "--standalone", "--local-addr=127.0.0.1", "--nproc-per-node=8",
                    "/root/miles/tools/convert_hf_to_torch_dist.py", *MODEL_ARGS,
                    "--hf-checkpoint", str(tmp_path / "hf"), "--save", str(tmp_path / "torch_dist")]
    known = {line.strip() for line in (ROOT / "tests" / "support" / "fixtures" / "miles-megatron-flags.txt").read_text().splitlines()}
    assert {"--hf-checkpoint", "--save", "--num-layers", "--hidden-size"} <= known
    assert mc.miles_dir({"MILES_DIR": "/opt/m"}) == "/opt/m"


def test_the_converter_runs_inside_the_sites_container(tmp_path: Path) -> None:
    spec = spec_for(tmp_path)
    cmd = mc.container_step(spec, str(spec.spec_path), base={})
    binds = [cmd.argv[i + 1] for i, a in enumerate(cmd.argv) if a == "--bind"]
    assert cmd.argv[:3] == ["apptainer", "exec", "--nv"] and "--containall" not in cmd.argv
    for needed in (tmp_path / "hf", tmp_path / "torch_dist", tmp_path / "run" / "convert"):  # all visible inside
        assert any(str(needed) == b or str(needed).startswith(b + "/") for b in binds), (needed, binds)
    assert cmd.argv[-7:] == ["/shared/images/beam.sif", "python3", "-m", "beam_hpc.backends.miles.convert",
                             "exec", "--spec", str(spec.spec_path)]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"backend": "reference"}, "backend: 'reference'"),
        ({"training": {"mode": "lora", "lora": {"rank": 8}, "offload": {"target": "none"}}}, "training.mode: lora"),
        ({"model": {"path": "/m/hf", "miles_model_args": MODEL_ARGS}}, "model.ref_load: not set"),
        ({"model": {"path": "/m/hf", "ref_load": "rel/dir", "miles_model_args": MODEL_ARGS}}, "model.ref_load: 'rel/dir' is relative"),
        ({"model": {"path": "/m/hf", "ref_load": "/m/hf/"}}, "is model.path itself"),
        ({"model": {"path": "/m/hf", "ref_load": "/m/td"}}, "model.miles_model_args: a Miles recipe needs the model.s architecture flags"),
        ({"model": {"path": "/m/hf", "ref_load": "/m/td", "miles_model_script": "/nowhere/m.sh"}},
         "model.miles_model_script: /nowhere/m.sh is not readable here"),
    ],
)
def test_recipes_that_cannot_be_converted_name_the_field(tmp_path: Path, change: dict, message: str) -> None:
    with pytest.raises(InputError, match=message.replace("(", r"\(")):
        spec_for(tmp_path, **change)


def test_cli_refuses_mixed_options(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    from beam_hpc.cli.app import main

    assert main(["prepare", "--convert", "r.yaml", "--tiny"]) == 2
    assert main(["prepare", "--site", "local"]) == 2
    assert "these go with --convert RECIPE" in capsys.readouterr().err


def test_bad_walltime_and_too_many_gpus(tmp_path: Path) -> None:
    recipe = recipe_from_dict(recipe_dict(tmp_path), "t")
    with pytest.raises(InputError, match="--walltime: 'soon'"):
        mc.convert_spec(recipe, site_from_dict(example_site(), "s"), walltime="soon")
    with pytest.raises(InputError, match="topology.trainer.gpus_per_node: 8 GPUs, but site"):
        mc.convert_spec(recipe, site_from_dict({**example_site(), "gpus_per_node": 4}, "s"))


def _complete(out: Path) -> None:
    (out / "release").mkdir(parents=True)
    (out / "release" / "common.pt").write_bytes(b"x")
    (out / "latest_checkpointed_iteration.txt").write_text("release")


def test_done_partial_and_outputs_that_must_not_be_touched(tmp_path: Path) -> None:
    spec = spec_for(tmp_path)
    out = Path(spec.output)
    assert mc.conversion_state(spec) == "missing"
    (out / "iter_0000001").mkdir(parents=True)  # a converter that died before its move
    (out / "README").write_text("the user's")
    assert mc.conversion_state(spec) == "partial"
    assert mc.clear_partial(out) == [str(out / "iter_0000001")]
    assert (out / "README").exists() and mc.conversion_state(spec) == "missing"
    _complete(out)  # complete, but beam-hpc did not record it: never overwritten
    with pytest.raises(InputError, match="model.ref_load: .* beam-hpc did not make"):
        mc.conversion_state(spec)
    (out / mc.MARKER).write_text(json.dumps({"key": spec.key()}))
    assert mc.conversion_state(spec) == "done"
    (out / "latest_checkpointed_iteration.txt").write_text("1")  # tracker not "release": not complete
    assert mc.conversion_state(spec) == "partial"
    (out / "latest_checkpointed_iteration.txt").write_text("release")
    other = spec_for(tmp_path, model={**recipe_dict(tmp_path)["model"], "miles_model_args": ["--num-layers", "4"]})
    with pytest.raises(InputError, match="holds a conversion of"):
        mc.conversion_state(other)


# -- on the local Slurm cluster --------------------------------------------------------------------------
@pytest.fixture
def conv_dir() -> Iterator[Path]:
    """Outside pytest's temp dirs, which other sessions prune while a job may still write."""
    root = Path(tempfile.mkdtemp(prefix="beam-cv-", dir="/tmp"))
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.slurm
@pytest.mark.e2e
def test_prepare_convert_runs_the_job_once_then_skips(slurm_cluster, conv_dir: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    from beam_hpc.cli.app import main

    (conv_dir / "hf").mkdir()
    (conv_dir / "hf" / "config.json").write_text("{}")
    d = recipe_dict(conv_dir)
    d["topology"] = {"trainer": {"nodes": 1, "gpus_per_node": 2},
                     "rollout": {"nodes": 1, "gpus_per_node": 2, "gpus_per_engine": 1}}
    recipe_file = conv_dir / "recipe.yaml"
    recipe_file.write_text(yaml.safe_dump(d))
    # the launch-parity site (its setup defines `module`), with MILES_DIR where beam-hpc's image has Miles
    site_file = parity_site(conv_dir / "site.yaml", env={"MILES_DIR": str(STANDIN)})
    args = ["prepare", "--convert", str(recipe_file), "--site", str(site_file)]

    assert main(args) == 0
    out = capsys.readouterr().out
    job = out.split("submitted conversion job ")[1].split()[0]
    assert main(args) == 0  # while it is queued or running: not submitted twice
    assert f"already queued or running as job {job}" in capsys.readouterr().out
    state = slurm_cluster.wait_for_job(job, timeout=240)
    log = (conv_dir / "run" / "convert" / "logs" / f"convert-{job}.out")
    assert state == "COMPLETED", log.read_text(errors="replace")[-3000:] if log.exists() else "(no log)"

    dst = conv_dir / "torch_dist"
    marker = json.loads((dst / mc.MARKER).read_text())
    assert marker["key"] == {"hf_checkpoint": str(conv_dir / "hf"), "model_args": MODEL_ARGS}
    assert marker["job_id"] == job and marker["gpus"] == 2
    assert (dst / "latest_checkpointed_iteration.txt").read_text() == "release"
    assert {"metadata.json", ".metadata", "common.pt"} <= {p.name for p in (dst / "release").iterdir()}
    ranks = [json.loads((conv_dir / "torch_dist.standin" / f"rank-{r}.json").read_text()) for r in (0, 1)]
    for r, rec in enumerate(ranks):  # torchrun started one converter per GPU with Miles's flags
        assert rec["rank"] == r and rec["world"] == 2 and rec["local_rank"] == r
        assert rec["argv"][1:] == [*MODEL_ARGS, "--hf-checkpoint", str(conv_dir / "hf"), "--save", str(dst)]
        assert Path(rec["argv"][0]) == STANDIN / mc.CONVERTER
        assert rec["env"]["PYTHONPATH"].split(":")[0] == str(STANDIN) and rec["env"]["SLURM_JOB_ID"] == job
        # the job got past the site's lines as the run's jobs do: `module` defined by setup, then loaded
        assert rec["env"]["LOADEDMODULES"] == MODULE and rec["env"]["BEAM_MODULE_RAN"] == SEEN_ENV["BEAM_MODULE_RAN"]
        assert rec["env"]["BEAM_PARITY_SITE"] == SEEN_ENV["BEAM_PARITY_SITE"]
    assert f"#SBATCH --comment={COMMENT}" in (conv_dir / "run" / "convert" / "convert.sbatch").read_text().splitlines()

    before = (dst / mc.MARKER).read_text()
    assert main(args) == 0
    assert "already converted; skipped" in capsys.readouterr().out
    assert (dst / mc.MARKER).read_text() == before
    assert mc.queued_jobs("beam-convert-torch_dist") == []  # nothing was submitted again


def test_a_second_conversion_of_the_same_output_is_refused_by_its_lock(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Two jobs that raced past the squeue check: the one that finds the output's lock held by a
    live holder stops with a message naming it, before touching the output; once the holder is
    gone the lock is stale and the next run goes on (here: finds the output done and skips)."""
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)  # a run outside Slurm: the holder is a pid
    spec = spec_for(tmp_path)
    Path(spec.work_dir).mkdir(parents=True)
    mc.write_atomic(spec.spec_path, spec.to_json())
    lock = mc.output_lock(spec.output)
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        holder = run_lock.Holder(job_id=None, restart=0, host=socket.gethostname(), pid=sleeper.pid, time=time.time())
        assert run_lock.acquire(lock, holder) is None
        with pytest.raises(mc.ConvertError, match=rf"model.ref_load: .* is being converted by a local run .* pid {sleeper.pid}"):
            mc.run(str(spec.spec_path))
        assert not Path(spec.output).exists()  # refused before anything was written
    finally:
        sleeper.kill()
        sleeper.wait()
    _complete(Path(spec.output))
    (Path(spec.output) / mc.MARKER).write_text(json.dumps({"key": spec.key()}))
    assert mc.run(str(spec.spec_path)) == 0  # the dead holder's lock taken over; already done
    assert not lock.exists()
