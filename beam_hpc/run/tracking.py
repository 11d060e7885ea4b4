"""One Weights & Biases run per beam-hpc run: its id, its files, its upload.

Every segment of a run (first, resubmitted, requeued) logs to one W&B run. Its id is made once, by
the first driver, and kept in ``<run>/wandb/run_id``: a file rather than a hash of the output
directory, so that a run started again in a deleted directory gets a run of its own. The driver
environment (``WANDB_RESUME=allow``, project, group, mode, directory) is static per run and travels
in the plan's driver command; the driver itself sets ``WANDB_RUN_ID`` from the file, because
Miles's ``init_wandb_primary`` passes no id to ``wandb.init`` (wandb then reads the environment).

Offline (``mode: offline``, or a site whose nodes have no internet) each segment leaves one
``offline-run-*`` directory; :func:`sync` uploads each finished one once with ``wandb sync`` and
records it in ``<run>/wandb/synced.json``. History is read back with wandb's own reader
(``wandb leet inspect --json``), which is also how a resumed segment learns what was logged.
This module imports no wandb: the login node needs it only to upload.
"""

from __future__ import annotations

import json
import netrc
import os
import secrets
import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from beam_hpc.config.recipe import Recipe
from beam_hpc.config.site import Site
from beam_hpc.errors import InputError
from beam_hpc.files import write_json_atomic

SUBDIR = "wandb"  # <run>/wandb: the id, the sync record, and W&B's own files (its "wandb/" below)
RUN_ID_FILE = "run_id"
SYNCED_FILE = "synced.json"
DEFAULT_HOST = "https://api.wandb.ai"


@dataclass(frozen=True)
class WandbSettings:
    """What the recipe and site ask of W&B, resolved: ``mode`` is offline where the nodes have no internet."""

    project: str
    entity: str | None
    mode: str
    group: str


def settings_for(recipe: Recipe, site: Site) -> WandbSettings | None:
    """The run's W&B settings, or None when the recipe has no ``tracking.wandb``."""
    w = recipe.tracking.wandb
    if w is None:
        return None
    mode = "offline" if w.mode == "offline" or not site.compute_internet else "online"
    return WandbSettings(project=w.project, entity=w.entity, mode=mode, group=recipe.name)


def wandb_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / SUBDIR


def driver_env(settings: WandbSettings, run_dir: str) -> dict[str, str]:
    """The driver's static W&B environment (``run_dir`` may be the ``{run_dir}`` placeholder)."""
    env = {
        "WANDB_PROJECT": settings.project,
        "WANDB_RUN_GROUP": settings.group,
        "WANDB_MODE": settings.mode,
        "WANDB_DIR": f"{run_dir}/{SUBDIR}",
        "WANDB_RESUME": "allow",
    }
    if settings.entity:
        env["WANDB_ENTITY"] = settings.entity
    return env


def run_id(run_dir: str | Path) -> str:
    """The run's W&B id, made by the first caller and read by every later one."""
    path = wandb_dir(run_dir) / RUN_ID_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return path.read_text().strip()
    new = f"beam-{secrets.token_hex(6)}"
    with os.fdopen(fd, "w") as f:
        f.write(new + "\n")
    return new


def existing_run_id(run_dir: str | Path) -> str | None:
    path = wandb_dir(run_dir) / RUN_ID_FILE
    return path.read_text().strip() if path.is_file() else None


def segment_dirs(run_dir: str | Path) -> list[Path]:
    """W&B's per-process directories of this run (one per segment), oldest first."""
    root = wandb_dir(run_dir) / "wandb"
    if not root.is_dir():
        return []
    found = [d for d in root.iterdir() if d.is_dir() and d.name.startswith(("offline-run-", "run-"))]
    return sorted(found, key=lambda d: d.name.split("-", 2)[-1] if d.name.startswith("offline-") else d.name[4:])


def transaction_log(segment_dir: Path) -> Path | None:
    logs = sorted(segment_dir.glob("run-*.wandb"))
    return logs[0] if logs else None


def wandb_command() -> list[str]:
    """``wandb`` on PATH, else the one installed beside this interpreter."""
    found = shutil.which("wandb")
    return [found] if found else [sys.executable, "-m", "wandb"]


def read_records(log: Path, timeout_s: float = 120) -> list[dict[str, Any]]:
    """Every record of a ``.wandb`` transaction log, as wandb's own reader prints them."""
    proc = subprocess.run([*wandb_command(), "leet", "inspect", "--json", str(log)],
                          capture_output=True, text=True, timeout=timeout_s, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"wandb leet inspect {log}: exit {proc.returncode}: {proc.stderr.strip()[-500:]}")
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def history(log: Path) -> list[dict[str, Any]]:
    """The history rows (``wandb.log`` calls) of one transaction log, in order."""
    return [r["history"]["item"] for r in read_records(log) if r.get("type") == "history"]


def finished(segment_dir: Path, later_exists: bool) -> bool:
    """A segment's W&B files are complete when its run ended (an exit record) or a later segment
    started (its driver is gone, whatever ended it)."""
    if later_exists:
        return True
    log = transaction_log(segment_dir)
    return log is not None and any(r.get("type") == "exit" for r in read_records(log))


def synced(run_dir: str | Path) -> dict[str, Any]:
    path = wandb_dir(run_dir) / SYNCED_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


def unsynced(run_dir: str | Path) -> list[Path]:
    """Offline segment directories not yet uploaded (finished or not)."""
    done = synced(run_dir)
    return [d for d in segment_dirs(run_dir) if d.name.startswith("offline-") and d.name not in done]


def sync(run_dir: str | Path, *, echo: Any = print) -> tuple[list[str], list[str]]:
    """Upload each finished, not yet synced offline segment with ``wandb sync``, oldest first, and
    record it. Returns (synced now, left for later: still running)."""
    pending = unsynced(run_dir)
    all_dirs = segment_dirs(run_dir)
    done, later = [], []
    record = synced(run_dir)
    for d in pending:
        if not finished(d, later_exists=d != all_dirs[-1]):
            later.append(d.name)
            continue
        proc = subprocess.run([*wandb_command(), "sync", str(d)], capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"wandb sync {d}: exit {proc.returncode}: {(proc.stderr or proc.stdout).strip()[-800:]}")
        record[d.name] = {"log": str(transaction_log(d))}
        write_json_atomic(wandb_dir(run_dir) / SYNCED_FILE, record)
        done.append(d.name)
        echo(f"synced {d.name}")
    return done, later


def has_api_key(environ: Mapping[str, str]) -> bool:
    """Whether wandb would find credentials: ``WANDB_API_KEY`` (or an identity token file), else a
    netrc entry (``NETRC`` or ``~/.netrc``) for the host of ``WANDB_BASE_URL`` (default api.wandb.ai)."""
    if environ.get("WANDB_API_KEY") or environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = urlparse(environ.get("WANDB_BASE_URL") or DEFAULT_HOST).hostname or ""
    path = Path(environ["NETRC"]) if environ.get("NETRC") else Path(environ.get("HOME", "~")).expanduser() / ".netrc"
    try:
        auth = netrc.netrc(str(path)).authenticators(host)
    except (OSError, netrc.NetrcParseError):
        return False
    return bool(auth and auth[2])


def check_credentials(recipe: Recipe, site: Site, environ: Mapping[str, str]) -> None:
    """W&B online needs a key where the job runs; refused (exit 2) before anything is submitted."""
    s = settings_for(recipe, site)
    if s is None or s.mode != "online" or has_api_key(environ):
        return
    raise InputError(
        "tracking.wandb.mode: online, but no W&B API key is set (neither WANDB_API_KEY nor a .netrc entry for "
        f"{urlparse(environ.get('WANDB_BASE_URL') or DEFAULT_HOST).hostname}); run `wandb login` or export "
        "WANDB_API_KEY, or set tracking.wandb.mode: offline and upload with `beam-hpc sync RUN`"
    )


def summary(run_dir: str | Path) -> dict[str, Any] | None:
    """For ``beam-hpc status``: the W&B run id and which offline segments are not yet uploaded
    (cheap: file names only). None where the run has no W&B files."""
    rid = existing_run_id(run_dir)
    if rid is None:
        return None
    dirs = segment_dirs(run_dir)
    done = synced(run_dir)
    offline = [d.name for d in dirs if d.name.startswith("offline-")]
    return {"run_id": rid, "segments": len(dirs), "offline": len(offline),
            "synced": [n for n in offline if n in done], "unsynced": [n for n in offline if n not in done]}


def describe(s: dict[str, Any] | None, run_dir: str) -> str | None:
    """One status line for :func:`summary`'s dict."""
    if s is None:
        return None
    if not s["offline"]:
        return f"W&B run {s['run_id']} ({s['segments']} segment(s), online)"
    if not s["unsynced"]:
        return f"W&B run {s['run_id']}: all {s['offline']} offline segment(s) synced"
    return (f"W&B run {s['run_id']}: {len(s['unsynced'])} of {s['offline']} offline segment(s) not yet synced; "
            f"upload them: beam-hpc sync {run_dir}")
