"""Test driver: attach to the job's Ray cluster, report, and hold it up until released.

It proves the driver got the job's token (ray.init succeeds under RAY_AUTH_MODE=token), writes
the cluster's view to ``--marker``, then waits for the ``--release`` file (or 300 s).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from beam_hpc.files import write_json_atomic


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--ray-address", required=True)
    p.add_argument("--marker", required=True)
    p.add_argument("--release", required=True)
    args = p.parse_args()
    import ray

    ray.init(address=args.ray_address, log_to_driver=False)
    view = {"address": args.ray_address, "auth_mode": os.environ.get("RAY_AUTH_MODE"),
            "token_path": os.environ.get("RAY_AUTH_TOKEN_PATH"),
            "nodes": [n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]]}
    write_json_atomic(args.marker, view)
    deadline = time.time() + 300
    while not Path(args.release).exists() and time.time() < deadline:
        time.sleep(0.2)
    ray.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
