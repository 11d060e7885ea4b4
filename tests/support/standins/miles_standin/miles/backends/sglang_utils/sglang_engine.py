"""Contract double of ``miles/backends/sglang_utils/sglang_engine.py`` (radixark/miles@31f1ca961), tests only.

Miles's ``SGLangEngine`` is the Ray actor that owns one SGLang server process. What this double
keeps of it (written from the facts of Miles's module, not copied):

- the constructor takes ``(args, rank, base_gpu_id, num_gpus_per_engine)`` and the server group makes
  it a Ray actor of 0.2 GPU / 0.2 CPU on one placement-group bundle (``server_group.py:86-134``);
- ``init`` starts the server as a child process of the actor (Miles: ``launch_server_process``, a
  ``multiprocessing.Process`` running SGLang's ``launch_server``) and waits until ``/health_generate``
  answers 200, raising if the process dies first (``_wait_server_healthy``); the seed is
  ``args.seed + rank`` (``_compute_server_args``, ``random_seed``);
- ``health_generate(timeout)`` is one ``GET /health_generate`` with that timeout, raising on any
  failure (the health monitor's probe);
- ``shutdown`` kills the server's process tree (``kill_process_tree``); Miles also removes the
  worker from its router first, which here is the driver's own list of engines (standin_driver).

The server itself is the SGLang stand-in (``tests/support/standins/sglang_standin``), started as
``python -m sglang.launch_server`` with that directory on ``PYTHONPATH``, where the image has SGLang.
It is started with ``PR_SET_PDEATHSIG`` so that it never outlives the actor (a killed actor, a
stopped Ray), as Miles's child process dies with its actor's process tree.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

SGLANG_STANDIN = Path(__file__).resolve().parents[4] / "sglang_standin"
START_TIMEOUT_S = 120.0  # Miles waits without a limit while the process lives; a bound keeps a broken test short
PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL("libc.so.6", use_errno=True)  # loaded here: the forked child only makes the call


def _die_with_parent() -> None:
    _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class SGLangEngine:
    """One rollout engine: an SGLang server process owned by this (Ray actor) object."""

    def __init__(self, args: Any, rank: int, base_gpu_id: int, num_gpus_per_engine: int) -> None:
        self.args, self.rank, self.base_gpu_id = args, rank, base_gpu_id
        self.num_gpus_per_engine = num_gpus_per_engine
        self.process: subprocess.Popen | None = None
        self.url = ""

    def init(self) -> dict[str, Any]:
        """Start the server on this node and wait until it is healthy; where it runs, for the record."""
        import ray

        host = ray.util.get_node_ip_address()
        port = _free_port(host)
        argv = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(self.args.hf_checkpoint or "model"),
                "--host", host, "--port", str(port), "--tp-size", str(self.num_gpus_per_engine),
                "--base-gpu-id", str(self.base_gpu_id), "--random-seed", str(self.args.seed + self.rank)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SGLANG_STANDIN), os.environ.get("PYTHONPATH", "")])}
        self.process = subprocess.Popen(argv, env=env, preexec_fn=_die_with_parent)  # noqa: PLW1509 - prctl only
        self.url = f"http://{host}:{port}"
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                self.health_generate(timeout=2.0)
                break
            except OSError:
                pass
            if self.process.poll() is not None:
                raise RuntimeError("Server process terminated unexpectedly.")  # Miles's message
            if time.monotonic() > deadline:
                raise RuntimeError(f"SGLang server at {self.url} not healthy after {START_TIMEOUT_S:.0f} s")
            time.sleep(0.2)
        return {"url": self.url, "pid": self.process.pid, "node": host, "base_gpu_id": self.base_gpu_id,
                "gpus": ray.get_gpu_ids()}

    def health_generate(self, timeout: float = 5.0) -> bool:
        """``GET /health_generate``; any failure (refused, timed out, not 200) raises."""
        with urllib.request.urlopen(f"{self.url}/health_generate", timeout=timeout) as response:
            if response.status != 200:
                raise OSError(f"/health_generate answered {response.status}")
        return True

    def shutdown(self) -> None:
        """Kill the server (its process tree: the stand-in has no children)."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)
