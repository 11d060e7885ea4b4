"""`beam-hpc prepare` on fixture files in the exact upstream schemas (tests/support/fixtures, made by
make_fixtures.py), the tiny synthetic set, reruns, damage and interrupted writes. No network:
the two Hub calls (``datasets.load_dataset``, ``huggingface_hub.snapshot_download``) are replaced
by contract doubles that serve the fixtures, labelled as such where they are used."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from beam_hpc.data import convert
from beam_hpc.data.convert import PrepareError, clean_aime_answer
from beam_hpc.data.prepare import EVAL_FILE, MANIFEST_FILE, TRAIN_FILE, prepare
from beam_hpc.data.tiny import PREPARED_EVAL_NAME, write_tiny_sources
from beam_hpc.reward.scoring import score_response

FIXTURES = Path(__file__).resolve().parents[2] / "tests" / "support" / "fixtures"
DAPO_PARQUET = FIXTURES / "dapo-math-17k-sample.parquet"
AIME_FILES = [FIXTURES / "aime2025-I.jsonl", FIXTURES / "aime2025-II.jsonl"]
ALL_FIXTURES = [DAPO_PARQUET, *AIME_FILES]


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def _manifest(data_dir: Path) -> dict:
    return json.loads((data_dir / MANIFEST_FILE).read_text())


def _dapo_fixture_rows() -> list[dict]:
    import pyarrow.parquet as pq

    return pq.read_table(DAPO_PARQUET).to_pylist()


def test_prepare_from_fixtures_writes_miles_jsonl(tmp_path: Path) -> None:
    report = prepare(tmp_path, from_local=ALL_FIXTURES, progress=False)

    train = _lines(tmp_path / TRAIN_FILE)
    assert len(train) == 5  # 12 rows, 5 distinct prompts
    assert [r["label"] for r in train] == ["24", "400", "45", "120", "4"]  # first occurrence wins
    for r in train:
        assert set(r) == {"prompt", "label", "metadata"}
        assert [m["role"] for m in r["prompt"]] == ["user"]
        assert "Answer: \\boxed{$Answer}" in r["prompt"][0]["content"]
        assert "Answer: $Answer" not in r["prompt"][0]["content"]
        assert r["metadata"]["data_source"] == "math_dapo" and r["metadata"]["index"].startswith("00000000-")
        assert r["metadata"]["reward_style"] == "rule-lighteval/MATH_v2"

    aime = _lines(tmp_path / EVAL_FILE)
    assert [r["label"] for r in aime] == ["10", "180", "401", "12", "80", "056"]
    assert aime[4]["metadata"] == {"config": "AIME2025-II", "index": 1, "answer": "80^\\circ"}
    assert aime[0]["metadata"]["config"] == "AIME2025-I"
    assert aime[0]["prompt"][0]["content"].startswith("Find the number of ordered pairs")

    manifest = _manifest(tmp_path)
    for f in report.files:
        entry = manifest["files"][f.name]
        assert entry["rows"] == f.rows == len(_lines(f.path)) and not f.skipped
        assert entry["sha256"] == hashlib.sha256(f.path.read_bytes()).hexdigest()
        assert entry["bytes"] == f.path.stat().st_size
    assert manifest["files"][TRAIN_FILE]["input_rows"] == 12
    assert manifest["files"][TRAIN_FILE]["label_conflicts"] == 1
    assert not list(tmp_path.glob(".*.tmp"))


def test_rerun_skips_verified_files_and_redoes_damaged_ones(tmp_path: Path) -> None:
    prepare(tmp_path, from_local=ALL_FIXTURES, progress=False)
    train, aime = tmp_path / TRAIN_FILE, tmp_path / EVAL_FILE
    stamps = (train.stat().st_mtime_ns, aime.stat().st_mtime_ns)

    again = prepare(tmp_path, from_local=ALL_FIXTURES, progress=False)
    assert [f.skipped for f in again.files] == [True, True]
    assert (train.stat().st_mtime_ns, aime.stat().st_mtime_ns) == stamps

    good = aime.read_bytes()
    aime.write_bytes(good[:-40])  # truncated by hand: different size
    train.write_bytes(train.read_bytes().replace(b'"24"', b'"42"'))  # same size, different content
    redone = prepare(tmp_path, from_local=ALL_FIXTURES, progress=False)
    assert [f.skipped for f in redone.files] == [False, False]
    assert aime.read_bytes() == good and _lines(train)[0]["label"] == "24"


def test_changed_source_is_rewritten_and_missing_dataset_left_alone(tmp_path: Path) -> None:
    prepare(tmp_path, from_local=ALL_FIXTURES, progress=False)
    only_one = prepare(tmp_path, from_local=[AIME_FILES[0]], progress=False)  # AIME-I only
    assert [f.name for f in only_one.files] == [EVAL_FILE] and not only_one.files[0].skipped
    assert len(_lines(tmp_path / EVAL_FILE)) == 3
    assert any(TRAIN_FILE in note for note in only_one.notes)
    assert _manifest(tmp_path)["files"][TRAIN_FILE]["rows"] == 5  # untouched, still vouched for


def test_interrupted_write_never_looks_complete(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    prepare(tmp_path, from_local=ALL_FIXTURES, progress=False)
    real_convert = convert.convert_aime_row

    def convert_then_die(row: dict, where: str, config: str, index: int) -> dict:
        if index == 2:
            raise KeyboardInterrupt  # the user's Ctrl-C, or a node going away, mid-file
        return real_convert(row, where, config, index)

    monkeypatch.setattr(convert, "convert_aime_row", convert_then_die)
    changed = tmp_path / "aime2025-I.jsonl"
    changed.write_text(AIME_FILES[0].read_text().replace('"10"', '"11"'))
    with pytest.raises(KeyboardInterrupt):
        prepare(tmp_path, from_local=[DAPO_PARQUET, changed, AIME_FILES[1]], progress=False)

    assert not list(tmp_path.glob(".*.tmp"))
    manifest = _manifest(tmp_path)
    assert EVAL_FILE not in manifest["files"]  # the old file is no longer vouched for
    assert manifest["files"][TRAIN_FILE]["rows"] == 5

    monkeypatch.setattr(convert, "convert_aime_row", real_convert)
    report = prepare(tmp_path, from_local=[DAPO_PARQUET, changed, AIME_FILES[1]], progress=False)
    assert [f.skipped for f in report.files] == [True, False]
    assert _lines(tmp_path / EVAL_FILE)[0]["label"] == "11"


def test_dapo_as_jsonl_gives_the_same_file(tmp_path: Path) -> None:
    jsonl = tmp_path / "dapo.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in _dapo_fixture_rows()))
    a = prepare(tmp_path / "a", from_local=[DAPO_PARQUET], progress=False).files[0]
    b = prepare(tmp_path / "b", from_local=[jsonl], progress=False).files[0]
    assert a.name == b.name == TRAIN_FILE and a.sha256 == b.sha256


@pytest.mark.parametrize(
    ("content", "name", "message"),
    [
        ('{"problem": "1+1", "solution": "2"}\n', "other.jsonl", "match neither upstream schema"),
        ("not json\n", "bad.jsonl", "not valid JSON"),
        ("a,b\n1,2\n", "data.csv", "use a .parquet or .jsonl file"),
        ("PAR1 nonsense", "broken.parquet", "not a readable parquet file"),
    ],
)
def test_bad_local_files_get_clear_errors(tmp_path: Path, content: str, name: str, message: str) -> None:
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(PrepareError, match=message):
        prepare(tmp_path / "out", from_local=[path], progress=False)
    with pytest.raises(PrepareError, match="no such file"):
        prepare(tmp_path / "out", from_local=[tmp_path / "missing.parquet"], progress=False)


def test_dapo_row_without_ground_truth_is_named(tmp_path: Path) -> None:
    rows = _dapo_fixture_rows()
    rows[3]["reward_model"] = {"style": "rule"}
    path = tmp_path / "dapo.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(PrepareError, match=r"row 4: reward_model.ground_truth is missing"):
        prepare(tmp_path / "out", from_local=[path], progress=False)
    assert not (tmp_path / "out" / TRAIN_FILE).exists()


@pytest.mark.parametrize(
    ("raw", "clean"), [("336^\\circ", "336"), ("336^{\\circ}", "336"), (" 70 ", "70"), ("$588$", "588"), (204, "204")]
)
def test_clean_aime_answer(raw: object, clean: str) -> None:
    assert clean_aime_answer(raw) == clean


def test_tiny_sources_are_deterministic_and_prepare_like_real_data(tmp_path: Path) -> None:
    first = write_tiny_sources(tmp_path / "s0", seed=0, n_train=300, n_eval=30)
    again = write_tiny_sources(tmp_path / "s0b", seed=0, n_train=300, n_eval=30)
    other = write_tiny_sources(tmp_path / "s1", seed=1, n_train=300, n_eval=30)
    assert [p.read_bytes() for p in first] == [p.read_bytes() for p in again]
    assert first[1].read_bytes() != other[1].read_bytes()
    assert json.loads(first[1].read_text().splitlines()[0]).keys() == {"question", "answer"}

    report = prepare(tmp_path / "data", from_local=first, progress=False)
    train_file, eval_file = report.files
    assert train_file.rows == 300 and train_file.input_rows > 300  # repeats removed
    assert eval_file.rows == 30
    train, evals = _lines(train_file.path), _lines(eval_file.path)

    def operands(record: dict) -> tuple[int, int]:
        a, b = record["prompt"][0]["content"].removeprefix("What is ").split("?")[0].split(" + ")
        return int(a), int(b)

    assert not {frozenset(operands(r)) for r in train} & {frozenset(operands(r)) for r in evals}
    for record in train[:20] + evals:
        assert record["label"] == str(sum(operands(record)))
        assert "\\boxed{}" in record["prompt"][0]["content"]
        right = score_response(f"\\boxed{{{record['label']}}}", record["label"], 5, max_response_tokens=64, buffer_tokens=16)
        assert right.correct and right.reward == 1.0
    with pytest.raises(ValueError, match="n_train"):
        write_tiny_sources(tmp_path / "x", n_train=5000)


def test_the_tiny_set_is_labelled_by_its_own_name(tmp_path: Path, capsys) -> None:
    """`prepare --tiny`'s progress bars: both files hold additions (in the upstream schemas), and
    their bars say so; neither names DAPO-Math-17k or AIME2025."""
    assert _cli(["prepare", "--tiny", "--data-dir", str(tmp_path / "data")]) == 0
    bars = capsys.readouterr().err
    assert "tiny-add (train): [" in bars and "tiny-add (eval): [" in bars, bars
    assert "DAPO" not in bars and "AIME" not in bars, bars


def _cli(argv: list[str]) -> int:
    from beam_hpc.cli import prepare as cli_prepare

    parser = argparse.ArgumentParser(prog="beam-hpc")
    cli_prepare.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_cli_tiny_then_rerun(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data_dir = tmp_path / "data"
    assert _cli(["prepare", "--tiny", "--data-dir", str(data_dir), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert f"{data_dir / TRAIN_FILE}: 2000 rows from" in out and "(written)" in out
    # the eval file is named for what it holds (additions), the name recipes/tiny.yaml reads
    assert f"{data_dir / PREPARED_EVAL_NAME}: 30 rows" in out and not (data_dir / "aime-2025.jsonl").exists()
    assert _cli(["prepare", "--tiny", "--data-dir", str(data_dir), "--no-progress"]) == 0
    assert out.count("(written)") == 2 and capsys.readouterr().out.count("verified, skipped") == 2
    with pytest.raises(SystemExit):  # --tiny and --from-local exclude each other
        _cli(["prepare", "--tiny", "--from-local", str(DAPO_PARQUET)])


def test_hub_download_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Contract double for the network: ``datasets.load_dataset(repo, config, split=...)`` serves
    the fixtures as real ``datasets.Dataset`` objects; everything after the call is real."""
    datasets = pytest.importorskip("datasets")
    calls: list[tuple[str, str | None, str]] = []
    served = {
        ("BytedTsinghua-SIA/DAPO-Math-17k", None, "train"): DAPO_PARQUET,
        ("opencompass/AIME2025", "AIME2025-I", "test"): AIME_FILES[0],
        ("opencompass/AIME2025", "AIME2025-II", "test"): AIME_FILES[1],
    }

    def load_dataset(repo: str, config: str | None = None, *, split: str) -> object:
        calls.append((repo, config, split))
        path = served[(repo, config, split)]
        if path.suffix == ".parquet":
            return datasets.Dataset.from_parquet(str(path), cache_dir=str(tmp_path / "cache"))
        return datasets.Dataset.from_list([json.loads(x) for x in path.read_text().splitlines()])

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    report = prepare(tmp_path / "data", progress=False)
    assert sorted(calls) == sorted(served)
    local = prepare(tmp_path / "local", from_local=ALL_FIXTURES, progress=False)
    assert [f.sha256 for f in report.files] == [f.sha256 for f in local.files]
    assert _manifest(tmp_path / "data")["files"][EVAL_FILE]["source"][1]["config"] == "AIME2025-II"

    calls.clear()
    assert all(f.skipped for f in prepare(tmp_path / "data", progress=False).files)
    assert calls == []  # a verified rerun downloads nothing


def test_model_download_recorded_and_skipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Contract double for the network: ``snapshot_download(repo_id=, local_dir=)`` writes files
    into ``local_dir`` as huggingface_hub does (plus its ``.cache`` bookkeeping)."""
    import huggingface_hub

    calls: list[str] = []

    def snapshot_download(*, repo_id: str, local_dir: str) -> str:
        calls.append(repo_id)
        root = Path(local_dir)
        (root / ".cache" / "huggingface").mkdir(parents=True, exist_ok=True)
        (root / "config.json").write_text('{"model_type": "qwen2"}')
        (root / "model.safetensors").write_bytes(b"\0" * 64)
        return local_dir

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    report = prepare(tmp_path, model="Org/Tiny-Model", from_local=AIME_FILES, progress=False)
    assert report.model_dir == tmp_path / "models" / "Tiny-Model" and not report.model_skipped
    entry = _manifest(tmp_path)["models"]["Org/Tiny-Model"]
    assert entry == {"path": "models/Tiny-Model", "files": {"config.json": 23, "model.safetensors": 64}}
    assert prepare(tmp_path, model="Org/Tiny-Model", from_local=AIME_FILES, progress=False).model_skipped
    (tmp_path / "models" / "Tiny-Model" / "model.safetensors").write_bytes(b"\0" * 10)  # damaged
    assert not prepare(tmp_path, model="Org/Tiny-Model", from_local=AIME_FILES, progress=False).model_skipped
    assert calls == ["Org/Tiny-Model", "Org/Tiny-Model"]
    with pytest.raises(PrepareError, match="--model"):
        prepare(tmp_path, model="../../etc", from_local=AIME_FILES, progress=False)


@pytest.mark.slow
def test_offline_download_fails_with_advice(tmp_path: Path) -> None:
    """The real `datasets` in offline mode: the error must point at --from-local."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    code = f"from beam_hpc.data.prepare import prepare; prepare({str(tmp_path / 'data')!r}, progress=False)"
    result = subprocess.run([sys.executable, "-c", code], check=False, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "PrepareError: could not download BytedTsinghua-SIA/DAPO-Math-17k:train" in result.stderr
    assert "--from-local" in result.stderr
    assert not (tmp_path / "data" / TRAIN_FILE).exists()
