"""Test driver: one Ray task on every node of the job, as a JIT compiler in an actor would run.

On the node whose address is ``--write-on`` the task writes a kernel file into its
``TRITON_CACHE_DIR`` (what Triton does on a cache miss); on every node it reports the cache
variables it inherited from the node's ``ray start``, the files in its Triton cache and the image
the Apptainer stand-in ran. The report goes to ``--out`` (JSON, one entry per node address).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

KERNEL = Path("9a1f3c", "matmul_kernel.cubin")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--ray-address", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--write-on", default="")
    args = p.parse_args()
    import ray

    ray.init(address=args.ray_address, log_to_driver=False)

    @ray.remote(num_cpus=0)
    def on_node(write: bool) -> dict:
        triton = Path(os.environ["TRITON_CACHE_DIR"])
        if write:
            (triton / KERNEL).parent.mkdir(parents=True, exist_ok=True)
            (triton / KERNEL).write_bytes(b"\x7fELF kernel")
        return {"ip": ray.util.get_node_ip_address(),
                "env": {k: os.environ.get(k) for k in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR",
                                                       "DG_JIT_CACHE_DIR", "SGLANG_DG_CACHE_DIR",
                                                       "FLASHINFER_WORKSPACE_BASE", "SGLANG_CACHE_DIR",
                                                       "FAKE_APPTAINER_IMAGE")},
                "ray_auth_mode": os.environ.get("RAY_AUTH_MODE"),
                "triton_files": sorted(str(f.relative_to(triton)) for f in triton.rglob("*") if f.is_file())}

    ips = [n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]]
    results = ray.get([on_node.options(resources={f"node:{ip}": 0.001}).remote(ip == args.write_on) for ip in ips])
    Path(args.out).write_text(json.dumps({r["ip"]: r for r in results}, indent=1))
    ray.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
