"""Helpers for the reference backend's tests: the tiny assets, runs and bitwise comparison (their
plans: job_plans.make_test_plan with the assets on HOST_SITE).

The tiny model and data are built by the project's own code (``data.tiny`` + ``data.prepare`` +
``tiny_model``), deterministically, and cached under ``$BEAM_TINY_CACHE`` (default
``~/.cache/beam-hpc``) keyed by the source of the modules that make them, so a developer pays the
~90 s warm start once and CI once per machine.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from polling import poll_until

from beam_hpc.files import write_json_atomic
from beam_hpc.node import procs
from beam_hpc.node.ray_node import stop_pids

REPO = Path(__file__).resolve().parents[4]
TINY_RECIPE = REPO / "recipes" / "tiny.yaml"
HEAD_FILE = "head.json"  # a shared LocalRayHead's address, ray start PID and temp dir


@dataclass(frozen=True)
class TinyAssets:
    data_dir: Path
    model_dir: Path


def _source_key() -> str:
    h = hashlib.sha256()
    for mod in ("beam_hpc/backends/reference/model/tiny_model.py", "beam_hpc/data/tiny.py", "beam_hpc/data/prepare.py",
                "beam_hpc/data/convert.py", "beam_hpc/data/sources.py"):
        h.update((REPO / mod).read_bytes())
    return h.hexdigest()[:12]


def build_tiny_assets() -> TinyAssets:
    from beam_hpc.backends.reference.model import tiny_model
    from beam_hpc.data.prepare import prepare
    from beam_hpc.data.tiny import PREPARED_EVAL_NAME, write_tiny_sources

    root = Path(os.environ.get("BEAM_TINY_CACHE", Path.home() / ".cache" / "beam-hpc")) / f"tiny-{_source_key()}"
    data_dir = root / "data"
    if not (data_dir / PREPARED_EVAL_NAME).is_file():
        prepare(data_dir, from_local=write_tiny_sources(root / "src"), progress=False, eval_file=PREPARED_EVAL_NAME)
    eval_texts = {json.loads(line)["prompt"][0]["content"] for line in (data_dir / PREPARED_EVAL_NAME).read_text().splitlines()}
    model_dir = tiny_model.build(root / "model", seed=0, exclude_texts=eval_texts)
    return TinyAssets(data_dir, model_dir)


# Small enough for CI on 2 cores: 4 prompts x 4 responses, 16 new tokens, no evaluation.
SMALL = [
    "batch.prompts=4",
    "batch.responses_per_prompt=4",
    "tokens.max_response=20",
    "reward.overlong_buffer=4",
    "eval.interval=0",
    "eval.samples_per_prompt=2",
]


def run_backend(plan: str | Path, ray_address: str, env: dict[str, str] | None = None, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """Run the backend as the runtime does: its own process, the real entry point."""
    proc = subprocess.run(
        [sys.executable, "-m", "beam_hpc.backends.reference", "--plan", str(plan), "--ray-address", ray_address],
        capture_output=True, text=True, timeout=timeout, env={**os.environ, "RAY_AUTH_MODE": "disabled", **(env or {})},
    )
    if proc.returncode != 0:
        raise AssertionError(f"backend failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


def metrics(run_dir: Path, kind: str) -> list[dict[str, Any]]:
    lines = (run_dir / "dumps" / "metrics.jsonl").read_text().splitlines()
    return [m for m in map(json.loads, lines) if m["kind"] == kind]


def load_checkpoint(it_dir: Path) -> dict[str, Any]:
    import torch

    return {f.name: torch.load(f, weights_only=False) for f in sorted(it_dir.glob("*.pt"))}


def assert_bitwise_equal(a: Any, b: Any, where: str = "") -> int:
    """torch.equal on every tensor of two nested structures (and == on everything else);
    returns how many tensors were compared, so that a test can insist it compared something."""
    import torch

    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), f"tensor differs at {where}"
        return 1
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"keys differ at {where}: {set(a) ^ set(b)}"
        return sum(assert_bitwise_equal(a[k], b[k], f"{where}/{k}") for k in a)
    if isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), f"length differs at {where}"
        return sum(assert_bitwise_equal(x, y, f"{where}[{i}]") for i, (x, y) in enumerate(zip(a, b, strict=False)))
    if type(a).__module__ == "numpy":  # numpy's RNG state holds an array
        import numpy as np

        assert np.array_equal(a, b), f"array differs at {where}"
        return 0
    assert a == b, f"value differs at {where}: {a!r} != {b!r}"
    return 0


def _free_ports(n: int) -> list[int]:
    """``n`` distinct ports free now on the loopback (held open together, so none repeats)."""
    import socket

    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


class LocalRayHead:
    """A real one-node Ray cluster (``ray start --head --block``) carrying both group resources and
    the ``beam-group=local`` label, shared by the tests that run the backend against an existing
    cluster (the runtime's way), so that each run does not pay for a new cluster. Stopped by
    signalling its ``ray start`` process, never with ``ray stop``.

    ``share``: a key that every pytest-xdist worker of one run has (``PYTEST_XDIST_TESTRUNUID``).
    The workers then use one head: the first to need it starts it, each holds a lease file (its
    PID) while it may use it, and the last to leave stops it. A head costs about 3 CPU-s to start
    and 1.3 CPU-s a minute to keep, idle (its raylet, GCS, agents and log monitor), so one per
    worker cost about 40 CPU-s of a suite run on two cores for nothing."""

    def __init__(self, share: str | None = None) -> None:
        self.share = share
        self.lab = Path(f"/tmp/rbs-{hashlib.sha256(share.encode()).hexdigest()[:12]}") if share else None
        self.temp_dir = Path()
        self.proc: subprocess.Popen[bytes] | None = None
        self.address = ""

    def __enter__(self) -> str:
        if self.lab is None:
            return self._start()
        with self._locked() as head:
            (self.lab / "leases" / str(os.getpid())).touch()
            if head is not None and procs.running(head["pid"]):
                self.address, self.temp_dir = head["address"], Path(head["temp_dir"])
                return self.address
            address = self._start()
            assert self.proc is not None
            write_json_atomic(self.lab / HEAD_FILE, {"address": address, "pid": self.proc.pid,
                                                      "temp_dir": str(self.temp_dir)})
            return address

    def __exit__(self, *exc: object) -> None:
        if self.lab is None:
            assert self.proc is not None
            self._stop(self.proc.pid, self.temp_dir)
            return
        with self._locked() as head:
            (self.lab / "leases" / str(os.getpid())).unlink(missing_ok=True)
            if any(procs.running(int(p.name)) for p in (self.lab / "leases").iterdir() if p.name.isdigit()):
                return
            if head is not None:
                self._stop(head["pid"], head["temp_dir"])
            (self.lab / HEAD_FILE).unlink(missing_ok=True)
        shutil.rmtree(self.lab, ignore_errors=True)  # the last one out: nothing of the run stays in /tmp

    @contextlib.contextmanager
    def _locked(self) -> Iterator[dict[str, Any] | None]:
        """The shared head's record (None: none started yet), under the lab's lock."""
        import fcntl

        assert self.lab is not None
        (self.lab / "leases").mkdir(mode=0o700, parents=True, exist_ok=True)
        with open(self.lab / ".lock", "w") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            record = self.lab / HEAD_FILE
            yield json.loads(record.read_text()) if record.exists() else None

    def _start(self) -> str:
        import socket
        import tempfile

        from beam_hpc.node.ray_node import ray_cli_argv

        self.temp_dir = Path(tempfile.mkdtemp(prefix="rbt", dir="/tmp"))  # short: socket paths < 107 bytes
        # every port Ray would otherwise take at a fixed default (the dashboard's 8265, whose process
        # starts even with --include-dashboard=false, the dashboard agent's 52365, the metrics
        # export's): free ones, as the product pins its own per job (beam_hpc.node.ray_node), so that
        # two pytest sessions on one machine each start a head
        port, *agent_ports = _free_ports(6)
        self.address = f"127.0.0.1:{port}"
        # as the product's nodes (beam_hpc.node.ray_node): no idle workers started for the first
        # driver, no drain on SIGTERM (the autoscaler's monitor stays: `ray status` reads its report)
        env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_prestart_worker_first_driver": "false",
               "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}
        argv = [
            *ray_cli_argv(sys.executable, "start", "--head", "--block"),
            "--node-ip-address=127.0.0.1", f"--port={port}", "--num-cpus=2", "--num-gpus=0",
            f"--resources={json.dumps({'beam_trainer': 1000, 'beam_rollout': 1000})}",
            "--labels=beam-group=local", f"--temp-dir={self.temp_dir}", "--include-dashboard=false",
            # 200 MB for each of three workers' runs at once: less and a shared head spills objects
            "--disable-usage-stats", "--object-store-memory=600000000",
            *(f"--{kind}={p}" for kind, p in zip(("dashboard-port", "dashboard-agent-grpc-port", "dashboard-agent-listen-port",
                                                  "runtime-env-agent-port", "metrics-export-port"), agent_ports,
                                                 strict=True)),
        ]
        self.proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        def ready() -> bool:  # when the GCS reports our resources
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"ray start exited with {self.proc.returncode}")
            # `ray status` is a Python process that imports Ray: seconds of CPU on 2 busy cores,
            # taken from the starting cluster. Ask it only once the GCS port accepts connections.
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
            except OSError:
                return False
            st = subprocess.run(ray_cli_argv(sys.executable, "status", f"--address={self.address}"),
                                capture_output=True, text=True, env=env)
            return "beam_trainer" in st.stdout

        if poll_until(ready, 180, 1.5):  # each `ray status` is about 0.3 CPU-s: ask seldom
            return self.address
        self._stop(self.proc.pid, self.temp_dir)
        raise RuntimeError("local Ray head did not become ready in 180 s")

    def _stop(self, pid: int, temp_dir: Path | str) -> None:
        """Stop a head by its ``ray start`` PID (SIGTERM, SIGKILL after 60 s), whichever worker
        started it; reap it if it is this process's child; remove its temp dir."""
        stop_pids([pid], grace_s=60)
        if self.proc is not None and self.proc.pid == pid:
            self.proc.wait()
        shutil.rmtree(temp_dir, ignore_errors=True)


# Measured on this 2-core machine (seeded and bitwise reproducible on one CPU type), 20 rollouts
# of recipes/tiny.yaml (rollouts in units of 4 prompts): eval accuracy 0.442 -> 0.567 (async) and
# 0.442 -> 0.558 (in turn and colocated, which compute the same thing); training accuracy over the
# first vs last 5 rollouts 0.44 -> 0.54 (async) and 0.43 -> 0.53 (in turn). Margins leave room for
# nothing but learning.
EVAL_MARGIN = 0.05
TRAIN_MARGIN = 0.08


def assert_learned(run_dir: Path, eval_tag: str) -> None:
    """The embedded default's 20 rollouts learned: the eval accuracy after them is above the eval
    before training, and the training accuracy and reward of the last 5 rollouts beat the first 5.
    (Used on the async run that ``beam-hpc execute`` makes and on the in-turn run.)"""
    from beam_hpc.run import metric_names as names

    evals = {m["rollout_id"]: m[eval_tag] for m in metrics(run_dir, "eval")}
    assert sorted(evals) == [0, 5, 10, 15, 20]
    assert evals[20] >= evals[0] + EVAL_MARGIN, evals
    rollouts = metrics(run_dir, "rollout")
    correct = [m[names.ROLLOUT_CORRECT] for m in rollouts]
    assert len(correct) == 20 and sum(correct[-5:]) / 5 >= sum(correct[:5]) / 5 + TRAIN_MARGIN, correct
    reward = [m[names.ROLLOUT_REWARD] for m in rollouts]
    assert sum(reward[-5:]) > sum(reward[:5]), reward
