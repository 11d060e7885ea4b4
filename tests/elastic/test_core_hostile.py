"""Hostile clients against the real rollout service, started the way a segment starts it (the
backend's own process on the session's Ray head), while the run waits on its outside workers.

The attacked run has no rollout worker of its own (``rollout_workers=0``), so every unit goes
through the service: first hostile clients get at it (idle connections past the connection limit,
a slow header, a slow body, an oversized body, garbage, a replayed request, and two registered
workers that post a result for each other's unit, at the wrong version, and malformed), then an
honest outside worker (``outside_worker.serve``, in this process) serves the whole run. The final
checkpoint must be bitwise that of the same run served by the segment's own worker, with no attack.
Every request goes to the address the driver's service binds (Ray's node IP: an address of this
machine, checked before the first request), and every attack is bounded in count and time.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from job_plans import HOST_SITE, make_test_plan
from polling import poll_until
from reference_harness import SMALL, assert_bitwise_equal, load_checkpoint, run_backend

from beam_hpc.backends.reference.rollouts import rendezvous
from beam_hpc.backends.reference.rollouts.outside_worker import serve
from beam_hpc.backends.reference.rollouts.unit_server import (
    AUTH_HEADER,
    BODY_LIMITS,
    MAX_CONNECTIONS,
    REQUEST_DEADLINE_S,
    Client,
    ServiceError,
    sign,
)
from beam_hpc.backends.reference.rollouts.units import Unit

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.e2e]

N = 1
BASE = [*SMALL, f"num_rollout={N}", f"checkpoint.interval={N}", "training.async_training=false",
        "backend_options.unit_prompts=1"]
def _this_machine(address: str) -> bool:
    """True if ``address`` is one of this machine's (a socket can be bound to it): the attacks
    never leave the machine."""
    try:
        with socket.socket() as s:
            s.bind((address, 0))
        return True
    except OSError:
        return False


def _plan(run_dir: Path, assets: Any, overrides: list[str]) -> Path:
    return Path(make_test_plan(run_dir, assets=assets, overrides=overrides, site=HOST_SITE).paths.plan)


def _raw(where: tuple[str, int], data: bytes, timeout: float = 15.0) -> bytes:
    """Send ``data`` on a new connection; everything the server answers until it closes."""
    with socket.create_connection(where, timeout=timeout) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


def _request(path: str, body: bytes, headers: dict[str, str]) -> bytes:
    head = "".join(f"{k}: {v}\r\n" for k, v in {"Host": "x", "Content-Length": str(len(body)), **headers}.items())
    return f"POST {path} HTTP/1.1\r\n{head}\r\n".encode() + body


def _status(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/") else 0


def _closed_by_server(sock: socket.socket, within_s: float) -> bool:
    """True if the server ends the connection (EOF or reset) within ``within_s``."""
    sock.settimeout(within_s)
    try:
        while sock.recv(4096):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def _lease_one(c: Client, me: dict[str, str], deadline_s: float = 120.0) -> Unit:
    """Lease until a unit comes (the driver publishes version 0 once an outside worker registered)."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        got = c.call("/lease", **me)
        if "unit" in got:
            return Unit.from_json(got["unit"])
        time.sleep(float(got.get("wait_s", 0.2)))
    raise AssertionError("no unit leased")


def _flood_and_trickle(where: tuple[str, int], rv: rendezvous.Rendezvous) -> None:
    """Idle connections past the limit, a slow header and an authenticated slow body: the server
    closes each within its deadline, and an honest request is answered meanwhile."""
    slow_head = socket.create_connection(where, timeout=10)
    slow_head.sendall(b"POST /lease HTTP/1.1\r\nHost: x\r\n")  # and never the rest
    body = json.dumps({"worker": "slowpoke"}).encode()
    slow_body = socket.create_connection(where, timeout=10)
    slow_body.sendall(_request("/register", body, {AUTH_HEADER: sign(rv.secret, "/register", body)})[:-len(body) + 3])
    idle = [socket.create_connection(where, timeout=10) for _ in range(MAX_CONNECTIONS + 8)]
    try:
        t0 = time.monotonic()
        # every slot is held by a silent client: an honest request waits in the backlog until the
        # reaper frees slots at the deadline, and is then answered
        assert "session" in Client(rv.url, rv.secret).call("/register", worker="prober")
        assert time.monotonic() - t0 < REQUEST_DEADLINE_S + 10
        for s in idle[:4] + [slow_head, slow_body]:  # cut off, whatever they were sending
            assert _closed_by_server(s, REQUEST_DEADLINE_S + 5)
    finally:
        for s in idle + [slow_head, slow_body]:
            s.close()


def _attack(rv: rendezvous.Rendezvous) -> dict[str, int]:
    assert _this_machine(rv.address), rv.address
    where = (rv.address, rv.port)
    seen: dict[str, int] = {}
    _flood_and_trickle(where, rv)
    # an oversized body, declared; and one sent without a declaration the server believes
    seen["oversized"] = _status(_raw(where, b"POST /result HTTP/1.1\r\nHost: x\r\nContent-Length: "
                                     + str(BODY_LIMITS["/result"] + 1).encode() + b"\r\n\r\n"))
    big = b"x" * (BODY_LIMITS["/lease"] + 1)
    seen["oversized_signed"] = _status(_raw(where, _request("/lease", big, {AUTH_HEADER: sign(rv.secret, "/lease", big)})))
    # no proof, a forged one, garbage with a good proof, a body that is not the signed one
    junk = b"\x00{{{ not json"
    seen["unsigned"] = _status(_raw(where, _request("/register", b'{"worker": "x"}', {})))
    seen["forged"] = _status(_raw(where, _request("/register", b'{"worker": "x"}', {AUTH_HEADER: "1:2:3:4:5"})))
    seen["garbage"] = _status(_raw(where, _request("/register", junk, {AUTH_HEADER: sign(rv.secret, "/register", junk)})))
    seen["not_an_object"] = _status(_raw(where, _request("/register", b"[1]", {AUTH_HEADER: sign(rv.secret, "/register", b"[1]")})))
    swapped = _request("/register", b'{"worker": "y"}', {AUTH_HEADER: sign(rv.secret, "/register", b'{"worker": "x"}')})
    seen["swapped_body"] = _status(_raw(where, swapped))
    # a captured request, sent again
    captured = _request("/register", b'{"worker": "evil-c"}', {AUTH_HEADER: sign(rv.secret, "/register", b'{"worker": "evil-c"}')})
    seen["first"], seen["replayed"] = _status(_raw(where, captured)), _status(_raw(where, captured))

    # two workers with the secret, misbehaving: each refusal puts the unit back, and nothing ends
    c = Client(rv.url, rv.secret)
    a = {"worker": "evil-a", "segment": rv.segment, "session": c.call("/register", worker="evil-a")["session"]}
    b = {"worker": "evil-b", "segment": rv.segment, "session": c.call("/register", worker="evil-b")["session"]}
    unit = _lease_one(c, a)
    n = len(unit.prompts) * unit.samples_per_prompt
    fake = {"response_ids": [[1, 2]] * n, "old_logp": [[-0.5, -0.5]] * n, "reward": [1.0] * n, "version": unit.version}
    attempts = {
        "others_unit": (b, fake),
        "wrong_version": (a, {**fake, "version": unit.version + 1}),
        "short": (a, {**fake, "response_ids": [[1, 2]] * (n - 1)}),
        "token_out_of_range": (a, {**fake, "response_ids": [[1, 10**9]] * n}),
        "nan_logp": (a, {**fake, "old_logp": [[-0.5, float("nan")]] * n}),
        "result_not_an_object": (a, ["x"]),
    }
    for what, (who, result) in attempts.items():
        if who is a and what != "wrong_version":
            assert _lease_one(c, a).key == unit.key  # refused before: back in the queue, first in line
        try:
            c.call("/result", **who, key=unit.key, result=result)
            seen[what] = 200
        except ServiceError as e:
            seen[what] = e.code
    for who in (a, b):
        c.call("/deregister", **who, give_back=[unit.key])
    return seen


def test_hostile_clients_change_nothing_and_the_segment_keeps_serving(tmp_path, tiny_assets, reference_ray) -> None:  # type: ignore[no-untyped-def]
    alone_dir = tmp_path / "alone"
    alone: dict[str, Any] = {}

    def run_alone() -> None:
        try:
            alone["done"] = run_backend(_plan(alone_dir, tiny_assets, BASE), reference_ray)
        except Exception as e:  # noqa: BLE001 (asserted below)
            alone["error"] = e

    reference = threading.Thread(target=run_alone, daemon=True)
    reference.start()  # the run without attack, served by the segment's own worker, meanwhile
    # the honest worker's imports (torch, the policy), paid while the backend starts, not after the attack
    threading.Thread(target=lambda: __import__("beam_hpc.backends.reference.rollouts.rollout_worker"), daemon=True).start()

    attacked = tmp_path / "attacked"
    plan = _plan(attacked, tiny_assets, [*BASE, "backend_options.rollout_workers=0"])
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    backend = subprocess.Popen([sys.executable, "-m", "beam_hpc.backends.reference", "--plan", str(plan),
                                "--ray-address", reference_ray], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, env=env)
    out: list[str] = []
    threading.Thread(target=lambda: out.extend(backend.stdout), daemon=True).start()  # type: ignore[arg-type]
    stop = threading.Event()
    worker = threading.Thread(target=lambda: serve(attacked, worker_id="honest", stop=stop), daemon=True)
    try:
        assert poll_until(lambda: rendezvous.read(attacked) is not None or backend.poll() is not None, 300, 0.2)
        rv = rendezvous.read(attacked)
        assert rv is not None, "".join(out)[-4000:]
        seen = _attack(rv)
        assert backend.poll() is None, "".join(out)[-4000:]  # the segment is still up
        worker.start()
        assert backend.wait(600) == 0, "".join(out)[-4000:]
    finally:
        stop.set()
        if backend.poll() is None:
            backend.send_signal(signal.SIGTERM)
            backend.wait(60)
        if worker.is_alive():
            worker.join(60)
        reference.join(600)
    assert seen == {"oversized": 413, "oversized_signed": 413, "unsigned": 401, "forged": 401, "garbage": 400,
                    "not_an_object": 400, "swapped_body": 401, "first": 200, "replayed": 401, "others_unit": 409,
                    "wrong_version": 400, "short": 400, "token_out_of_range": 400, "nan_logp": 400,
                    "result_not_an_object": 400}, seen
    log = "".join(out)
    assert "a replayed request" in log and log.count("refused (") >= 4 and "Traceback" not in log, log[-4000:]
    assert "done" in alone, alone.get("error", "the reference run did not finish")
    last = f"iter_{N - 1:07d}"
    assert assert_bitwise_equal(load_checkpoint(alone_dir / "checkpoints" / last),
                                load_checkpoint(attacked / "checkpoints" / last), "final") > 50
    served = {json.loads(x)["served_by"] for k in range(N)
              for x in (attacked / "dumps" / "rollout" / f"rollout_{k:07d}.jsonl").read_text().splitlines()}
    assert served == {"honest"}  # nothing the attackers sent was trained on
