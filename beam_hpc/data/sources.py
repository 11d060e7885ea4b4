"""Where upstream rows come from: local parquet/JSONL files, or Hub splits through ``datasets``.

Owns opening and reading the inputs of ``beam-hpc prepare``: recognising a file's set by its
columns (the schemas are ``data.convert``'s), describing each source (path or repo, size, sha256:
what the manifest records to decide whether a rerun may skip), and yielding its rows in batches
under one progress bar. A source is opened only when its output must be (re)written, so a
verified rerun reads and downloads nothing.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from beam_hpc.data.convert import PrepareError, dataset_of
from beam_hpc.errors import InputError, shorten
from beam_hpc.files import sha256_file
from beam_hpc.progress import Progress

_BATCH = 8192


class PreparePathError(PrepareError, InputError):
    """A path given to prepare is missing or of the wrong kind: bad input (exit 2), raised before
    anything is written; still a :class:`PrepareError` for callers that catch those."""

    exit_code = InputError.exit_code


@dataclass(frozen=True)
class Source:
    """Rows from one local file or Hub split. ``open()`` gives (row count, batches of rows); it is
    called only when the file must be (re)written, so a verified rerun downloads nothing."""

    dataset: str  # data.convert.DAPO | data.convert.AIME
    label: str  # a file path or "repo:config:split", for messages and AIME configs
    open: Callable[[], tuple[int, Iterator[list[dict[str, Any]]]]]
    describe: dict[str, Any]  # what the manifest records; the same content means the same rows

    @property
    def aime_config(self) -> str:
        """The AIME2025 config (``AIME2025-I``/``-II``) these rows are: the Hub config, or read
        from a local file's name (``aime2025-I.jsonl``), else the file's stem."""
        if self.describe.get("config"):
            return str(self.describe["config"])
        stem = Path(self.label).stem
        match = re.search(r"(?i)aime[-_]?2025[-_](I{1,2})$", stem)
        return f"AIME2025-{match.group(1).upper()}" if match else stem


def _columns_to_rows(columns: dict[str, list[Any]]) -> list[dict[str, Any]]:
    names = list(columns)
    return [dict(zip(names, values, strict=False)) for values in zip(*(columns[n] for n in names), strict=False)]


def local_source(path: Path) -> Source:
    """A ``--from-local`` file; refused (exit 2) when it is missing or not parquet/JSONL."""
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

        return Source(dataset_of(parquet.schema_arrow.names, str(path)), str(path), open_parquet, describe)
    if suffix in (".jsonl", ".json"):

        def open_jsonl() -> tuple[int, Iterator[list[dict[str, Any]]]]:
            rows = read_jsonl(path)
            return len(rows), iter([rows])

        first = next(iter(read_jsonl(path, limit=1)), {})
        return Source(dataset_of(first, str(path)), str(path), open_jsonl, describe)
    raise PreparePathError(f"--from-local {shorten(str(path))}: use a .parquet or .jsonl file in the upstream schema")


def read_jsonl(path: Path, limit: int | None = None) -> list[dict[str, Any]]:
    """The JSON objects of a JSONL file (blank lines skipped); a bad line names its number."""
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


def hub_source(repo: str, config: str | None, split: str, dataset: str) -> Source:
    """One split of a Hub dataset, downloaded through ``datasets`` when opened."""
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
        if dataset_of(ds.column_names, label) != dataset:
            raise PrepareError(f"{label}: its columns {ds.column_names} are not the {dataset} schema")
        return len(ds), (_columns_to_rows(batch) for batch in ds.iter(batch_size=_BATCH))

    return Source(dataset, label, open_hub, {"kind": "hub", "repo": repo, "config": config, "split": split})


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


def iter_rows(sources: list[Source], desc: str, progress: bool) -> Iterator[tuple[Source, int, dict[str, Any]]]:
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
