"""`ray start` through beam-hpc's LEAN_RAY_CLI waits for a slow raylet as long as the job says.

Ray 2.60's `ray start` gives its raylet a constant 30 s to register with the GCS and ignores
RAY_raylet_start_wait_time_s, which beam-hpc sets (``beam_hpc.node.ray_node.ray_env``); on a loaded
host a node then fails ("The current node timed out during startup") and the node step starts Ray
again from scratch. Real Ray here: two heads start side by side, and each one's raylet is stopped
(SIGSTOP) as soon as it exists and resumed 40 s later, a registration slower than Ray's 30 s. The
head given a 180 s wait comes up; the one left at Ray's 30 s fails as Ray does (the negative
control: if a Ray release honours the variable itself, it fails and says so).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from beam_hpc.node.ray_node import LEAN_RAY_CLI

pytestmark = [pytest.mark.slow, pytest.mark.ray]

STALL_S = 40.0  # over Ray's constant 30 s


def _free_port(ip: str) -> int:
    with socket.socket() as s:
        s.bind((ip, 0))
        return s.getsockname()[1]


def _raylet(proc: subprocess.Popen) -> psutil.Process | None:
    """The raylet that ``proc`` (a `ray start`) started, once it runs as itself."""
    try:
        children = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        return None
    for child in children:
        try:
            if child.name() == "raylet":
                return child
        except psutil.Error:
            pass
    return None


def _start_head(ip: str, base: Path, wait_s: str | None) -> subprocess.Popen:
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}
    env.pop("RAY_raylet_start_wait_time_s", None)
    if wait_s is not None:
        env["RAY_raylet_start_wait_time_s"] = wait_s
    argv = [sys.executable, "-c", LEAN_RAY_CLI, "start", "--block", "--head", f"--port={_free_port(ip)}",
            f"--node-ip-address={ip}", "--include-dashboard=false", "--no-monitor", "--num-cpus=1",
            "--object-store-memory=78643200", "--disable-usage-stats", f"--temp-dir={base / ip.rsplit('.', 1)[1]}"]
    return subprocess.Popen(argv, env=env, start_new_session=True, stdout=open(base / f"{ip}.log", "wb"),
                            stderr=subprocess.STDOUT)


def test_a_raylet_slower_than_rays_30_s_joins_within_the_jobs_wait() -> None:
    base = Path(tempfile.mkdtemp(prefix="rsw", dir="/tmp"))  # short: Ray's socket paths
    ips = {"waits": "127.0.0.94", "ray's 30 s": "127.0.0.95"}
    heads = {"waits": _start_head(ips["waits"], base, "180"), "ray's 30 s": _start_head(ips["ray's 30 s"], base, None)}
    logs = {name: base / f"{ip}.log" for name, ip in ips.items()}
    try:
        stopped: dict[str, psutil.Process] = {}
        deadline = time.monotonic() + 120
        while len(stopped) < len(heads):  # stop each raylet as soon as it runs, before it registers
            assert time.monotonic() < deadline, f"no raylet started: {sorted(base.glob('*.log'))}"
            for name, proc in heads.items():
                raylet = None if name in stopped else _raylet(proc)
                if raylet is not None:
                    try:
                        raylet.send_signal(signal.SIGSTOP)
                        stopped[name] = raylet
                    except psutil.Error:
                        pass  # replaced by its exec: found again on the next pass
            time.sleep(0.01)
        time.sleep(STALL_S)
        for raylet in stopped.values():
            try:
                raylet.send_signal(signal.SIGCONT)
            except psutil.Error:
                pass  # its `ray start` gave up and killed it
        deadline = time.monotonic() + 120
        while not (heads["ray's 30 s"].poll() is not None and "Ray runtime started" in logs["waits"].read_text()):
            assert heads["waits"].poll() is None, logs["waits"].read_text()[-3000:]
            assert time.monotonic() < deadline, {n: p.read_text()[-1500:] for n, p in logs.items()}
            time.sleep(0.3)
        assert heads["ray's 30 s"].returncode != 0
        assert "timed out during startup" in logs["ray's 30 s"].read_text()
        assert heads["waits"].poll() is None  # up, and blocking as `ray start --block` does
    finally:
        for proc in heads.values():
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=30)
        shutil.rmtree(base, ignore_errors=True)
