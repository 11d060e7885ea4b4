"""beam_hpc.node.nvme on real filesystems, and the node step's NVMe cleanup on SIGTERM and after SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from job_plans import make_test_plan
from polling import poll_until

from beam_hpc.node import nvme
from beam_hpc.node.ray_node import ClusterRuntime, loopback_ip

ROOT = Path(__file__).resolve().parents[2]


def test_tmpfs_target_is_refused_before_anything_is_created():
    if nvme.mount_of("/dev/shm").fstype != "tmpfs":
        pytest.skip("/dev/shm is not tmpfs here")
    target = Path(f"/dev/shm/beam-nvme-test-{os.getpid()}/run/7")
    with pytest.raises(nvme.NvmeError) as err:
        nvme.stage(target, segment="7-0", min_free_bytes=0, node="n9")
    assert "node n9" in str(err.value) and "tmpfs" in str(err.value) and str(target) in str(err.value)
    assert not target.parent.parent.exists()


def test_mount_table_parsing_picks_the_innermost_and_last_mount(tmp_path):
    table = tmp_path / "mounts"
    absent = tmp_path / "not-created" / "scratch"  # a fixture path, never the host's own /scratch
    table.write_text(
        "/dev/vda / ext4 rw 0 0\n"
        f"tmpfs {absent} tmpfs rw 0 0\n"
        f"/dev/nvme0n1 {absent} xfs rw 0 0\n"  # mounted over the tmpfs: this one counts
        f"overlay {absent}/my\\040dir overlay rw 0 0\n"
    )
    # nothing exists there: the path is judged by its nearest existing ancestor (tmp_path, on "/")
    assert nvme.mount_of(absent / "beam" / "run", str(table)) == nvme.Mount("/", "ext4")
    scratch_like = tmp_path / "scratch"
    (scratch_like / "my dir").mkdir(parents=True)
    table.write_text(f"/dev/vda / ext4 rw 0 0\n/dev/nvme0n1 {scratch_like} xfs rw 0 0\n"
                     f"overlay {str(scratch_like).replace(' ', chr(92) + '040')}/my\\040dir overlay rw 0 0\n")
    assert nvme.mount_of(scratch_like / "beam", str(table)).fstype == "xfs"
    assert nvme.mount_of(scratch_like / "my dir" / "x", str(table)).fstype == "overlay"


def test_impossible_free_space_requirement_names_node_path_free_and_needed(tmp_path):
    target = tmp_path / "nvme" / "runid" / "7"
    with pytest.raises(nvme.NvmeError) as err:
        nvme.stage(target, segment="7-0", min_free_bytes=10**18, node="n2")
    msg = str(err.value)
    assert "node n2" in msg and str(target) in msg and "1000000000000000000 bytes" in msg
    free = int(msg.split(" has ")[1].split(" bytes free")[0])
    assert 0 < free < 10**18
    assert not target.exists() and not target.parent.exists()


def test_stale_dirs_of_the_run_are_purged_and_a_segments_own_dir_is_shared(tmp_path):
    run_root = tmp_path / "nvme" / "runid"
    old_job = run_root / "5"
    requeued = run_root / "7"
    for d, seg in ((old_job, "5-0"), (requeued, "7-0")):
        d.mkdir(parents=True)
        (d / nvme.MARKER).write_text(seg)
        (d / "rank00000.bin").write_bytes(b"x" * 1024)
    staged = nvme.stage(requeued, segment="7-1", min_free_bytes=1, node="n1")
    assert sorted(staged.purged) == [old_job, requeued]
    assert not old_job.exists() and requeued.is_dir() and not (requeued / "rank00000.bin").exists()
    (requeued / "state.bin").write_bytes(b"y")
    again = nvme.stage(requeued, segment="7-1", min_free_bytes=1, node="n2")  # a second node, same host
    assert again.purged == [] and (requeued / "state.bin").exists()
    stale_handle = nvme.StagedDir(requeued, "7-0", staged.mount, 0)
    assert stale_handle.remove() is False and requeued.exists()  # an old segment never removes a newer one's
    assert staged.remove() is True and not requeued.exists() and not run_root.exists()


def test_staged_dir_is_removed_when_the_body_fails(tmp_path):
    target = tmp_path / "nvme" / "runid" / "9"
    with pytest.raises(SystemExit):
        with nvme.staged(target, segment="9-0", min_free_bytes=1, node="n1"):
            assert target.is_dir()
            raise SystemExit(143)  # what a SIGTERM handler does
    assert not target.exists()


# -- the real node step -----------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _runtime(plan, job_id: str, seg_dir: Path, port: int) -> ClusterRuntime:
    rt = ClusterRuntime(job_id=job_id, job_num=int(job_id), restart=0, job_tag=f"{plan.run_id}.{job_id}.0",
                        head_ip=loopback_ip(0), gcs_port=port, host_stride=16,
                        token_path=str(seg_dir / "token"), segment_dir=str(seg_dir), nonce=f"nonce{job_id}",
                        deadline=time.time() + 120, nodelists={"trainer": ["n1", "n2"], "rollout": ["n3"]})
    rt.write()
    return rt


def _start_worker(plan, rt: ClusterRuntime) -> subprocess.Popen:
    """Trainer node 1 (a worker): it stages NVMe, then waits for a head that never comes."""
    argv = [sys.executable, "-m", "beam_hpc.node.step", "--plan", plan.paths.plan, "--group", "trainer",
            "--runtime", str(rt.path), "--nonce", rt.nonce, "--node-index", "1",
            "--node-ip", loopback_ip(1), "--gpus", "2", "--cpus", "1"]
    return subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _wait_for_state(rt: ClusterRuntime, state: str, timeout: float = 60) -> dict:
    path = rt.node_report("trainer", 1)

    def report() -> dict | None:
        try:
            got = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        return got if got.get("state") == state else None

    found = poll_until(report, timeout, 0.1)
    assert found is not None, f"node step never reached state {state!r}: {path}"
    return found


@pytest.mark.slow
def test_node_step_cleans_nvme_on_sigterm_and_the_next_segment_purges_after_sigkill(tmp_path):
    nvme_root = tmp_path / "nvme"
    plan = make_test_plan(tmp_path / "run", trainer_nodes=2, rollout_nodes=1, nvme=(str(nvme_root), 0.001),
                          local_run=True)
    port = _free_port()
    rt1 = _runtime(plan, "101", tmp_path / "seg101", port)
    first = _start_worker(plan, rt1)
    try:
        report = _wait_for_state(rt1, "staged")
        killed_dir = Path(report["nvme_dir"])
        assert killed_dir == nvme_root / plan.run_id / "101" and killed_dir.is_dir()
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=10)
    finally:
        first.kill()
    assert killed_dir.is_dir(), "SIGKILL cannot be caught: the directory stays behind"

    rt2 = _runtime(plan, "102", tmp_path / "seg102", port)
    second = _start_worker(plan, rt2)
    try:
        report = _wait_for_state(rt2, "staged")
        assert report["nvme_purged"] == [str(killed_dir)]
        assert not killed_dir.exists()
        own = Path(report["nvme_dir"])
        assert own.is_dir()
        second.send_signal(signal.SIGTERM)
        assert second.wait(timeout=20) == 0
    finally:
        second.kill()
    assert _wait_for_state(rt2, "stopped", timeout=5)["reason"] == "SIGTERM"
    assert not own.exists() and not (nvme_root / plan.run_id).exists()
