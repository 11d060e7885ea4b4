"""benchmarks/two_gpu.py end to end on CPU with its tiny config: every mode and transport runs.

On CPU the trainer and rollout actors are two processes and ``nccl`` runs as gloo, so this drives
the same loops, actors and weight-sync calls that the two-GPU run uses (a smoke test: the numbers
themselves mean nothing here). It joins the shared local Ray head (``reference_ray``) to save a
cluster start; on the device it starts a private one with the same resources.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.slow
@pytest.mark.ray
def test_tiny_cpu_run_measures_every_mode_and_writes_the_table(tmp_path: Path, reference_ray: str) -> None:
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONUNBUFFERED": "1"}
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "two_gpu.py"), "--device", "cpu", "--tiny", "--out-dir", str(tmp_path),
         "--machine", "smoke", "--ray-address", reference_ray],
        capture_output=True, text=True, env=env, timeout=180, cwd=tmp_path,
    )
    took = time.monotonic() - t0
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    tables = list(tmp_path.glob("two_gpu-*-smoke.md"))
    assert len(tables) == 1, sorted(p.name for p in tmp_path.iterdir())
    text = tables[0].read_text()
    assert "failed:" not in text and "not run" not in text, text
    raw = json.loads(tables[0].with_suffix(".json").read_text())

    rows = {r["mode"]: r for r in raw["rows"]}
    assert set(rows) == {"in-turn", "async", "colocated"}
    for mode, row in rows.items():
        assert len(row["steps"]) == 2, mode
        for st in row["steps"]:
            assert st["step_s"] > 0 and st["gen_s"] > 0 and st["train_s"] > 0 and st["sync_s"] > 0, (mode, st)
            if mode != "async":  # in turn the parts add up (async overlaps them, by design)
                assert st["step_s"] >= (st["gen_s"] + st["train_s"]) * 0.9, (mode, st)
    assert "policy lag 1" in rows["async"]["note"] and "gloo" in rows["async"]["note"]

    sync = {w["transport"]: w for w in raw["sync"]}
    assert set(sync) == {"object_store", "nccl (gloo)", "same-device copy"}
    tiny_bytes = sync["same-device copy"]["nbytes"]
    assert tiny_bytes > 100_000  # the tiny Qwen2 in fp32
    for w in sync.values():
        assert w["nbytes"] == tiny_bytes and len(w["times_s"]) >= 2 and min(w["times_s"]) > 0, w
    for mode in ("in-turn", "async", "colocated"):
        assert f"| {mode} |" in text
    assert took < 90, f"the smoke run took {took:.0f} s (about 20 s expected on 2 cores)"
