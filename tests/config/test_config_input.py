"""Strict input for recipes, site profiles and ``--set`` overrides (issue 14, items 2 and 3).

Table-driven: every bad file, override and out-of-range value must raise
:class:`beam_hpc.errors.InputError` with a message naming the file, override or field; a
representative subset goes through ``beam-hpc render`` to check exit code 2, one stderr line per
problem and no traceback. Valid controls make sure the strictness refuses nothing that is right:
Slurm times quoted or not, sane anchors, the shipped recipes and sites.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from beam_hpc.cli.app import main
from beam_hpc.config import strict_yaml
from beam_hpc.config.recipe import apply_overrides, load_recipe, load_yaml, recipe_from_dict
from beam_hpc.config.site import find_site, load_site, site_from_dict
from beam_hpc.config.slurm_size import parse_mib
from beam_hpc.config.strict_yaml import MAX_BYTES, parse_yaml_value
from beam_hpc.errors import InputError

ROOT = Path(__file__).resolve().parents[2]
DEDICATED = (ROOT / "recipes" / "dedicated.yaml").read_text()
SITE = str(ROOT / "env" / "example-site.yaml")


def _billion_laughs() -> str:
    """Nine levels of nine aliases: 9**9 (387 million) strings when expanded, 800 bytes on disk."""
    lines = ['l0: &l0 "lol"']
    for i in range(1, 10):
        lines.append(f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]")
    return DEDICATED + "\n".join(lines) + "\n"


def _bytes(text: str | bytes) -> bytes:
    return text if isinstance(text, bytes) else text.encode()


# (id, file content, substrings the one-line message must hold besides the file name)
BAD_FILES: list[tuple[str, str | bytes, list[str]]] = [
    ("latin-1 byte", DEDICATED.encode() + b"name: caf\xe9\n", ["not UTF-8", f"byte {len(DEDICATED) + 9}"]),
    ("latin-1 first byte", b"\xe9t\xe9: 1\n", ["not UTF-8", "byte 0"]),
    ("utf-16", "name: x\n".encode("utf-16"), ["not UTF-8", "byte 0"]),
    ("billion laughs", _billion_laughs(), ["expands to more than", "aliases"]),
    ("recursive anchor", DEDICATED + "backend_options: &a {x: *a}\n", ["recursive"]),
    ("deep nesting", "name: " + "[" * 5000 + "]" * 5000 + "\n", ["nested deeper"]),
    ("duplicate top-level key", DEDICATED + "num_rollout: 5\n", ["duplicate key 'num_rollout'",
     f"first at line {DEDICATED.splitlines().index(next(l for l in DEDICATED.splitlines() if l.startswith('num_rollout:'))) + 1}"]),
    ("duplicate key in flow mapping", DEDICATED.replace("batch: {prompts: 32,", "batch: {prompts: 32, prompts: 16,"),
     ["duplicate key 'prompts'"]),
    ("duplicate nested key", DEDICATED.replace("  mode: full\n", "  mode: full\n  mode: lora\n"), ["duplicate key 'mode'"]),
    ("python tag", DEDICATED.replace("name: dedicated", "name: !!python/object/apply:os.system ['true']"),
     ["tag", "python/object/apply:os.system", "not allowed"]),
    ("python name tag", DEDICATED + "seed: !!python/name:os.getpid ''\n", ["tag", "not allowed"]),
    ("binary tag", DEDICATED.replace("name: dedicated", "name: !!binary ZGVk"), ["binary", "not allowed"]),
    ("set tag", DEDICATED + "backend_options: !!set {a, b}\n", ["set", "not allowed"]),
    ("local tag", DEDICATED.replace("name: dedicated", "name: !mine dedicated"), ["!mine", "not allowed"]),
    ("timestamp tag", DEDICATED.replace("name: dedicated", "name: !!timestamp 2026-01-01"), ["timestamp", "not allowed"]),
    ("unclosed flow", DEDICATED.replace("batch: {prompts: 32,", "batch: {prompts: 32"), ["not valid YAML", "line"]),
    ("unclosed bracket", "name: [x\n", ["not valid YAML", "line 2"]),
    ("tab indentation", "name: x\nmodel:\n\tpath: /m\n", ["not valid YAML", "line 3"]),
    ("control character", "name: \x07bell\n", ["not valid YAML", "line 1", "control character #x0007"]),
    ("undefined alias", DEDICATED + "seed: *nope\n", ["not valid YAML", "nope"]),
    ("two documents", "name: a\n---\nname: b\n", ["not valid YAML", "single document"]),
    ("unhashable key", "? [a, b]\n: 1\n", ["not valid YAML", "unhashable"]),
    ("empty file", "", ["empty"]),
    ("comments only", "# nothing\n", ["empty"]),
    ("top-level list", "- name\n- x\n", ["mapping", "list"]),
    ("top-level scalar", "dedicated\n", ["mapping", "str"]),
    ("too large", "# " + "x" * MAX_BYTES + "\nname: x\n", ["too large", str(MAX_BYTES)]),
]


@pytest.mark.parametrize("content,expect", [c[1:] for c in BAD_FILES], ids=[c[0] for c in BAD_FILES])
def test_bad_recipe_file_is_one_input_error(tmp_path: Path, content: str | bytes, expect: list[str]) -> None:
    path = tmp_path / "r.yaml"
    path.write_bytes(_bytes(content))
    with pytest.raises(InputError) as info:
        load_recipe(path)
    msg = str(info.value)
    assert msg.startswith(str(path)), msg
    assert len(msg.splitlines()) == 1 and len(msg) < 600, msg
    for part in expect:
        assert part in msg, (part, msg)


def _missing(tmp: Path) -> Path:
    return tmp / "nope.yaml"


def _directory(tmp: Path) -> Path:
    (tmp / "d.yaml").mkdir()
    return tmp / "d.yaml"


def _fifo(tmp: Path) -> Path:
    os.mkfifo(tmp / "f.yaml")
    return tmp / "f.yaml"


def _unreadable(tmp: Path) -> Path:
    if os.geteuid() == 0:
        pytest.skip("root reads every file")
    path = tmp / "locked.yaml"
    path.write_text(DEDICATED)
    path.chmod(0)
    return path


def _nul_in_name(tmp: Path) -> Path:
    return tmp / "a\0b.yaml"


UNREADABLE: list[tuple[str, Callable[[Path], Path], str]] = [
    ("missing", _missing, "no such recipe file"),
    ("nul in the name", _nul_in_name, "cannot read this recipe file"),
    ("directory", _directory, "is a directory"),
    ("fifo", _fifo, "not a regular file"),
    ("permission", _unreadable, "permission denied"),
]


@pytest.mark.parametrize("make,expect", [u[1:] for u in UNREADABLE], ids=[u[0] for u in UNREADABLE])
def test_unreadable_recipe_file_is_named(tmp_path: Path, make: Callable[[Path], Path], expect: str) -> None:
    path = make(tmp_path)
    with pytest.raises(InputError, match=expect) as info:
        load_recipe(path)
    assert str(tmp_path) in str(info.value)


def test_read_refused_by_the_os_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The permission case above is skipped as root; here the open itself fails, as for a user."""
    path = tmp_path / "r.yaml"
    path.write_text(DEDICATED)

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(strict_yaml, "open", refuse, raising=False)
    with pytest.raises(InputError, match="cannot read this site profile file \\(permission denied\\)") as info:
        load_site(path)
    assert str(path) in str(info.value)


# (id, override, substrings); the override itself (shortened) must be named
BAD_OVERRIDES: list[tuple[str, str, list[str]]] = [
    ("value not YAML", "num_rollout=[", ["override 'num_rollout=['", "not valid YAML", "quote the value"]),
    ("unclosed mapping", "batch={prompts: 3", ["override", "not valid YAML"]),
    ("empty key", "=5", ["override '=5'", "empty part"]),
    ("empty middle part", "a..b=1", ["override 'a..b=1'", "empty part"]),
    ("trailing dot", "batch.prompts.=3", ["empty part"]),
    ("no equals sign", "num_rollout", ["override 'num_rollout'", "no '='", "key.path=value"]),
    ("python tag", "name=!!python/object/apply:os.system ['true']", ["override", "tag", "not allowed"]),
    ("local tag", "seed=!seed 5", ["override", "not allowed"]),
    ("duplicate key", "batch={prompts: 1, prompts: 2}", ["override", "duplicate key 'prompts'"]),
    ("recursive alias", "backend_options=&a {x: *a}", ["override", "recursive"]),
    ("billion laughs", "backend_options={a: &a [x,x,x,x,x,x,x,x,x,x], b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a,*a], "
     "c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b,*b], d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c,*c], "
     "e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d,*d], f: [*e,*e,*e,*e,*e,*e,*e,*e,*e,*e]}", ["override", "expands"]),
    ("control character", "name=\x07", ["override", "not valid YAML"]),
    ("through a value", "model.path.x=1", ["override", "'path' is not a section"]),
    ("value over the size limit", "name=" + "x" * (MAX_BYTES + 1), ["override", "longer than", "... ("]),
]


@pytest.mark.parametrize("override,expect", [o[1:] for o in BAD_OVERRIDES], ids=[o[0] for o in BAD_OVERRIDES])
def test_bad_override_names_the_override(tmp_path: Path, override: str, expect: list[str]) -> None:
    data = load_yaml(ROOT / "recipes" / "dedicated.yaml")
    with pytest.raises(InputError) as info:
        apply_overrides(data, [override])
        recipe_from_dict(data, "dedicated.yaml")
    msg = str(info.value)
    assert len(msg.splitlines()) == 1 and len(msg) < 800, msg[:1000]
    for part in expect:
        assert part in msg, (part, msg)


# (id, overrides, field that must be named, value that must be named)
BAD_VALUES: list[tuple[str, list[str], str, str]] = [
    ("adam_beta1 above 1", ["training.optimizer.adam_beta1=1.5"], "training.optimizer.adam_beta1", "1.5"),
    ("adam_beta1 exactly 1", ["training.optimizer.adam_beta1=1"], "training.optimizer.adam_beta1", "1"),
    ("adam_beta1 negative", ["training.optimizer.adam_beta1=-0.1"], "training.optimizer.adam_beta1", "-0.1"),
    ("adam_beta2 exactly 1", ["training.optimizer.adam_beta2=1.0"], "training.optimizer.adam_beta2", "1.0"),
    ("adam_beta2 negative", ["training.optimizer.adam_beta2=-1"], "training.optimizer.adam_beta2", "-1"),
    ("weight decay negative", ["training.optimizer.weight_decay=-0.01"], "training.optimizer.weight_decay", "-0.01"),
    ("lr zero", ["training.optimizer.lr=0"], "training.optimizer.lr", "0"),
    ("lr negative", ["training.optimizer.lr=-1.0e-6"], "training.optimizer.lr", "-1e-06"),
    ("grad clip zero", ["training.optimizer.grad_clip=0"], "training.optimizer.grad_clip", "0"),
    ("warmup not below num_rollout", ["training.optimizer.warmup_rollouts=100"], "training.optimizer.warmup_rollouts", "100"),
    ("warmup negative", ["training.optimizer.warmup_rollouts=-1"], "training.optimizer.warmup_rollouts", "-1"),
    ("eps_clip zero", ["training.eps_clip=0", "training.eps_clip_high=0.28"], "training.eps_clip", "0"),
    ("eps_clip_high below eps_clip", ["training.eps_clip_high=0.1"], "training.eps_clip_high", "0.1"),
    ("train temperature zero", ["training.temperature=0"], "training.temperature", "0"),
    ("kl negative", ["training.kl_coef=-0.1"], "training.kl_coef", "-0.1"),
    ("eval top_p zero", ["eval.top_p=0"], "eval.top_p", "0"),
    ("eval top_p above 1", ["eval.top_p=1.5"], "eval.top_p", "1.5"),
    ("eval temperature negative", ["eval.temperature=-1"], "eval.temperature", "-1"),
    ("eval samples zero", ["eval.samples_per_prompt=0"], "eval.samples_per_prompt", "0"),
    ("eval max_response zero", ["eval.max_response=0"], "eval.max_response", "0"),
    ("responses per prompt one", ["batch.responses_per_prompt=1"], "batch.responses_per_prompt", "1"),
    ("updates zero", ["batch.updates_per_rollout=0"], "batch.updates_per_rollout", "0"),
    ("overlong buffer at max response", ["reward.overlong_buffer=4096"], "reward.overlong_buffer", "4096"),
    ("overlong factor negative", ["reward.overlong_factor=-1"], "reward.overlong_factor", "-1"),
    ("max response tiny", ["tokens.max_response=4"], "tokens.max_response", "4"),
    ("checkpoint interval zero", ["checkpoint.interval=0"], "checkpoint.interval", "0"),
    ("seed zero", ["seed=0"], "seed", "0"),
    ("seed too large", ["seed=99999999999"], "seed", "99999999999"),
    ("tensor parallel zero", ["model.tensor_parallel=0"], "model.tensor_parallel", "0"),
    ("walltime zero", ["lifecycle.walltime=00:00:00"], "lifecycle.walltime", "00:00:00"),
    ("walltime garbage", ["lifecycle.walltime=noon"], "lifecycle.walltime", "noon"),
    ("stall timeout negative", ["lifecycle.stall_timeout_s=-5"], "lifecycle.stall_timeout_s", "-5"),
    ("stall timeout not a number", ["lifecycle.stall_timeout_s=soon"], "lifecycle.stall_timeout_s", "soon"),
    ("startup timeout negative", ["lifecycle.startup_timeout_s=-1"], "lifecycle.startup_timeout_s", "-1"),
    ("startup timeout fractional", ["lifecycle.startup_timeout_s=1.5"], "lifecycle.startup_timeout_s", "1.5"),
    ("section replaced by a number", ["training=5"], "training", "5"),
    ("huge bad value shortened", ["num_rollout=" + "9x" * 250_000], "num_rollout", "characters)"),
]


@pytest.mark.parametrize("overrides,field,value", [v[1:] for v in BAD_VALUES], ids=[v[0] for v in BAD_VALUES])
def test_out_of_range_value_names_field_and_value(overrides: list[str], field: str, value: str) -> None:
    data = load_yaml(ROOT / "recipes" / "dedicated.yaml")
    apply_overrides(data, overrides)
    with pytest.raises(InputError) as info:
        recipe_from_dict(data, "dedicated.yaml")
    msg = str(info.value)
    assert len(msg.splitlines()) == 1 and len(msg) < 800, msg[:1000]
    assert msg.startswith("dedicated.yaml: ") and field in msg and value in msg, msg


# Through the CLI: (id, how to build argv from tmp_path, what stderr must name)
def _file_arg(content: str | bytes) -> Callable[[Path], list[str]]:
    def make(tmp: Path) -> list[str]:
        path = tmp / "bad.yaml"
        path.write_bytes(_bytes(content))
        return [str(path), "--site", SITE]
    return make


def _site_arg(content: str | bytes) -> Callable[[Path], list[str]]:
    def make(tmp: Path) -> list[str]:
        path = tmp / "site.yaml"
        path.write_bytes(_bytes(content))
        return [str(ROOT / "recipes" / "dedicated.yaml"), "--site", str(path)]
    return make


def _set(*overrides: str) -> Callable[[Path], list[str]]:
    def make(tmp: Path) -> list[str]:
        return [str(ROOT / "recipes" / "dedicated.yaml"), "--site", SITE] + [a for o in overrides for a in ("--set", o)]
    return make


SITE_TEXT = (ROOT / "env" / "example-site.yaml").read_text()
CLI_BAD: list[tuple[str, Callable[[Path], list[str]], list[str]]] = [
    ("recipe not UTF-8", _file_arg(b"name: caf\xe9\n"), ["bad.yaml", "not UTF-8", "byte 9"]),
    ("recipe billion laughs", _file_arg(_billion_laughs()), ["bad.yaml", "expands"]),
    ("recipe duplicate key", _file_arg(DEDICATED + "seed: 1\n"), ["bad.yaml", "duplicate key 'seed'"]),
    ("recipe python tag", _file_arg(DEDICATED.replace("name: dedicated", "name: !!python/name:os.system")), ["bad.yaml", "tag"]),
    ("recipe is a directory", lambda tmp: [str(tmp), "--site", SITE], [" is a directory"]),
    ("site not UTF-8", _site_arg(SITE_TEXT.encode() + b"qos: \xff\n"), ["site.yaml", "not UTF-8", f"byte {len(SITE_TEXT) + 5}"]),
    ("site duplicate key", _site_arg(SITE_TEXT + "gres: gpu\n"), ["site.yaml", "duplicate key 'gres'"]),
    ("site bad YAML", _site_arg("name: [x\n"), ["site.yaml", "not valid YAML"]),
    ("site tmp a fraction", _site_arg(SITE_TEXT.replace("tmp: 2000G", "tmp: 1.5T")),  # sbatch refuses it too
     ["site.yaml: tmp: not a Slurm size", "1.5T", "2000G or 2T", "none"]),
    ("site tmp not a size", _site_arg(SITE_TEXT.replace("tmp: 2000G", "tmp: lots")), ["tmp", "'lots'"]),
    ("site tmp negative", _site_arg(SITE_TEXT.replace("tmp: 2000G", "tmp: -5")), ["tmp", "not a Slurm size"]),
    ("site file missing", lambda tmp: [str(ROOT / "recipes" / "dedicated.yaml"), "--site", str(tmp / "s.yaml")],
     ["s.yaml", "no such site profile file"]),
    ("override not YAML", _set("num_rollout=["), ["override 'num_rollout=['"]),
    ("override empty key", _set("=5"), ["override '=5'", "empty part"]),
    ("override yaml tag", _set("seed=!!python/object/new:int [5]"), ["override", "not allowed"]),
    ("adam_beta1 1.5", _set("training.optimizer.adam_beta1=1.5"), ["training.optimizer.adam_beta1", "1.5"]),
    ("top_p 0", _set("eval.top_p=0"), ["eval.top_p", "0"]),
    ("5 MB value", _set("num_rollout=" + "x" * 900_000), ["num_rollout", "characters)"]),
]


@pytest.mark.parametrize("make,expect", [c[1:] for c in CLI_BAD], ids=[c[0] for c in CLI_BAD])
def test_cli_bad_input_exits_2_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                             make: Callable[[Path], list[str]], expect: list[str]) -> None:
    code = main(["render", *make(tmp_path)])
    out, err = capsys.readouterr()
    assert code == 2, err[:2000]
    assert "Traceback" not in err and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and len(lines[0]) < 800, err[:2000]
    assert lines[0].startswith("beam-hpc: error: ")
    for part in expect:
        assert part in lines[0], (part, lines[0])


def test_two_problems_give_two_lines(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["render", str(ROOT / "recipes" / "dedicated.yaml"), "--site", SITE,
                 "--set", "training.optimizer.adam_beta1=1.5", "--set", "training.optimizer.adam_beta2=-1"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 2, lines
    assert "adam_beta1" in lines[0] and "adam_beta2" in lines[1]


# ---- valid controls -------------------------------------------------------------------------


@pytest.mark.parametrize("written,meant", [
    ('"24:00:00"', "24:00:00"),
    ("24:00:00", "24:00:00"),
    ("12:00:00", "12:00:00"),
    ("1-00:00:00", "1-00:00:00"),
    ("'2-12'", "2-12"),
    ("30:00", "30:00"),
    ("90", "90"),
])
def test_walltime_quoted_or_not_is_a_slurm_string(tmp_path: Path, written: str, meant: str) -> None:
    path = tmp_path / "r.yaml"
    path.write_text(DEDICATED.replace('walltime: "24:00:00"', f"walltime: {written}"))
    assert load_recipe(path).lifecycle.walltime == meant


def test_walltime_override_is_read_like_the_file(capsys: pytest.CaptureFixture[str]) -> None:
    path = ROOT / "recipes" / "dedicated.yaml"
    assert load_recipe(path, ["lifecycle.walltime=12:00:00"]).lifecycle.walltime == "12:00:00"
    assert load_recipe(path, ["lifecycle.walltime=1-00:00:00"]).lifecycle.walltime == "1-00:00:00"
    assert main(["render", str(path), "--site", SITE, "--set", "lifecycle.walltime=12:00:00"]) == 0
    assert "--time=12:00:00" in capsys.readouterr().out


def test_sane_anchors_and_merge_keys_load(tmp_path: Path) -> None:
    path = tmp_path / "r.yaml"
    path.write_text(
        "name: anchors\noutput_dir: /shared/runs/a\nnum_rollout: 10\n"
        "data: {dir: &shared /shared/data/beam}\n"
        "model: {path: *shared}\n"
        "topology:\n"
        "  trainer: &trainer {nodes: 8, gpus_per_node: 8}\n"
        "  rollout:\n    <<: *trainer\n    nodes: 4\n    gpus_per_engine: 16\n"
    )
    recipe = load_recipe(path)
    assert recipe.topology.rollout is not None
    assert (recipe.topology.rollout.nodes, recipe.topology.rollout.gpus_per_node) == (4, 8)
    assert recipe.topology.trainer.nodes == 8 and recipe.model.path == recipe.data.dir == "/shared/data/beam"


def test_plain_values_keep_their_meaning() -> None:
    assert parse_yaml_value("5", "v") == 5 and parse_yaml_value("1.0e-6", "v") == 1.0e-6
    assert parse_yaml_value("true", "v") is True and parse_yaml_value("null", "v") is None
    assert parse_yaml_value("0x10", "v") == 16 and parse_yaml_value("!!str 5", "v") == "5"
    assert parse_yaml_value("2026-01-01", "v") == "2026-01-01"  # a date-like name stays a string
    assert parse_yaml_value("[a, {b: 1}]", "v") == ["a", {"b": 1}]
    assert parse_yaml_value("{a: 1, <<: {a: 2, b: 3}}", "v") == {"a": 1, "b": 3}  # merge may be overridden


def test_empty_override_value_is_an_empty_string() -> None:
    data: dict[str, Any] = {}
    apply_overrides(data, ["name=", " training . async_training =false"])
    assert data == {"name": "", "training": {"async_training": False}}


@pytest.mark.parametrize("text,mib", [("2000G", 2000 * 1024), ("2T", 2 * 1024**2), ("500", 500), ("500m", 500),
                                      ("1025K", 2), ("2000GB", 2000 * 1024), (" 3000000 ", 3_000_000), (7, 7)])
def test_slurm_sizes_read_as_sbatch_reads_them(text: str | int, mib: int) -> None:
    """A bare number is MB; K rounds up to whole MB (checked with `sbatch --test-only --tmp=...`)."""
    assert parse_mib(text) == mib


@pytest.mark.parametrize("text", ["1.5T", "2 T", "G", "", "-5", "500B", "2P", "lots", "1e3"])
def test_sizes_sbatch_refuses_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="not a Slurm size"):
        parse_mib(text)


@pytest.mark.parametrize("tmp", ["2000G", "none", 500000, None])
def test_site_tmp_takes_a_slurm_size_or_none(tmp: object) -> None:
    site = load_site(ROOT / "env" / "local.yaml").model_dump(mode="json") | {"tmp": tmp}
    assert site_from_dict(site).tmp == (str(tmp) if isinstance(tmp, int) else tmp)


@pytest.mark.parametrize("path", sorted((ROOT / "recipes").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_recipes_load(path: Path) -> None:
    assert load_recipe(path).name


@pytest.mark.parametrize("path", sorted((ROOT / "env").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_sites_load(path: Path) -> None:
    assert load_site(path).name
    assert find_site(path.stem, ROOT / "env") == ROOT / "env" / path.name


def test_the_seed_recipes_evaluate_on_aime2025_by_name() -> None:
    """The seed's recipes leave data.eval_name at its default, which names the metrics as Miles's
    AIME2025 eval does (eval/aime25); the tiny recipe names its own set. (A run's metric rows under
    either name: tests/backends/reference/test_reference_backend.py and tests/observe/.)"""
    from beam_hpc.run import metric_names as names

    for seed in ("dedicated", "colocated", "lora"):
        recipe = load_recipe(ROOT / "recipes" / f"{seed}.yaml")
        assert names.eval_accuracy_tag(recipe.data.eval_name) == names.EVAL_ACCURACY == "eval/aime25"
    assert load_recipe(ROOT / "recipes" / "tiny.yaml").data.eval_name == "tiny-add"
