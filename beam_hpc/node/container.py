"""The container seam: one function turns (site, argv, env, binds) into the command to run.

The Apptainer binary cannot be installed on the machines where this project is developed and
tested, so this is the only place that knows Apptainer's command line, and it is tested against a
written contract of Apptainer's documented behaviour (tests/node/test_container.py):
``apptainer exec [--nv] [--bind src[:dest[:opts]]]... IMAGE COMMAND ARGS...``; the host environment
passes in, but the image's own variables win over host ones of the same name unless set as
``APPTAINERENV_NAME`` on the host. ``--contain``, ``--containall`` and ``--compat`` give the
container a private in-memory /tmp and a minimal /dev, which breaks Ray (its sockets live in /tmp,
its object store in /dev/shm), and ``--cleanenv`` would drop the token and Ray variables: none of
them is ever used. The ``host`` runtime (laptops, tests, the local Slurm cluster) runs the command
as it is.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from beam_hpc.config.site import Site

APPTAINER = "apptainer"
APPTAINER_ENV_PREFIX = "APPTAINERENV_"
SHM = "/dev/shm"


@dataclass(frozen=True)
class Command:
    """What to hand to subprocess: the argv and the complete environment."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)


def container_command(
    site: Site,
    argv: Sequence[str],
    env: Mapping[str, str],
    binds: Sequence[str] = (),
    *,
    base: Mapping[str, str] | None = None,
    image: str | None = None,
) -> Command:
    """The command that runs ``argv`` under the site's container runtime.

    ``env`` holds the variables the job sets for this process (token path, Ray's mode, the job
    tag); ``base`` is the inherited environment they are added to (default: this process's).
    Under Apptainer each variable of ``env`` is also passed as ``APPTAINERENV_<NAME>``, so the
    image's own defaults cannot override it, while inherited host variables (PATH,
    LD_LIBRARY_PATH) keep Apptainer's normal treatment. ``binds`` are extra host paths (the run
    directory, the NVMe dir); the site's shared paths, its extra binds, its node-local scratch and
    /dev/shm are always bound. ``image`` overrides the site's image (a node-local staged copy).
    """
    full_env = dict(os.environ if base is None else base)
    full_env.update(env)
    spec = site.container
    if spec.runtime == "host":
        return Command(list(argv), full_env)
    sif = image or spec.image
    if not sif:
        raise ValueError("container.image: the apptainer runtime needs the .sif path")
    mounts = _dedupe([*site.shared_paths, *spec.binds, *([site.scratch] if site.scratch else []), SHM, *binds])
    cmd = [APPTAINER, "exec", "--nv"]
    for m in mounts:
        cmd += ["--bind", m]
    cmd.append(sif)
    cmd.extend(argv)
    for name, value in env.items():
        if not name.startswith(APPTAINER_ENV_PREFIX) and not name.startswith("APPTAINER_"):
            full_env[APPTAINER_ENV_PREFIX + name] = value
    return Command(cmd, full_env)


def _dedupe(binds: Sequence[str]) -> list[str]:
    """Drop repeats, and plain binds (same path inside) that a plain bind of a parent covers."""
    out: list[str] = []
    for b in binds:
        if not b or b in out:
            continue
        src = _plain_source(b)
        if src is not None and any(_inside(src, o) for o in map(_plain_source, out) if o is not None):
            continue
        out.append(b)
    return out


def _plain_source(bind: str) -> str | None:
    """The source of a bind that mounts a path at the same place inside, else None."""
    parts = bind.split(":")
    if len(parts) > 1 and parts[1] != parts[0]:
        return None
    if len(parts) > 2:  # options such as ro change what the container may do: keep it explicit
        return None
    return parts[0].rstrip("/") or "/"


def _inside(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")
