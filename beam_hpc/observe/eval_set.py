"""Which evaluation set a run's eval numbers come from, for `beam-hpc status` and `plot`.

A number such as "accuracy 0.487" means nothing without the data behind it: the seed's AIME2025 and
the tiny recipe's synthetic additions share a schema (and, in runs from before the tiny set's file
was named ``tiny-add.jsonl``, a file name), so the name and label come
from the run's plan (``recipe.data.eval_name`` / ``eval_label``), and the file and its row count
from the prepare manifest in the data directory (``beam_hpc.data.prepare``).

Both are read, never trusted: an old plan without ``eval_name`` means the seed's ``aime25``; a run
whose metrics carry another eval tag than the plan names (written before the recipe named its set,
or resumed across a rename) is read under the tag it really recorded; a manifest that is missing,
unreadable, or no longer matches the file on disk gives "unknown", never a traceback.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from beam_hpc.config.recipe import DataSpec
from beam_hpc.data.prepare import MANIFEST_FILE, MANIFEST_FORMAT
from beam_hpc.files import sha256_file
from beam_hpc.run import metric_names

_MAX_HASHED_BYTES = 64 << 20  # check the sha256 of eval files up to this size (AIME2025: ~20 kB)
UNKNOWN = "unknown"


@dataclass(frozen=True)
class EvalData:
    """The eval file as the prepare manifest describes it; ``rows`` is None when unknown."""

    file: str | None  # the path the recipe names (data.dir / data.eval)
    rows: int | None
    sha256: str | None
    note: str  # "" when the manifest vouches for the file, else why the rows are unknown

    def describe(self) -> str:
        """One line for people: ``<file>: 30 rows (prepare manifest)``, or says what is unknown."""
        where = self.file or "eval file unknown"
        if self.rows is None:
            return f"{where}: rows {UNKNOWN} ({self.note})" if self.note else f"{where}: rows {UNKNOWN}"
        return f"{where}: {self.rows} rows (prepare manifest)"


@dataclass(frozen=True)
class EvalSet:
    """The evaluation set of one run: its slug (as in the metric tags), its human label, the tags
    its numbers are stored under in this run, and the data they were computed on."""

    name: str
    label: str
    accuracy_tag: str
    response_len_tag: str
    data: EvalData

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _recipe_data(plan: dict[str, Any] | None) -> dict[str, Any]:
    recipe = (plan or {}).get("recipe")
    data = recipe.get("data") if isinstance(recipe, dict) else None
    return data if isinstance(data, dict) else {}


def _text(value: object) -> str | None:
    return value.strip() if isinstance(value, str) and value.strip() else None


def eval_set_of(plan: dict[str, Any] | None, recorded_tags: set[str] | frozenset[str]) -> EvalSet:
    """The run's evaluation set from its plan dict (None: no plan.json) and the metric tags it
    recorded. The plan's name wins when its tag is there (or nothing was recorded yet); else the one
    eval name the metrics do carry (an old run), under the plan's label when the plan has one."""
    data = _recipe_data(plan)
    planned = _text(data.get("eval_name")) or metric_names.DEFAULT_EVAL_NAME
    label = _text(data.get("eval_label"))
    name = planned
    if metric_names.eval_accuracy_tag(planned) not in recorded_tags:
        recorded = metric_names.eval_names_in(recorded_tags)
        if len(recorded) == 1:
            name = recorded[0]
            if label is None and _text(data.get("eval_name")) is None:
                label = DataSpec.label_for(name)  # no name in the plan: the tags are all there is
    return EvalSet(
        name=name,
        label=label or DataSpec.label_for(planned),
        accuracy_tag=metric_names.eval_accuracy_tag(name),
        response_len_tag=metric_names.eval_response_len_tag(name),
        data=eval_data_of(data),
    )


def eval_data_of(data: dict[str, Any]) -> EvalData:
    """The eval file named by a plan's ``recipe.data`` and its row count from the prepare manifest
    beside it; every failure to read or match the manifest is a note, not an exception."""
    d, ev = _text(data.get("dir")), _text(data.get("eval"))
    if ev is None:
        return EvalData(None, None, None, "the plan names no eval file")
    path = Path(ev) if ev.startswith("/") or d is None else Path(d) / ev
    manifest_path = path.parent / MANIFEST_FILE
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return EvalData(str(path), None, None, f"no {MANIFEST_FILE} beside it")
    except (OSError, ValueError) as err:
        return EvalData(str(path), None, None, f"{MANIFEST_FILE} unreadable: {type(err).__name__}")
    files = manifest.get("files") if isinstance(manifest, dict) else None
    entry = files.get(path.name) if isinstance(files, dict) and manifest.get("format") == MANIFEST_FORMAT else None
    if not isinstance(entry, dict):
        return EvalData(str(path), None, None, f"{MANIFEST_FILE} does not describe {path.name}")
    rows, size, sha = entry.get("rows"), entry.get("bytes"), entry.get("sha256")
    if not (isinstance(rows, int) and not isinstance(rows, bool) and rows >= 0 and isinstance(size, int)
            and isinstance(sha, str)):
        return EvalData(str(path), None, None, f"{MANIFEST_FILE} entry for {path.name} is malformed")
    try:
        st = path.stat()
        if st.st_size != size:
            return EvalData(str(path), None, None, "the file changed since prepare (size differs)")
        if st.st_size <= _MAX_HASHED_BYTES and sha256_file(path) != sha:
            return EvalData(str(path), None, None, "the file changed since prepare (sha256 differs)")
    except OSError as err:
        return EvalData(str(path), None, None, f"the file is not readable here: {type(err).__name__}")
    return EvalData(str(path), rows, sha, "")


