"""The tests' fault hooks (beam_hpc.fault_hooks) off and on: each does nothing without its variable;
the bad-node file is claimed by the first node only; the hang stops at its allowed count. (The
hooks at work on real jobs: test_job_local, test_lifecycle_slurm, test_lifecycle_stall.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from beam_hpc import fault_hooks


def test_without_their_variables_the_hooks_do_nothing(monkeypatch, tmp_path: Path) -> None:
    for var in (fault_hooks.BAD_NODE_FILE_VAR, fault_hooks.HANG_RAY_START_VAR, fault_hooks.HANG_AFTER_ROLLOUT_VAR):
        monkeypatch.delenv(var, raising=False)
    fault_hooks.check_bad_node("n1")
    assert not fault_hooks.hangs_ray_start(0)
    fault_hooks.hang_after_rollout(1, tmp_path / "logs", str(tmp_path / "seg"))  # returns
    assert list(tmp_path.iterdir()) == []


def test_the_first_node_claims_the_bad_node_file_and_only_it_fails(monkeypatch, tmp_path: Path) -> None:
    claim = tmp_path / "claim"
    monkeypatch.setenv(fault_hooks.BAD_NODE_FILE_VAR, str(claim))
    with pytest.raises(fault_hooks.InjectedFault, match="node n3 is the bad node"):
        fault_hooks.check_bad_node("n3")
    fault_hooks.check_bad_node("n4")  # another node: fine
    with pytest.raises(fault_hooks.InjectedFault):
        fault_hooks.check_bad_node("n3")  # the same node again, in a later segment
    assert claim.read_text() == "n3" and sorted(p.name for p in tmp_path.iterdir()) == ["claim"]


def test_ray_start_hangs_on_the_listed_nodes(monkeypatch) -> None:
    monkeypatch.setenv(fault_hooks.HANG_RAY_START_VAR, "1,3")
    assert [i for i in range(5) if fault_hooks.hangs_ray_start(i)] == [1, 3]


def test_the_driver_hangs_after_its_rollout_until_the_count_is_reached(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    seg = logs / "7-0"
    seg.mkdir(parents=True)
    env = {**os.environ, fault_hooks.HANG_AFTER_ROLLOUT_VAR: "2"}
    code = f"from beam_hpc import fault_hooks; fault_hooks.hang_after_rollout(2, {str(logs)!r}, {str(seg)!r})"
    hung = subprocess.Popen([sys.executable, "-c", code], env=env, stderr=subprocess.PIPE, text=True)
    try:
        assert hung.stderr is not None and "hanging after rollout 2 (test hook)" in hung.stderr.readline()
        assert hung.poll() is None  # and stays
    finally:
        hung.kill()
        hung.wait()
    marker = json.loads((seg / fault_hooks.HANG_MARKER_FILE).read_text())
    assert marker["rollout"] == 2 and fault_hooks.hang_markers(logs) == [seg / fault_hooks.HANG_MARKER_FILE]
    # allowed once (the default): the next segment finishes rollout 2 and goes on
    assert subprocess.run([sys.executable, "-c", code.replace("7-0", "8-0")], env=env, timeout=60).returncode == 0
