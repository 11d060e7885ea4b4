"""beam_hpc.node.container against written contracts of Apptainer's and pyxis's command lines.

The Apptainer binary cannot be installed on the machines these tests run on, so the contract
below is taken from Apptainer's documentation (apptainer-userdocs: bind_paths_and_mounts.rst,
environment_and_metadata.rst, gpu.rst) and checked two ways: on the command lines themselves, and
by running them through a stand-in `apptainer` that accepts exactly the documented grammar of the
options we use and applies the documented environment rules before exec'ing the command.

Contract:
  C1  ``apptainer exec [options] IMAGE COMMAND [ARGS...]``.
  C2  ``--nv`` makes the host's NVIDIA driver and devices available.
  C3  By default Apptainer binds the user's $HOME, the current directory, /tmp and /var/tmp from the
      host (apptainer/apptainer 917d665, internal/pkg/runtime/engine/apptainer/container_linux.go:
      addTmpMount, addHomeMount, createCwdDir); ``--bind src[:dest[:opts]]`` (repeatable) mounts
      more. Ray needs /dev/shm, /tmp (its sockets), the run directory and node-local scratch inside.
  C4  The host environment is passed in, but image-defined variables win over host variables of
      the same name; ``APPTAINERENV_X=v`` sets X=v inside, over the image's value.
  C5  ``--contain``, ``--containall``, ``--compat`` give an empty /tmp and $HOME and no cwd (Ray's
      sockets and the run directory are gone); ``--cleanenv`` drops host variables (token, Ray mode).

pyxis's contract (NVIDIA/pyxis 0.24.0 at 1075199: README "Usage", args.c, pyxis_slurmstepd.c; enroot
at 8ea147d, conf/mounts/10-system.fstab):
  P1  ``srun [options] --container-image=IMAGE COMMAND``: IMAGE is ``[USER@][REGISTRY#]IMAGE[:TAG]``
      (an enroot URI without scheme) or a squashfs path (starts with / or .).
  P2  ``--container-mounts=SRC:DST[:FLAGS][,SRC:DST...]``: mounts separated by commas, a mount's
      flags by "+" (pyxis turns them into enroot's commas); DST defaults to SRC. enroot mounts a
      fresh tmpfs on /tmp in every container, so the host's /tmp is there only when mounted.
  P3  ``--container-name=NAME``: a named container is kept on the node; a later step of that name
      joins it while it runs (its own mounts ignored), else starts it afresh (a new /tmp).
  P4  ``--container-workdir=PATH``; ``--[no-]container-mount-home``.
  P5  The task's environment goes in, the image's values winning; ``--container-env=NAME[,...]``
      keeps the host's value of those names. RANK/LOCAL_RANK are set per task for PyTorch images.
The same options on the real local Slurm cluster, through a SPANK stand-in: tests/node/test_pyxis_slurm.py.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from fake_apptainer import install_fake_apptainer

from beam_hpc.config.site import Site
from beam_hpc.node import container
from beam_hpc.node.container import ContainerError, container_command
from beam_hpc.node.ray_node import TASK_RANK_NAMES, TEMP_ROOT

FORBIDDEN = {"--contain", "--containall", "-C", "-c", "--compat", "--cleanenv", "-e"}

def _site(runtime: str, tmp_path: Path, image: str | None = None, **extra) -> Site:
    shared = tmp_path / "shared"
    scratch = tmp_path / "scratch"
    shared.mkdir(exist_ok=True)
    scratch.mkdir(exist_ok=True)
    if image is None:
        image = str(tmp_path / ("beam.sqsh" if runtime == "pyxis" else "beam.sif"))
        Path(image).write_text("not really an image")
    spec = {"runtime": runtime, "image": image, "binds": [str(shared) + ":/data:ro"],
            **extra.pop("container", {})}
    return Site.model_validate({"name": "t", "container": spec, "shared_paths": [str(shared)],
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


# -- pyxis -------------------------------------------------------------------------------------------
def _option(opts: list[str], name: str) -> str | None:
    values = [o.split("=", 1)[1] for o in opts if o.startswith(name + "=")]
    assert len(values) <= 1, (name, opts)
    return values[0] if values else None


def test_pyxis_srun_options_mount_the_hosts_tmp_first_and_what_apptainer_binds(tmp_path):
    """P1-P4: the image, the host's /tmp first (enroot's own /tmp is empty: P2), then every path
    Apptainer binds that /tmp does not already hold (flags joined by "+"), the job's container name,
    the working directory, and no home unless the site asks."""
    site = _site("pyxis", tmp_path)
    run_dir = str(tmp_path / "run")
    opts = container.srun_options(site, job_id="42", binds=[run_dir, "/opt/models"], workdir=run_dir)
    assert _option(opts, "--container-image") == site.container.image  # P1
    assert _option(opts, "--container-name") == "beam-42" and _option(opts, "--container-workdir") == run_dir
    assert "--no-container-mount-home" in opts and "--container-mount-home" not in opts
    assert _option(opts, "--container-env") is None  # a node step's own variables: pyxis's rule (P5)
    mounts = _option(opts, "--container-mounts").split(",")  # P2
    shared = str(tmp_path / "shared")  # under /tmp here: the host's /tmp already holds it
    assert mounts == ["/tmp:/tmp", f"{shared}:/data:ro", "/dev/shm:/dev/shm", "/opt/models:/opt/models"]
    assert container.pyxis_mount("/a:/b:ro,nosuid") == "/a:/b:ro+nosuid" and container.pyxis_mount("/a") == "/a:/a"
    asked = _site("pyxis", tmp_path, container={"mount_home": True})
    assert "--container-mount-home" in container.srun_options(asked, job_id="42", binds=[], workdir="/")


def test_inside_each_container_the_driver_and_ray_find_their_paths(tmp_path):
    """C3 through the Apptainer stand-in (its default binds), and the host runtime: a process
    started by container_command sees the run directory, the token, the scratch, /dev/shm and the
    node's /tmp (where a `ray start` outside it left its sockets: a marker stands for them). The
    same probe under --containall (C5) does not: the check can fail."""
    bin_dir = install_fake_apptainer(tmp_path / "bin")
    run_dir = tmp_path / "run"
    token_dir = run_dir / ".ray-auth" / "7-0"
    token_dir.mkdir(parents=True)
    sockets = Path(tempfile.mkdtemp(prefix="beam-probe-", dir=TEMP_ROOT))  # Ray's temp dir: on the node's /tmp
    try:
        (sockets / "raylet").write_text("")
        needed = [str(run_dir), str(token_dir), str(tmp_path / "scratch"), "/dev/shm", str(sockets / "raylet")]
        probe = f"import os, sys; missing = [p for p in {needed!r} if not os.path.exists(p)]; sys.exit(str(missing) if missing else None)"
        for runtime in ("host", "apptainer"):
            cmd = container_command(_site(runtime, tmp_path), [sys.executable, "-c", probe], {"BEAM_RAY_JOB": "r.7.0"},
                                    [str(run_dir)], base={"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path)})
            out = subprocess.run(cmd.argv, env=cmd.env, capture_output=True, text=True, check=False, cwd=run_dir)
            assert out.returncode == 0, (runtime, out.stderr)
            contained = [*cmd.argv[:3], "--containall", *cmd.argv[3:]] if runtime == "apptainer" else None
        out = subprocess.run(contained, env=cmd.env, capture_output=True, text=True, check=False, cwd=run_dir)
        assert out.returncode == 1 and out.stderr.strip() == str([str(sockets / "raylet")]), out.stderr  # binds stay
    finally:
        shutil.rmtree(sockets, ignore_errors=True)


@pytest.mark.parametrize("runtime", ["host", "apptainer"])
def test_other_runtimes_put_nothing_on_srun_and_run_the_node_step_on_the_host(tmp_path, runtime):
    site = _site(runtime, tmp_path)
    assert container.srun_options(site, job_id="42", binds=[str(tmp_path)], workdir=str(tmp_path)) == []
    assert container.node_step_python(site) == sys.executable


def test_under_pyxis_the_node_step_is_in_the_image_and_runs_ray_as_it_is(tmp_path):
    """The seam: the launcher's srun put the node step inside the container, so what it starts
    gets no wrapper, only the job's variables; its interpreter is the image's."""
    site = _site("pyxis", tmp_path, container={"python": "/opt/venv/bin/python"})
    assert container.node_step_python(site) == "/opt/venv/bin/python"
    cmd = container.node_step_command(site, ["python3", "-m", "ray.scripts.scripts", "start"],
                                      {"RAY_AUTH_MODE": "token"}, [str(tmp_path)], base={"PATH": "/bin"})
    assert cmd.argv == ["python3", "-m", "ray.scripts.scripts", "start"]
    assert cmd.env == {"PATH": "/bin", "RAY_AUTH_MODE": "token"}
    apptainer = container.node_step_command(_site("apptainer", tmp_path), ["true"], {}, base={})
    assert apptainer.argv[:3] == ["apptainer", "exec", "--nv"]


def test_a_batch_host_process_under_pyxis_is_a_one_task_srun_step_on_this_node(tmp_path, monkeypatch):
    """Readiness and the driver: srun --overlap in the job (het group 0, its first node: the batch
    host), the same image and mounts, a container name of their own, the job's variables kept
    over the image's (P5: --container-env), and only SLURM_CONF of the job's SLURM_* variables."""
    site = _site("pyxis", tmp_path)
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_HET_SIZE", "2")
    monkeypatch.setenv("SLURM_CONF", "/etc/x/slurm.conf")
    monkeypatch.chdir(tmp_path / "shared")  # a mounted directory: the process starts there, as on the host
    run_dir = str(tmp_path / "run")
    cmd = container_command(site, ["python3", "-m", "beam_hpc.job.readiness"], {"RAY_AUTH_MODE": "token", "B": "1"},
                            [run_dir], base={"PATH": "/bin"})
    cut = cmd.argv.index("python3")
    srun, argv = cmd.argv[:cut], cmd.argv[cut:]
    assert argv == ["python3", "-m", "beam_hpc.job.readiness"]
    unset = srun.index("env")  # pyxis's per-task ranks (P5) are unset inside, before Python starts
    srun, unsets = srun[:unset], srun[unset + 1:]
    assert unsets == [a for n in TASK_RANK_NAMES for a in ("-u", n)]
    done = subprocess.run(["env", *unsets, "sh", "-c", "echo ${RANK-unset}${LOCAL_RANK-unset}"],
                          env={"RANK": "3", "LOCAL_RANK": "1", "PATH": "/usr/bin:/bin"}, capture_output=True, text=True)
    assert done.stdout.strip() == "unsetunset", done
    assert srun[:2] == ["srun", "--overlap"] and {"--jobid=7", "--het-group=0", "--nodes=1", "--ntasks=1",
                                                  "--relative=0"} <= set(srun)
    assert srun[srun.index("--kill-on-bad-exit=1") + 1:] == container.srun_options(
        site, job_id="7", binds=[run_dir], workdir=str(tmp_path / "shared"), env_names=["B", "RAY_AUTH_MODE"],
        name="beam-7-batch")
    assert cmd.env == {"PATH": "/bin", "RAY_AUTH_MODE": "token", "B": "1", "SLURM_CONF": "/etc/x/slurm.conf"}
    monkeypatch.chdir("/")  # not mounted: the caller's first path (the run directory) instead
    outside = container_command(site, ["true"], {}, [run_dir], base={})
    assert f"--container-workdir={run_dir}" in outside.argv


def test_pyxis_outside_a_job_is_refused_with_the_reason(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    with pytest.raises(ContainerError, match="container.runtime: pyxis starts containers through srun, inside a Slurm job"):
        container_command(_site("pyxis", tmp_path), ["true"], {}, [])


def test_srun_help_without_pyxis_options_is_named(tmp_path):
    """What `srun --help` must list: every option beam-hpc passes (as pyxis's table registers them)."""
    with_pyxis = "\n".join(f"      {o}=X   [pyxis] ..." if o != "--no-container-mount-home" else f"      {o}"
                           for o in container.PYXIS_OPTIONS)
    assert container.pyxis_srun_problem("srun options\n" + with_pyxis) is None
    plain = "Usage: srun [OPTIONS(0)...]\n      --overlap   ...\n"
    problem = container.pyxis_srun_problem(plain)
    assert problem.startswith("container.runtime: pyxis") and "--container-image" in problem


def test_image_file_is_a_path_but_not_a_registry_image(tmp_path):
    assert container.image_file(_site("apptainer", tmp_path)) == str(tmp_path / "beam.sif")
    assert container.image_file(_site("pyxis", tmp_path)) == str(tmp_path / "beam.sqsh")
    assert container.image_file(_site("pyxis", tmp_path, image="nvcr.io#nvidia/pytorch:24.01-py3")) is None
    assert container.image_file(_site("host", tmp_path)) is None
