"""The real ``wandb`` package for the tests: present, or a clear skip.

Tests that need it skip with the install line where it is missing, except under
``BEAM_REQUIRE_WANDB=1`` (CI), where they fail, so a broken install cannot pass as skipped tests.
They run W&B offline only: no network, no key. What ``wandb sync`` would upload is seen through
:func:`recording_wandb_server`, a local endpoint in W&B's place that answers the few calls
wandb-core's sync makes and records them.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from optional_package import OptionalPackage

WANDB_VERSION = "0.31.0"
WANDB = OptionalPackage("wandb", "BEAM_REQUIRE_WANDB",
                        f"wandb unavailable: pip install wandb=={WANDB_VERSION} to run the W&B tracking tests")
# have_wandb: for a test that checks W&B on top of what it checks anyway (the walltime chain)
have_wandb = WANDB.present
require_wandb = WANDB.require


# -- a W&B server that records: what the real `wandb sync` would upload, without W&B ----------------

FAKE_KEY = "0" * 40  # wandb checks a key's form, not its value, unless asked to verify (wbauth)


@dataclass
class Recorded:
    """What wandb-core sent: each GraphQL operation by name, and each run's file-stream requests
    (``files`` holds ``wandb-history.jsonl`` etc.; the last request of a replayed file carries
    ``complete`` and ``exitcode``)."""

    operations: list[str] = field(default_factory=list)
    streams: list[tuple[str, dict[str, Any]]] = field(default_factory=list)  # (run path, request body)

    def history(self) -> list[dict[str, Any]]:
        """Every history row uploaded, in the order the server received them."""
        rows = []
        for _, body in self.streams:
            rows += [json.loads(line) for line in body.get("files", {}).get("wandb-history.jsonl", {}).get("content", [])]
        return rows

    def exit_codes(self) -> list[int]:
        """The exit code each replayed file ended its upload with, in order."""
        return [body["exitcode"] for _, body in self.streams if body.get("complete")]


def _handler(rec: Recorded, port_box: list[int]) -> type[BaseHTTPRequestHandler]:
    """Answers the few calls wandb-core 0.31's sync makes (RunResumeStatus, UpsertBucket,
    ServerFeaturesQuery, CreateRunFiles and the uploads it names, file_stream) with the least the
    client accepts, and records them."""

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def _reply(self, obj: Any) -> None:
            data = json.dumps(obj).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _body(self) -> bytes:
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def do_PUT(self) -> None:  # a file upload, at the URL CreateRunFiles gave
            self._body()
            self._reply({})

        def do_POST(self) -> None:
            body = self._body()
            if self.path.endswith("/file_stream"):
                rec.streams.append((self.path.split("/files/", 1)[1].rsplit("/", 1)[0], json.loads(body)))
                return self._reply({"exitcode": None, "limits": {}})
            if not self.path.startswith("/graphql"):
                return self._reply({})  # the SDK's own telemetry
            req = json.loads(body)
            query, variables = req.get("query", ""), req.get("variables") or {}
            rec.operations.append(req.get("operationName") or query.split("(")[0].split()[-1])
            if "upsertBucket" in query:
                project = {"id": "p", "name": variables.get("project") or "p",
                           "entity": {"id": "e", "name": variables.get("entity") or "e"}}
                return self._reply({"data": {"upsertBucket": {"inserted": True, "bucket": {
                    "id": "b", "name": variables.get("name"), "displayName": variables.get("displayName"),
                    "description": "", "config": "{}", "sweepName": None, "historyLineCount": 0,
                    "project": project}}}})
            if "createRunFiles" in query:
                files = [{"name": f, "uploadUrl": f"http://127.0.0.1:{port_box[0]}/upload/{f}"}
                         for f in variables.get("files") or []]
                return self._reply({"data": {"createRunFiles": {"runID": "b", "uploadHeaders": [], "files": files}}})
            return self._reply({"data": {}})

    return Handler


@contextlib.contextmanager
def recording_wandb_server() -> Iterator[tuple[dict[str, str], Recorded]]:
    """A local HTTP endpoint in the place of W&B: yields the environment that points wandb at it
    (``WANDB_BASE_URL``, a key of the right form) and what it recorded."""
    rec, port_box = Recorded(), [0]
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(rec, port_box))
    port_box[0] = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield {"WANDB_BASE_URL": f"http://127.0.0.1:{port_box[0]}", "WANDB_API_KEY": FAKE_KEY}, rec
    finally:
        server.shutdown()
        server.server_close()
