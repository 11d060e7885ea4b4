"""The resume identity: what a run's checkpoints were made with, recorded once and checked once.

The seed: a resume keeps the model, data, output directory and topology (num_rollout, walltime and
partitions may change). ``Recipe.identity()`` is that set of fields. The first segment records it
in ``checkpoints/run_identity.json`` before its driver starts (:func:`record_identity`); it lives
beside the checkpoints, not in plan.json, because plan.json is what a segment is told to run and
may have been changed since (by hand, or by another submission).

:func:`identity_problem` is the one comparison, used by the login-node guard
(beam_hpc.submission.run_guard, before a ``--resume`` submission) and inside the job
(beam_hpc.job.segment, through the same guard, for a segment that Slurm requeued or a script
started): both give the same message, naming the changed fields. Only where no record exists
(checkpoints from an older beam-hpc) does plan.json's recipe stand in for it; plan.json's
``identity_sha`` stays a record and is never a second check.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from beam_hpc.errors import InputError
from beam_hpc.files import write_json_atomic
from beam_hpc.plan.paths import RunPaths

log = logging.getLogger(__name__)


class IdentityError(InputError):
    """The checkpoints were made with another model, data or topology (the message names the fields)."""


def identity_path(paths: RunPaths) -> Path:
    """``checkpoints/run_identity.json``: the recipe identity the checkpoints were made with."""
    return Path(paths.identity)


def _flatten(value: object, prefix: str = "") -> dict[str, object]:
    if isinstance(value, dict) and value:
        out: dict[str, object] = {}
        for k, v in value.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: value}


def _recorded(paths: RunPaths) -> tuple[dict | None, str | None]:
    """(the identity the checkpoints were made with, or None when nothing says; a problem reading it)."""
    p = identity_path(paths)
    try:
        return json.loads(p.read_text())["identity"], None
    except FileNotFoundError:
        pass
    except (ValueError, KeyError, TypeError) as err:
        return None, (f"identity: {p} is unreadable ({err}); it records what the checkpoints were made with: "
                      "restore it, or start a new --output-dir")
    return _from_plan(paths), None


def _from_plan(paths: RunPaths) -> dict | None:
    """Checkpoints from before run_identity.json existed: the run's plan.json recipe stands in.
    An unreadable or older plan.json says nothing (the job's own record decides later)."""
    from beam_hpc.config.recipe import Recipe

    try:
        old = json.loads(Path(paths.plan).read_text())
        return Recipe.model_validate(old["recipe"]).identity()
    except Exception:  # no plan.json, or an older or hand-edited one: nothing to compare with
        return None


def identity_problem(paths: RunPaths, identity: dict[str, Any]) -> str | None:
    """Why a segment with ``identity`` must not resume from the run's checkpoints (None when it
    may): the fields (dotted, e.g. ``model.path``, ``topology.trainer.nodes``) whose value differs
    from the one the checkpoints were made with."""
    recorded, problem = _recorded(paths)
    if problem is not None:
        return problem
    if recorded is None:
        return None
    old, new = _flatten(recorded), _flatten(identity)
    changed = [f"{k} (was {old.get(k)!r}, now {new.get(k)!r})" for k in sorted(old.keys() | new.keys())
               if old.get(k) != new.get(k)]
    if not changed:
        return None
    return (f"identity: the checkpoints in {paths.checkpoints} were made with another {'; '.join(changed)}. "
            "A run keeps its model, data and topology (num_rollout, walltime and partitions may change): "
            "restore plan.json (resubmit with the run's recipe and --resume), or run this configuration "
            "in a new --output-dir")


def check_identity(paths: RunPaths, identity: dict[str, Any]) -> None:
    """Raise :class:`IdentityError` with :func:`identity_problem`'s message when there is one."""
    problem = identity_problem(paths, identity)
    if problem is not None:
        raise IdentityError(problem)


def record_identity(paths: RunPaths, identity: dict[str, Any], segment: str, *, has_ckpt: bool) -> None:
    """Record the identity the checkpoints are made with, before the driver starts: once per run (a
    later segment only compares with it), or again while no checkpoint exists yet (nothing was
    made with the old one). Written atomically: a torn record would refuse every later segment."""
    p = identity_path(paths)
    if has_ckpt and p.is_file():
        return
    if has_ckpt:
        log.warning("%s is missing (checkpoints from an older beam-hpc?): recording this plan's identity", p)
    write_json_atomic(p, {"identity": identity, "recorded_by": segment, "time": time.time()})
