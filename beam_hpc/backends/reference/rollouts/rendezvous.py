"""Where an outside worker finds a run's rollout service: ``RUN/elastic/rendezvous.json``.

The run's driver writes it (mode 0600, atomically) once a segment's service is up and removes it
when that segment's driver stops, so "no file" means "wait for the next segment". It holds the
per-run secret every request must prove it knows (see :mod:`beam_hpc.backends.reference.rollouts.unit_server`), which is
why only the run's owner may read it.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import asdict, dataclass
from pathlib import Path

from beam_hpc.files import write_json_atomic

FILE_MODE = 0o600


def elastic_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "elastic"


def path_of(run_dir: str | Path) -> Path:
    return elastic_dir(run_dir) / "rendezvous.json"


def new_secret() -> str:
    return secrets.token_hex(32)


@dataclass(frozen=True)
class Rendezvous:
    segment: str  # "<job>-<restart>" in a Slurm job, "local-<pid>" outside one
    address: str
    port: int
    secret: str
    run_seed: int
    sync: bool  # True: a unit is served only at the exact current policy version
    max_staleness: int  # versions a unit's policy may lag the trainer's (0 when sync)
    policy_dir: str

    @property
    def url(self) -> str:
        return f"http://{self.address}:{self.port}"


def write(run_dir: str | Path, rv: Rendezvous) -> Path:
    p = path_of(run_dir)
    write_json_atomic(p, asdict(rv), mode=FILE_MODE)
    return p


def read(run_dir: str | Path) -> Rendezvous | None:
    """The run's current rendezvous, or None when no segment serves now (or the file is torn by
    a writer other than ours: readers then simply look again)."""
    try:
        d = json.loads(path_of(run_dir).read_text())
        return Rendezvous(**{k: d[k] for k in Rendezvous.__dataclass_fields__})
    except (OSError, ValueError, KeyError, TypeError):
        return None


def remove(run_dir: str | Path, segment: str) -> None:
    """Remove the rendezvous if it is still this segment's (a later segment's stays)."""
    rv = read(run_dir)
    if rv is not None and rv.segment == segment:
        path_of(run_dir).unlink(missing_ok=True)
