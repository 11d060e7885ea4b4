"""The pyxis runtime on the real local Slurm cluster, through the pyxis stand-in.

pyxis and enroot cannot run here; Slurm's SPANK interface can. The cluster loads
tests/support/standins/spank/pyxis_standin.c (its plugstack.conf): it registers pyxis's srun options,
refuses malformed ones as pyxis does, and does to each task what pyxis and enroot do to its mount
namespace and environment (a fresh /tmp per container, named containers joined while they run, the
image's variables over the job's except --container-env's, RANK/LOCAL_RANK for PyTorch images), on
the host's own filesystem; it writes what each task got to ``<LAB>/pyxis/<job>.<step>.<node>.<task>.json``.

- The tiny recipe runs to completion under ``container.runtime: pyxis``, its image a PyTorch one
  that sets RAY_AUTH_MODE=disabled: the driver in the batch host's container reaches the head node's
  raylet through Ray's sockets under /tmp (before the host's /tmp was mounted into every container,
  readiness failed with "Failed to connect to socket at address:/tmp/beam-.../sockets/raylet" and
  the run ended node-failure twice). Every node step ran in the job's container, the batch host's
  processes in their own, and inside the batch steps the job's variables have the job's values
  (the image's only where --container-env does not keep them). In the same test, the same recipe
  under Apptainer (tests/support/standins/fake_apptainer.py, Apptainer's default binds; a smoke
  run: Ray on every node and a driver) has, inside every `ray start` and batch-host process, the
  run directory, the token, the scratch, /dev/shm and /tmp.
- A submission to a pyxis site whose srun lacks pyxis's options (the cluster's config with an
  empty plugstack.conf) exits 2 naming container.runtime, before anything is written.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import yaml
from fake_apptainer import install_fake_apptainer
from run_watch import diagnostics, segments, wait_for
from slurm_cluster import image_files

from beam_hpc.cli.app import main
from beam_hpc.node.container import pyxis_srun_problem
from beam_hpc.node.ray_node import LEAN_RAY_CLI
from beam_hpc.slurm.client import srun_help

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.slurm, pytest.mark.ray]
TIMEOUT_S = 600.0


def site_file(tmp: Path, name: str, container: dict, **extra: object) -> Path:
    """env/local.yaml with another container section (and ``extra`` fields)."""
    data = yaml.safe_load((REPO / "env" / "local.yaml").read_text())
    data.update(name=name, container=container, **extra)
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def submit_args(site: Path, run: Path, assets) -> list[str]:  # type: ignore[no-untyped-def]
    from reference_harness import SMALL

    args = ["submit", str(REPO / "recipes" / "tiny.yaml"), "--site", str(site), "--output-dir", str(run),
            "--via", "sbatch"]
    for item in (f"model.path={assets.model_dir}", f"data.dir={assets.data_dir}", "num_rollout=2", *SMALL):
        args += ["--set", item]
    return args


def submitted_job(out: str) -> str:
    return out.split("submitted job ")[1].split()[0]


# A PyTorch image's environment (NGC images set PYTORCH_VERSION), with a Ray setting of its own: the
# stand-in reads NAME=VALUE lines of the image file as the image's ENV.
IMAGE_ENV = {"PYTORCH_VERSION": "2.5.0", "RAY_AUTH_MODE": "disabled", "BEAM_IMAGE_ONLY": "from-image"}


def test_tiny_recipe_runs_under_pyxis_and_every_container_sees_what_ray_needs(  # type: ignore[no-untyped-def]
        tmp_path: Path, tiny_assets, slurm_cluster, capsys, monkeypatch) -> None:
    assert pyxis_srun_problem(srun_help()) is None, "the pyxis stand-in is not loaded (see slurm_cluster.py)"
    image = tmp_path / "beam.sqsh"  # the stand-in reads only its ENV lines; submit checks it exists
    image.write_text("hsqs stand-in\n" + "".join(f"{k}={v}\n" for k, v in IMAGE_ENV.items()))
    sif = tmp_path / "beam.sif"
    sif.write_text("stand-in image")
    shared, ro_data = tmp_path / "shared", tmp_path / "ro-data"  # a shared path; an extra bind, read-only
    shared.mkdir()
    ro_data.mkdir()
    paths = {"shared_paths": [str(shared)]}
    binds = [f"{ro_data}:/data:ro"]
    pyxis_site = site_file(tmp_path, "pyxis-local", {"runtime": "pyxis", "image": str(image), "binds": binds,
                                                     "python": sys.executable}, **paths)
    app_site = site_file(tmp_path, "apptainer-local", {"runtime": "apptainer", "image": str(sif), "binds": binds,
                                                        "python": sys.executable}, **paths)
    recorded = tmp_path / "apptainer-records"
    recorded.mkdir()
    bin_dir = install_fake_apptainer(tmp_path / "bin")
    runs = {"pyxis": tmp_path / "run-pyxis", "apptainer": tmp_path / "run-apptainer"}
    scratch = yaml.safe_load((REPO / "env" / "local.yaml").read_text())["scratch"]
    needed = [str(runs["apptainer"]), str(runs["apptainer"] / ".ray-auth"), scratch, str(shared), "/dev/shm", "/tmp"]
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")  # sbatch exports it to the job
    monkeypatch.setenv("FAKE_APPTAINER_RECORD", str(recorded))
    monkeypatch.setenv("FAKE_APPTAINER_PROBE", os.pathsep.join(needed))

    jobs = {}
    # the whole tiny recipe under pyxis; beside it, Apptainer's view from a smoke run (Ray up, a driver)
    for name, site, extra in (("pyxis", pyxis_site, []), ("apptainer", app_site, ["--smoke"])):
        assert main(submit_args(site, runs[name], tiny_assets) + extra) == 0
        jobs[name] = submitted_job(capsys.readouterr().out)
    for job in jobs.values():
        slurm_cluster.wait_for_job(job, timeout=TIMEOUT_S)
    run = runs["pyxis"]
    wait_for("the pyxis run's ledger end line", lambda: segments(run) and "end" in segments(run)[-1], run, 30)
    assert [s["end"]["reason"] for s in segments(run)] == ["completed"], diagnostics(run)
    assert json.loads((runs["apptainer"] / "smoke.json").read_text())["ok"], diagnostics(runs["apptainer"])

    leader = jobs["pyxis"]
    records = [json.loads(p.read_text()) for p in slurm_cluster.pyxis_records.glob("*.json")]
    mine = [r for r in records if r["name"] in (f"beam-{leader}", f"beam-{leader}-batch")]
    steps = [r for r in mine if "beam_hpc.node.step" in r["argv"]]
    batch = [r for r in mine if "beam_hpc.node.step" not in r["argv"]]
    # a bring-up retried under load starts the node steps again as a later step of each component:
    # the run's nodes are those of the last one
    last = {}
    for r in steps:
        last[r["job_id"]] = max(last.get(r["job_id"], -1), r["step_id"])
    steps = [r for r in steps if r["step_id"] == last[r["job_id"]]]
    plan = json.loads((run / "plan.json").read_text())
    want_nodes = sum(g["nodes"] for g in plan["groups"])
    assert len(steps) == want_nodes and len({r["node"] for r in steps}) == want_nodes, steps
    rt = json.loads(next(run.glob("logs/*/runtime.json")).read_text())  # the one (completed) segment's
    for r in mine:  # each its own fresh container, whose /tmp is the node's (Ray's sockets), all else mounted
        assert r["image"] == str(image) and r["mount_home"] == 0 and not r["joined"], r
        assert r["mounts"][0] == "/tmp:/tmp" and r["unmounted"] == [f"{ro_data}:/data:ro"], r
        assert r["environ"]["RANK"] == "0" and r["environ"]["BEAM_IMAGE_ONLY"] == "from-image", r  # pyxis's rules
    for r in steps:  # in the job's container, Ray started as it is; the image's RAY_AUTH_MODE wins here
        assert r["name"] == f"beam-{leader}" and r["workdir"] == str(run) and r["env"] == [], r
        assert r["argv"][0] == sys.executable and "apptainer" not in r["argv"], r
        assert r["environ"]["RAY_AUTH_MODE"] == "disabled", r  # the node step sets token for Ray itself
    # the batch host's processes: readiness and the driver, on the head node, with the job's values
    # kept over the image's inside the task, and pyxis's per-task ranks unset before Python starts
    modules = {a for r in batch for a in r["argv"] if a.startswith("beam_hpc.")}
    assert {"beam_hpc.job.readiness", "beam_hpc.backends.reference"} <= modules, batch
    head = next(r["node"] for r in steps if "trainer" in r["argv"])
    for r in batch:
        assert r["node"] == head, r
        assert r["environ"]["RAY_AUTH_MODE"] == "token", r
        assert r["environ"]["RAY_AUTH_TOKEN_PATH"] == rt["token_path"], r
        assert r["environ"]["BEAM_RAY_ADDRESS"] == f"{rt['head_ip']}:{rt['gcs_port']}", r
        python = r["argv"].index(sys.executable)
        assert r["argv"][0] == "env" and {"RANK", "LOCAL_RANK"} <= set(r["argv"][1:python]), r

    # the same recipe under Apptainer: inside every `ray start`, readiness poller and driver, the paths
    app = [json.loads(p.read_text()) for p in recorded.glob("*.json")]
    ray_starts = [a for a in app if a["argv"][:4] == [sys.executable, "-c", LEAN_RAY_CLI, "start"]]
    assert len(ray_starts) == want_nodes and len(app) > want_nodes, app
    for a in app:
        assert a["seen"] == dict.fromkeys(needed, True), a


def test_submit_refuses_a_pyxis_site_when_srun_lacks_its_options(tmp_path: Path, tiny_assets, slurm_cluster,  # type: ignore[no-untyped-def]
                                                                 capsys, monkeypatch) -> None:
    """The cluster's own configuration, with no SPANK plugin: srun --help lists no --container-*."""
    etc = tmp_path / "etc"
    shutil.copytree(slurm_cluster.conf.parent, etc)
    (etc / "plugstack.conf").write_text("")
    conf = (etc / "slurm.conf").read_text().replace(str(slurm_cluster.conf.parent / "plugstack.conf"),
                                                    str(etc / "plugstack.conf"))
    (etc / "slurm.conf").write_text(conf)
    monkeypatch.setenv("SLURM_CONF", str(etc / "slurm.conf"))
    image = tmp_path / "beam.sqsh"
    image.write_bytes(b"hsqs stand-in")
    site = site_file(tmp_path, "pyxis-local", {"runtime": "pyxis", "image": str(image), "python": sys.executable})
    run = tmp_path / "run"
    assert main(submit_args(site, run, tiny_assets)) == 2
    err = capsys.readouterr().err
    assert "container.runtime: pyxis" in err and "--container-image" in err and "Traceback" not in err, err
    assert not run.exists()  # nothing written: no plan.json, no script, no job


ENROOT_STANDIN = """#!/bin/sh
# enroot's documented `enroot version` (NVIDIA/enroot doc/cmd/version.md): prints the version
[ "$1" = version ] && echo 3.5.0 && exit 0
exit 1
"""


def test_doctor_checks_pyxis_on_the_login_node_and_enroot_on_each_node(  # type: ignore[no-untyped-def]
        tmp_path: Path, slurm_cluster, capsys, monkeypatch) -> None:
    """`doctor --in-job` for a pyxis site: srun takes every pyxis option (the stand-in), the squashfs
    is there, and each node is asked for enroot: missing on PATH fails with the fix, present passes."""
    image = tmp_path / "beam.sqsh"
    image.write_bytes(b"hsqs stand-in")
    site = site_file(tmp_path, "pyxis-local", {"runtime": "pyxis", "image": str(image), "python": sys.executable},
                     python=sys.executable)
    args = ["doctor", "--site", str(site), "--in-job", "--nodes", "2", "--output-dir", str(tmp_path / "runs"),
            "--wait", "120", "--json"]
    bare = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if not Path(p, "enroot").exists())
    monkeypatch.setenv("PATH", bare)
    assert main(args) == 1
    checks = json.loads(capsys.readouterr().out)
    by = {(c["where"], c["name"]): c for c in checks}
    assert by[("login", "pyxis")]["status"] == "pass" and by[("login", "image")]["status"] == "pass", checks
    enroot = [c for c in checks if c["name"] == "enroot"]
    assert len(enroot) == 2 and {c["status"] for c in enroot} == {"fail"}, enroot
    assert "install enroot on the compute nodes" in enroot[0]["fix"]

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "enroot").write_text(ENROOT_STANDIN)
    (bin_dir / "enroot").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{bare}")  # srun passes PATH to the tasks
    assert main(args) == 0
    enroot = [c for c in json.loads(capsys.readouterr().out) if c["name"] == "enroot"]
    assert len(enroot) == 2 and {c["status"] for c in enroot} == {"pass"} and "3.5.0" in enroot[0]["detail"], enroot


JOIN_SCRIPT = """#!/bin/sh
# one node, four steps of the container pyxis_demo (the stand-in's records name what each saw)
srun --ntasks=1 --container-image={image} --container-name=demo --container-mounts={mnt}:/tmp/in-demo \\
    --container-env=KEEP sh -c 'touch /tmp/made-inside; echo up > {out}/first; sleep 6' &
while [ ! -e {out}/first ]; do sleep 0.2; done
srun --overlap --ntasks=1 --container-name=demo --container-mounts={mnt}:/tmp/other \\
    sh -c 'ls -A /tmp > {out}/joined'
srun --overlap --ntasks=1 --container-name=demo:no_exec sh -c 'ls -A /tmp > {out}/no_exec'
wait
srun --ntasks=1 --container-name=demo sh -c 'ls -A /tmp > {out}/restarted'
srun --ntasks=1 --container-name=demo:exec true || echo refused > {out}/exec
"""


def test_the_stand_in_joins_a_running_named_container_and_gives_a_stopped_one_a_fresh_tmp(  # type: ignore[no-untyped-def]
        tmp_path: Path, slurm_cluster, monkeypatch, request) -> None:
    """What the stand-in does, as pyxis_slurmstepd.c does it: a step naming a running container joins it
    (sees what the first step made in its /tmp, and its own --container-mounts are ignored); no_exec
    and a container that runs nothing any more start with a fresh /tmp; exec refuses a stopped one.
    The image's variables win except --container-env's, and a PyTorch image gets RANK per task."""
    image = tmp_path / "img.sqsh"
    image.write_text("hsqs stand-in\nPYTORCH_VERSION=2.5.0\nKEEP=image\nFROM_IMAGE=yes\n")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    out = Path(tempfile.mkdtemp(prefix="beam-join-", dir="/var/tmp"))  # outside /tmp: every container sees it
    request.addfinalizer(lambda: shutil.rmtree(out, ignore_errors=True))
    script = tmp_path / "join.sh"
    script.write_text(JOIN_SCRIPT.format(image=image, mnt=mnt, out=out))
    monkeypatch.setenv("KEEP", "job")
    job = slurm_cluster.run("sbatch", "--parsable", "--nodes=1", "--ntasks=2",
                            f"--output={tmp_path / 'job.log'}", str(script)).stdout.strip().split(";")[0]
    # five steps, each a container start; 120 s was not enough on a loaded 2-core host (a whole run)
    slurm_cluster.wait_for_job(job, timeout=300)
    log = (tmp_path / "job.log").read_text() if (tmp_path / "job.log").exists() else ""
    # the entries that stand for the image's own files (a checkout or venv under /tmp) are in every
    # container's /tmp, as the image's root filesystem would be: not what a step made there
    image_tops = {Path(f).parts[2] for f in image_files() if Path(f).parts[1:2] == ("tmp",) and len(Path(f).parts) > 2}
    seen = {p.name: [e for e in p.read_text().split() if e not in image_tops] for p in out.iterdir()}
    assert seen.get("joined") == ["in-demo", "made-inside"], (seen, log)  # its own mount ignored
    assert seen.get("no_exec") == [] and seen.get("restarted") == [] and seen.get("exec") == ["refused"], (seen, log)
    records = sorted((json.loads(p.read_text()) for p in slurm_cluster.pyxis_records.glob(f"{job}.*.json")),
                     key=lambda r: r["step_id"])
    assert [r["joined"] for r in records] == [False, True, False, False], records
    first = records[0]["environ"]
    assert first["KEEP"] == "job" and first["FROM_IMAGE"] == "yes" and first["RANK"] == "0", first
    assert records[1]["environ"]["KEEP"] == "image", records[1]  # not listed in --container-env there
