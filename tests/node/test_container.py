"""beam_hpc.node.container against a written contract of Apptainer's command line.

The Apptainer binary cannot be installed on the machines these tests run on, so the contract
below is taken from Apptainer's documentation (apptainer-userdocs: bind_paths_and_mounts.rst,
environment_and_metadata.rst, gpu.rst) and checked two ways: on the command lines themselves, and
by running them through a stand-in `apptainer` that accepts exactly the documented grammar of the
options we use and applies the documented environment rules before exec'ing the command.

Contract:
  C1  ``apptainer exec [options] IMAGE COMMAND [ARGS...]``.
  C2  ``--nv`` makes the host's NVIDIA driver and devices available.
  C3  ``--bind src[:dest[:opts]]`` (repeatable) mounts host paths; Ray needs /dev/shm, the run
      directory and node-local scratch inside.
  C4  The host environment is passed in, but image-defined variables win over host variables of
      the same name; ``APPTAINERENV_X=v`` sets X=v inside, over the image's value.
  C5  ``--contain``, ``--containall``, ``--compat`` give a private /tmp and minimal /dev (Ray's
      sockets and object store break); ``--cleanenv`` drops host variables (token, Ray mode).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from fake_apptainer import install_fake_apptainer

from beam_hpc.config.site import Site
from beam_hpc.node.container import container_command

FORBIDDEN = {"--contain", "--containall", "-C", "-c", "--compat", "--cleanenv", "-e"}

def _site(runtime: str, tmp_path: Path, **extra) -> Site:
    shared = tmp_path / "shared"
    scratch = tmp_path / "scratch"
    shared.mkdir(exist_ok=True)
    scratch.mkdir(exist_ok=True)
    image = tmp_path / "beam.sif"
    image.write_text("not really an image")
    container = {"runtime": runtime, "image": str(image), "binds": [str(shared) + ":/data:ro"]}
    return Site.model_validate({"name": "t", "container": container, "shared_paths": [str(shared)],
                                "scratch": str(scratch), **extra})


def test_host_runtime_runs_the_command_as_is(tmp_path):
    site = _site("host", tmp_path)
    cmd = container_command(site, ["python3", "-V"], {"RAY_AUTH_MODE": "token"}, ["/somewhere"],
                            base={"PATH": "/bin"})
    assert cmd.argv == ["python3", "-V"]
    assert cmd.env == {"PATH": "/bin", "RAY_AUTH_MODE": "token"}


def test_apptainer_command_line_follows_the_contract(tmp_path):
    site = _site("apptainer", tmp_path)
    run_dir = tmp_path / "run"
    cmd = container_command(site, ["python3", "-m", "x"], {"RAY_AUTH_MODE": "token"}, [str(run_dir)],
                            base={"PATH": "/host/bin", "HOME": "/root"})
    argv = cmd.argv
    assert argv[:3] == ["apptainer", "exec", "--nv"]  # C1, C2
    binds = [argv[i + 1] for i, a in enumerate(argv) if a == "--bind"]
    assert binds == [str(tmp_path / "shared"), str(tmp_path / "shared") + ":/data:ro",
                     str(tmp_path / "scratch"), "/dev/shm", str(run_dir)]  # C3
    image_at = argv.index(site.container.image)
    assert argv[image_at + 1:] == ["python3", "-m", "x"]
    assert not FORBIDDEN & set(argv)  # C5
    assert cmd.env["APPTAINERENV_RAY_AUTH_MODE"] == "token"  # C4: the job's variables win
    assert "APPTAINERENV_PATH" not in cmd.env and cmd.env["PATH"] == "/host/bin"  # inherited stay normal


def test_staged_image_replaces_the_sites_image_and_duplicate_binds_collapse(tmp_path):
    site = _site("apptainer", tmp_path)
    inner = tmp_path / "shared" / "runs"
    cmd = container_command(site, ["true"], {}, [str(inner), str(tmp_path / "shared")], image="/local/beam.sif")
    binds = [cmd.argv[i + 1] for i, a in enumerate(cmd.argv) if a == "--bind"]
    assert binds.count(str(tmp_path / "shared")) == 1 and str(inner) not in binds
    assert cmd.argv[-2:] == ["/local/beam.sif", "true"]


@pytest.mark.parametrize("runtime", ["host", "apptainer"])
def test_commands_run_with_the_job_environment_inside(tmp_path, runtime):
    """The whole seam: the command line is accepted by the contract's grammar and the process
    inside sees the job's variables even where the image sets its own (C4)."""
    bin_dir = install_fake_apptainer(tmp_path / "bin")
    site = _site(runtime, tmp_path)
    probe = "import os; print(os.environ['RAY_AUTH_MODE'], os.environ['BEAM_RAY_JOB'], os.environ.get('FAKE_APPTAINER_NV'))"
    base = {"PATH": f"{bin_dir}:/usr/bin:/bin"}
    cmd = container_command(site, [sys.executable, "-c", probe],
                            {"RAY_AUTH_MODE": "token", "BEAM_RAY_JOB": "r.1.0"}, [str(tmp_path)], base=base)
    out = subprocess.run(cmd.argv, env=cmd.env, capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    expected_nv = "True" if runtime == "apptainer" else "None"
    assert out.stdout.split() == ["token", "r.1.0", expected_nv]
