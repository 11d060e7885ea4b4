"""``beam-hpc prepare``: the recipe's data (and model) on shared storage, in Miles's JSONL format.

Outputs, under ``data_dir``:

- ``dapo-math-17k.jsonl``: BytedTsinghua-SIA/DAPO-Math-17k, deduplicated by prompt content (the
  release repeats each of ~17.4k prompts about 100 times: 1.79M rows), ``reward_model.ground_truth``
  flattened to ``label`` (Miles reads top-level keys only), ``prompt`` kept as chat messages. The
  prompt's "Answer: $Answer" line becomes "Answer: \\boxed{$Answer}", as in Miles's own copy of the
  set, because the reward reads boxed answers.
- ``aime-2025.jsonl``: opencompass/AIME2025 (configs AIME2025-I and AIME2025-II, split test, 30
  problems), ``question`` as a user message (unchanged: the seed notes AIME prompts do not ask
  for a box), ``answer`` cleaned (``$``, a trailing ``^\\circ``) as ``label``.
- ``manifest.json``: rows, bytes and sha256 per file, and where each came from.

Every line is ``{"prompt": [{"role": "user", "content": ...}], "label": ..., "metadata": {...}}``
with the upstream ids and fields under ``metadata``.

Why the care: several nodes read these files, and a half-written one would train on part of the
data without anyone noticing. Each file is written to a temporary name in the same directory and
renamed into place; the manifest is written last. A rerun skips a file only when the manifest
names the same source and the file's size and sha256 still match.
"""

from __future__ import annotations

from beam_hpc.run.files import sha256_file
from beam_hpc.errors import InputError, RuntimeFailure, shorten

import hashlib
import json
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from beam_hpc.progress import Progress
from beam_hpc.run.files import atomic_path, write_atomic


class PrepareError(RuntimeFailure):
    """Bad input or a failed download, with what to do about it."""


class PreparePathError(PrepareError, InputError):
    """A path given to prepare is missing or of the wrong kind: bad input (exit 2), raised before
    anything is written; still a :class:`PrepareError` for callers that catch those."""

    exit_code = InputError.exit_code


DAPO_REPO = "BytedTsinghua-SIA/DAPO-Math-17k"
AIME_REPO = "opencompass/AIME2025"
AIME_CONFIGS = ("AIME2025-I", "AIME2025-II")
TRAIN_FILE = "dapo-math-17k.jsonl"
EVAL_FILE = "aime-2025.jsonl"
MANIFEST_FILE = "manifest.json"
MANIFEST_FORMAT = 1

_DAPO_COLUMNS = {"prompt", "reward_model"}
_AIME_COLUMNS = {"question", "answer"}
_DATASET_OF_FILE = {TRAIN_FILE: "DAPO-Math-17k", EVAL_FILE: "AIME2025"}
_BATCH = 8192


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
# Row conversion (pure)

_ANSWER_TEMPLATE = "Answer: $Answer"
_BOXED_TEMPLATE = "Answer: \\boxed{$Answer}"
_AIME_DEGREE_RE = re.compile(r"\s*(?:\^\s*\{?\s*\\circ\s*\}?|°)\s*$")


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


# ---------------------------------------------------------------------------------------------
# Reading sources: local parquet/JSONL, or the Hub through `datasets`


@dataclass(frozen=True)
class _Source:
    """Rows from one local file or Hub split. ``open()`` gives (row count, batches of rows); it is
    called only when the file must be (re)written, so a verified rerun downloads nothing."""

    dataset: str  # "DAPO-Math-17k" | "AIME2025"
    label: str  # a file path or "repo:config:split", for messages and AIME configs
    open: Callable[[], tuple[int, Iterator[list[dict[str, Any]]]]]
    describe: dict[str, Any]



def _dataset_of(columns: Iterable[str], where: str) -> str:
    cols = set(columns)
    if _DAPO_COLUMNS <= cols:
        return "DAPO-Math-17k"
    if _AIME_COLUMNS <= cols:
        return "AIME2025"
    raise PrepareError(
        f"{where}: columns {sorted(cols)} match neither upstream schema; --from-local takes DAPO-Math-17k "
        "(prompt, reward_model, data_source, ability, extra_info) or AIME2025 (question, answer) as parquet or JSONL"
    )


def _columns_to_rows(columns: dict[str, list[Any]]) -> list[dict[str, Any]]:
    names = list(columns)
    return [dict(zip(names, values)) for values in zip(*(columns[n] for n in names))]


def _local_source(path: Path) -> _Source:
    if not path.is_file():
        what = "is a directory, not a file" if path.is_dir() else "no such file"
        raise PreparePathError(f"--from-local {shorten(str(path))}: {what}; give a .parquet or .jsonl file "
                               "in the upstream schema")
    describe = {"kind": "local", "path": str(path.resolve()), "bytes": path.stat().st_size, "sha256": sha256_file(path)}
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            parquet = pq.ParquetFile(path)
        except Exception as err:  # noqa: BLE001 - pyarrow raises several types for a damaged file
            raise PrepareError(f"--from-local {path}: not a readable parquet file ({err})") from None

        def open_parquet() -> tuple[int, Iterator[list[dict[str, Any]]]]:
            batches = (batch.to_pylist() for batch in parquet.iter_batches(batch_size=_BATCH))
            return parquet.metadata.num_rows, batches

        return _Source(_dataset_of(parquet.schema_arrow.names, str(path)), str(path), open_parquet, describe)
    if suffix in (".jsonl", ".json"):

        def open_jsonl() -> tuple[int, Iterator[list[dict[str, Any]]]]:
            rows = _read_jsonl(path)
            return len(rows), iter([rows])

        first = next(iter(_read_jsonl(path, limit=1)), {})
        return _Source(_dataset_of(first, str(path)), str(path), open_jsonl, describe)
    raise PreparePathError(f"--from-local {shorten(str(path))}: use a .parquet or .jsonl file in the upstream schema")


def _read_jsonl(path: Path, limit: int | None = None) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if limit is not None and len(rows) >= limit:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise PrepareError(f"{path}:{n}: not valid JSON ({err.msg})") from None
            if not isinstance(row, dict):
                raise PrepareError(f"{path}:{n}: each line must be a JSON object")
            rows.append(row)
    return rows


def _hub_source(repo: str, config: str | None, split: str, dataset: str) -> _Source:
    label = ":".join(p for p in (repo, config, split) if p)

    def open_hub() -> tuple[int, Iterator[list[dict[str, Any]]]]:
        import datasets

        try:
            ds = datasets.load_dataset(repo, config, split=split)
        except Exception as err:  # noqa: BLE001 - network, auth, offline mode: all need the same advice
            raise PrepareError(
                f"could not download {label}: {type(err).__name__}: {err}. Without network access, download "
                "the files elsewhere and pass them with --from-local FILE (parquet or JSONL, upstream schema)."
            ) from None
        if _dataset_of(ds.column_names, label) != dataset:
            raise PrepareError(f"{label}: its columns {ds.column_names} are not the {dataset} schema")
        return len(ds), (_columns_to_rows(batch) for batch in ds.iter(batch_size=_BATCH))

    return _Source(dataset, label, open_hub, {"kind": "hub", "repo": repo, "config": config, "split": split})


# ---------------------------------------------------------------------------------------------
# Writing


class _NoProgress:
    def __enter__(self) -> _NoProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def update(self, n: float = 1) -> None:
        return None


def _progress(total: int, desc: str, enabled: bool) -> Progress | _NoProgress:
    """beam-hpc's stderr bar: redrawn on a terminal, one line per 10 % in a Slurm log."""
    return Progress(desc, total, unit="rows") if enabled else _NoProgress()


# A temporary path beside ``path`` to write; renamed onto ``path`` only if the block succeeds, so a
# reader (or a rerun) never sees a half-written file under the final name (beam_hpc.run.files).
atomic_target = atomic_path


def _write_jsonl_atomically(path: Path, records: Iterable[dict[str, Any]]) -> tuple[int, str, int]:
    """Write records as JSONL, atomically: (rows, sha256, bytes)."""
    digest, rows, size = hashlib.sha256(), 0, 0
    with atomic_target(path) as tmp, tmp.open("wb") as f:
        for record in records:
            line = (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")
            f.write(line)
            digest.update(line)
            rows += 1
            size += len(line)
    return rows, digest.hexdigest(), size


def _write_json_atomically(path: Path, obj: Any) -> None:
    write_atomic(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def _rows(sources: list[_Source], desc: str, progress: bool) -> Iterator[tuple[_Source, int, dict[str, Any]]]:
    """(source, 0-based row number, row) over all sources, with one progress bar."""
    opened = [(source, *source.open()) for source in sources]
    with _progress(sum(total for _, total, _ in opened), desc, progress) as bar:
        for source, _, batches in opened:
            n = 0
            for batch in batches:
                for row in batch:
                    yield source, n, row
                    n += 1
                bar.update(len(batch))


def _dapo_records(sources: list[_Source], progress: bool, stats: dict[str, int]) -> Iterator[dict[str, Any]]:
    seen: dict[tuple[tuple[str, str], ...], str] = {}
    for source, n, row in _rows(sources, "DAPO-Math-17k", progress):
        key, record = convert_dapo_row(row, f"{source.label}: row {n + 1}")
        stats["input_rows"] += 1
        if key in seen:
            stats["label_conflicts"] += seen[key] != record["label"]
            continue
        seen[key] = record["label"]
        yield record


def _aime_records(sources: list[_Source], progress: bool, stats: dict[str, int]) -> Iterator[dict[str, Any]]:
    for source, n, row in _rows(sources, "AIME2025", progress):
        stats["input_rows"] += 1
        yield convert_aime_row(row, f"{source.label}: row {n + 1}", _aime_config_name(source), n)


def _aime_config_name(source: _Source) -> str:
    if source.describe.get("config"):
        return str(source.describe["config"])
    stem = Path(source.label).stem
    match = re.search(r"(?i)aime[-_]?2025[-_](I{1,2})$", stem)
    return f"AIME2025-{match.group(1).upper()}" if match else stem


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


def _same_sources(recorded: object, sources: list[_Source]) -> bool:
    """Same content, wherever it lies now (``--tiny`` writes its sources to a new temp dir)."""

    def content(d: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in d.items() if k != "path"}

    if not isinstance(recorded, list) or len(recorded) != len(sources):
        return False
    return all(isinstance(r, dict) and content(r) == content(s.describe) for r, s in zip(recorded, sources))


def _prepare_file(
    data_dir: Path, name: str, sources: list[_Source], manifest: dict[str, Any], progress: bool
) -> PreparedFile:
    signature = [s.describe for s in sources]
    entry = manifest["files"].get(name)
    if entry and _same_sources(entry.get("source"), sources) and verified(data_dir, name, entry):
        return PreparedFile(name, data_dir / name, entry["rows"], entry["sha256"], signature, True, entry.get("input_rows"))
    stats = {"input_rows": 0, "label_conflicts": 0}
    records = _dapo_records(sources, progress, stats) if name == TRAIN_FILE else _aime_records(sources, progress, stats)
    manifest["files"].pop(name, None)  # the old entry no longer describes what is on disk
    rows, sha, size = _write_jsonl_atomically(data_dir / name, records)
    if rows == 0:
        raise PrepareError(f"{name}: the sources ({', '.join(s.label for s in sources)}) held no rows")
    manifest["files"][name] = {
        "rows": rows,
        "bytes": size,
        "sha256": sha,
        "dataset": _DATASET_OF_FILE.get(name, "AIME2025"),  # another eval file name: the AIME2025 schema
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
) -> PrepareReport:
    """Write the training and evaluation JSONL (and download ``model``) under ``data_dir``.

    With ``from_local``, each file's dataset is recognised by its columns and only the datasets
    found there are (re)written; nothing is downloaded. Without it, both come from the Hub.
    ``eval_file`` names the evaluation file (the tiny set's is ``beam_hpc.data.tiny.PREPARED_EVAL_NAME``:
    it holds additions, not AIME problems).
    """
    data_dir = Path(data_dir)
    for p in (data_dir, *data_dir.parents):
        if p.exists() and not p.is_dir():
            raise PreparePathError(f"--data-dir: {shorten(str(data_dir))} is not a directory ({shorten(str(p))} "
                                   "is a file); give a directory for the prepared data")
    # Every --from-local file is opened before the data directory is made: a missing one is
    # refused with nothing created.
    sources = [_local_source(Path(p)) for p in from_local] if from_local else []
    data_dir.mkdir(parents=True, exist_ok=True)
    manifest_path = data_dir / MANIFEST_FILE
    manifest = _read_manifest(manifest_path)
    notes: list[str] = []

    if from_local:
        train = [s for s in sources if s.dataset == "DAPO-Math-17k"]
        evals = [s for s in sources if s.dataset == "AIME2025"]
        for name, group in ((TRAIN_FILE, train), (eval_file, evals)):
            if not group:
                notes.append(f"{name}: no {_DATASET_OF_FILE.get(name, 'AIME2025')} file among --from-local; left as it was")
    else:
        train = [_hub_source(DAPO_REPO, None, "train", "DAPO-Math-17k")]
        evals = [_hub_source(AIME_REPO, config, "test", "AIME2025") for config in AIME_CONFIGS]

    prepared = []
    try:
        for name, group in ((TRAIN_FILE, train), (eval_file, evals)):
            if group:
                prepared.append(_prepare_file(data_dir, name, group, manifest, progress))
        model_dir, model_skipped = _prepare_model(data_dir, model, manifest) if model else (None, False)
    finally:
        _write_json_atomically(manifest_path, manifest)  # records whatever did complete
    return PrepareReport(data_dir, manifest_path, tuple(prepared), model_dir, model_skipped, tuple(notes))
