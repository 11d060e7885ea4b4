"""`beam-hpc doctor`: passes on the local Slurm cluster, and fails with the fix when one thing is
broken on purpose (a partition that does not exist, scratch on the tmpfs /dev/shm).

The --in-job half runs for real: srun starts `python -m beam_hpc.node.checks` on two nodes of the
local cluster, which read the login side's canary and answer with their checks. The TmpDisk check
reads the cluster's real TmpDisk (10 nodes 3,000,000 MB, 2 nodes 100,000 MB); the answers the local
cluster cannot give (TmpDisk unset everywhere) are judged as data by the same function.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest
import yaml

from beam_hpc.cli.app import main
from beam_hpc.node.checks import node_checks
from beam_hpc.observe import doctor
from beam_hpc.plan.local_disk import TmpDisk
from beam_hpc.slurm.client import gres_counts
from beam_hpc.submission.submit import build_recipe, build_site

ROOT = Path(__file__).resolve().parents[2]
LOCAL_SITE = ROOT / "env" / "local.yaml"


def _local_site_with(tmp_path: Path, **changes: object) -> Path:
    data = yaml.safe_load(LOCAL_SITE.read_text())
    data.update(changes)
    path = tmp_path / "site.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.slow
@pytest.mark.slurm
def test_doctor_passes_on_the_local_cluster(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    site = _local_site_with(tmp_path, replacement_partition="spot")  # the local site, and a backfill partition
    rc = main(["doctor", "--site", str(site), "--in-job", "--nodes", "2", "--output-dir",
               str(tmp_path / "runs"), "--wait", "120", "--json"])
    checks = json.loads(capsys.readouterr().out)
    assert rc == 0, [c for c in checks if c["status"] == "fail"]
    by_where: dict[str, set[str]] = {}
    for c in checks:
        by_where.setdefault(c["where"], set()).add(c["name"])
    nodes = [w for w in by_where if w != "login"]
    assert len(nodes) == 2 and all(w.startswith("n") for w in nodes)
    for node in nodes:  # every node ran every node check, and each passed
        assert by_where[node] == {"shared-fs canary", "scratch", "/dev/shm", "gpus", "ray ports"}
        assert all(c["status"] == "pass" for c in checks if c["where"] == node)
    assert {"slurm commands", "slurm controller", "partition debug", "gres gpu on debug", "python",
            "tmp disk debug"} <= by_where["login"]
    spot = next(c for c in checks if c["name"] == "replacement partition spot")
    assert spot["status"] == "pass" and "replaced there first" in spot["detail"], spot
    tmp = next(c for c in checks if c["name"] == "tmp disk debug")  # what the cluster's slurm.conf declares
    assert tmp["status"] == "pass" and tmp["detail"].startswith(
        "TmpDisk 3000000 MB (2929G) on 10 node(s), 100000 MB (97G) on 2 node(s)"), tmp
    # the run dir's "usually node-local" warning was settled by the canary
    assert next(c for c in checks if c["name"].startswith("shared "))["status"] == "pass"
    assert not list((tmp_path / "runs").glob(".beam-doctor-*"))  # canary cleaned up


@pytest.mark.slow
@pytest.mark.slurm
def test_doctor_names_the_fix_for_a_missing_partition_and_tmpfs_scratch(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    site = _local_site_with(tmp_path, partitions={"trainer": "debug", "rollout": "nosuch"},
                        scratch="/dev/shm/beam-scratch", replacement_partition="backfil")
    assert main(["doctor", "--site", str(site), "--in-job", "--output-dir", str(tmp_path), "--wait", "120"]) == 1
    out = capsys.readouterr().out
    assert "FAIL partition nosuch (login): fix: set partitions.rollout in the site to one of: debug, spot, urgent" in out
    assert ("FAIL replacement partition backfil (login): fix: set replacement_partition in the site to one of: "
            "debug, spot, urgent, or leave it out") in out
    assert "scratch" in out and "/dev/shm/beam-scratch is on tmpfs" in out
    assert "fix: set scratch in the site to a node-local disk" in out
    assert "SKIP    login  nodes of nosuch" in out  # no srun into a partition known not to exist
    assert "3 check(s) failed" in out


def test_node_checks_refuse_tmpfs_scratch_and_a_too_small_shm(tmp_path: Path) -> None:
    """The node half on this machine, without Slurm: the checks that need no allocation to fail."""
    base = yaml.safe_load(LOCAL_SITE.read_text())
    base.update(python="python3", scratch="/dev/shm/x", gpus_per_node=0,
                ray={"gcs_port_base": 21000, "port_span": 1000, "object_store_gb": 10_000})
    site = build_site(str(_local_site_with(tmp_path, **base)))
    checks = {c.name: c for c in node_checks(site, scratch_gb=1)}
    assert checks["scratch"].status == "fail" and "tmpfs" in checks["scratch"].detail
    assert checks["/dev/shm"].status == "fail" and "ray.object_store_gb" in checks["/dev/shm"].fix
    assert checks["gpus"].status == "skip" and checks["shared-fs canary"].status == "skip"
    ok = build_site(str(_local_site_with(tmp_path, scratch=str(tmp_path / "scratch"), gpus_per_node=0)))
    scratch = {c.name: c for c in node_checks(ok, scratch_gb=1e9)}["scratch"]
    assert scratch.status == "fail" and "need 1e+09 GB" in scratch.detail


def test_gres_parser() -> None:
    assert gres_counts("gpu:2\ngpu:h200:8(S:0-1),shard:4\n(null)", "gpu") == [2, 8]
    assert gres_counts("shard:4", "gpu") == []


def test_tmp_disk_verdict_says_why_there_is_no_tmp_and_refuses_a_disk_too_small() -> None:
    """The same decision as submit's (beam_hpc.plan.local_disk), on the answers a real cluster gives."""
    site = build_site(str(LOCAL_SITE))
    dedicated = build_recipe(ROOT / "recipes" / "dedicated.yaml")  # 8 trainer nodes, 2,000 GB each
    unset = doctor.tmp_disk_verdict(site, dedicated, TmpDisk("gpu", (0,) * 12))  # TmpDisk never configured
    assert unset.status == "warn" and "declare no TmpDisk" in unset.detail and "leaves --tmp out" in unset.detail
    assert "NVMe check still refuses" in unset.detail and "TmpDisk for the nodes (slurm.conf)" in unset.fix
    small = doctor.tmp_disk_verdict(site, dedicated, TmpDisk("gpu", (100_000,) * 12))
    assert small.status == "fail" and small.name == "tmp disk gpu"
    assert "needs --tmp=1863G (1907712 MB)" in small.detail and "no node of partition gpu" in small.detail
    assert "largest 100000 MB (97G)" in small.detail and "tmp: none" in small.fix
    few = doctor.tmp_disk_verdict(site, dedicated, TmpDisk("gpu", (3_000_000,) * 7 + (0,) * 5))
    assert few.status == "fail" and "only 7 of the 12 nodes" in few.detail and "8 trainer node(s)" in few.detail
    fits = doctor.tmp_disk_verdict(site, dedicated, TmpDisk("gpu", (3_000_000,) * 8 + (0,) * 4))
    assert fits.status == "pass" and "--tmp=1863G" in fits.detail and "8 of the 12 nodes" in fits.detail
    bare = doctor.tmp_disk_verdict(site, None, TmpDisk("gpu", (3_000_000,)))  # no recipe, no site tmp
    assert bare.status == "pass" and "--recipe" in bare.detail
    off = site.model_copy(update={"tmp": "none"})
    assert doctor.tmp_disk_check(off, dedicated).status == "skip"  # asks Slurm nothing


def test_doctor_without_slurm_on_path_fails_with_the_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty PATH: a login node without Slurm's module
    site = build_site(str(LOCAL_SITE))
    checks = doctor.run_doctor(site, in_job=True)
    first = checks[0]
    assert first.name == "slurm commands" and first.status == "fail" and "PATH" in first.fix
    assert checks[-1].name == "nodes" and checks[-1].status == "skip" and doctor.failed(checks)
    assert doctor.format_checks(checks).endswith("1 check(s) failed")


def test_ports_check_names_a_port_that_is_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    from beam_hpc.node.ray_node import LOOPBACK_MAX_NODES, ray_ports

    for var in ("SLURM_JOB_ID", "SLURM_NODEID"):
        monkeypatch.delenv(var, raising=False)
    site = build_site(str(LOCAL_SITE))
    gcs = ray_ports(site.ray, 0, 0, LOOPBACK_MAX_NODES).gcs
    with socket.socket() as holder:
        holder.bind(("127.0.0.10", gcs))
        holder.listen()
        check = {c.name: c for c in node_checks(site)}["ray ports"]
    assert check.status == "fail" and f"{gcs} (gcs" in check.detail and "ray.gcs_port_base" in check.fix
    assert {c.name: c for c in node_checks(site)}["ray ports"].status == "pass"


def test_doctor_says_where_the_wandb_key_comes_from_in_a_container_without_home(
        tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """pyxis without container.mount_home starts the containers with --no-container-mount-home: a
    ~/.netrc on the login node is not there. doctor fails that for a recipe logging to W&B online
    (warns without a recipe) and passes WANDB_API_KEY in the environment, a netrc on a mounted
    path (NETRC), or home mounted."""
    home = Path(tempfile.mkdtemp(prefix="beam-home-", dir="/var/tmp"))  # not below /tmp: that is mounted
    request.addfinalizer(lambda: shutil.rmtree(home, ignore_errors=True))
    (home / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password k" + "0" * 39 + "\n")
    image = tmp_path / "beam.sqsh"
    image.write_text("hsqs")

    def site(**container: object) -> object:
        return build_site(_local_site_with(tmp_path, container={"runtime": "pyxis", "image": str(image), **container}))

    recipe = build_recipe(ROOT / "recipes" / "tiny.yaml", overrides=["tracking.wandb.project=p"])
    netrc_only = {"HOME": str(home)}
    [hidden] = doctor.wandb_key_checks(site(), recipe, netrc_only)
    assert hidden.status == "fail" and "--no-container-mount-home" in hidden.detail, hidden
    assert str(home / ".netrc") in hidden.detail and "WANDB_API_KEY" in hidden.fix and "NETRC" in hidden.fix
    assert doctor.wandb_key_checks(site(), None, netrc_only)[0].status == "warn"
    assert doctor.wandb_key_checks(site(mount_home=True), recipe, netrc_only)[0].status == "pass"
    [by_env] = doctor.wandb_key_checks(site(), recipe, {"HOME": str(tmp_path), "WANDB_API_KEY": "k"})
    assert by_env.status == "pass" and "environment" in by_env.detail
    mounted = tmp_path / "shared" / "netrc"  # a path the containers mount (a site bind)
    mounted.parent.mkdir()
    mounted.write_text((home / ".netrc").read_text())
    on_mount = site(binds=[str(mounted.parent)])
    assert doctor.wandb_key_checks(on_mount, recipe, {"HOME": str(home), "NETRC": str(mounted)})[0].status == "pass"
    assert doctor.wandb_key_checks(site(), recipe.model_copy(update={"tracking": type(recipe.tracking)()}),
                                   netrc_only) == []  # no W&B: nothing to say
