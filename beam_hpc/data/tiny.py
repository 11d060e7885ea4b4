"""Synthetic two-digit addition in the exact upstream schemas, for the embedded ``tiny`` recipe.

Why the upstream schemas and not Miles JSONL directly: the tiny recipe must exercise the same
``prepare(from_local=...)`` path as the real data (schema detection, deduplication, label
flattening, the manifest), so a bug there shows up on a laptop, not on the cluster. The training
file is DAPO-Math-17k-shaped parquet with repeated prompts, like the 1.79M-row release; the
evaluation file is AIME2025-shaped JSONL with 30 problems, none of which (in either order of
the operands) appears in training. Everything is a pure function of ``seed``.
"""

from __future__ import annotations

import json
import random
import uuid
from pathlib import Path

from beam_hpc.files import atomic_path

TRAIN_NAME = "dapo-math-17k-tiny.parquet"
EVAL_NAME = "aime2025-tiny.jsonl"  # the AIME2025-shaped source file
# What `prepare` names the prepared eval file of this set: named for what it holds (the recipes'
# data.eval). Run directories from before name "aime-2025.jsonl" in their plan; they still read.
PREPARED_EVAL_NAME = "tiny-add.jsonl"
# What progress bars call this set while `prepare` reads it (its rows are not DAPO-Math-17k's).
SET_NAME = "tiny-add"
_LOW, _HIGH = 10, 99
_PAIRS = (_HIGH - _LOW + 1) * (_HIGH - _LOW + 2) // 2  # unordered {a, b}: 4,095


def tiny_prompt(a: int, b: int) -> str:
    """Short on purpose: a tiny model's context is small. It asks for a boxed answer."""
    return f"What is {a} + {b}? Put the final answer in \\boxed{{}}."


def dapo_arrow_schema():  # type: ignore[no-untyped-def]
    """The column layout of the DAPO-Math-17k parquet release (a ``pyarrow.Schema``)."""
    import pyarrow as pa

    message = pa.struct([("content", pa.string()), ("role", pa.string())])
    return pa.schema(
        [
            ("data_source", pa.string()),
            ("prompt", pa.list_(message)),
            ("ability", pa.string()),
            ("reward_model", pa.struct([("ground_truth", pa.string()), ("style", pa.string())])),
            ("extra_info", pa.struct([("index", pa.string())])),
        ]
    )


def write_tiny_sources(out_dir: Path, *, seed: int = 0, n_train: int = 2000, n_eval: int = 30) -> list[Path]:
    """Write ``[train parquet, eval jsonl]`` under ``out_dir`` and return their paths."""
    if n_train < 1 or n_eval < 1 or n_train + n_eval > _PAIRS:
        raise ValueError(f"tiny data: need 1 <= n_train, 1 <= n_eval and n_train + n_eval <= {_PAIRS} (two-digit pairs)")
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(seed)
    pairs = [(a, b) for a in range(_LOW, _HIGH + 1) for b in range(a, _HIGH + 1)]
    rng.shuffle(pairs)
    eval_pairs, train_pairs = pairs[:n_eval], pairs[n_eval : n_eval + n_train]
    rows = []
    for a, b in train_pairs:
        if rng.random() < 0.5:
            a, b = b, a
        record = {
            "data_source": "beam-hpc-tiny-addition",
            "prompt": [{"content": tiny_prompt(a, b), "role": "user"}],
            "ability": "MATH",
            "reward_model": {"ground_truth": str(a + b), "style": "rule-lighteval/MATH_v2"},
            "extra_info": {"index": str(uuid.UUID(int=rng.getrandbits(128), version=4))},
        }
        rows.extend([record] * rng.randint(1, 3))  # the release repeats prompts; prepare dedups
    rng.shuffle(rows)
    schema = dapo_arrow_schema()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    train_path, eval_path = out_dir / TRAIN_NAME, out_dir / EVAL_NAME
    with atomic_path(train_path) as tmp:
        pq.write_table(pa.Table.from_pylist(rows, schema=schema), tmp)
    lines = [json.dumps({"question": tiny_prompt(a, b), "answer": str(a + b)}) + "\n" for a, b in eval_pairs]
    with atomic_path(eval_path) as tmp:
        tmp.write_text("".join(lines), encoding="utf-8")
    return [train_path, eval_path]
