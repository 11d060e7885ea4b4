"""``beam-hpc prepare``: the data directory: the recipe's data (and model) on shared storage.

Owns what lies in ``data_dir`` and the manifest that vouches for it; the rows come from
``data.sources`` and are made Miles records by ``data.convert``. Outputs, under ``data_dir``:

- ``dapo-math-17k.jsonl``: BytedTsinghua-SIA/DAPO-Math-17k, deduplicated, in Miles JSONL;
- ``aime-2025.jsonl``: opencompass/AIME2025 (configs AIME2025-I and AIME2025-II, split test, 30
  problems), in Miles JSONL;
- ``models/<Name>/``: with ``--model Org/Name``, the Hub snapshot (the second concern here);
- ``manifest.json``: rows, bytes and sha256 per file, and where each came from.

Why the care: several nodes read these files, and a half-written one would train on part of the
data without anyone noticing. Each file is written to a temporary name in the same directory and
renamed into place; the manifest is written last. A rerun skips a file only when the manifest
names the same source and the file's size and sha256 still match.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from beam_hpc.data.convert import AIME, DAPO, PrepareError, aime_records, dapo_records
from beam_hpc.data.sources import PreparePathError, Source, hub_source, iter_rows, local_source
from beam_hpc.errors import shorten
from beam_hpc.files import atomic_path, sha256_file, write_json_atomic

DAPO_REPO = "BytedTsinghua-SIA/DAPO-Math-17k"
AIME_REPO = "opencompass/AIME2025"
AIME_CONFIGS = ("AIME2025-I", "AIME2025-II")
TRAIN_FILE = "dapo-math-17k.jsonl"
EVAL_FILE = "aime-2025.jsonl"
MANIFEST_FILE = "manifest.json"
MANIFEST_FORMAT = 1

_DATASET_OF_FILE = {TRAIN_FILE: DAPO, EVAL_FILE: AIME}


@dataclass(frozen=True)
class PreparedFile:
    """One output file as it stands after ``prepare``; ``skipped`` when it was already verified."""

    name: str
    path: Path
    rows: int
    sha256: str
    sources: list[dict[str, Any]]
    skipped: bool
    input_rows: int | None = None


@dataclass(frozen=True)
class PrepareReport:
    data_dir: Path
    manifest: Path
    files: tuple[PreparedFile, ...]
    model_dir: Path | None = None
    model_skipped: bool = False
    notes: tuple[str, ...] = field(default_factory=tuple)


# ---------------------------------------------------------------------------------------------
# Writing


def _write_jsonl_atomically(path: Path, records: Iterable[dict[str, Any]]) -> tuple[int, str, int]:
    """Write records as JSONL, atomically: (rows, sha256, bytes)."""
    digest, rows, size = hashlib.sha256(), 0, 0
    with atomic_path(path) as tmp, tmp.open("wb") as f:
        for record in records:
            line = (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")
            f.write(line)
            digest.update(line)
            rows += 1
            size += len(line)
    return rows, digest.hexdigest(), size


def _records(name: str, sources: list[Source], progress: bool, stats: dict[str, int],
             set_name: str | None = None) -> Iterator[dict[str, Any]]:
    """The Miles records of output ``name`` from its sources, each row named in errors by source and line.
    The progress bar is labelled with the dataset, or for another eval file (the tiny set's
    ``tiny-add.jsonl``) with that file's name: it holds no AIME2025 problems. ``set_name`` labels
    both files of a set that is not the upstream one (the tiny set's training rows are additions in
    DAPO-Math-17k's schema, not DAPO-Math-17k)."""
    role = "train" if name == TRAIN_FILE else "eval"
    label = f"{set_name} ({role})" if set_name else _DATASET_OF_FILE.get(name, Path(name).stem)
    rows = iter_rows(sources, label, progress)
    if name == TRAIN_FILE:
        return dapo_records(((f"{s.label}: row {n + 1}", row) for s, n, row in rows), stats)
    return aime_records(((f"{s.label}: row {n + 1}", s.aime_config, n, row) for s, n, row in rows), stats)


# ---------------------------------------------------------------------------------------------
# The manifest and verification


def _read_manifest(path: Path) -> dict[str, Any]:
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {"format": MANIFEST_FORMAT, "files": {}, "models": {}}
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        return {"format": MANIFEST_FORMAT, "files": {}, "models": {}}
    manifest.setdefault("files", {})
    manifest.setdefault("models", {})
    return manifest


def verified(data_dir: Path, name: str, entry: dict[str, Any] | None) -> bool:
    """True when ``name`` exists with the size and sha256 its manifest entry records."""
    path = data_dir / name
    if not entry or not path.is_file() or path.stat().st_size != entry.get("bytes"):
        return False
    return sha256_file(path) == entry.get("sha256")


def _same_sources(recorded: object, sources: list[Source]) -> bool:
    """Same content, wherever it lies now (``--tiny`` writes its sources to a new temp dir)."""

    def content(d: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in d.items() if k != "path"}

    if not isinstance(recorded, list) or len(recorded) != len(sources):
        return False
    return all(isinstance(r, dict) and content(r) == content(s.describe) for r, s in zip(recorded, sources, strict=False))


def _prepare_file(
    data_dir: Path, name: str, sources: list[Source], manifest: dict[str, Any], progress: bool,
    set_name: str | None = None,
) -> PreparedFile:
    signature = [s.describe for s in sources]
    entry = manifest["files"].get(name)
    if entry and _same_sources(entry.get("source"), sources) and verified(data_dir, name, entry):
        return PreparedFile(name, data_dir / name, entry["rows"], entry["sha256"], signature, True, entry.get("input_rows"))
    stats = {"input_rows": 0, "label_conflicts": 0}
    records = _records(name, sources, progress, stats, set_name)
    manifest["files"].pop(name, None)  # the old entry no longer describes what is on disk
    rows, sha, size = _write_jsonl_atomically(data_dir / name, records)
    if rows == 0:
        raise PrepareError(f"{name}: the sources ({', '.join(s.label for s in sources)}) held no rows")
    manifest["files"][name] = {
        "rows": rows,
        "bytes": size,
        "sha256": sha,
        "dataset": _DATASET_OF_FILE.get(name, AIME),  # another eval file name: the AIME2025 schema
        "source": signature,
        "input_rows": stats["input_rows"],
        "label_conflicts": stats["label_conflicts"],
    }
    return PreparedFile(name, data_dir / name, rows, sha, signature, False, stats["input_rows"])


# ---------------------------------------------------------------------------------------------
# The model


def model_dir_name(model: str) -> str:
    """``Org/Name`` -> ``Name``: the directory under ``<data_dir>/models``."""
    name = model.rstrip("/").rsplit("/", 1)[-1]
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name) or model.count("/") > 1:
        raise PrepareError(f"--model {model!r}: expected a Hugging Face model id such as Org/Name")
    return name


def _model_files(root: Path) -> dict[str, int]:
    return {
        str(p.relative_to(root)): p.stat().st_size
        for p in sorted(root.rglob("*"))
        if p.is_file() and ".cache" not in p.relative_to(root).parts
    }


def _prepare_model(data_dir: Path, model: str, manifest: dict[str, Any]) -> tuple[Path, bool]:
    target = data_dir / "models" / model_dir_name(model)
    entry = manifest["models"].get(model)
    if entry and target.is_dir() and _model_files(target) == entry.get("files"):
        return target, True
    manifest["models"].pop(model, None)
    from huggingface_hub import snapshot_download

    try:
        snapshot_download(repo_id=model, local_dir=str(target))
    except Exception as err:  # noqa: BLE001 - network, auth, missing repo
        raise PrepareError(f"could not download model {model}: {type(err).__name__}: {err}") from None
    files = _model_files(target)
    if not files:
        raise PrepareError(f"model {model}: the download left no files in {target}")
    manifest["models"][model] = {"path": str(target.relative_to(data_dir)), "files": files}
    return target, False


# ---------------------------------------------------------------------------------------------
# Entry point


def prepare(
    data_dir: Path,
    *,
    model: str | None = None,
    from_local: list[Path] | None = None,
    progress: bool = True,
    eval_file: str = EVAL_FILE,
    set_name: str | None = None,
) -> PrepareReport:
    """Write the training and evaluation JSONL (and download ``model``) under ``data_dir``.

    With ``from_local``, each file's dataset is recognised by its columns and only the datasets
    found there are (re)written; nothing is downloaded. Without it, both come from the Hub.
    ``eval_file`` names the evaluation file (the tiny set's is ``beam_hpc.data.tiny.PREPARED_EVAL_NAME``:
    it holds additions, not AIME problems). ``set_name`` is what the progress bars call a set that
    is not the upstream one (the tiny set: ``beam_hpc.data.tiny.SET_NAME``).
    """
    data_dir = Path(data_dir)
    for p in (data_dir, *data_dir.parents):
        if p.exists() and not p.is_dir():
            raise PreparePathError(f"--data-dir: {shorten(str(data_dir))} is not a directory ({shorten(str(p))} "
                                   "is a file); give a directory for the prepared data")
    # Every --from-local file is opened before the data directory is made: a missing one is
    # refused with nothing created.
    sources = [local_source(Path(p)) for p in from_local] if from_local else []
    data_dir.mkdir(parents=True, exist_ok=True)
    manifest_path = data_dir / MANIFEST_FILE
    manifest = _read_manifest(manifest_path)
    notes: list[str] = []

    if from_local:
        train = [s for s in sources if s.dataset == DAPO]
        evals = [s for s in sources if s.dataset == AIME]
        for name, group in ((TRAIN_FILE, train), (eval_file, evals)):
            if not group:
                notes.append(f"{name}: no {_DATASET_OF_FILE.get(name, 'AIME2025')} file among --from-local; left as it was")
    else:
        train = [hub_source(DAPO_REPO, None, "train", DAPO)]
        evals = [hub_source(AIME_REPO, config, "test", AIME) for config in AIME_CONFIGS]

    prepared = []
    try:
        for name, group in ((TRAIN_FILE, train), (eval_file, evals)):
            if group:
                prepared.append(_prepare_file(data_dir, name, group, manifest, progress, set_name))
        model_dir, model_skipped = _prepare_model(data_dir, model, manifest) if model else (None, False)
    finally:
        write_json_atomic(manifest_path, manifest, indent=2)  # records whatever did complete
    return PrepareReport(data_dir, manifest_path, tuple(prepared), model_dir, model_skipped, tuple(notes))
