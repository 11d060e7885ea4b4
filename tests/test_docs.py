"""The README's commands and the generated field reference hold what they promise.

What runs here, for real: the cluster quick start's `cp`, `render` and `submit --dry-run` lines, in
a scratch copy of the repository's env/ and recipes/, against no Slurm at all (SLURM_CONF names a
controller that is never there, so that the result cannot depend on which cluster this machine
reaches). Every other
`beam-hpc` line of the quick start is parsed by the real command-line parser, so that a renamed
command or flag fails here; the ones that need a cluster, the network or Apptainer (`doctor`,
`prepare`, `image build`, `prepare --convert`, `submit`, `cancel`) are not run. The quick start's
`status`, `logs` and `plot` lines run on a real finished run in tests/cli/test_execute.py, which
also runs the fresh-machine command's `execute recipes/tiny.yaml` end to end; the install half of
that command is what .ci/run runs. The site build (`mkdocs build --strict`) is CI's `docs` phase.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from beam_hpc.cli.app import build_parser, main
from beam_hpc.config import field_reference

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
RUN_DIR = "/shared/runs/beam-dedicated"  # the quick start's run directory


def _bash_blocks(text: str) -> list[list[str]]:
    """The README's ```bash blocks, each as its command lines (comments stripped)."""
    blocks = re.findall(r"^```bash\n(.*?)^```", text, flags=re.S | re.M)
    commands = [[" ".join(shlex.split(line, comments=True)) for line in block.splitlines()] for block in blocks]
    return [[line for line in block if line] for block in commands]


def _readme_blocks() -> tuple[list[str], list[str], list[str]]:
    """(the set-up-and-run command, the test command, the cluster quick start), in README order."""
    blocks = _bash_blocks(README.read_text(encoding="utf-8"))
    assert len(blocks) == 3, f"README.md: expected 3 bash blocks (set up, tests, cluster quick start), got {len(blocks)}"
    return blocks[0], blocks[1], blocks[2]


def _ci_phase(name: str) -> str:
    """The command of one `phase NAME ...` line of .ci/run."""
    for line in (REPO / ".ci" / "run").read_text(encoding="utf-8").splitlines():
        if line.startswith(f"phase {name} "):
            return line.removeprefix(f"phase {name} ").strip()
    raise AssertionError(f".ci/run has no phase {name}")


def test_field_reference_is_current() -> None:
    """docs/reference/ is what the recipe and site models give today."""
    stale = [name for name, text in field_reference.render_all().items()
             if not (REPO / "docs" / "reference" / name).is_file()
             or (REPO / "docs" / "reference" / name).read_text(encoding="utf-8") != text]
    assert not stale, (f"docs/reference/{', '.join(stale)} no longer match(es) beam_hpc/config/recipe.py and site.py; "
                       f"regenerate with `{field_reference.REGENERATE}` and commit the result")


def test_field_reference_names_every_field() -> None:
    """Every field of every (nested) model has its own row, under its dotted path."""
    recipe = field_reference.render_all()["recipe.md"]
    for path in ("`num_rollout`", "`topology.rollout.gpus_per_engine`", "`training.offload.min_free_gb`",
                 "`lifecycle.stall_timeout_s`", "`tracking.wandb.project`"):
        assert f"| {path} |" in recipe, path
    site = field_reference.render_all()["site.md"]
    assert "| `container.runtime` | one of: `apptainer`, `pyxis`, `host` | `\"apptainer\"` |" in site
    assert "| `quarantine_days` | number | `7.0` | &gt; `0` |" in site


def test_readme_links_lead_to_files_of_the_repository() -> None:
    """README is not part of the MkDocs site, so `mkdocs build --strict` does not check its links."""
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README.read_text(encoding="utf-8"))
    assert links, "README.md links to no page of the guide"
    missing = [link for link in links if "://" not in link and not (REPO / link).is_file()]
    assert not missing, f"README.md links to files that do not exist: {missing}"


def test_readme_test_command_is_the_one_ci_runs() -> None:
    _, tests, _ = _readme_blocks()
    assert tests == [_ci_phase("tests")], "README's test command and .ci/run's tests phase must be the same line"


def test_readme_setup_command_is_what_ci_installs_then_the_embedded_default() -> None:
    setup, _, _ = _readme_blocks()
    assert len(setup) == 1
    steps = [s.strip() for s in setup[0].split("&&")]
    assert steps[0] == "python3 -m venv .venv"
    assert steps[1] == _ci_phase("pip-torch").replace(" --no-compile", "")  # the CPU torch first
    assert steps[2] == ".venv/bin/pip install -e .[test]" and "-e '.[test" in _ci_phase("pip-project")
    assert steps[3] == ".venv/bin/beam-hpc execute recipes/tiny.yaml"
    build_parser().parse_args(shlex.split(steps[3])[1:])  # tests/cli/test_execute.py runs it for real


def test_cluster_quick_start_lines_are_commands_beam_hpc_has() -> None:
    _, _, quick = _readme_blocks()
    assert 8 <= len(quick) <= 14, "the cluster quick start is about a dozen lines"
    commands = [shlex.split(line) for line in quick if line.startswith("beam-hpc ")]
    parser = build_parser()
    for argv in commands:
        try:
            parser.parse_args(argv[1:])
        except SystemExit as err:
            raise AssertionError(f"README quick start: `{' '.join(argv)}` is refused by beam-hpc's parser") from err
    for verb in ("status", "logs", "plot"):  # what tests/cli/test_execute.py runs on a real run
        assert any(argv[1] == verb and RUN_DIR in argv for argv in commands), verb


@pytest.fixture
def scratch_repo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A directory holding copies of env/ and recipes/, as the commands expect, with no Slurm."""
    for name in ("env", "recipes"):
        shutil.copytree(REPO / name, tmp_path / name)
    monkeypatch.chdir(tmp_path)
    # A Slurm whose controller is never there: its clients fail at once with "Unable to contact slurm
    # controller" (a missing SLURM_CONF would instead make them look for a configless controller
    # in DNS, about a minute here). Port 9 (discard) is closed on loopback; MessageTimeout=1: a
    # client retries a refused connection for that long (default 10 s).
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=none\nSlurmctldHost=localhost(127.0.0.1)\nSlurmctldPort=9\nMessageTimeout=1\n",
                    encoding="utf-8")
    monkeypatch.setenv("SLURM_CONF", str(conf))
    return tmp_path


def test_cluster_quick_start_runs_what_needs_no_cluster(scratch_repo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`cp`, `render` and `submit --dry-run` as the README writes them, in order."""
    _, _, quick = _readme_blocks()
    cp = next(line for line in quick if line.startswith("cp "))
    subprocess.run(["bash", "-c", cp], check=True, cwd=scratch_repo)
    render = next(line for line in quick if line.startswith("beam-hpc render "))
    dry_run = next(line for line in quick if line.startswith("beam-hpc submit ") and "--dry-run" in line)

    assert main(shlex.split(render)[1:]) == 0
    script = scratch_repo / shlex.split(render)[shlex.split(render).index("-o") + 1]
    text = script.read_text(encoding="utf-8")
    assert text.startswith("#!") and "#SBATCH hetjob" in text and "BEAM_PLAN_JSON" in text
    capsys.readouterr()

    before = sorted(p.relative_to(scratch_repo) for p in scratch_repo.rglob("*"))
    assert main(shlex.split(dry_run)[1:]) == 0
    out = capsys.readouterr().out
    assert "dry run: nothing submitted" in out and "#SBATCH" in out, out
    assert sorted(p.relative_to(scratch_repo) for p in scratch_repo.rglob("*")) == before  # wrote nothing
