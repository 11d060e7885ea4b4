"""beam_hpc.run.identity: the resume identity, recorded once and checked in one place."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from beam_hpc.errors import InputError
from beam_hpc.plan.paths import RunPaths
from beam_hpc.run.identity import IdentityError, check_identity, identity_path, identity_problem, record_identity

_IDENTITY = {"model": {"path": "/m"}, "topology": {"trainer": {"nodes": 1}}, "seed": 1}


def test_identity_is_recorded_once_and_names_changed_fields(tmp_path: Path) -> None:
    paths = RunPaths(str(tmp_path))
    assert identity_problem(paths, _IDENTITY) is None  # nothing recorded, no plan.json
    record_identity(paths, _IDENTITY, "1-0", has_ckpt=False)
    record_identity(paths, {**_IDENTITY, "seed": 2}, "2-0", has_ckpt=True)  # a later segment: kept
    assert json.loads(identity_path(paths).read_text())["recorded_by"] == "1-0"
    assert identity_problem(paths, _IDENTITY) is None
    changed = {**_IDENTITY, "topology": {"trainer": {"nodes": 2}}}
    msg = identity_problem(paths, changed)
    assert msg is not None and "topology.trainer.nodes (was 1, now 2)" in msg
    assert "num_rollout, walltime and partitions may change" in msg and "new --output-dir" in msg
    with pytest.raises(IdentityError) as err:
        check_identity(paths, changed)
    assert str(err.value) == msg and isinstance(err.value, InputError)
    identity_path(paths).write_text("{torn")
    assert "unreadable" in identity_problem(paths, _IDENTITY)
