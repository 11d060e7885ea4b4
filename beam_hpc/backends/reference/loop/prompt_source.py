"""Training and evaluation prompts, and the data order as a pure function of (seed, cursor).

The only data state a run carries is the cursor (prompts consumed so far); which prompt sits at
cursor ``c`` is computed from the run seed and ``c`` alone, so a resumed run draws exactly the
prompts an uninterrupted one would (a bitwise resume needs nothing else of the data). The cursor is saved
with each checkpoint under Miles's name (``rollout/global_dataset_state_dict_<k>.pt``) and with
Miles's field names (``sample_offset``, ``epoch_id``).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from beam_hpc.backends.reference.model.policy import derive_seed
from beam_hpc.errors import InputError


class DataError(InputError):
    """A data file is missing or malformed; the message names the file and the fix."""


@dataclass(frozen=True)
class Prompt:
    index: int  # row number in the source file
    ids: list[int]
    label: str


def read_rows(path: str) -> list[dict[str, Any]]:
    p = Path(path)
    if not p.is_file():
        raise DataError(f"{p}: no such data file; run `beam-hpc prepare` (or `beam-hpc execute recipes/tiny.yaml`, which writes the tiny data)")
    rows = []
    with p.open() as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                _ = row["prompt"][0]["content"], row["label"]
            except (ValueError, KeyError, IndexError, TypeError):
                raise DataError(f"{p}:{n}: expected {{'prompt': [{{'role': ..., 'content': ...}}], 'label': ...}}") from None
            rows.append(row)
    if not rows:
        raise DataError(f"{p}: the file has no rows")
    return rows


def encode_prompts(rows: list[dict[str, Any]], tokenizer: Any, max_prompt: int) -> tuple[list[Prompt], int]:
    """Chat-format and tokenize; prompts over ``max_prompt`` tokens are skipped (Miles's
    ``--rollout-max-prompt-len`` filters the same way: a truncated problem is a different problem).
    Returns (kept prompts, number skipped)."""
    kept: list[Prompt] = []
    skipped = 0
    for i, row in enumerate(rows):
        ids = tokenizer.encode(tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True))
        if len(ids) > max_prompt:
            skipped += 1
            continue
        kept.append(Prompt(i, list(ids), str(row["label"])))
    return kept, skipped


class PromptOrder:
    """Epoch-wise permutations of the kept prompts, seeded per (run seed, epoch)."""

    def __init__(self, prompts: list[Prompt], seed: int, shuffle: bool) -> None:
        if not prompts:
            raise DataError("no training prompt fits tokens.max_prompt; raise tokens.max_prompt")
        self.prompts = prompts
        self.seed = seed
        self.shuffle = shuffle
        self._perm_epoch = -1
        self._perm: list[int] = []

    def _permutation(self, epoch: int) -> list[int]:
        if epoch != self._perm_epoch:
            order = list(range(len(self.prompts)))
            if self.shuffle:
                random.Random(derive_seed(self.seed, "data-order", epoch)).shuffle(order)
            self._perm, self._perm_epoch = order, epoch
        return self._perm

    def take(self, cursor: int, count: int) -> list[Prompt]:
        n = len(self.prompts)
        return [self.prompts[self._permutation(c // n)[c % n]] for c in range(cursor, cursor + count)]

    def state(self, cursor: int) -> dict[str, int]:
        n = len(self.prompts)
        return {"sample_offset": cursor, "epoch_id": cursor // n, "sample_index": cursor % n, "dataset_size": n}
