"""The site's ``container.runtime`` (beam_hpc.config.site): apptainer, pyxis or host (``none`` reads
as host), and what a pyxis site must hold; every refusal is one line naming the field and the fix,
and through the CLI exits 2 before anything is written."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from beam_hpc.cli.app import main
from beam_hpc.config.site import site_from_dict
from beam_hpc.errors import InputError

ROOT = Path(__file__).resolve().parents[2]


def site(container: dict, **extra: object) -> dict:
    return {"name": "t", "container": container, **extra}


def test_none_reads_as_host_and_the_three_runtimes_load() -> None:
    assert site_from_dict(site({"runtime": "none"})).container.runtime == "host"
    assert site_from_dict(site({"runtime": "host"})).node_python == "python3"
    apptainer = site_from_dict(site({"runtime": "apptainer", "image": "/x/beam.sif", "python": "/opt/py"}))
    pyxis = site_from_dict(site({"runtime": "pyxis", "image": "nvcr.io#nvidia/pytorch:24.01-py3", "python": "/opt/py"}))
    assert apptainer.node_python == pyxis.node_python == "/opt/py"  # the image's interpreter for both
    assert pyxis.container.mount_home is False


@pytest.mark.parametrize(("container", "extra", "field", "says"), [
    ({"runtime": "podman"}, {}, "container.runtime", "'podman' is not a container runtime; use one of apptainer, pyxis, host"),
    ({"runtime": "pyxis"}, {}, "container.image", "the pyxis runtime needs a squashfs path or an enroot URI"),
    ({"runtime": "pyxis", "image": "docker://ubuntu:24.04"}, {}, "container.image", "without a scheme"),
    ({"runtime": "pyxis", "image": "/x/b.sqsh", "stage_to_local": True}, {}, "container.stage_to_local",
     "enroot imports and unpacks the image on each node itself"),
    ({"runtime": "pyxis", "image": "/x/b.sqsh", "binds": ["/a,b:/c"]}, {}, "container.binds", "holds a comma"),
    ({"runtime": "pyxis", "image": "/x/b.sqsh"}, {"shared_paths": ["/lus,tre"]}, "shared_paths", "holds a comma"),
])
def test_bad_runtime_settings_name_the_field(container: dict, extra: dict, field: str, says: str) -> None:
    with pytest.raises(InputError) as err:
        site_from_dict(site(container, **extra), "s.yaml")
    message = str(err.value)
    assert len(message.splitlines()) == 1 and f"{field}: " in message and says in message, message


def test_pyxis_bind_options_may_hold_commas() -> None:
    """A bind's options (``ro,nosuid``) are not a mount path: pyxis gets them joined by "+"."""
    ok = site_from_dict(site({"runtime": "pyxis", "image": "/x/b.sqsh", "binds": ["/a:/b:ro,nosuid"]}))
    assert ok.container.binds == ["/a:/b:ro,nosuid"]


def test_submit_with_an_unknown_runtime_exits_2_before_anything_is_written(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    data = yaml.safe_load((ROOT / "env" / "local.yaml").read_text())
    data["container"] = {"runtime": "docker"}
    path = tmp_path / "site.yaml"
    path.write_text(yaml.safe_dump(data))
    run = tmp_path / "run"
    rc = main(["submit", str(ROOT / "recipes" / "tiny.yaml"), "--site", str(path), "--output-dir", str(run),
               "--via", "sbatch"])
    err = capsys.readouterr().err
    assert rc == 2 and "container.runtime: 'docker' is not a container runtime" in err and "Traceback" not in err, err
    assert not run.exists()
