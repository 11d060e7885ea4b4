"""beam_hpc.job.runner.run_local: the same job code with no Slurm (what `beam-hpc execute` runs), on the
host and through the Apptainer seam (the stand-in binary of tests/support/standins/fake_apptainer.py, whose image
sets RAY_AUTH_MODE=disabled: only the job's forced environment can turn token auth back on), and
the readiness deadline with one node whose `ray start` hangs; warm JIT caches and the node-local
image copy across two segments (through the stand-in), each node with a local disk of its own."""

from __future__ import annotations

import json
import os
import stat
import sys
import tarfile
from glob import glob
from pathlib import Path

import pytest
from fake_apptainer import install_fake_apptainer
from job_plans import make_test_plan
from polling import gone

from beam_hpc.fault_hooks import HANG_RAY_START_VAR
from beam_hpc.job.runner import run_local, smoke_driver_argv
from beam_hpc.node import procs
from beam_hpc.node.image import sha256_file
from beam_hpc.node.ray_node import tagged_pids

# The node step of a local run as it would start on a node with its own local disk: the site's
# scratch path is the same on every node, the disk behind it is not. The nodes of a local run share
# this host, so each node step gets a mount namespace of its own (root, as the local Slurm cluster's
# per-node UTS namespaces need) with the scratch path bound to that node's directory, chosen by the
# step's --node-ip. It then execs the real node step; nothing else changes.
NODE_WITH_OWN_SCRATCH = r"""#!/bin/sh
ip=; prev=
for a in "$@"; do [ "$prev" = --node-ip ] && ip=$a; prev=$a; done
[ -n "$ip" ] || {{ echo "node-local scratch stand-in: no --node-ip in $*" >&2; exit 2; }}
mkdir -p "{disks}/$ip"
exec unshare --mount --propagation private sh -c 'mount --bind "$1" "$2" && shift 2 && exec "$@"' \
    sh "{disks}/$ip" "{scratch}" "{python}" "$@"
"""


def start_nodes_with_own_scratch(monkeypatch: pytest.MonkeyPatch, bin_dir: Path, scratch: Path, disks: Path) -> None:
    """Every node step run_local starts from now on (it starts them as ``sys.executable -m
    beam_hpc.node.step``) sees ``disks/<node ip>`` at ``scratch``."""
    wrapper = bin_dir / "node-with-own-scratch"
    wrapper.write_text(NODE_WITH_OWN_SCRATCH.format(disks=disks, scratch=scratch, python=sys.executable))
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setattr(sys, "executable", str(wrapper))


def holding_files_under(prefix: str) -> list[tuple[int, list[str]]]:
    """Processes with a file open whose path starts with ``prefix``, and their command lines."""
    found = []
    for pid in procs.pids():
        if any(t.startswith(prefix) for t in procs.open_files(pid).values()):
            found.append((pid, procs.cmdline(pid)))
    return found


@pytest.mark.ray
@pytest.mark.slow
def test_run_local_brings_up_both_groups_places_work_and_cleans_up(tmp_path):
    """On the host; the Apptainer case is test_jit_cache_and_image_copy_carry_over_to_another_node."""
    plan = make_test_plan(tmp_path / "run", trainer_nodes=1, rollout_nodes=1, gpus=1, local_run=True)
    outcome = run_local(plan, driver_argv=smoke_driver_argv(plan), ready_timeout_s=300)
    assert outcome.status == "completed", outcome.message
    assert outcome.ready_s and outcome.ready_s > 0 and outcome.teardown_s is not None
    smoke = json.loads(Path(plan.output_dir, "smoke.json").read_text())
    assert smoke["ok"]
    by_role = {t["role"]: t["ip"] for t in smoke["tasks"]}
    assert by_role == {"trainer": "127.0.0.10", "rollout": "127.0.0.11"}  # loopback node per group
    assert {t["ray_auth_mode"] for t in smoke["tasks"]} == {"token"}
    # Ray makes its temp dir 0777; every node's lies in a directory only the job's user can enter
    assert {(t["ray_temp_parent_mode"], Path(t["ray_temp_dir"]).name) for t in smoke["tasks"]} == {("0o700", "r")}
    job_id = f"l{os.getpid()}"
    assert gone(lambda: tagged_pids(f"{plan.run_id}.{job_id}.0")) == []
    # Ray's agents too: they rename themselves (ray::DashboardAgent), which can hide the job's tag, and
    # an agent that outlives its raylet lingers for a minute or two before it notices; by their
    # open log files under the job's Ray temp dirs (deleted or not), within seconds of the end
    assert gone(lambda: holding_files_under(f"/tmp/beam-{job_id}.0-"), timeout=10) == []
    assert gone(lambda: glob(f"/tmp/beam-{job_id}.0-*")) == []
    assert not Path(plan.output_dir, ".ray-auth").exists()
    saved = json.loads(Path(outcome.segment_dir, "outcome.json").read_text())
    assert saved["status"] == "completed" and saved["ready_s"] == outcome.ready_s


@pytest.mark.ray
@pytest.mark.slow
def test_a_node_whose_ray_start_hangs_is_named_at_the_readiness_deadline(tmp_path, monkeypatch):
    """The rollout node's `ray start` never starts Ray (ray_node's test-only hang hook, set for node
    index 1 only); the trainer head comes up for real. At the short deadline the job ends not-ready,
    naming the rollout node, its state and its log, and leaves nothing running."""
    monkeypatch.setenv(HANG_RAY_START_VAR, "1")
    plan = make_test_plan(tmp_path / "run", trainer_nodes=1, rollout_nodes=1, gpus=1, local_run=True)
    # The deadline must leave the trainer's head time to take a driver (the message counts its node):
    # 10 s did not, once, on a quiet 2-core machine (the session's first Ray start, cold caches).
    outcome = run_local(plan, driver_argv=smoke_driver_argv(plan), ready_timeout_s=25)
    assert outcome.status == "not-ready", outcome.message
    seg = Path(outcome.segment_dir)
    assert "Ray cluster not ready by its deadline" in outcome.message
    assert "trainer: 1/1 nodes, 1/1 GPUs; rollout: 0/1 nodes, 0/1 GPUs" in outcome.message
    assert (f"never joined: rollout node 0 (local-rollout-0, 127.0.0.11: state running; log "
            f"{seg / 'node-rollout-0.log'})") in outcome.message
    assert "hung ray start" in (seg / "node-rollout-0.log").read_text()
    # the node to leave out next time (beam_hpc.lifecycle.exclusions): the one that never joined
    assert [f["node"] for f in outcome.failed_nodes] == ["local-rollout-0"]
    assert "did not join in time" in outcome.failed_nodes[0]["why"]
    assert "hung ray start" not in (seg / "node-trainer-0.log").read_text()
    hung_pid = json.loads((seg / "nodes" / "rollout-0.json").read_text())["ray_pid"]
    assert not gone(lambda: procs.running(hung_pid))
    job_id = f"l{os.getpid()}"
    assert gone(lambda: tagged_pids(f"{plan.run_id}.{job_id}.0")) == []
    assert gone(lambda: glob(f"/tmp/beam-{job_id}.0-*")) == []
    assert not Path(plan.output_dir, ".ray-auth").exists()


@pytest.mark.ray
@pytest.mark.slow
def test_jit_cache_and_image_copy_carry_over_to_another_node(tmp_path, monkeypatch):
    """Two segments of one run, two nodes in the group, through the Apptainer stand-in with the
    image staged to local scratch. Segment 1: a Ray task on node 0 writes a kernel into its Triton
    cache (as Triton does on a miss). Segment 2: the task on node 1, which never compiled it, finds
    it in its own node-local cache, seeded from the group's archive; every task ran the node-local
    copy of the image, and segment 2 reused the copies segment 1 made. It is also the Apptainer
    case of the bring-up test above: the image sets RAY_AUTH_MODE=disabled, and only the job's
    forced environment turns token auth back on inside the container; nothing is left running.
    Each node has its own scratch disk (start_nodes_with_own_scratch): each stages and verifies its
    own copy of the image, and keeps its own cache."""
    from beam_hpc.node.image import write_checksum

    if os.geteuid() != 0:
        pytest.skip("a node-local disk per node needs a mount namespace per node step (root)")

    bin_dir = install_fake_apptainer(tmp_path / "bin")
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    image = tmp_path / "shared" / "beam.sif"
    image.parent.mkdir()
    image.write_text("stand-in image")
    digest = write_checksum(image)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    site = {"container": {"runtime": "apptainer", "image": str(image), "python": sys.executable,
                          "stage_to_local": True}, "scratch": str(scratch)}
    plan = make_test_plan(tmp_path / "run", trainer_nodes=2, rollout_nodes=0, gpus=1, site=site, local_run=True)
    driver = [sys.executable, str(Path(__file__).resolve().parents[2] / "tests" / "support" / "programs" / "jit_cache_driver.py"), "--ray-address", "{ray_address}"]
    n0, n1 = "127.0.0.10", "127.0.0.11"
    disks = tmp_path / "node-disks"  # what each node has at `scratch`: disks/<its ip>
    start_nodes_with_own_scratch(monkeypatch, bin_dir, scratch, disks)

    def on_node(ip: str, path: str | Path) -> Path:
        """A path under the site's scratch, on the disk of node ``ip``."""
        return disks / ip / Path(path).relative_to(scratch)

    first = run_local(plan, driver_argv=[*driver, "--write-on", n0, "--out", str(tmp_path / "seg1.json")],
                      ready_timeout_s=300)
    assert first.status == "completed", first.message
    seg1 = json.loads((tmp_path / "seg1.json").read_text())
    kernel = "9a1f3c/matmul_kernel.cubin"
    assert seg1[n0]["triton_files"] == [kernel] and seg1[n1]["triton_files"] == []
    staged = scratch / "beam-images" / f"beam-{digest[:12]}.sif"
    for ip in (n0, n1):
        env = seg1[ip]["env"]
        assert env["FAKE_APPTAINER_IMAGE"] == str(staged)  # the container ran the node-local copy
        assert all((env[v] or "").startswith(f"{scratch}/beam-jit/{plan.run_id}/trainer/") for v in env if v != "FAKE_APPTAINER_IMAGE")
    assert seg1[n0]["env"]["TRITON_CACHE_DIR"] != seg1[n1]["env"]["TRITON_CACHE_DIR"]  # a disk per node
    # each node staged the image to its own disk: copied there, checked against the image's sha256
    # (the copy and its .verified record), and nothing reached the scratch path outside the nodes
    reports1 = {i: json.loads(Path(first.segment_dir, "nodes", f"trainer-{i}.json").read_text()) for i in (0, 1)}
    assert [(r["image"], r["image_copied"]) for r in reports1.values()] == [(str(staged), True)] * 2
    for ip in (n0, n1):
        copy = on_node(ip, staged)
        assert sha256_file(copy) == digest and copy.read_text() == "stand-in image", ip
        st = copy.stat()
        assert copy.with_name(f".{copy.name}.verified").read_text().split() == [digest, str(st.st_size),
                                                                                str(st.st_mtime_ns)], ip
    assert list(scratch.iterdir()) == []
    assert {seg1[ip]["ray_auth_mode"] for ip in (n0, n1)} == {"token"}
    with tarfile.open(plan.paths.jit_cache_archive("trainer")) as tar:
        assert [m.name for m in tar if m.isfile()] == [f"triton/{kernel}"]

    second = run_local(plan, driver_argv=[*driver, "--out", str(tmp_path / "seg2.json")], ready_timeout_s=300)
    assert second.status == "completed", second.message
    seg2 = json.loads((tmp_path / "seg2.json").read_text())
    assert seg2[n1]["triton_files"] == [kernel]  # node 1 never compiled it: seeded from the archive
    assert on_node(n1, Path(seg2[n1]["env"]["TRITON_CACHE_DIR"], kernel)).read_bytes() == b"\x7fELF kernel"
    reports = {i: json.loads(Path(second.segment_dir, "nodes", f"trainer-{i}.json").read_text()) for i in (0, 1)}
    assert (reports[1]["jit_seeded"], reports[0]["jit_kept"]) == (1, 1)
    assert [(r["image"], r["image_copied"]) for r in reports.values()] == [(str(staged), False)] * 2
    job_id = f"l{os.getpid()}"
    assert gone(lambda: tagged_pids(f"{plan.run_id}.{job_id}.0")) == []
    assert gone(lambda: glob(f"/tmp/beam-{job_id}.0-*")) == []
    assert not Path(plan.output_dir, ".ray-auth").exists()
