"""Step time and learning curve of the reference backend on the tiny recipe (CPU).

    python benchmarks/reference_step.py --work /tmp/bench --modes async sync colocated --num-rollout 20

For each mode it runs ``recipes/tiny.yaml`` (32 prompts x 8 responses, 32 new tokens, eval every
5 rollouts on 30 held-out sums x 8 samples) as its own backend process on a private local Ray,
then prints, from ``dumps/metrics.jsonl``: median step / generate / train / wait seconds over the
rollouts after the first (which includes warm-up), rollout tokens per second, the first and last
training reward, and the eval accuracy curve. ``--json`` writes the same numbers to a file.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

MODES = {
    "async": [],
    "sync": ["training.async_training=false"],
    "colocated": ["training.colocated=true", "training.async_training=false", "topology.rollout=null"],
}


def prepare_assets(work: Path) -> tuple[Path, Path]:
    from beam_hpc.backends.reference import tiny_model
    from beam_hpc.prepare import prepare
    from beam_hpc.tiny_data import write_tiny_sources

    data = work / "data"
    if not (data / "aime-2025.jsonl").is_file():
        prepare(data, from_local=write_tiny_sources(work / "src"), progress=False)
    texts = {json.loads(x)["prompt"][0]["content"] for x in (data / "aime-2025.jsonl").read_text().splitlines()}
    return data, tiny_model.build(work / "model", seed=0, exclude_texts=texts)


def run_mode(work: Path, mode: str, num_rollout: int, data: Path, model: Path, extra: list[str]) -> dict:
    from beam_hpc.plan import make_plan
    from beam_hpc.recipe import load_recipe
    from beam_hpc.site import Site

    run_dir = work / f"run-{mode}"
    overrides = [f"output_dir={run_dir}", f"model.path={model}", f"data.dir={data}", f"num_rollout={num_rollout}",
                 f"checkpoint.interval={num_rollout}", *MODES[mode], *extra]
    plan = make_plan(load_recipe(REPO / "recipes" / "tiny.yaml", overrides), Site(name="bench", container={"runtime": "host"})).write()
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "beam_hpc.backends.reference", "--plan", str(plan), "--ray-address", "local"],
                   check=True, env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    wall = time.perf_counter() - t0
    rows = [json.loads(x) for x in (run_dir / "dumps" / "metrics.jsonl").read_text().splitlines()]
    roll = [r for r in rows if r["kind"] == "rollout"]
    steady = roll[1:] or roll

    def med(tag: str) -> float:
        return round(statistics.median(r[tag] for r in steady), 3)

    return {
        "mode": mode,
        "wall_s": round(wall, 1),
        "step_s": med("perf/rollout_time_s"),
        "generate_s": med("perf/generate_time_s"),
        "train_s": med("perf/train_time_s"),
        "wait_s": med("perf/rollout_wait_s"),
        "rollout_tokens_per_s": med("perf/rollout_tokens_per_s"),
        "reward": [round(r["rollout/reward"], 3) for r in roll],
        "correct": [round(r["rollout/correct"], 3) for r in roll],
        "eval": {r["rollout_id"]: r["eval/aime25"] for r in rows if r["kind"] == "eval"},
        "eval_len": {r["rollout_id"]: round(r["eval/aime25_response_len"], 1) for r in rows if r["kind"] == "eval"},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, required=True, help="run directories go here")
    ap.add_argument("--assets", type=Path, help="where the tiny data/ and model/ are (built if missing); default --work")
    ap.add_argument("--modes", nargs="+", default=["async", "sync"], choices=sorted(MODES))
    ap.add_argument("--num-rollout", type=int, default=20)
    ap.add_argument("--override", action="append", default=[], help="extra recipe override, key=value")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    data, model = prepare_assets(args.assets or args.work)
    results = [run_mode(args.work, m, args.num_rollout, data, model, args.override) for m in args.modes]
    for r in results:
        print(json.dumps(r))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
