"""The pyxis runtime on the real local Slurm cluster, through the pyxis stand-in.

pyxis and enroot cannot run here; Slurm's SPANK interface can. The cluster loads
tests/support/standins/spank/pyxis_standin.c (its plugstack.conf): it registers pyxis's srun options with
pyxis's argument forms, refuses malformed ones as pyxis does, and writes what each task received
to ``<LAB>/pyxis/<job>.<step>.<node>.<task>.json``; it runs the task WITHOUT a container, which is
where the seam under test ends. So these tests prove that Slurm takes every option beam-hpc
passes, and what each step gets; not that enroot would start the image.

- The tiny recipe runs to completion under ``container.runtime: pyxis``: every node step (each
  node of both groups) got the image, the mounts, the job's container name, the run directory as
  its working directory and no home; the batch host's processes (readiness, driver) got the same
  image and mounts in a container of their own name, with the job's variables kept over the
  image's (--container-env). In the same test, the same recipe under Apptainer (the stand-in
  binary, tests/support/standins/fake_apptainer.py; a smoke run: Ray on every node and a driver) binds
  exactly those paths around each `ray start`, and around its readiness poller and driver.
- A submission to a pyxis site whose srun lacks pyxis's options (the cluster's config with an
  empty plugstack.conf) exits 2 naming container.runtime, before anything is written.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import yaml
from fake_apptainer import install_fake_apptainer
from run_watch import diagnostics, segments, wait_for

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


def mount_set(entries: list[str], run: Path) -> frozenset[tuple[str, str, str]]:
    """(source, target, options) of each mount, the run directory written as <run>: pyxis's
    SRC:DST[:FLAGS] (flags joined by +) and Apptainer's src[:dst[:opts]] read alike."""
    out = set()
    for e in entries:
        src, _, rest = e.replace(str(run), "<run>").partition(":")
        dst, _, opts = rest.partition(":")
        out.add((src, dst or src, opts.replace("+", ",")))
    return frozenset(out)


def test_tiny_recipe_runs_under_pyxis_and_each_step_gets_what_apptainer_binds(  # type: ignore[no-untyped-def]
        tmp_path: Path, tiny_assets, slurm_cluster, capsys, monkeypatch) -> None:
    assert pyxis_srun_problem(srun_help()) is None, "the pyxis stand-in is not loaded (see slurm_cluster.py)"
    image = tmp_path / "beam.sqsh"  # the stand-in never opens it: submit checks it exists
    image.write_bytes(b"hsqs stand-in")
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
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")  # sbatch exports it to the job
    monkeypatch.setenv("FAKE_APPTAINER_RECORD", str(recorded))

    runs = {"pyxis": tmp_path / "run-pyxis", "apptainer": tmp_path / "run-apptainer"}
    jobs = {}
    # the whole tiny recipe under pyxis; beside it, Apptainer's binds from a smoke run (Ray up, a driver)
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
    # a bring-up retried under load starts the node steps again as a later step of each component:
    # the run's nodes are those of the last one
    last = {}
    for r in steps:
        last[r["job_id"]] = max(last.get(r["job_id"], -1), r["step_id"])
    steps = [r for r in steps if r["step_id"] == last[r["job_id"]]]
    batch = [r for r in mine if "beam_hpc.node.step" not in r["argv"]]
    # every node of both groups ran its node step inside the job's container, with no apptainer inside
    plan = json.loads((runs["pyxis"] / "plan.json").read_text())
    want_nodes = sum(g["nodes"] for g in plan["groups"])
    assert len(steps) == want_nodes and len({r["node"] for r in steps}) == want_nodes, steps
    for r in steps:
        assert r["image"] == str(image) and r["name"] == f"beam-{leader}", r
        assert r["workdir"] == str(runs["pyxis"]) and r["mount_home"] == 0 and r["env"] == [], r
        assert r["argv"][0] == sys.executable and "apptainer" not in r["argv"], r
    # the batch host's processes: readiness and the driver, in the batch container on the head node
    modules = {a for r in batch for a in r["argv"] if a.startswith("beam_hpc.")}
    assert {"beam_hpc.job.readiness", "beam_hpc.backends.reference"} <= modules, batch
    head = next(r["node"] for r in steps if "trainer" in r["argv"])
    for r in batch:
        assert r["image"] == str(image) and r["node"] == head and r["mount_home"] == 0, r
        assert {"RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH", "BEAM_RAY_ADDRESS"} <= set(r["env"]), r

    # the same recipe under Apptainer: what it binds around `ray start`, the driver and readiness
    app = [json.loads(p.read_text()) for p in recorded.glob("*.json")]
    ray_starts = [a for a in app if a["argv"][:4] == [sys.executable, "-c", LEAN_RAY_CLI, "start"]]
    assert len(ray_starts) == want_nodes, app
    app_batch = [a for a in app if a not in ray_starts]
    assert {mount_set(r["mounts"], runs["pyxis"]) for r in steps} == \
        {mount_set(a["binds"], runs["apptainer"]) for a in ray_starts}
    assert {mount_set(r["mounts"], runs["pyxis"]) for r in batch} == \
        {mount_set(a["binds"], runs["apptainer"]) for a in app_batch}
    expected = {("<run>", "<run>", ""), (str(shared), str(shared), ""), (str(ro_data), "/data", "ro"), ("/dev/shm", "/dev/shm", "")}
    assert expected <= mount_set(steps[0]["mounts"], runs["pyxis"])  # the run directory, the site's paths, Ray's shm


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
