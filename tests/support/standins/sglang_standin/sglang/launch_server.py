"""Stand-in for ``python -m sglang.launch_server``: SGLang's server cannot run without a GPU.

What it holds to, from SGLang's code (the copy in the miles-rl 0.0.2 wheel: ``srt/entrypoints/
http_server.py``, request fields from ``srt/managers/io_struct.py``) and Miles main's (radixark/miles
@31f1ca961 ``miles/backends/sglang_utils/sglang_engine.py``, what Miles asks of an engine it attaches,
and ``miles/rollout/sglang_rollout.py``, what it reads from ``/generate``):

- it accepts exactly the options of the written contract ``tests/support/fixtures/sglang-server-flags.txt``
  (SGLang's own parser, dumped) and, like argparse, exits 2 naming any other;
- ``GET /health`` and ``/health_generate`` (200), ``GET|POST /flush_cache`` (200: Miles waits on both
  before it attaches), ``GET /server_info`` and ``/get_server_info`` (the parsed arguments under
  ServerArgs's field names, which Miles compares with what it expects), ``GET /model_info``
  (``model_path`` and ``weight_version``, which Miles's health monitor reads; ``default`` until set);
- ``POST|PUT /generate`` (``GenerateReqInput``): ``input_ids`` or ``text``, ``sampling_params``
  (``max_new_tokens``, default 128, as SGLang's), ``return_logprob``; the answer has ``text``,
  ``output_ids`` and ``meta_info`` with ``finish_reason: {"type": "length"}``, ``prompt_tokens``,
  ``completion_tokens``, ``cached_tokens``, ``weight_version`` and, with ``return_logprob``,
  ``output_token_logprobs`` as ``[logprob, token_id, null]`` (what ``sglang_rollout.generate`` reads).
  The tokens come from a generator seeded with ``--random-seed`` and the prompt, so one engine
  answers a prompt the same way each time and engines of other seeds differently. Neither
  ``input_ids`` nor ``text``: 400, as SGLang's ``normalize_batch_and_arguments`` ValueError;
- the weight updates Miles sends an engine it does not colocate (``sglang_engine.py``
  ``init_weights_update_group`` / ``destroy_weights_update_group`` / ``update_weights_from_distributed``
  / ``update_weights_from_disk`` / ``update_weight_version`` / ``pause_generation`` /
  ``continue_generation``; ``release_memory_occupation`` / ``resume_memory_occupation``), each with
  ``{"success", "message"}`` (pause and continue: ``{"message", "status": "ok"}``; memory release and
  resume: ``null``). A missing
  required field or a value of the wrong type is FastAPI's 422; a distributed update into a group
  that was never initialised, or names, dtypes and shapes of different lengths, is 400 with
  ``success: false``. No tensor moves (no GPU, no NCCL): an update records its names and sets the
  weight version it carries. ``update_weights_from_tensor`` (CUDA IPC handles, colocated runs only)
  is not served;
- while paused, ``/generate`` waits for ``/continue_generation`` (at most ``PAUSE_WAIT_S``, then 503);
- it binds ``--host``/``--port`` and stops cleanly on SIGTERM or SIGINT.
Checked once by hand against miles-rl 0.0.2's own client (``SGLangEngine``'s methods, each of the
calls above, through ``requests``): every call succeeded. Importing that client takes about 90 s on
the CI machine, so the test drives the stand-in with the bodies as Miles writes them instead.
Where ``BEAM_SGLANG_STANDIN_RECORD`` names a directory, it writes ``<port>.json`` there with its argv,
and ``<port>-calls.jsonl`` with one line per weight-update call (path and body).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import signal
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

CONTRACT = Path(__file__).resolve().parents[3] / "fixtures" / "sglang-server-flags.txt"
RECORD_VAR = "BEAM_SGLANG_STANDIN_RECORD"
# ServerArgs.from_cli_args: the parser's long dest names -> the dataclass fields /server_info reports
FIELD_OF = {"tensor_parallel_size": "tp_size", "pipeline_parallel_size": "pp_size",
            "data_parallel_size": "dp_size", "expert_parallel_size": "ep_size",
            "attention_context_parallel_size": "attn_cp_size", "moe_data_parallel_size": "moe_dp_size"}
OK_PATHS = ("/health", "/health_generate", "/flush_cache")
NULL = object()  # a JSON ``null`` body, as FastAPI sends for a handler that returns None
DEFAULT_MAX_NEW_TOKENS = 128  # SamplingParams.max_new_tokens
VOCAB = 32000  # token ids drawn below this
PAUSE_WAIT_S = 30.0
PAUSE_MODES = ("abort", "retract", "in_place")  # PauseGenerationReqInput.mode
DEFAULT_GROUP = "weight_update_group"  # the group_name default of io_struct's requests
# Request bodies: required field -> type, optional field -> type (io_struct.py in miles-rl 0.0.2's sglang).
WEIGHT_REQUESTS: dict[str, tuple[dict[str, type | tuple[type, ...]], dict[str, type | tuple[type, ...]]]] = {
    "/init_weights_update_group": ({"master_address": str, "master_port": int, "rank_offset": int,
                                    "world_size": int}, {"group_name": str, "backend": str}),
    "/destroy_weights_update_group": ({}, {"group_name": str}),
    "/update_weights_from_distributed": ({"names": list, "dtypes": list, "shapes": list},
                                         {"group_name": str, "flush_cache": bool, "abort_all_requests": bool,
                                          "weight_version": (str, type(None)), "load_format": (str, type(None))}),
    "/update_weights_from_disk": ({"model_path": str}, {"load_format": (str, type(None)), "flush_cache": bool,
                                                         "abort_all_requests": bool,
                                                         "weight_version": (str, type(None))}),
    "/update_weight_version": ({"new_version": str}, {"abort_all_requests": bool}),
    "/pause_generation": ({}, {"mode": str}),
    "/continue_generation": ({}, {}),
    "/release_memory_occupation": ({}, {"tags": (list, type(None))}),
    "/resume_memory_occupation": ({}, {"tags": (list, type(None))}),
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sglang.launch_server")
    for line in CONTRACT.read_text().splitlines():
        if not line or line.startswith("#"):
            continue
        flags, nargs, dest, default = line.split("\t")
        value = json.loads(default)
        if nargs == "0":
            p.add_argument(*flags.split(","), dest=dest, action="store_const",
                           const=(not value) if isinstance(value, bool) else True, default=value)
        else:
            p.add_argument(*flags.split(","), dest=dest, nargs=None if nargs == "1" else nargs, default=value)
    return p


def server_info(ns: argparse.Namespace) -> dict[str, object]:
    info = {FIELD_OF.get(k, k): v for k, v in vars(ns).items()}
    for key in ("port", "base_gpu_id", "gpu_id_step", "tp_size", "dp_size", "pp_size", "ep_size", "nnodes",
                "node_rank", "random_seed"):
        if isinstance(info.get(key), str):
            info[key] = int(info[key])  # argparse's type=int, which the contract does not carry
    return info


class Engine:
    """What the server holds between requests: its weight version, its update groups, pause."""

    def __init__(self, info: dict[str, object], record: Path | None) -> None:
        self.info, self.record = info, record
        self.weight_version = "default"  # ServerArgs.weight_version
        self.groups: set[str] = set()
        self.running = threading.Event()
        self.running.set()
        self.lock = threading.Lock()

    def note(self, path: str, body: dict[str, Any]) -> None:
        if self.record is not None:
            with self.lock, (self.record / f"{self.info['port']}-calls.jsonl").open("a") as f:
                f.write(json.dumps({"path": path, "body": body}) + "\n")

    def generate(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        ids, text = body.get("input_ids"), body.get("text")
        if ids is None and text is None:
            return 400, {"error": {"message": "Either text or input_ids should be provided."}}
        if ids is None:
            ids = list(str(text).encode())
        params = body.get("sampling_params") or {}
        n = params.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
        if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids) or not isinstance(n, int) or n < 0:
            return 400, {"error": {"message": "input_ids must be a list of token ids, max_new_tokens an int >= 0"}}
        if not self.running.wait(PAUSE_WAIT_S):
            return 503, {"error": {"message": "generation is paused"}}
        digest = hashlib.sha256(json.dumps(ids).encode()).digest()
        rng = random.Random(int(str(self.info.get("random_seed") or 0)) * 2**64 + int.from_bytes(digest[:8], "big"))
        out_ids = [rng.randrange(VOCAB) for _ in range(n)]
        meta: dict[str, Any] = {"id": digest.hex()[:32], "finish_reason": {"type": "length", "length": n},
                                "prompt_tokens": len(ids), "completion_tokens": n, "cached_tokens": 0,
                                "weight_version": self.weight_version}
        if body.get("return_logprob"):
            meta["output_token_logprobs"] = [[-rng.random() * 4, t, None] for t in out_ids]
        return 200, {"text": " ".join(f"t{t}" for t in out_ids), "output_ids": out_ids, "meta_info": meta}

    def weights(self, path: str, body: dict[str, Any]) -> tuple[int, object]:
        required, optional = WEIGHT_REQUESTS[path]
        bad = [k for k in required if k not in body] + [
            k for k, t in {**required, **optional}.items() if k in body and not isinstance(body[k], t)]
        if path == "/pause_generation" and body.get("mode", "abort") not in PAUSE_MODES:
            bad.append("mode")
        if bad:
            return 422, {"detail": [{"loc": ["body", k], "msg": "missing or of the wrong type"} for k in bad]}
        self.note(path, body)
        group = body.get("group_name", DEFAULT_GROUP)
        if path == "/init_weights_update_group":
            self.groups.add(group)
            return 200, {"success": True, "message": "Succeeded to initialize custom process group."}
        if path == "/destroy_weights_update_group":
            if group not in self.groups:
                return 400, {"success": False, "message": f"Group {group} not in the update groups"}
            self.groups.discard(group)
            return 200, {"success": True, "message": "Succeeded to destroy custom process group."}
        if path == "/update_weights_from_distributed":
            if group not in self.groups:
                return 400, {"success": False, "message": f"Group {group} not in the update groups"}
            if not len(body["names"]) == len(body["dtypes"]) == len(body["shapes"]):
                return 400, {"success": False, "message": "names, dtypes and shapes differ in length"}
        if path in ("/update_weights_from_distributed", "/update_weights_from_disk"):
            if body.get("weight_version") is not None:
                self.weight_version = body["weight_version"]
            return 200, {"success": True, "message": "Succeeded to update model weights."}
        if path == "/update_weight_version":
            self.weight_version = body["new_version"]
            return 200, {"success": True, "message": f"Weight version updated to {body['new_version']}",
                         "new_version": body["new_version"]}
        if path == "/pause_generation":
            self.running.clear()
            return 200, {"message": "Generation paused successfully.", "status": "ok"}
        if path == "/continue_generation":
            self.running.set()
            return 200, {"message": "Generation continued successfully.", "status": "ok"}
        return 200, NULL  # memory release/resume: SGLang's handler returns nothing (JSON null); nothing held here


def main() -> int:
    ns = parser().parse_args(sys.argv[1:])
    info = server_info(ns)
    record_dir = os.environ.get(RECORD_VAR)
    record = Path(record_dir) if record_dir else None
    if record is not None:
        record.mkdir(parents=True, exist_ok=True)
        (record / f"{info['port']}.json").write_text(json.dumps({"argv": sys.argv[1:], "pid": os.getpid()}))
    engine = Engine(info, record)

    class Handler(BaseHTTPRequestHandler):
        def _send(self, code: int, body: object = None) -> None:
            data = b"null" if body is NULL else json.dumps(body).encode() if body is not None else b""
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _body(self) -> dict[str, Any] | None:
            try:
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                body = json.loads(raw) if raw else {}
            except (ValueError, OSError):
                return None
            return body if isinstance(body, dict) else None

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            path = self.path.split("?")[0]
            if path in OK_PATHS:
                self._send(200)
            elif path in ("/server_info", "/get_server_info"):
                self._send(200, info)
            elif path == "/model_info":
                self._send(200, {"model_path": info.get("model_path"), "weight_version": engine.weight_version})
            elif path in ("/release_memory_occupation", "/resume_memory_occupation"):
                self._send(*engine.weights(path, {}))
            else:
                self._send(404, {"detail": "Not Found"})

        def do_POST(self) -> None:  # noqa: N802
            path = self.path.split("?")[0]
            if path == "/flush_cache":
                self._send(200)
                return
            if path != "/generate" and path not in WEIGHT_REQUESTS:
                self._send(404, {"detail": "Not Found"})
                return
            body = self._body()
            if body is None:
                self._send(422, {"detail": [{"loc": ["body"], "msg": "a JSON object is required"}]})
            elif path == "/generate":
                self._send(*engine.generate(body))
            else:
                self._send(*engine.weights(path, body))

        def do_PUT(self) -> None:  # noqa: N802 - /generate alone takes PUT as well
            if self.path.split("?")[0] == "/generate":
                self.do_POST()
            else:
                self._send(405, {"detail": "Method Not Allowed"})

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - quiet
            return

    server = ThreadingHTTPServer((str(info["host"]), int(info["port"])), Handler)
    server.daemon_threads = True
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    stop.wait()
    server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
