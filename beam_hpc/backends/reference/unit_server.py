"""The driver's rollout service for outside workers: HTTP + JSON over one TCP port, stdlib only.

Every request proves it knows the run's secret: header ``X-Beam-Auth: <unix time>:<hex>`` where
hex is HMAC-SHA256(secret, "<time>\\n<path>\\n" + body). A request without it, with a wrong one, or
more than ``MAX_SKEW_S`` old is refused with 401 before its body is looked at. Endpoints (POST):
``/register`` -> the segment, the run's recipe and model; ``/lease`` -> a unit (held open up to
``LEASE_WAIT_S`` until one suits the worker, else how long to wait); ``/result``; ``/heartbeat``;
``/deregister`` (with the keys it gives back). A worker the
segment does not know (it registered with an earlier segment) gets 409 and registers again.
The :class:`Client` here is what :mod:`beam_hpc.backends.reference.outside_worker` speaks.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from beam_hpc.backends.reference.units import Unit, UnitQueue

log = logging.getLogger(__name__)

AUTH_HEADER = "X-Beam-Auth"
MAX_SKEW_S = 300.0
# A lease is a long poll: the request waits for a unit that suits the worker. The segment's own
# workers get their next unit the moment they finish one, so a worker that asked again only every
# so often would lose every unit of a short rollout to them (seen: a tiny run on a quiet machine).
LEASE_WAIT_S = 1.0
WAIT_S = 0.2  # what a worker is told to wait when no unit suited it within LEASE_WAIT_S
MAX_BODY_BYTES = 64 << 20  # a unit's result is far smaller; a client must not make the driver read more


def sign(secret: str, path: str, body: bytes, now: float | None = None) -> str:
    ts = str(int(time.time() if now is None else now))
    mac = hmac.new(secret.encode(), f"{ts}\n{path}\n".encode() + body, hashlib.sha256).hexdigest()
    return f"{ts}:{mac}"


def verify(secret: str, path: str, body: bytes, header: str | None, now: float | None = None) -> bool:
    if not header or ":" not in header:
        return False
    ts, _, mac = header.partition(":")
    try:
        age = abs((time.time() if now is None else now) - int(ts))
    except ValueError:
        return False
    want = hmac.new(secret.encode(), f"{ts}\n{path}\n".encode() + body, hashlib.sha256).hexdigest()
    return age <= MAX_SKEW_S and hmac.compare_digest(want, mac)


class Service:
    """What the endpoints do, apart from HTTP: the queue, plus the driver's view of versions.

    ``accept(unit)``: may an outside worker serve this unit now (its version is published and
    within the staleness the run allows). ``hello``: what a registering worker is told.
    ``on_register``: called with a new outside worker's name (the driver publishes versions then).
    """

    def __init__(self, queue: UnitQueue, segment: str, hello: dict[str, Any], accept: Callable[[Unit], bool],
                 on_register: Callable[[str], None] | None = None) -> None:
        self.queue, self.segment, self.hello, self.accept = queue, segment, hello, accept
        self.on_register = on_register

    def handle(self, path: str, req: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        worker = str(req.get("worker", ""))
        if not worker or worker.startswith("segment:"):
            return 400, {"error": "worker: a name is required (not one starting with 'segment:')"}
        if path == "/register":
            self.queue.register(worker, outside=True)
            log.info("outside worker %s registered", worker)
            if self.on_register is not None:
                self.on_register(worker)
            return 200, {"segment": self.segment, **self.hello}
        if req.get("segment") != self.segment or not self.queue.heartbeat(worker):
            return 409, {"error": "register with this segment first", "segment": self.segment}
        if path == "/heartbeat":
            return 200, {}
        if path == "/lease":
            unit = self._lease(worker)
            return 200, ({"unit": unit.to_json()} if unit is not None else {"wait_s": WAIT_S})
        if path == "/result":
            verdict = self.queue.complete(worker, str(req["key"]), req["result"])
            return 200, {"verdict": verdict}
        if path == "/deregister":
            back = self.queue.give_back(worker, [str(k) for k in req.get("give_back", [])])
            back += self.queue.deregister(worker)
            log.info("outside worker %s left%s", worker, f", giving back {', '.join(back)}" if back else "")
            return 200, {"given_back": back}
        return 404, {"error": f"no endpoint {path}"}

    def _lease(self, worker: str) -> Unit | None:
        """The next unit ``accept`` lets ``worker`` serve, waiting up to ``LEASE_WAIT_S`` for one: the
        queue wakes the wait when a unit is added or put back, and when a version is published."""
        deadline = time.monotonic() + LEASE_WAIT_S
        while True:
            seen = self.queue.changes  # read before the lease: a change while leasing is not slept on
            unit = self.queue.lease(worker, self.accept)
            left = deadline - time.monotonic()
            if unit is not None or left <= 0:
                return unit
            self.queue.wait_for_change(seen, left)


class ElasticServer:
    """The HTTP server on ``(host, port)`` (0: any free port), in a daemon thread."""

    def __init__(self, service: Service, secret: str, host: str, port: int = 0) -> None:
        self.service, self.secret = service, secret
        handler = _handler_for(self)
        self.httpd = ThreadingHTTPServer((host, port), handler)
        self.httpd.daemon_threads = True
        self.address, self.port = host, int(self.httpd.server_address[1])
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="elastic-server", daemon=True)

    def start(self) -> ElasticServer:
        self.thread.start()
        return self

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _handler_for(server: ElasticServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the stdlib's name)
            log.debug("elastic: " + format, *args)

        def do_POST(self) -> None:  # noqa: N802 (the stdlib's name)
            try:
                length = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                length = -1
            if not 0 <= length <= MAX_BODY_BYTES:
                self._reply(413, {"error": f"Content-Length: {length}; at most {MAX_BODY_BYTES} bytes"})
                return
            body = self.rfile.read(length)
            if not verify(server.secret, self.path, body, self.headers.get(AUTH_HEADER)):
                log.warning("elastic: refused %s from %s: no valid proof of the run's secret", self.path, self.client_address[0])
                self._reply(401, {"error": "no valid proof of the run's secret"})
                return
            try:
                code, out = server.service.handle(self.path, json.loads(body or b"{}"))
            except (ValueError, KeyError, TypeError) as e:
                code, out = 400, {"error": f"bad request: {e}"}
            self._reply(code, out)

        def _reply(self, code: int, obj: dict[str, Any]) -> None:
            data = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    return Handler


class ServiceError(Exception):
    """A request got an answer other than 200; ``code`` says which (409: register again)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


class Client:
    """Signed JSON requests to one segment's service. Raises :class:`ServiceError` on a refusal and
    ``OSError`` when nothing answers (the segment is gone)."""

    def __init__(self, url: str, secret: str, timeout_s: float = 30.0) -> None:
        self.url, self.secret, self.timeout_s = url, secret, timeout_s

    def call(self, path: str, **payload: Any) -> dict[str, Any]:
        body = json.dumps(payload).encode()
        req = urllib.request.Request(self.url + path, data=body, method="POST",
                                     headers={"Content-Type": "application/json", AUTH_HEADER: sign(self.secret, path, body)})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                out: dict[str, Any] = json.loads(resp.read())
                return out
        except urllib.error.HTTPError as e:
            try:
                msg = json.loads(e.read()).get("error", "")
            except ValueError:
                msg = ""
            raise ServiceError(e.code, msg) from None
