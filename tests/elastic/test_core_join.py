"""An outside worker joins a running reference run, serves part of its rollouts and leaves in the
middle of a unit (stopped with SIGTERM, or killed with SIGKILL as a lost node is, without a word),
and the run ends bitwise equal to the same run without it; and the negative control: a worker that
serves one policy version behind changes the final weights, so the comparison can fail.

Real processes throughout: the backend as the runtime starts it (on the session's real Ray head),
and ``python -m beam_hpc.backends.reference.rollouts.outside_worker`` as its own process, found through the run's rendezvous
file. The only hook is ``BEAM_TEST_SLOW_UNITS`` (beam_hpc.fault_hooks): the outside worker's units
from rollout 8 on take seconds, so the signal lands inside one. The stale worker is the real worker
with its policy loading shifted by one version (STALE_WORKER).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest
from job_plans import HOST_SITE, make_test_plan
from polling import poll_until
from reference_harness import SMALL, assert_bitwise_equal, load_checkpoint, metrics, run_backend

from beam_hpc.backends.reference.rollouts import policy_store, unit_service
from beam_hpc.fault_hooks import SLOW_ROLLOUT_VAR, SLOW_UNITS_VAR

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.e2e]

N = 12
LEAVE_AT = 8
BASE = [*SMALL, f"num_rollout={N}", f"checkpoint.interval={N}", "training.async_training=false",
        "backend_options.unit_prompts=1"]
WORKER = "outside-1"


def _plan(run_dir: Path, assets, overrides: list[str]) -> Path:
    return Path(make_test_plan(run_dir, assets=assets, overrides=overrides, site=HOST_SITE).paths.plan)


def _rollouts_done(run_dir: Path) -> int:
    f = run_dir / "dumps" / "metrics.jsonl"
    if not f.is_file():
        return 0
    return sum(1 for line in f.read_text().splitlines() if json.loads(line)["kind"] == "rollout")


def _samples(run_dir: Path, k: int) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "dumps" / "rollout" / f"rollout_{k:07d}.jsonl").read_text().splitlines()]


def _checkpoint(run_dir: Path) -> dict:
    return load_checkpoint(run_dir / "checkpoints" / f"iter_{N - 1:07d}")


ASYNC_N, ASYNC_LEAVE_AT = 10, 8
ASYNC_BASE = [*SMALL, f"num_rollout={ASYNC_N}", f"checkpoint.interval={ASYNC_N}", "backend_options.unit_prompts=1"]
# The negative control's worker: the real one (outside_worker.main), changed in one place. Asked for
# policy version k, it computes with the weights of k-1 whenever it has held k-1, and its result still
# says k (a unit's version label is the unit's own, echoed back; nothing in a result shows which
# weights made it). Each substitution is printed, so that the test can tell the lie was told.
STALE_WORKER = """
import sys
from beam_hpc.backends.reference.rollouts import outside_worker, policy_store
verified, held = policy_store.load_verified, {}
def one_behind(run_dir, version):
    held[version] = verified(run_dir, version)
    for old in [v for v in held if v < version - 1]:
        del held[old]
    if version - 1 in held:
        print(f"one behind: serving version {version} with the weights of version {version - 1}", flush=True)
        return held[version - 1]
    return held[version]
policy_store.load_verified = one_behind  # outside_worker looks it up on the module at each call
sys.exit(outside_worker.main())
"""


@pytest.fixture(scope="module")
def alone(tmp_path_factory, tiny_assets, reference_ray) -> Path:  # type: ignore[no-untyped-def]
    """The sync run with its one own rollout worker, run once for the module: what a run joined by an
    outside worker must give bit for bit, and what a stale worker's run must not."""
    run_dir = tmp_path_factory.mktemp("sync") / "alone"
    run_backend(_plan(run_dir, tiny_assets, BASE), reference_ray)
    return run_dir


@pytest.fixture(scope="module")
def async_alone(tmp_path_factory, tiny_assets, reference_ray) -> Path:  # type: ignore[no-untyped-def]
    """The async run (one-step-off, units of one prompt: 4 a rollout) with its one own rollout worker:
    what two workers and an outside worker must each give bit for bit. Run once for the module."""
    alone = tmp_path_factory.mktemp("async") / "alone"
    run_backend(_plan(alone, tiny_assets, ASYNC_BASE), reference_ray)
    return alone


def test_one_worker_and_two_workers_compute_the_same_run(tmp_path, tiny_assets, reference_ray, async_alone) -> None:  # type: ignore[no-untyped-def]
    """Units are cut by size, never by worker count: two rollout workers give the bits of one (an
    async run of 4 units a rollout)."""
    two = tmp_path / "two"
    run_backend(_plan(two, tiny_assets, [*ASYNC_BASE, "backend_options.rollout_workers=2"]), reference_ray)
    last = f"iter_{ASYNC_N - 1:07d}"
    n = assert_bitwise_equal(load_checkpoint(async_alone / "checkpoints" / last),
                             load_checkpoint(two / "checkpoints" / last), last)
    assert n > 50
    assert all(len(_samples(two, k)) == 16 for k in range(ASYNC_N))
    served = {s["served_by"] for k in range(ASYNC_N) for s in _samples(two, k)}
    assert served == {"segment:0", "segment:1"}  # both took a share, and the result did not move


@dataclass
class Joined:
    run_dir: Path
    backend_log: str
    worker_log: str
    given_back: str | None  # the unit the worker was serving when it was signalled (None: never signalled)


def _run_with_outside_worker(tmp_path: Path, assets, address: str, overrides: list[str], leave_at: int | None,
                             *, stop: signal.Signals = signal.SIGTERM, worker: list[str] | None = None) -> Joined:
    """The backend in its own process; once it has done 2 rollouts, an outside worker process starts,
    slowed from rollout ``leave_at`` on, and gets ``stop`` as it starts its first unit there (in
    rollout ``leave_at`` or a later one: the own worker may take all of a rollout's units while the
    outside worker loads that rollout's version); with ``leave_at`` None it serves until the run ends
    and then gets SIGTERM. SIGTERM: it leaves cleanly, giving the unit back; SIGKILL: it dies
    without a word, as on a lost node, and the run must take the unit back by itself.
    ``worker``: the worker's command (default: the real one). The
    backend's driver is paused (SIGSTOP) while the worker starts and loads the model, which takes
    more than a whole tiny run on a busy machine: so it joins around rollout 3 on every machine."""
    joined = tmp_path / "joined"
    plan = _plan(joined, assets, overrides)
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    backend = subprocess.Popen([sys.executable, "-m", "beam_hpc.backends.reference", "--plan", str(plan),
                                "--ray-address", address], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, env=env)
    backend_out: list[str] = []
    threading.Thread(target=lambda: backend_out.extend(backend.stdout), daemon=True).start()
    proc: subprocess.Popen[str] | None = None
    lines: list[str] = []
    signalled: list[str] = []
    paused = False
    command = worker or [sys.executable, "-m", "beam_hpc.backends.reference.rollouts.outside_worker"]
    try:
        assert poll_until(lambda: _rollouts_done(joined) >= 2 or backend.poll() is not None, 600, 0.2)
        assert backend.poll() is None, "".join(backend_out)[-4000:]
        assert oct((joined / "elastic" / "rendezvous.json").stat().st_mode & 0o777) == "0o600"
        backend.send_signal(signal.SIGSTOP)
        paused = True
        slow = {SLOW_UNITS_VAR: f"{leave_at}:0.25"} if leave_at is not None else {}
        proc = subprocess.Popen([*command, "--run-dir", str(joined), "--worker-id", WORKER], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env={**env, **slow})
        threading.Thread(target=_stop_once_the_run_ends, args=(backend, proc, signalled), daemon=True).start()
        for line in proc.stdout:
            lines.append(line)
            if paused and "ready to serve" in line:  # model loaded; it registers next
                backend.send_signal(signal.SIGCONT)
                paused = False
            unit = _unit_started(line)
            if leave_at is not None and unit and int(unit.split(":")[1]) >= leave_at and not signalled:
                signalled.append(unit)
                proc.send_signal(stop)  # slowed: the unit has seconds to go
        out = "".join(lines)
        rc = proc.wait(60)
        if leave_at is not None:
            assert signalled, f"the run ended before the worker reached rollout {leave_at}:\n{out[-4000:]}"
        if stop == signal.SIGKILL and signalled:
            assert rc == -signal.SIGKILL and "gave back" not in out, out[-4000:]  # it said nothing
        else:
            assert rc == 0, out[-4000:]
            if signalled:
                assert f"gave back ['{signalled[0]}']" in out, out[-4000:]
        assert backend.wait(900) == 0, "".join(backend_out)[-4000:]
    finally:
        if backend.poll() is None:
            backend.send_signal(signal.SIGCONT)
        for p in (proc, backend):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
    log = "".join(backend_out)
    assert f"outside worker {WORKER} registered" in log
    if stop == signal.SIGKILL and signalled:  # it never deregistered: the run took the unit back by itself
        assert f"outside worker {WORKER} left" not in log, log[-4000:]
    else:
        if signalled:  # (not signalled: it is stopped after the run, whose service is gone by then)
            assert f"outside worker {WORKER} left, giving back {signalled[0]}" in log
        assert f"worker {WORKER}: " in "".join(lines)  # its report line, printed after it deregistered
    assert not (joined / "elastic" / "rendezvous.json").exists()  # the segment's driver removed it
    return Joined(joined, log, "".join(lines), signalled[0] if signalled else None)


def _unit_started(line: str) -> str | None:
    """The unit a worker log line says it started (``train:<rollout>:<index>``), or None."""
    if "serving unit " not in line:
        return None
    return line.split("serving unit ")[1].split()[0]


def _stop_once_the_run_ends(backend: subprocess.Popen, worker: subprocess.Popen, signalled: list[str]) -> None:
    """SIGTERM the worker if the run ends before the test signalled it: a worker outlives its run on
    purpose (it waits for the run's next segment), so the test would otherwise wait on it for ever."""
    backend.wait()
    if not signalled and worker.poll() is None:
        worker.send_signal(signal.SIGTERM)


def _outside_units(run_dir: Path, k: int) -> int:
    """How many of rollout k's units the outside worker served (1 prompt x 4 responses a unit), after
    checking that each unit was served by one worker whole."""
    by = [s["served_by"] for s in _samples(run_dir, k)]
    units = [by[i:i + 4] for i in range(0, len(by), 4)]
    assert len(by) == 16 and all(len(set(u)) == 1 for u in units), by
    return sum(1 for u in units if u[0] == WORKER)


def test_an_outside_worker_joins_leaves_mid_unit_and_changes_no_bit(tmp_path, tiny_assets, reference_ray,  # type: ignore[no-untyped-def]
                                                                     alone) -> None:
    j = _run_with_outside_worker(tmp_path, tiny_assets, reference_ray, BASE, LEAVE_AT)
    joined, signalled = j.run_dir, [j.given_back]

    # 1. Who served a unit changed no bit of the run.
    assert assert_bitwise_equal(_checkpoint(alone), _checkpoint(joined), "final") > 50
    # 2. Every unit of every rollout counted once, at the exact current version (a sync run).
    first_served = None
    outside = 0
    for k in range(N):
        samples = _samples(joined, k)
        assert all(s["policy_version"] == k for s in samples)  # a sync run: the exact current version
        assert [s["response"] for s in samples] == [s["response"] for s in _samples(alone, k)]
        n_out = _outside_units(joined, k)
        outside += n_out
        if n_out and first_served is None:
            first_served = k
        if k >= LEAVE_AT:
            assert n_out == 0, k  # it left in the middle of its first unit from rollout LEAVE_AT on
    # It joined mid-run: it starts once 2 rollouts are done, and serves before it leaves (none from
    # LEAVE_AT on, above). Which rollout it first wins a unit in depends on the machine's load: it
    # registers around rollout 2, then must load each new version while the own worker drains the
    # queue (first served at 2 to 5 seen on a busy 2-core machine).
    assert outside > 0 and first_served is not None and 2 <= first_served < LEAVE_AT, first_served
    _, left_in, given_back = signalled[0].split(":")
    assert int(left_in) >= LEAVE_AT
    assert _samples(joined, int(left_in))[4 * int(given_back)]["served_by"] == "segment:0"  # served again, once
    rollouts = metrics(joined, "rollout")
    assert [m[unit_service.UNITS] for m in rollouts] == [4.0] * N
    assert sum(m[unit_service.UNITS_OUTSIDE] for m in rollouts) == outside
    assert rollouts[-1][unit_service.OUTSIDE_WORKERS] == 0
    assert len(policy_store.versions(joined)) == 1  # published while it served, pruned to the current one


def test_an_outside_worker_killed_mid_unit_in_an_async_run_costs_its_unit_once_and_changes_no_bit(  # type: ignore[no-untyped-def]
        tmp_path, tiny_assets, reference_ray, async_alone) -> None:
    """Async (one-step-off): rollout k is generated with W_(k-1), by whoever serves it; the outside
    worker gets the versions it needs from the published files. It is then killed (SIGKILL) in the
    middle of a unit, as when its node is lost: it neither deregisters nor gives the unit back. The
    run serves that unit again, once, by its own worker (which takes over a unit only outside
    workers hold as soon as it is idle; the lease of a silent worker, 30 s, lapses later), and ends
    bitwise equal. Seen on a loaded machine: the own worker took it over and the run ended 4 s
    after the kill, before the lease lapsed."""
    n = ASYNC_N
    j = _run_with_outside_worker(tmp_path, tiny_assets, reference_ray, ASYNC_BASE, ASYNC_LEAVE_AT, stop=signal.SIGKILL)
    last = f"iter_{n - 1:07d}"
    assert assert_bitwise_equal(load_checkpoint(async_alone / "checkpoints" / last),
                                load_checkpoint(j.run_dir / "checkpoints" / last), "final") > 50
    outside = 0
    for k in range(n):
        assert {s["policy_version"] for s in _samples(j.run_dir, k)} == {max(k - 1, 0)}
        outside += _outside_units(j.run_dir, k)  # each unit served whole by one worker
    assert outside > 0
    assert j.given_back is not None
    _, held_in, index = j.given_back.split(":")
    assert _samples(j.run_dir, int(held_in))[4 * int(index)]["served_by"] == "segment:0"  # served again
    # once: every rollout counts its 4 units (a second result for a unit, e.g. from a worker whose
    # unit the own worker took over, is dropped as a duplicate, never counted)
    assert [m[unit_service.UNITS] for m in metrics(j.run_dir, "rollout")] == [4.0] * n
    assert "published for outside workers" in j.backend_log
    assert 1 <= len(policy_store.versions(j.run_dir)) <= 2  # pruned to what one step of staleness needs


def test_negative_control_a_worker_serving_one_version_behind_changes_the_final_weights(  # type: ignore[no-untyped-def]
        tmp_path, tiny_assets, reference_ray, alone) -> None:
    """The comparisons above can fail: a sync run served in part by a worker that computes version
    k's units with the weights of k-1 (STALE_WORKER) ends with other weights than
    the run alone, although every sample still carries the label k: the label is the unit's own,
    echoed back, and only the bitwise comparison of the checkpoint sees the difference."""
    j = _run_with_outside_worker(tmp_path, tiny_assets, reference_ray, BASE, None,
                                 worker=[sys.executable, "-c", STALE_WORKER])
    lies = [line for line in j.worker_log.splitlines() if line.startswith("one behind: ")]
    assert lies, j.worker_log[-4000:]  # it did serve a unit with the version before
    assert sum(_outside_units(j.run_dir, k) for k in range(N)) > 0
    for k in range(N):
        assert {s["policy_version"] for s in _samples(j.run_dir, k)} == {k}  # the labels cannot tell
    with pytest.raises(AssertionError, match="differs"):
        assert_bitwise_equal(_checkpoint(alone), _checkpoint(j.run_dir), "final")


def test_an_own_worker_whose_process_dies_on_a_live_node_is_started_again_and_changes_no_bit(  # type: ignore[no-untyped-def]
        tmp_path, tiny_assets, reference_ray, async_alone) -> None:
    """The segment's only rollout worker is SIGKILLed mid-run, its node (this machine's Ray node)
    left up: an out-of-memory kill or a crash, not a lost node. The driver starts a new worker in
    its place (unit_service._restart_in_place), which loads the model and the weights of every
    version a unit may still ask for before it is fed a unit; the unit the dead worker held is
    served again, once, and the run ends bitwise equal to the run without the fault. (Before the
    restart, this run ended at the loss: no rollout capacity left.) Each rollout is slowed by a
    second in the driver (BEAM_TEST_SLOW_ROLLOUT_S), so the kill lands with rollouts to go."""
    run_dir = tmp_path / "restarted"
    plan = _plan(run_dir, tiny_assets, ASYNC_BASE)
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", SLOW_ROLLOUT_VAR: "1.0"}
    backend = subprocess.Popen([sys.executable, "-m", "beam_hpc.backends.reference", "--plan", str(plan),
                                "--ray-address", reference_ray], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, env=env)
    out: list[str] = []
    threading.Thread(target=lambda: out.extend(backend.stdout), daemon=True).start()
    try:
        assert poll_until(lambda: _rollouts_done(run_dir) >= 2 or backend.poll() is not None, 600, 0.1)
        assert backend.poll() is None, "".join(out)[-4000:]
        (worker,) = json.loads((run_dir / "placement.json").read_text())["rollout"]
        killed_after = _rollouts_done(run_dir)
        os.kill(worker["pid"], signal.SIGKILL)
        assert backend.wait(900) == 0, "".join(out)[-4000:]
    finally:
        if backend.poll() is None:
            backend.kill()
            backend.wait()
    log = "".join(out)
    assert killed_after < ASYNC_N, killed_after
    assert "rollout worker segment:0 lost" in log and "starting a new worker in its place (restart 1)" in log, log[-4000:]
    assert "rollout worker segment:0 started again on node" in log, log[-4000:]
    last = f"iter_{ASYNC_N - 1:07d}"
    assert assert_bitwise_equal(load_checkpoint(async_alone / "checkpoints" / last),
                                load_checkpoint(run_dir / "checkpoints" / last), last) > 50
    rows = metrics(run_dir, "rollout")
    assert [m[unit_service.UNITS] for m in rows] == [4.0] * ASYNC_N  # every unit once, none counted twice
    assert rows[-1][unit_service.WORKERS_RESTARTED] == 1.0 and rows[-1][unit_service.WORKERS_LOST] == 0.0
    assert {s["served_by"] for k in range(ASYNC_N) for s in _samples(run_dir, k)} == {"segment:0"}
