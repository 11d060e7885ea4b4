"""Time the pre-Ray check (the image's Miles parsing the driver command) on this machine.

``PYTHONPATH=$PWD .venv/bin/python benchmarks/miles_preflight.py [--repeat 3] [--json out.json]``

Needs ``miles-rl`` importable (no container: site runtime ``host``). Each repetition runs the check
process from scratch (a fresh interpreter importing Miles, Megatron and SGLang, as the job does on
the head node) for two seed configurations on a Qwen3-30B-A3B config.json: ``colocated`` as
shipped (refused by miles-rl 0.0.2: four flags it lacks) and ``dedicated`` with the remedies the
refusal names (accepted after Miles's whole validation).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), *(str(ROOT / "tests" / "support" / d)
                             for d in ("builders/miles", "cluster", "standins"))]

from miles_facts import QWEN3_30B_A3B  # noqa: E402

from beam_hpc.backends.miles import preflight  # noqa: E402
from beam_hpc.backends.registry import plan_for  # noqa: E402
from beam_hpc.config.recipe import load_recipe  # noqa: E402
from beam_hpc.config.site import Site  # noqa: E402

CASES = {
    "colocated (as shipped)": ("colocated", []),
    "dedicated (cpu offload, no sentinel)": ("dedicated", ["training.offload.target=cpu", "lifecycle.save_on_request=false"]),
}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json", default=None)
    opts = p.parse_args()
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    tmp = Path(tempfile.mkdtemp(prefix="beam-preflight-bench-"))
    (tmp / "model").mkdir()
    (tmp / "model" / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    site = Site(name="bench", container={"runtime": "host"}, python=sys.executable)
    out: dict[str, dict] = {}
    for label, (name, overrides) in CASES.items():
        r = load_recipe(ROOT / "recipes" / f"{name}.yaml", ["model.miles_model_script=null", f"model.path={tmp}/model",
                                                               f"output_dir={tmp}/run-{name}", *overrides])
        plan = plan_for(r, site)
        walls, inner, verdicts = [], [], []
        for _ in range(opts.repeat):
            load = os.getloadavg()[0]
            start = time.monotonic()
            v = preflight.check_plan(plan)
            walls.append(time.monotonic() - start)
            inner.append(float(v.detail.get("seconds", 0.0)))
            verdicts.append(("accepted" if v.ok else f"refused ({len(v.unrecognized)} unknown flags)", round(load, 2)))
        out[label] = {"wall_s": walls, "parse_s": inner, "verdicts": verdicts,
                      "median_wall_s": statistics.median(walls), "median_parse_s": statistics.median(inner)}
        print(f"{label}: wall median {statistics.median(walls):.1f} s (min {min(walls):.1f}, max {max(walls):.1f}); "
              f"inside, import+parse median {statistics.median(inner):.1f} s; {verdicts}", flush=True)
    if opts.json:
        Path(opts.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
