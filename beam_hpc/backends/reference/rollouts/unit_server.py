"""The driver's rollout service for outside workers: HTTP + JSON over one TCP port, stdlib only.

Anyone who can reach the port can connect, so the service is built for clients that do not know the
run's secret, and for clients that know it but send nonsense:

- **Proof before body.** Every request carries ``X-Beam-Auth: <time>:<nonce>:<length>:<sha256>:<mac>``
  where mac is HMAC-SHA256(secret, "beam-unit-v2\\n<time>\\n<nonce>\\n<path>\\n<length>\\n<sha256>")
  and length and sha256 are the body's. The server checks the header (constant-time compare,
  time within ``MAX_SKEW_S``, length within the path's limit and equal to ``Content-Length``) before
  it reads one byte of the body; then it reads exactly that many bytes and checks their digest.
- **No replay.** A nonce is accepted once: the server remembers every nonce it accepted until its
  time leaves the window, so a captured request is refused (401) whenever it is sent again.
- **Bounded.** At most ``MAX_CONNECTIONS`` connections are served at once; further ones wait in
  the listen backlog until a slot frees. A connection must deliver its request line, headers and
  body within ``REQUEST_DEADLINE_S`` (a reaper thread shuts down one that has not: a slow client
  cannot hold a thread), and a body may be at most ``BODY_LIMITS[path]`` bytes. One request per
  connection (HTTP/1.0).
- **Malformed bodies get 400.** A body that is not a JSON object, a field of the wrong type or a
  missing one is answered 400 with what is wrong; nothing a client sends raises in the server.

Endpoints (POST): ``/register`` -> the segment, the run's recipe and model, and a session token
that every later request of that worker must carry; ``/lease`` -> a unit (held open up to
``LEASE_WAIT_S`` until one suits the worker, else how long to wait); ``/result`` (accepted only from
the worker that holds the unit's lease, at the unit's version, and after the driver's own check of
it: :mod:`beam_hpc.backends.reference.rollouts.unit_service`); ``/heartbeat``; ``/deregister`` (with the keys
it gives back). A worker the segment does not know (it registered with an earlier segment, or
another registration took its name) gets 409 and registers again. The :class:`Client` here is what
:mod:`beam_hpc.backends.reference.rollouts.outside_worker` speaks.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import re
import secrets
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from beam_hpc.backends.reference.rollouts.units import Unit, UnitQueue

log = logging.getLogger(__name__)

AUTH_HEADER = "X-Beam-Auth"
SESSION_FIELD = "session"
_MAC_CONTEXT = "beam-unit-v2"  # names the signed layout: a v1 signature never verifies as v2
MAX_SKEW_S = 300.0  # how far a request's time may be from the server's (cluster clocks drift a little)
# A lease is a long poll: the request waits for a unit that suits the worker. The segment's own
# workers get their next unit the moment they finish one, so a worker that asked again only every
# so often would lose every unit of a short rollout to them (seen: a tiny run on a quiet machine).
LEASE_WAIT_S = 1.0
WAIT_S = 0.2  # what a worker is told to wait when no unit suited it within LEASE_WAIT_S
MAX_CONNECTIONS = 32  # served at once; a handful of outside workers needs 2 each (a request and a heartbeat)
BACKLOG = 128  # connections the kernel queues while every slot is taken
# Request line, headers and body must all arrive within this: a 32 MiB result over a slow link
# takes well under it, and a client that trickles bytes is cut off instead of holding a thread.
REQUEST_DEADLINE_S = 5.0
SMALL_BODY = 16 << 10
# What each path's body may be: a unit's result is the only large one (tokens, log-probs and texts
# of a few prompts' samples: about 1 MiB for 4 prompts x 16 samples x 1024 tokens as JSON).
BODY_LIMITS = {"/register": SMALL_BODY, "/heartbeat": SMALL_BODY, "/lease": SMALL_BODY,
               "/deregister": 256 << 10, "/result": 32 << 20}
_WORKER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@+-]{0,127}$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_NONCE = re.compile(r"^[0-9a-f]{32}$")
LINGER_BYTES = 64 << 10  # after a refusal, what is drained so the client reads the answer, not a reset


def valid_worker_name(name: str) -> bool:
    """A name an outside worker may use: letters, digits and ``._@+-``, up to 128 characters, so
    that it cannot pose as one of the segment's own (``segment:N``) or forge a line of the log."""
    return bool(_WORKER_NAME.match(name))


@dataclass(frozen=True)
class Proof:
    """What a checked ``X-Beam-Auth`` header vouches for: the body that must follow."""

    time: int
    nonce: str
    length: int
    digest: str


def _mac(secret: str, ts: int, nonce: str, path: str, length: int, digest: str) -> str:
    msg = f"{_MAC_CONTEXT}\n{ts}\n{nonce}\n{path}\n{length}\n{digest}".encode()
    return hmac.new(secret.encode(), msg, hashlib.sha256).hexdigest()


def sign(secret: str, path: str, body: bytes, now: float | None = None, nonce: str | None = None) -> str:
    """The ``X-Beam-Auth`` value for one request: a fresh nonce unless one is given (tests)."""
    ts = int(time.time() if now is None else now)
    n = secrets.token_hex(16) if nonce is None else nonce
    digest = hashlib.sha256(body).hexdigest()
    return f"{ts}:{n}:{len(body)}:{digest}:{_mac(secret, ts, n, path, len(body), digest)}"


def check_header(secret: str, path: str, header: str | None, now: float | None = None) -> Proof | None:
    """The header's proof if it is well formed, fresh and signed with ``secret`` for ``path``;
    None otherwise. Needs no body: the body is read only once this has passed."""
    parts = (header or "").split(":")
    if len(parts) != 5:
        return None
    ts, nonce, length, digest, mac = parts
    if not (ts.isdigit() and length.isdigit() and len(ts) <= 12 and len(length) <= 12 and _NONCE.match(nonce)
            and _HEX64.match(digest) and _HEX64.match(mac)):
        return None
    if abs((time.time() if now is None else now) - int(ts)) > MAX_SKEW_S:
        return None
    if not hmac.compare_digest(_mac(secret, int(ts), nonce, path, int(length), digest), mac):
        return None
    return Proof(int(ts), nonce, int(length), digest)


def body_matches(proof: Proof, body: bytes) -> bool:
    return len(body) == proof.length and hmac.compare_digest(hashlib.sha256(body).hexdigest(), proof.digest)


def verify(secret: str, path: str, body: bytes, header: str | None, now: float | None = None) -> bool:
    """Header and body together (what the server checks in two steps); no replay check."""
    proof = check_header(secret, path, header, now)
    return proof is not None and body_matches(proof, body)


class NonceBook:
    """Nonces accepted within the signature window: a nonce is good once. Only requests whose MAC
    checked out are entered, so a stranger cannot fill it; it forgets a nonce once the request's
    time has left the window (the header would be refused as too old by then)."""

    def __init__(self, window_s: float = MAX_SKEW_S, clock: Callable[[], float] = time.time) -> None:
        self.window_s, self.clock = window_s, clock
        self.seen: dict[str, float] = {}  # nonce -> until when it must be remembered
        self.lock = threading.Lock()
        self.next_sweep = 0.0

    def first_use(self, proof: Proof) -> bool:
        with self.lock:
            now = self.clock()
            if now >= self.next_sweep:
                self.seen = {n: until for n, until in self.seen.items() if until >= now}
                self.next_sweep = now + 10.0
            if proof.nonce in self.seen:
                return False
            self.seen[proof.nonce] = proof.time + self.window_s
            return True


class BadRequest(ValueError):
    """A body that is JSON but not what the endpoint takes: answered 400 with this message."""


def _field(req: dict[str, Any], name: str, kind: type, *, max_len: int = 256) -> Any:
    v = req.get(name)
    if not isinstance(v, kind) or isinstance(v, bool) and kind is not bool:
        raise BadRequest(f"{name}: {type(v).__name__} {str(v)[:40]!r}; a {kind.__name__} is required")
    if isinstance(v, str) and not 0 < len(v) <= max_len:
        raise BadRequest(f"{name}: {len(v)} characters; 1 to {max_len} are allowed")
    return v


class ResultRefused(ValueError):
    """A unit's result that does not fit the unit (raised by the service's ``check``)."""


class Service:
    """What the endpoints do, apart from HTTP: the queue, plus the driver's view of versions.

    ``accept(unit)``: may an outside worker serve this unit now (its version is published and
    within the staleness the run allows). ``hello``: what a registering worker is told.
    ``on_register``: called with a new outside worker's name (the driver publishes versions then).
    ``check(unit, result)``: the driver's own check of a result (shapes, lengths, what it can
    recompute); returns the result to keep or raises :class:`ResultRefused`. Whatever ``check``
    does, a result is taken only from the worker holding the unit's lease and at the unit's version.
    """

    def __init__(self, queue: UnitQueue, segment: str, hello: dict[str, Any], accept: Callable[[Unit], bool],
                 on_register: Callable[[str], None] | None = None,
                 check: Callable[[Unit, dict[str, Any]], dict[str, Any]] | None = None) -> None:
        self.queue, self.segment, self.hello, self.accept = queue, segment, hello, accept
        self.on_register, self.check = on_register, check
        self.sessions: dict[str, str] = {}  # worker -> the token its registration got
        self.lock = threading.Lock()
        self.refused = 0  # results refused (counted for the driver's log)

    def handle(self, path: str, req: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """The answer to one authenticated request; raises :class:`BadRequest` on a malformed one."""
        worker = _field(req, "worker", str)
        if not valid_worker_name(worker):
            raise BadRequest(f"worker: {worker[:40]!r}; use letters, digits and ._@+- (up to 128, not 'segment:...')")
        if path == "/register":
            token = secrets.token_hex(16)
            with self.lock:
                self.sessions[worker] = token
            self.queue.register(worker, outside=True)
            log.info("outside worker %s registered", worker)
            if self.on_register is not None:
                self.on_register(worker)
            return 200, {"segment": self.segment, **self.hello, SESSION_FIELD: token}
        segment, session = req.get("segment"), req.get(SESSION_FIELD)
        with self.lock:
            known = self.sessions.get(worker)
        if (segment != self.segment or not isinstance(session, str) or known is None
                or not hmac.compare_digest(session.encode(), known.encode()) or not self.queue.heartbeat(worker)):
            return 409, {"error": "register with this segment first", "segment": self.segment}
        if path == "/heartbeat":
            return 200, {}
        if path == "/lease":
            unit = self._lease(worker)
            return 200, ({"unit": unit.to_json()} if unit is not None else {"wait_s": WAIT_S})
        if path == "/result":
            return self._result(worker, _field(req, "key", str), _field(req, "result", dict))
        if path == "/deregister":
            keys = req.get("give_back", [])
            if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
                raise BadRequest("give_back: a list of unit keys (strings) is required")
            back = self.queue.give_back(worker, keys)
            back += self.queue.deregister(worker)
            with self.lock:
                self.sessions.pop(worker, None)
            log.info("outside worker %s left%s", worker, f", giving back {', '.join(back)}" if back else "")
            return 200, {"given_back": back}
        return 404, {"error": f"no endpoint {path}"}

    def _result(self, worker: str, key: str, result: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """Check a result against the unit the worker holds, outside the queue's lock (scoring may
        take a while), then hand it to the queue, which takes it only if the lease still holds."""
        unit = self.queue.held_by(worker, key)
        checked: dict[str, Any] | None = None
        if unit is not None:
            try:
                version = result.get("version")
                if type(version) is not int or version != unit.version:
                    raise ResultRefused(f"version: {version!r}; unit {key} was leased at version {unit.version}")
                checked = self.check(unit, result) if self.check is not None else result
            except ResultRefused as e:
                self.queue.give_back(worker, [key])  # served again, by whoever leases it next
                with self.lock:
                    self.refused += 1
                log.warning("outside worker %s: result for %s refused (%s); the unit is served again", worker, key, e)
                return 400, {"error": f"result refused: {e}", "verdict": "refused"}
        verdict = self.queue.complete(worker, key, checked)
        if verdict == "not-leased":
            return 409, {"error": f"unit {key} is not leased to {worker}", "verdict": verdict}
        return 200, {"verdict": verdict}

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


class _BoundedHTTPServer(ThreadingHTTPServer):
    """``ThreadingHTTPServer`` with at most ``slots`` connections at once (the rest wait in the
    listen backlog: accept is not called while none is free) and a deadline for each request's
    bytes, enforced by shutting the socket down from a reaper thread."""

    daemon_threads = True
    request_queue_size = BACKLOG

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], slots: int) -> None:
        self.slots = threading.BoundedSemaphore(slots)
        self.closing = threading.Event()
        self.reading: dict[socket.socket, float] = {}  # connection -> when its request must be in
        self.reading_lock = threading.Lock()
        super().__init__(address, handler)
        self.reaper = threading.Thread(target=self._reap, name="elastic-reaper", daemon=True)
        self.reaper.start()

    def get_request(self) -> tuple[Any, Any]:
        while not self.slots.acquire(timeout=0.2):
            if self.closing.is_set():
                raise OSError("the rollout service is closing")
        try:
            conn, addr = super().get_request()
        except BaseException:
            self.slots.release()
            raise
        with self.reading_lock:
            self.reading[conn] = time.monotonic() + REQUEST_DEADLINE_S
        return conn, addr

    def read_done(self, conn: socket.socket) -> None:
        with self.reading_lock:
            self.reading.pop(conn, None)

    def shutdown_request(self, request: Any) -> None:
        self.read_done(request)
        try:
            super().shutdown_request(request)
        finally:
            self.slots.release()

    def _reap(self) -> None:
        while not self.closing.wait(0.25):
            now = time.monotonic()
            with self.reading_lock:
                late = [c for c, until in self.reading.items() if now > until]
                for c in late:
                    del self.reading[c]
            for c in late:
                try:
                    c.shutdown(socket.SHUT_RDWR)  # its handler's read returns; the handler ends
                except OSError:
                    pass

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A connection that broke (a client gone, a socket the reaper shut): one log line, no
        traceback on the driver's stderr; anything else is logged with its traceback."""
        e = sys.exc_info()[1]
        if isinstance(e, OSError):
            log.debug("elastic: connection from %s ended: %s", client_address, e)
        else:
            log.error("elastic: request from %s failed", client_address, exc_info=True)

    def close(self) -> None:
        self.closing.set()
        self.shutdown()
        self.server_close()


class ElasticServer:
    """The HTTP server on ``(host, port)`` (0: any free port), in a daemon thread."""

    def __init__(self, service: Service, secret: str, host: str, port: int = 0) -> None:
        self.service, self.secret = service, secret
        self.nonces = NonceBook()
        self.httpd = _BoundedHTTPServer((host, port), _handler_for(self), MAX_CONNECTIONS)
        self.address, self.port = host, int(self.httpd.server_address[1])
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="elastic-server", daemon=True)

    def start(self) -> ElasticServer:
        self.thread.start()
        return self

    def close(self) -> None:
        self.httpd.close()


def _handler_for(server: ElasticServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        timeout = REQUEST_DEADLINE_S  # each read's own limit; the reaper bounds the whole request

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the stdlib's name)
            log.debug("elastic: " + format, *args)

        def do_POST(self) -> None:  # noqa: N802 (the stdlib's name)
            limit = BODY_LIMITS.get(self.path)
            if limit is None:
                self._refuse(404, f"no endpoint {self.path[:80]}")
                return
            try:
                length = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                length = -1
            if not 0 <= length <= limit:
                self._refuse(413, f"Content-Length: {length}; {self.path} takes at most {limit} bytes")
                return
            proof = check_header(server.secret, self.path, self.headers.get(AUTH_HEADER))
            if proof is None:
                log.warning("elastic: refused %s from %s: no valid proof of the run's secret", self.path, self.client_address[0])
                self._refuse(401, "no valid proof of the run's secret")
                return
            if proof.length != length:
                self._refuse(400, f"Content-Length: {length}; the signed length is {proof.length}")
                return
            if not server.nonces.first_use(proof):
                log.warning("elastic: refused %s from %s: a replayed request", self.path, self.client_address[0])
                self._refuse(401, "this request was sent before (a replay)")
                return
            try:
                body = self.rfile.read(length)
            except OSError:  # the deadline passed: the reaper shut the socket, or a read timed out
                body = b""
            server.httpd.read_done(self.connection)
            if len(body) != length:
                self.close_connection = True
                log.warning("elastic: %s from %s: the body did not arrive within %.0fs", self.path,
                            self.client_address[0], REQUEST_DEADLINE_S)
                return  # the socket is shut: nothing can be answered
            if not body_matches(proof, body):
                self._reply(401, {"error": "the body does not match its signed digest"})
                return
            try:
                req = json.loads(body or b"{}")
            except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError; nesting too deep
                self._reply(400, {"error": f"bad request: the body is not JSON ({str(e)[:200]})"})
                return
            if not isinstance(req, dict):
                self._reply(400, {"error": f"bad request: the body is a JSON {type(req).__name__}, not an object"})
                return
            try:
                code, out = server.service.handle(self.path, req)
            except BadRequest as e:
                code, out = 400, {"error": f"bad request: {e}"}
            except Exception:  # noqa: BLE001 (a bug must not end the thread without an answer)
                log.exception("elastic: %s failed", self.path)
                code, out = 500, {"error": "internal error (see the driver's log)"}
            self._reply(code, out)

        def _refuse(self, code: int, message: str) -> None:
            """Answer without reading the body, then drain a little of it (bounded in bytes and by
            the request's deadline) so that the client reads the answer rather than a reset."""
            self.close_connection = True
            self._reply(code, {"error": message})
            try:
                self.wfile.flush()
                self.connection.shutdown(socket.SHUT_WR)
                self.connection.settimeout(0.2)
                drained = 0
                while drained < LINGER_BYTES:
                    chunk = self.connection.recv(16 << 10)
                    if not chunk:
                        break
                    drained += len(chunk)
            except OSError:
                pass

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
    """Signed JSON requests to one segment's service (each with its own nonce). Raises
    :class:`ServiceError` on a refusal and ``OSError`` when nothing answers (the segment is gone)."""

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
            except (ValueError, AttributeError):
                msg = ""
            raise ServiceError(e.code, msg) from None
