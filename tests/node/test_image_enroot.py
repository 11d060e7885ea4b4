"""`beam-hpc image build --runtime enroot` (beam_hpc.node.image) against a written contract of
enroot's documented usage; enroot cannot be installed where these tests run.

Contract (NVIDIA/enroot doc/cmd/*.md at 8ea147d, 14 commits after v4.1.2):
  E1  ``enroot import [--output PATH] URI``; ``docker://[USER@][REGISTRY#]IMAGE[:TAG]`` imports a
      registry image to a squashfs file.
  E2  ``enroot create [--name NAME] [--force] IMAGE`` unpacks a squashfs into a container.
  E3  ``enroot start [--root] [--rw] [--mount FSTAB] [--rc SCRIPT] NAME``: --rw a writable root
      filesystem, --root remapped to root, --mount an fstab entry with fields separated by ":",
      --rc a host script run as the container's command script.
  E4  ``enroot export [--force] [--output PATH] NAME`` writes the container back to a squashfs;
      ``enroot remove --force NAME`` deletes it.
  E5  The image's /etc/environment holds ``NAME=value`` lines, read when the container starts.
The def file is the one recipe: its ``From:``, ``%files``, ``%post`` and ``%environment`` are what
the enroot build applies (tests/node/test_apptainer_def.py holds the def file to Apptainer's rules).
"""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

import pytest

from beam_hpc.cli.app import main
from beam_hpc.node import image
from beam_hpc.node.image import SOURCE_MOUNT, read_def

DEF = Path(__file__).resolve().parents[2] / "apptainer.def"
ROOT = DEF.parent


def test_the_def_file_gives_the_base_image_files_post_and_environment() -> None:
    recipe = read_def(DEF)
    assert recipe.base == "radixark/miles:beam"  # From: with %arguments' MILES_TAG
    assert read_def(DEF, tag="v9").base == "radixark/miles:v9"
    assert ("beam_hpc", "/opt/beam-hpc/beam_hpc") in recipe.files
    assert "pip install --no-cache-dir /opt/beam-hpc" in recipe.post
    assert "MILES_DIR=/root/miles" in recipe.environment and not any(e.startswith("export") for e in recipe.environment)


def test_the_build_commands_follow_enroots_usage(tmp_path: Path) -> None:
    cmds = image.enroot_build_commands(DEF, tmp_path / "beam.sqsh", tmp_path / "work", tag="v9", force=True)
    base = str(tmp_path / "work" / "base.sqsh")
    assert cmds[0] == ["enroot", "import", "--output", base, "docker://radixark/miles:v9"]  # E1
    assert cmds[1] == ["enroot", "create", "--force", "--name", "beam-image-build", base]  # E2
    start = cmds[2]  # E3
    assert start[:4] == ["enroot", "start", "--root", "--rw"] and start[-1] == "beam-image-build"
    src, dst, fstype, opts = start[start.index("--mount") + 1].split(":")
    assert (src, dst, fstype) == (str(ROOT), SOURCE_MOUNT, "none") and "ro" in opts.split(",")
    assert start[start.index("--rc") + 1] == str(tmp_path / "work" / "build.rc")
    assert cmds[3] == ["enroot", "export", "--force", "--output", str(tmp_path / "beam.sqsh"), "beam-image-build"]  # E4


def test_the_build_script_applies_the_def_file(tmp_path: Path) -> None:
    """Run the script with sh on a scratch tree: %files copied from the source mount, %post run,
    %environment appended as NAME=value lines (E5). Paths are moved under tmp_path to run it here."""
    recipe = read_def(DEF)
    script = image.enroot_build_script(recipe)
    root = tmp_path / "rootfs"
    (root / "etc").mkdir(parents=True)
    (root / "etc" / "environment").write_text("PATH=/usr/bin\n")
    script = (script.replace(SOURCE_MOUNT, str(ROOT)).replace("/opt/beam-hpc", str(root / "opt/beam-hpc"))
              .replace("/etc/environment", str(root / "etc/environment")))
    script = script.replace("python3 -m pip install --no-cache-dir", "echo would pip install")
    script = script.replace("chmod 755 /root", "true")
    res = subprocess.run(["sh", "-c", script], capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stderr
    assert (root / "opt/beam-hpc/beam_hpc/node/image.py").is_file() and (root / "opt/beam-hpc/pyproject.toml").is_file()
    assert f"would pip install {root / 'opt/beam-hpc'}" in res.stdout
    env = (root / "etc" / "environment").read_text().splitlines()
    assert env[0] == "PATH=/usr/bin" and "MEGATRON_PATH=/root/Megatron-LM" in env


def test_dry_run_prints_the_commands_and_runs_nothing(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "beam.sqsh"
    assert main(["image", "build", "--runtime", "enroot", "--dry-run", "--output", str(out),
                 "--local-dir", str(tmp_path / "w")]) == 0
    printed = capsys.readouterr().out
    commands = [shlex.split(line) for line in printed.splitlines() if line.startswith("enroot ")]
    assert [c[:2] for c in commands] == [["enroot", "import"], ["enroot", "create"], ["enroot", "start"],
                                          ["enroot", "export"], ["enroot", "remove"]]
    assert "set -e" in printed and not out.exists() and not (tmp_path / "w").exists()


def test_without_enroot_the_build_says_where_to_run_it(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("PATH", str(tmp_path))  # no enroot here
    with pytest.raises(image.ImageError, match="enroot not found on PATH: build on a machine with enroot"):
        image.build_enroot_image(DEF, tmp_path / "beam.sqsh", local_dir=tmp_path / "w")


def test_dry_run_is_for_enroot_only(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["image", "build", "--dry-run", "--output", str(tmp_path / "b.sif")]) == 2
    assert "--dry-run: only with --runtime enroot" in capsys.readouterr().err
