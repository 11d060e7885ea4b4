"""Upstream rows -> Miles records: the two upstream schemas and their conversion (pure).

Owns what a row of each upstream set looks like and what beam-hpc makes of it; nothing here reads
a file or the network (``data.sources`` does), or writes one (``data.prepare`` does).
DAPO-Math-17k: ``reward_model.ground_truth`` flattened to ``label`` (Miles reads top-level keys
only), ``prompt`` kept as chat messages with its "Answer: $Answer" line made "Answer:
\\boxed{$Answer}" as in Miles's own copy of the set (the reward reads boxed answers), deduplicated by
prompt (the release repeats each of ~17.4k prompts about 100 times). AIME2025: the question as a
user message, unchanged (the seed notes AIME prompts do not ask for a box), the answer cleaned (``$``, a
trailing ``^\\circ``). Every record is ``{"prompt": [{"role": "user", "content": ...}], "label": ...,
"metadata": {...}}`` with the upstream ids and fields under ``metadata``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

from beam_hpc.errors import RuntimeFailure

DAPO = "DAPO-Math-17k"
AIME = "AIME2025"
_DAPO_COLUMNS = {"prompt", "reward_model"}
_AIME_COLUMNS = {"question", "answer"}

_ANSWER_TEMPLATE = "Answer: $Answer"
_BOXED_TEMPLATE = "Answer: \\boxed{$Answer}"
_AIME_DEGREE_RE = re.compile(r"\s*(?:\^\s*\{?\s*\\circ\s*\}?|°)\s*$")


class PrepareError(RuntimeFailure):
    """Bad input or a failed download, with what to do about it (every ``beam-hpc prepare`` error)."""


def dataset_of(columns: Iterable[str], where: str) -> str:
    """Which upstream set a file or split with these columns is (:data:`DAPO` or :data:`AIME`)."""
    cols = set(columns)
    if _DAPO_COLUMNS <= cols:
        return DAPO
    if _AIME_COLUMNS <= cols:
        return AIME
    raise PrepareError(
        f"{where}: columns {sorted(cols)} match neither upstream schema; --from-local takes DAPO-Math-17k "
        "(prompt, reward_model, data_source, ability, extra_info) or AIME2025 (question, answer) as parquet or JSONL"
    )


def clean_aime_answer(raw: object) -> str:
    """``"336^\\circ"`` -> ``"336"``; also drops ``$`` delimiters and whitespace."""
    text = str(raw).strip().strip("$").strip()
    return _AIME_DEGREE_RE.sub("", text)


def _messages(prompt: object, where: str) -> list[dict[str, str]]:
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if not isinstance(prompt, list) or not prompt:
        raise PrepareError(f"{where}: prompt must be a list of {{role, content}} messages, got {type(prompt).__name__}")
    messages = []
    for m in prompt:
        if not isinstance(m, dict) or "content" not in m:
            raise PrepareError(f"{where}: each prompt message needs 'role' and 'content', got {m!r:.80}")
        messages.append({"role": str(m.get("role") or "user"), "content": str(m["content"])})
    return messages


def convert_dapo_row(row: dict[str, Any], where: str) -> tuple[tuple[tuple[str, str], ...], dict[str, Any]]:
    """An upstream DAPO-Math-17k row -> (dedup key, Miles record)."""
    messages = _messages(row.get("prompt"), where)
    reward_model = row.get("reward_model")
    if not isinstance(reward_model, dict) or reward_model.get("ground_truth") is None:
        raise PrepareError(f"{where}: reward_model.ground_truth is missing; expected the DAPO-Math-17k schema")
    extra = row.get("extra_info") if isinstance(row.get("extra_info"), dict) else {}
    key = tuple((m["role"], m["content"]) for m in messages)
    record = {
        "prompt": [{**m, "content": m["content"].replace(_ANSWER_TEMPLATE, _BOXED_TEMPLATE)} for m in messages],
        "label": str(reward_model["ground_truth"]).strip(),
        "metadata": {
            "data_source": row.get("data_source"),
            "ability": row.get("ability"),
            "index": extra.get("index"),
            "reward_style": reward_model.get("style"),
        },
    }
    return key, record


def convert_aime_row(row: dict[str, Any], where: str, config: str, index: int) -> dict[str, Any]:
    """An upstream AIME2025 row (``question``, ``answer``) -> Miles record."""
    question, answer = row.get("question"), row.get("answer")
    if not isinstance(question, str) or answer is None:
        raise PrepareError(f"{where}: needs a 'question' string and an 'answer'; expected the AIME2025 schema")
    extra = {k: v for k, v in row.items() if k not in ("question", "answer")}
    return {
        "prompt": [{"role": "user", "content": question}],
        "label": clean_aime_answer(answer),
        "metadata": {"config": config, "index": index, "answer": str(answer), **extra},
    }


def dapo_records(rows: Iterable[tuple[str, dict[str, Any]]], stats: dict[str, int]) -> Iterator[dict[str, Any]]:
    """(where, row) -> records, the first of each prompt only; counts ``input_rows`` and
    ``label_conflicts`` (a repeated prompt with another label) into ``stats``."""
    seen: dict[tuple[tuple[str, str], ...], str] = {}
    for where, row in rows:
        key, record = convert_dapo_row(row, where)
        stats["input_rows"] += 1
        if key in seen:
            stats["label_conflicts"] += seen[key] != record["label"]
            continue
        seen[key] = record["label"]
        yield record


def aime_records(rows: Iterable[tuple[str, str, int, dict[str, Any]]], stats: dict[str, int]) -> Iterator[dict[str, Any]]:
    """(where, config, index in its config, row) -> records; counts ``input_rows`` into ``stats``."""
    for where, config, index, row in rows:
        stats["input_rows"] += 1
        yield convert_aime_row(row, where, config, index)
