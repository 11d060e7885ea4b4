"""One Weights & Biases run per beam-hpc run: its id, its files, its upload.

Every segment of a run (first, resubmitted, requeued) logs to one W&B run. Its id is made once, by
the first driver, and kept in ``<run>/wandb/run_id``: a file rather than a hash of the output
directory, so that a run started again in a deleted directory gets a run of its own. The driver
environment (``WANDB_RESUME=allow``, project, group, mode, directory) is static per run and travels
in the plan's driver command; the driver itself sets ``WANDB_RUN_ID`` from the file, because
Miles's ``init_wandb_primary`` passes no id to ``wandb.init`` (wandb then reads the environment).

Offline (``mode: offline``, or a site whose nodes have no internet) every process that calls
``wandb.init`` writes a *fragment* of the run: its own ``offline-run-<time>-<id>[-n]`` directory
under ``<run>/wandb/wandb``. The reference backend has one writer per segment (its driver). Miles
has three (radixark/miles 31f1ca96, ``miles/utils/tracking_utils/wandb_utils.py``):
``init_wandb_primary`` in the driver, and ``init_wandb_secondary`` (same id, ``resume="allow"``,
``reinit=True``) in the first trainer rank (``backends/megatron_utils/actor.py``) and in the rollout
manager (``ray/rollout/rollout_manager.py``). The secondaries are Ray actors that never call
``wandb.finish``; their fragments often end without an exit record.

:func:`sync` therefore decides per *segment*, from beam-hpc's own ledger, when a fragment is
complete: the segment that wrote it has an end line, or a later segment has started (every process
of the earlier job is gone). A fragment of a segment that is still running is never uploaded.
wandb 0.31's ``wandb sync`` (wandb-core ``internal/runsync/runsyncoperation.go``, ``initAndPlan``,
read at wandb/wandb master of 2026-08, 0.28.3.dev1, and stated by 0.31.0's own ``wandb sync --help``)
groups the files of one call by run path and replays those of one run one after another in order of
their start time, each as a resumption of the run; a file without an exit record is closed with exit
code 1 (``runreader.go``, ``sendExitIfNotSeen``), and the run's state is the last replay's. So
the finished fragments go to W&B in two ``wandb sync`` calls, which order them: the secondary
writers' (Miles's killed actors: no exit record), then the primaries', whose exit is the run's;
``wandb sync`` marks each file it uploaded with a
``<file>.wandb.synced`` marker (``runsyncer.go``, ``markSynced``), and since it exits 0 even when an
upload failed, :func:`sync` checks those markers and records the uploaded fragments and segments in
``<run>/wandb/synced.json``.

History is read back with wandb's own reader (``wandb leet inspect --json``), which is also how a
resumed segment learns what was logged. This module imports no wandb: the login node needs it only
to upload.
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
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from beam_hpc.config.recipe import Recipe
from beam_hpc.config.site import Site
from beam_hpc.errors import InputError
from beam_hpc.files import fsync_dir, write_atomic, write_json_atomic

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


def wandb_env(settings: WandbSettings, run_dir: str) -> dict[str, str]:
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
    """The run's W&B id, made by the first caller and read by every later one.

    The id is written to a private temporary file and then hard-linked onto its name: ``link``
    fails when the name exists, as ``O_EXCL`` would, but the file appears with its content, so a
    racing reader never sees it empty."""
    path = wandb_dir(run_dir) / RUN_ID_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_file():
        return path.read_text().strip()
    new = f"beam-{secrets.token_hex(6)}"
    tmp = path.with_name(f".{RUN_ID_FILE}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        write_atomic(tmp, new + "\n")
        os.link(tmp, path)
    except FileExistsError:
        return path.read_text().strip()
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)
    return new


def existing_run_id(run_dir: str | Path) -> str | None:
    path = wandb_dir(run_dir) / RUN_ID_FILE
    return path.read_text().strip() if path.is_file() else None


def _fragment_key(d: Path) -> str:
    """Sort key from the directory name: ``<time>-<id>[-n]`` (wandb adds ``-n`` when two processes
    of one id start in the same second: ``wandb_init.py`` ``set_sync_dir_suffix``)."""
    return d.name.split("-", 2)[-1] if d.name.startswith("offline-") else d.name[4:]


def fragment_dirs(run_dir: str | Path) -> list[Path]:
    """W&B's per-process directories of this run (its fragments: one per ``wandb.init``), oldest
    first by name (second resolution: fragments of one segment may tie)."""
    root = wandb_dir(run_dir) / "wandb"
    if not root.is_dir():
        return []
    found = [d for d in root.iterdir() if d.is_dir() and d.name.startswith(("offline-run-", "run-"))]
    return sorted(found, key=_fragment_key)


def transaction_log(fragment: Path) -> Path | None:
    logs = sorted(fragment.glob("run-*.wandb"))
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


@dataclass(frozen=True)
class Fragment:
    """One process's offline directory, as its transaction log tells: the run id and start time of
    its run record (None before the log's first flush) and whether it holds an exit record."""

    path: Path
    log: Path | None
    start: float | None
    exited: bool
    run_id: str | None = None
    primary: bool = True  # its run record names the group or the run, as only a primary writer's does


def read_fragment(d: Path) -> Fragment:
    log = transaction_log(d)
    start, exited, rid, primary = None, False, None, True
    if log is not None and log.stat().st_size > 0:
        for r in read_records(log):
            if r.get("type") == "run" and start is None:
                rid = r["run"].get("run_id")
                # Miles's init_wandb_primary passes group and name; init_wandb_secondary neither (the
                # reference backend's one writer passes both)
                primary = bool(r["run"].get("run_group") or r["run"].get("display_name"))
                stamp = str(r["run"].get("start_time", ""))
                if stamp:
                    start = datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
            elif r.get("type") == "exit":
                exited = True
    return Fragment(d, log, start, exited, rid, primary)


def _synced_marker(log: Path) -> Path:
    """What ``wandb sync`` leaves beside a file it uploaded (wandb-core ``runsyncer.go``
    ``markSynced``; ``cli/beta_sync.py`` ``_is_synced`` skips such files)."""
    return log.with_name(log.name + ".synced")


def synced(run_dir: str | Path) -> dict[str, Any]:
    """``{"fragments": {name: {"segment", "log"}}, "segments": [id, ...]}`` of what was uploaded
    (a record from before segments were kept is a flat ``{name: {...}}``)."""
    path = wandb_dir(run_dir) / SYNCED_FILE
    data = json.loads(path.read_text()) if path.is_file() else {}
    if "fragments" not in data:
        data = {"fragments": data, "segments": []}
    return data


@dataclass(frozen=True)
class SyncPlan:
    """What :func:`sync` would do now: the fragments to upload, by segment; the ended segments that
    left nothing to upload; what is left for later, each with the reason; and the fragments that
    hold nothing W&B can replay (recorded as such, never uploaded)."""

    upload: dict[str, list[Fragment]]
    empty: list[str]
    later: list[tuple[str, str]]
    no_record: list[str]  # fragments of ended segments whose log holds no run record: nothing to upload

    @property
    def fragments(self) -> list[Fragment]:
        return sorted((f for fs in self.upload.values() for f in fs), key=lambda f: f.start or 0.0)


def _segment_of(start: float, segments: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The ledger segment a fragment that started at ``start`` belongs to: the last one started
    before it (a segment's driver, and with it every W&B writer, starts after its start line)."""
    owner = None
    for rec in segments:
        t = (rec.get("start") or {}).get("time")
        if t is not None and t <= start:
            owner = rec
    return owner


def _ended(rec: dict[str, Any], segments: list[dict[str, Any]]) -> bool:
    """A segment has ended when its end line is written, or when a later segment has started (its
    job is gone, whatever ended it: a segment killed hard writes no end line)."""
    if rec.get("end") is not None:
        return True
    after = segments[segments.index(rec) + 1:]
    return any(r.get("start") is not None for r in after)


def plan_sync(run_dir: str | Path, segments: list[dict[str, Any]]) -> SyncPlan:
    """Group the offline fragments not yet uploaded by the ledger segment that wrote them
    (``segments``: :func:`beam_hpc.run.ledger.read_ledger`'s records) and keep those of ended
    segments. Without a ledger (W&B used outside a beam-hpc segment) a fragment counts as finished
    only when it has an exit record."""
    record = synced(run_dir)
    upload: dict[str, list[Fragment]] = {}
    later: list[tuple[str, str]] = []
    empties: list[str] = []
    open_segments: set[str] = set()
    for d in fragment_dirs(run_dir):
        if not d.name.startswith("offline-") or d.name in record["fragments"]:
            continue
        frag = read_fragment(d)
        # a log without a run record yet: placed by its directory's time (wandb makes it at init)
        rec = _segment_of(frag.start if frag.start is not None else d.stat().st_mtime, segments)
        if rec is None:
            if frag.exited:
                upload.setdefault(d.name, []).append(frag)  # no ledger: a group of its own
            else:
                later.append((d.name, "no segment of the ledger wrote it and it has no exit record"))
            continue
        if not _ended(rec, segments):
            open_segments.add(rec["segment"])
            later.append((d.name, f"segment {rec['segment']} is still running"))
        elif frag.start is None:
            # its process was killed before wandb first flushed the log (every 15 s offline): W&B's
            # sync cannot replay a log without a run record, and one such file fails the whole call
            # (wandb-core runsyncoperation.go: initAndPlan returns the first Init error)
            empties.append(d.name)
        else:
            upload.setdefault(rec["segment"], []).append(frag)
    empty = [r["segment"] for r in segments if _ended(r, segments) and r["segment"] not in upload
             and r["segment"] not in record["segments"] and r["segment"] not in open_segments]
    return SyncPlan(upload, empty, later, empties)


def sync(run_dir: str | Path, segments: list[dict[str, Any]], *, dry_run: bool = False,
         echo: Any = print) -> SyncPlan:
    """Upload the fragments of every ended, not yet uploaded segment with ``wandb sync`` (one call
    for the secondary writers' fragments, then one for the primaries'; wandb replays one run's files
    in order of their start time: see the module docstring), check wandb's own markers, and record
    what was uploaded. With ``dry_run``, ``wandb sync --dry-run``
    lists what it would upload (it needs no server and no key) and nothing is recorded."""
    plan = plan_sync(run_dir, segments)
    frags = plan.fragments
    # Secondaries first, then the primaries: each replay ends the run with its file's exit (exit code 1
    # where the file has none, as Miles's killed secondaries' files), so the run's state on W&B is
    # the last primary's: finished when the chain completed. Within a call wandb orders by start time.
    for batch in ([f for f in frags if not f.primary], [f for f in frags if f.primary]):
        if not batch:
            continue
        argv = [*wandb_command(), "sync", *(["--dry-run", "--verbose"] if dry_run else []),
                *(str(f.path) for f in batch)]
        proc = subprocess.run(argv, capture_output=True, text=True, check=False, cwd=wandb_dir(run_dir) / "wandb")
        said = "\n".join(x for x in (proc.stdout.strip(), proc.stderr.strip()) if x)
        if proc.returncode != 0:
            raise RuntimeError(f"wandb sync: exit {proc.returncode}: {said[-800:]}")
        if dry_run:
            echo(said)
            continue
        missing = [f.path.name for f in batch if f.log is None or not _synced_marker(f.log).exists()]
        if missing:
            raise RuntimeError(f"wandb sync did not upload {', '.join(missing)} (no .wandb.synced marker); "
                               f"it said: {said[-800:]}")
    if dry_run:
        return plan
    record = synced(run_dir)
    for segment, fs in plan.upload.items():
        for f in fs:
            record["fragments"][f.path.name] = {"segment": segment, "log": str(f.log)}
            echo(f"synced {f.path.name} (segment {segment})")
    for name in plan.no_record:
        record["fragments"][name] = {"segment": None, "log": None, "skipped": "no run record"}
        echo(f"skipped {name}: its log holds no run record (its process was killed before wandb's first flush)")
    record["segments"] = [*record["segments"], *(s for s in [*plan.upload, *plan.empty] if s not in record["segments"])]
    if plan.upload or plan.empty or plan.no_record:
        write_json_atomic(wandb_dir(run_dir) / SYNCED_FILE, record)
    return plan


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


def check_credentials(settings: WandbSettings | None, environ: Mapping[str, str]) -> None:
    """W&B online needs a key where the job runs; refused (exit 2) before anything is submitted.
    ``settings``: the run's settings as :func:`settings_for` resolved them for its plan (once per
    plan: the driver's flags, its environment and this check read the same)."""
    if settings is None or settings.mode != "online" or has_api_key(environ):
        return
    raise InputError(
        "tracking.wandb.mode: online, but no W&B API key is set (neither WANDB_API_KEY nor a .netrc entry for "
        f"{urlparse(environ.get('WANDB_BASE_URL') or DEFAULT_HOST).hostname}); run `wandb login` or export "
        "WANDB_API_KEY, or set tracking.wandb.mode: offline and upload with `beam-hpc sync RUN`"
    )


def summary(run_dir: str | Path, segments: list[str]) -> dict[str, Any] | None:
    """For ``beam-hpc status``: the W&B run id and which of the run's segments (``segments``: the
    ledger's ids, in order) are not yet uploaded, from file names and ``synced.json`` only (cheap;
    a segment counts once, however many processes wrote fragments of it). None where the run has
    no W&B files."""
    rid = existing_run_id(run_dir)
    if rid is None:
        return None
    dirs = fragment_dirs(run_dir)
    offline = any(d.name.startswith("offline-") for d in dirs)
    done = synced(run_dir)["segments"] if offline else []
    return {"run_id": rid, "segments": len(segments), "fragments": len(dirs), "offline": len(segments) if offline else 0,
            "synced": [s for s in segments if s in done], "unsynced": [s for s in segments if s not in done] if offline else []}


def describe(s: dict[str, Any] | None, run_dir: str) -> str | None:
    """One status line for :func:`summary`'s dict."""
    if s is None:
        return None
    if not s["offline"]:
        return f"W&B run {s['run_id']} ({s['segments']} segment(s), online)"
    if not s["unsynced"]:
        return f"W&B run {s['run_id']}: all {s['offline']} offline segment(s) synced"
    return (f"W&B run {s['run_id']}: {len(s['unsynced'])} of {s['offline']} offline segment(s) not yet synced; "
            f"upload the ended ones: beam-hpc sync {run_dir}")
