"""Stand-in for ``python -m sglang.launch_server``: SGLang's server cannot run without a GPU.

What it holds to, from SGLang's code (the copy in the miles-rl 0.0.2 wheel) and Miles main's
(radixark/miles@31f1ca961 ``sglang_engine.py``, what Miles asks of an engine it attaches):
- it accepts exactly the options of the written contract ``tests/support/fixtures/sglang-server-flags.txt``
  (SGLang's own parser, dumped) and, like argparse, exits 2 naming any other;
- it serves ``GET /health`` and ``/health_generate`` (200), ``GET|POST /flush_cache`` (200: Miles waits
  on both before it attaches), ``GET /server_info`` and ``/get_server_info`` (the parsed arguments
  under ServerArgs's field names, which Miles compares with what it expects) and ``GET /model_info``
  (``weight_version``, which Miles's health monitor reads);
- it binds ``--host``/``--port`` and stops cleanly on SIGTERM or SIGINT.
Where ``BEAM_SGLANG_STANDIN_RECORD`` names a directory, it writes ``<port>.json`` there with its argv.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

CONTRACT = Path(__file__).resolve().parents[3] / "fixtures" / "sglang-server-flags.txt"
RECORD_VAR = "BEAM_SGLANG_STANDIN_RECORD"
# ServerArgs.from_cli_args: the parser's long dest names -> the dataclass fields /server_info reports
FIELD_OF = {"tensor_parallel_size": "tp_size", "pipeline_parallel_size": "pp_size",
            "data_parallel_size": "dp_size", "expert_parallel_size": "ep_size",
            "attention_context_parallel_size": "attn_cp_size", "moe_data_parallel_size": "moe_dp_size"}
OK_PATHS = ("/health", "/health_generate", "/flush_cache")


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


def main() -> int:
    ns = parser().parse_args(sys.argv[1:])
    info = server_info(ns)
    record = os.environ.get(RECORD_VAR)
    if record:
        Path(record).mkdir(parents=True, exist_ok=True)
        (Path(record) / f"{info['port']}.json").write_text(json.dumps({"argv": sys.argv[1:], "pid": os.getpid()}))

    class Handler(BaseHTTPRequestHandler):
        def _send(self, code: int, body: object = None) -> None:
            data = json.dumps(body).encode() if body is not None else b""
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            path = self.path.split("?")[0]
            if path in OK_PATHS:
                self._send(200)
            elif path in ("/server_info", "/get_server_info"):
                self._send(200, info)
            elif path == "/model_info":
                self._send(200, {"model_path": info.get("model_path"), "weight_version": "default"})
            else:
                self._send(404, {"detail": "Not Found"})

        def do_POST(self) -> None:  # noqa: N802
            self._send(200) if self.path.split("?")[0] == "/flush_cache" else self._send(404, {"detail": "Not Found"})

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - quiet
            return

    server = ThreadingHTTPServer((str(info["host"]), int(info["port"])), Handler)
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
