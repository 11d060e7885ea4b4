"""Published policy versions: ``RUN/elastic/policy/v<NNNNNN>/``, immutable and checksummed.

The driver publishes the trainer's trainable weights after an update (only while an outside worker
is registered: the segment's own workers get theirs over the run's transport) as
``weights.pt`` plus ``manifest.json`` with the file's sha256, staged in a temporary directory and
renamed into place, so a reader sees a whole version or none. A worker loads the version a unit
names and refuses it if the checksum does not match. Versions older than the staleness allows are
pruned, and a new segment starts from none (a version number is only ever one segment's weights).
torch is imported only by the functions that read or write weights.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import stat
from pathlib import Path
from typing import Any

from beam_hpc.errors import RuntimeFailure
from beam_hpc.files import atomic_dir, sha256_file, write_json_atomic

WEIGHTS = "weights.pt"
MANIFEST = "manifest.json"
_NAME = re.compile(r"^v(\d{6,})$")
_FILE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")  # a name in the version directory itself
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


class PolicyVersionError(RuntimeFailure):
    """A version's files do not match their manifest."""


class PolicyVersionMissing(PolicyVersionError):
    """A version is not (or no longer) published: its segment has ended, or it was pruned."""


def policy_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "elastic" / "policy"


def version_dir(run_dir: str | Path, version: int) -> Path:
    return policy_dir(run_dir) / f"v{version:06d}"


def versions(run_dir: str | Path) -> list[int]:
    d = policy_dir(run_dir)
    if not d.is_dir():
        return []
    found = (_NAME.match(p.name) for p in d.iterdir())
    return sorted(int(m.group(1)) for m in found if m and (d / m.group(0) / MANIFEST).is_file())


def latest(run_dir: str | Path) -> int | None:
    v = versions(run_dir)
    return v[-1] if v else None


def publish(run_dir: str | Path, version: int, state: dict[str, Any]) -> bool:
    """Write ``state`` (name -> tensor) as ``version``; False if it exists already (immutable)."""
    import torch

    target = version_dir(run_dir, version)
    if (target / MANIFEST).is_file():
        return False
    target.parent.mkdir(parents=True, exist_ok=True)
    with atomic_dir(target) as staged:
        torch.save({k: v.detach().cpu().contiguous() for k, v in state.items()}, staged / WEIGHTS)
        write_json_atomic(staged / MANIFEST, {"version": version, "files": {WEIGHTS: sha256_file(staged / WEIGHTS)},
                                              "tensors": len(state)})
    return True


def _manifest_files(manifest: Any, version: int) -> dict[str, str]:
    """The manifest's ``files`` (name -> sha256), each name a plain file name of the version
    directory, ``weights.pt`` among them; raises PolicyVersionError on anything else."""
    if not isinstance(manifest, dict) or manifest.get("version") != version:
        raise PolicyVersionError(f"policy version {version}: the manifest is not this version's")
    files = manifest.get("files")
    if not isinstance(files, dict) or WEIGHTS not in files:
        raise PolicyVersionError(f"policy version {version}: the manifest does not list {WEIGHTS}; it will not be loaded")
    for name, digest in files.items():
        if not (isinstance(name, str) and _FILE.match(name) and name != MANIFEST):
            raise PolicyVersionError(f"policy version {version}: manifest names {str(name)[:60]!r}, not a plain file "
                                     "name of its directory (no '/', '..' or absolute path); it will not be loaded")
        if not (isinstance(digest, str) and _SHA256.match(digest)):
            raise PolicyVersionError(f"policy version {version}: manifest gives {name} no sha256")
    return files


def _read_plain(path: Path, version: int) -> bytes:
    """The bytes of ``path``, refusing a symbolic link (it could point out of the directory)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError as e:
        raise PolicyVersionMissing(f"policy version {version}: pruned while loading") from e
    except OSError as e:  # ELOOP: a symbolic link
        raise PolicyVersionError(f"policy version {version}: {path.name} is not a plain file ({e}); it will not be loaded") from e
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise PolicyVersionError(f"policy version {version}: {path.name} is not a plain file; it will not be loaded")
        return f.read()


def load_verified(run_dir: str | Path, version: int) -> dict[str, Any]:
    """The weights of ``version`` after checking every file against the manifest. The manifest must
    list ``weights.pt``, every name must stay inside the version directory, and the weights loaded
    are the very bytes that were checked (read once, then hashed and deserialised)."""
    import torch

    d = version_dir(run_dir, version)
    try:
        manifest = json.loads((d / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        raise PolicyVersionMissing(f"policy version {version}: no readable manifest in {d} ({e})") from e
    weights = b""
    for name, digest in _manifest_files(manifest, version).items():
        data = _read_plain(d / name, version)
        got = hashlib.sha256(data).hexdigest()
        if got != digest:
            raise PolicyVersionError(f"policy version {version}: {name} has sha256 {got[:12]}..., "
                                     f"the manifest says {digest[:12]}...; it will not be served")
        if name == WEIGHTS:
            weights = data
    state: dict[str, Any] = torch.load(io.BytesIO(weights), weights_only=True)
    return state


def prune(run_dir: str | Path, keep_from: int | None = None) -> list[int]:
    """Remove the versions older than ``keep_from`` (None: all of them); returns them."""
    gone = [v for v in versions(run_dir) if keep_from is None or v < keep_from]
    for v in gone:
        shutil.rmtree(version_dir(run_dir, v), ignore_errors=True)
    return gone
