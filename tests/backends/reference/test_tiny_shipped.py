"""The shipped tiny model is the one the code would build (fast check of the key, not a rebuild).

tiny_model.build copies tiny_shipped/ only when its key (the module's source, the seed, the
excluded evaluation pairs) matches; this test fails as soon as a change to tiny_model.py or to the
tiny data set makes the shipped copy stale, so that nobody ships weights the code no longer makes.
Refresh: `python -m beam_hpc.backends.reference.model.tiny_model --refresh-shipped`.
"""

from __future__ import annotations

import json
from pathlib import Path

from beam_hpc.backends.reference.model import tiny_model
from beam_hpc.data.prepare import prepare
from beam_hpc.data.tiny import PREPARED_EVAL_NAME, write_tiny_sources


def test_shipped_tiny_model_matches_the_code(tmp_path: Path) -> None:
    prepare(tmp_path / "data", from_local=write_tiny_sources(tmp_path / "src"), progress=False,
            eval_file=PREPARED_EVAL_NAME)
    texts = {json.loads(line)["prompt"][0]["content"]
             for line in (tmp_path / "data" / PREPARED_EVAL_NAME).read_text().splitlines()}
    key = tiny_model.build_key(0, tiny_model.pairs_in(texts))
    assert (tiny_model.SHIPPED / tiny_model.KEY_FILE).read_text().strip() == key, (
        "tiny_shipped/ is stale: run `python -m beam_hpc.backends.reference.model.tiny_model --refresh-shipped`")
    info = json.loads((tiny_model.SHIPPED / "build_info.json").read_text())
    assert tiny_model.TARGET[0] <= info["held_out_accuracy"] <= tiny_model.TARGET[1]
    assert (tiny_model.SHIPPED / "model.safetensors").stat().st_size > 1_000_000
