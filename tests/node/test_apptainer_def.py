"""apptainer.def and `beam-hpc image build` against a written contract of Apptainer's build.

The Apptainer binary cannot be installed where these tests run, so the def file is checked
against what Apptainer's documentation (apptainer-userdocs definition_files.rst,
environment_and_metadata.rst, and the build-args parser's tests in apptainer/apptainer) says:

  D1  The header starts with ``Bootstrap:``; ``docker`` takes ``From: <repo>:<tag>``.
  D2  ``{{ NAME }}`` is replaced anywhere in the file (header included) by ``--build-arg NAME=v``
      or else by ``NAME=v`` in ``%arguments``; a name defined in neither fails the build.
  D3  ``%files``: ``<source> [<destination>]`` per line, copied before ``%post`` runs.
  D4  ``%post`` runs as root at build time; ``%environment`` is sourced at run time;
      ``%labels`` holds ``name value`` pairs; ``%test`` runs at the end of the build (and with
      ``apptainer test``) and fails the build on a non-zero exit.
  D5  Processes in the container run as the calling user: code under /root needs chmod 755 /root.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from beam_hpc.node.image import (
    REQUIRED_STACK,
    TAG_ARG,
    ImageError,
    build_command,
    build_env,
    build_image,
    verify_stack,
    version_tuple,
)
from beam_hpc.version import __version__

ROOT = Path(__file__).resolve().parents[2]
DEF = ROOT / "apptainer.def"


def parse_def(text: str) -> tuple[dict[str, str], dict[str, list[str]]]:
    """Header keywords and section bodies (comments and blank lines dropped)."""
    header: dict[str, str] = {}
    sections: dict[str, list[str]] = {}
    current = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("%"):
            current = line[1:].split()[0]
            sections.setdefault(current, [])
        elif current is None:
            key, _, value = line.partition(":")
            header.setdefault("_first", key)
            header[key.strip()] = value.strip()
        else:
            sections[current].append(line)
    return header, sections


def render_args(text: str, build_args: dict[str, str]) -> str:
    """D2, as Apptainer applies it."""
    _, sections = parse_def(text)
    defaults = dict(line.split("=", 1) for line in sections.get("arguments", []))
    values = {**{k.strip(): v.strip() for k, v in defaults.items()}, **build_args}

    def sub(m: re.Match) -> str:
        name = m.group(1)
        if name not in values:
            raise KeyError(f"{name} is not defined through either --build-arg or 'arguments' section")
        return values[name]

    return re.sub(r"{{\s*(\w+)\s*}}", sub, text)


TEXT = DEF.read_text()
HEADER, SECTIONS = parse_def(TEXT)


def test_bootstraps_from_the_miles_beam_image_with_an_overridable_tag():
    assert HEADER["_first"] == "Bootstrap" and HEADER["Bootstrap"] == "docker"  # D1
    assert HEADER["From"] == "radixark/miles:{{ MILES_TAG }}"
    assert SECTIONS["arguments"] == [f"{TAG_ARG}=beam"]
    assert parse_def(render_args(TEXT, {}))[0]["From"] == "radixark/miles:beam"  # D2
    assert parse_def(render_args(TEXT, {TAG_ARG: "v0.5.1"}))[0]["From"] == "radixark/miles:v0.5.1"
    build = build_command("apptainer.def", "beam.sif", tag="v0.5.1")
    assert build == ["apptainer", "build", "--build-arg", f"{TAG_ARG}=v0.5.1", "beam.sif", "apptainer.def"]


def test_files_copy_the_package_from_this_repository():
    pairs = [line.split() for line in SECTIONS["files"]]  # D3
    for src, _dest in pairs:
        assert (DEF.parent / src).exists(), f"%files source {src} is missing (paths are relative to the def file)"
    dests = {dest for _src, dest in pairs}
    assert {"/opt/beam-hpc/pyproject.toml", "/opt/beam-hpc/beam_hpc"} <= dests
    readme = re.search(r'readme\s*=\s*"([^"]+)"', (ROOT / "pyproject.toml").read_text())
    assert readme is None or f"/opt/beam-hpc/{readme.group(1)}" in dests  # pip needs it to build


def test_post_makes_root_code_readable_and_installs_beam_hpc_without_touching_the_stack():
    post = "\n".join(SECTIONS["post"])
    assert "chmod 755 /root" in post  # D5
    assert "chmod -R a+rX" in post and "/root/miles" in post and "/root/Megatron-LM" in post
    installs = [line for line in SECTIONS["post"] if "pip install" in line]
    assert installs == ["python3 -m pip install --no-cache-dir /opt/beam-hpc"]
    stack = {dist for _m, dist, _v in REQUIRED_STACK}
    assert not any(name in line for line in installs for name in stack), "never reinstall the image's stack"


def test_environment_labels_and_no_containall():
    env = "\n".join(SECTIONS["environment"])
    assert "export PYTHONUNBUFFERED=1" in env
    assert "RAY_AUTH_MODE" not in env and "RAY_ADDRESS" not in env  # the job sets these per run
    labels = dict(line.split(None, 1) for line in SECTIONS["labels"])
    assert labels["beam-hpc.version"] == __version__, "the image label must follow the package version"
    assert labels["beam-hpc.miles-image"] == "radixark/miles:{{ MILES_TAG }}"
    assert "--containall" not in TEXT.replace("never `--containall`", "")


@pytest.mark.slow
def test_test_section_version_checks_the_stack_and_fails_without_it():
    assert SECTIONS["test"] == ["python3 -m beam_hpc.cli.app image verify"]
    assert [(m, v) for m, _d, v in REQUIRED_STACK] == [
        ("torch", None), ("megatron.core", None), ("sglang", None), ("ray", "2.52"), ("deepspeed", None)]
    # The same command here, where only part of the stack exists: it must fail and name what is missing.
    res = subprocess.run([sys.executable, "-m", "beam_hpc.cli.app", "image", "verify"], capture_output=True,
                         text=True, cwd=ROOT, timeout=300, check=False)
    checks = {c.module: c for c in verify_stack()}
    assert res.returncode == (0 if all(c.ok for c in checks.values()) else 1)
    for module, check in checks.items():
        assert f"{'ok  ' if check.ok else 'FAIL'} {module}" in res.stdout
    assert checks["ray"].ok and checks["torch"].ok  # installed here: real imports, real versions


def test_ray_minimum_is_enforced_by_version_compare():
    assert version_tuple("2.51.9") < version_tuple("2.52") <= version_tuple("2.52.0") < version_tuple("2.60.0rc1")
    old_stack = [("json", "no-such-dist", "99.0")]
    [check] = verify_stack(old_stack)
    assert not check.ok and "older than the required 99.0" in check.error


def test_build_says_clearly_when_apptainer_is_missing(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ImageError, match="apptainer not found on PATH"):
        build_image(DEF, tmp_path / "beam.sif")


def test_build_puts_cache_and_tmp_on_local_disk_unless_chosen(tmp_path):
    env = build_env({"HOME": "/home/u"}, tmp_path / "local")
    assert env["APPTAINER_CACHEDIR"] == str(tmp_path / "local" / "cache")
    assert env["APPTAINER_TMPDIR"] == str(tmp_path / "local" / "tmp") and Path(env["APPTAINER_TMPDIR"]).is_dir()
    assert build_env({"APPTAINER_CACHEDIR": "/fast/cache"}, tmp_path)["APPTAINER_CACHEDIR"] == "/fast/cache"
