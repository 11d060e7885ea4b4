"""A Miles run the local Slurm cluster can hold, on the Miles contract double: the seed's dedicated
recipe shrunk to one trainer node and one rollout node of one fake GPU, and env/local.yaml with the
Miles directory pointed at tests/support/standins/miles_standin. Used by the Miles chain
(tests/backends/miles/test_miles_slurm.py) and the Miles extra rollout job (tests/elastic/)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from miles_facts import QWEN3_8B

from beam_hpc.config.recipe import load_yaml

ROOT = Path(__file__).resolve().parents[4]
STANDIN = ROOT / "tests" / "support" / "standins" / "miles_standin"
NUM_ROLLOUT = 10
PROMPTS = 4


def miles_recipe(base: Path) -> dict:
    """The seed's dedicated configuration, shrunk to 1 trainer node + 1 rollout node of 1 fake GPU,
    with the model, torch_dist copy and data files that the login-node checks want to see."""
    d = load_yaml(ROOT / "recipes" / "dedicated.yaml")
    for sub in ("model/hf", "model/torch_dist", "data"):
        (base / sub).mkdir(parents=True, exist_ok=True)
    for name in ("dapo-math-17k.jsonl", "aime-2025.jsonl"):
        (base / "data" / name).write_text('{"prompt": [{"role": "user", "content": "1+1"}], "label": "2"}\n')
    # a public model's config.json: the architecture flags are derived from it at submit
    (base / "model/hf/config.json").write_text(json.dumps(QWEN3_8B))
    d.update(output_dir=str(base / "run"), num_rollout=NUM_ROLLOUT)
    d["model"] = {"path": str(base / "model/hf"), "ref_load": str(base / "model/torch_dist")}
    d["data"]["dir"] = str(base / "data")
    d["batch"] = {"prompts": PROMPTS, "responses_per_prompt": 2, "updates_per_rollout": 1}
    d["tokens"] = {"max_prompt": 64, "max_response": 64}
    d["reward"]["overlong_buffer"] = 16
    d["checkpoint"] = {"interval": 1000}  # the only save of segment 1 is the one the sentinel asks for
    d["training"]["offload"] = {"target": "cpu"}
    d["topology"] = {"trainer": {"nodes": 1, "gpus_per_node": 1},
                     "rollout": {"nodes": 1, "gpus_per_node": 1, "gpus_per_engine": 1}}
    d["lifecycle"] = {"walltime": "00:10:00", "lead_s": 60, "max_segments": 4}
    return d


def local_site() -> dict:
    """env/local.yaml, with the Miles directory pointed at the contract double."""
    s = load_yaml(ROOT / "env" / "local.yaml")
    s["python"] = sys.executable
    s["env"] = {"PYTHONPATH": str(STANDIN), "MILES_DIR": str(STANDIN), "BEAM_STANDIN_ROLLOUT_S": "0.3"}
    return s
