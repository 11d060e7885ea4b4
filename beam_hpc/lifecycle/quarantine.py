"""The site's node quarantine: nodes that failed in any run stay out of every run for a while.

Why: a run's own exclusions (:mod:`beam_hpc.lifecycle.exclusions`) live in its ledger, so the next
run, or another user's, would land on the same broken node and pay a bring-up to find out again; on
large clusters a few "lemon" nodes cause most failures. A site may name one shared file
(``quarantine:``; ``quarantine_days`` how long an entry holds): every segment that ends because of a
node adds an entry per node (run, segment, reason, time, expiry fixed when written); every
submission, resubmission and requeue excludes the nodes with an unexpired entry; ``beam-hpc nodes``
lists and releases them. Shared by every user of the site, the file changes only by a locked
read-modify-write published atomically (two segments ending at once both land; expired entries go
on the next write), and it and its lock are created group-writable (0664; keep them in a setgid
directory of the users' common group). A damaged file is refused with its path and repair (exit 2)
on the login node; inside the allocation it is logged and left alone, because failing a segment
over bookkeeping would cost more than the node it guards against.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from beam_hpc.errors import InputError, RuntimeFailure, shorten
from beam_hpc.files import LockTimeout, locked, write_json_atomic

log = logging.getLogger(__name__)

# The file: {"version": 1, "entries": [{"node", "run", "run_dir", "segment", "why", "time", "expires"}, ...]}
VERSION = 1
DAY_S = 86400.0
LOCK_TIMEOUT_S = 60.0  # a holder only reads and rewrites a small file; a minute means a stuck filesystem


class QuarantineFileError(InputError):
    """The quarantine file exists but is not a quarantine list (exit 2: it names the file and the fix)."""


class QuarantineBusy(RuntimeFailure):
    """The quarantine file's lock stayed held for the whole timeout."""


@dataclass(frozen=True)
class Entry:
    """One failure of one node in one run; the node is out until ``expires`` (epoch seconds)."""

    node: str
    run: str
    run_dir: str
    segment: str
    why: str
    time: float
    expires: float


def lock_path(path: str | Path) -> Path:
    p = Path(path)
    return p.with_name(p.name + ".lock")


def read_entries(path: str | Path) -> list[Entry]:
    """Every entry of the file (expired ones too); none when the file does not exist.
    Raises :class:`QuarantineFileError` when it exists but cannot be read as a quarantine list."""
    p = Path(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        return []
    except OSError as err:
        raise QuarantineFileError(f"quarantine: cannot read {shorten(str(p))} ({err.strerror}); "
                                  "fix its permissions or the site's quarantine path") from None
    try:
        data = json.loads(text)
        if not isinstance(data, dict) or not isinstance(data.get("entries"), list):
            raise ValueError("no 'entries' list")
        entries = [_entry(e) for e in data["entries"]]
    except (ValueError, TypeError, KeyError) as err:
        raise QuarantineFileError(
            f"quarantine: {shorten(str(p))} is not a quarantine list ({shorten(str(err), 120)}); repair it "
            "(format: {\"version\": 1, \"entries\": [...]}) or remove it to start an empty one") from None
    return entries


def _entry(raw: Any) -> Entry:
    if not isinstance(raw, Mapping):
        raise ValueError(f"entry {raw!r} is not an object")
    node = raw["node"]
    if not isinstance(node, str) or not node:
        raise ValueError(f"entry {raw!r} names no node")
    return Entry(node=node, run=str(raw.get("run", "")), run_dir=str(raw.get("run_dir", "")),
                 segment=str(raw.get("segment", "")), why=str(raw.get("why", "")),
                 time=float(raw["time"]), expires=float(raw["expires"]))


def active(entries: Iterable[Entry], *, now: float | None = None) -> list[Entry]:
    """One entry per node still out at ``now``: its latest failure (and the latest expiry among its
    entries, so a later failure never shortens the quarantine), oldest first."""
    at = time.time() if now is None else now
    latest: dict[str, Entry] = {}
    until: dict[str, float] = {}
    for e in entries:
        if e.expires <= at:
            continue
        until[e.node] = max(until.get(e.node, 0.0), e.expires)
        if e.node not in latest or e.time >= latest[e.node].time:
            latest[e.node] = e
    out = [Entry(**{**asdict(e), "expires": until[e.node]}) for e in latest.values()]
    return sorted(out, key=lambda e: e.time)


def quarantined(path: str | Path, *, now: float | None = None) -> list[Entry]:
    """The nodes out now, read without the lock (the file is replaced atomically)."""
    return active(read_entries(path), now=now)


FILE_MODE = 0o664  # every user of the site writes it: group-writable, in a setgid directory of their group


def _write(path: Path, entries: Sequence[Entry], now: float) -> None:
    keep = [asdict(e) for e in entries if e.expires > now]
    write_json_atomic(path, {"version": VERSION, "entries": keep}, mode=FILE_MODE)


def _lock(path: Path):  # type: ignore[no-untyped-def]
    """The file's exclusive lock, created group-writable (the umask would keep the next user out)."""
    lp = lock_path(path)
    if not lp.exists():
        lp.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lp, os.O_RDWR | os.O_CREAT, FILE_MODE)
        try:
            os.fchmod(fd, FILE_MODE)
        except OSError:  # created by another user in between: theirs to set
            pass
        finally:
            os.close(fd)
    return locked(lp, timeout_s=LOCK_TIMEOUT_S)


def record(path: str | Path, failed_nodes: Iterable[Mapping[str, str]], *, run: str, run_dir: str,
           segment: str, days: float, now: float | None = None) -> list[Entry]:
    """Add one entry per failed node (``{"node", "why"}``, as in a ledger end line); returns them.
    Locked read-modify-write, published atomically; expired entries are dropped on the way."""
    at = time.time() if now is None else now
    added = [Entry(node=str(f["node"]), run=run, run_dir=run_dir, segment=segment, why=str(f.get("why", "")),
                   time=at, expires=at + days * DAY_S) for f in failed_nodes if f.get("node")]
    if not added:
        return []
    p = Path(path)
    try:
        with _lock(p):
            _write(p, [*read_entries(p), *added], at)
    except LockTimeout as err:
        raise QuarantineBusy(f"quarantine: {err}") from None
    return added


def release(path: str | Path, nodes: Sequence[str], *, now: float | None = None) -> list[Entry]:
    """Let ``nodes`` back in for every run: remove all their entries; returns what was released.
    A node that is not quarantined is refused (InputError) before anything is written, so that a
    typo does not pass silently."""
    at = time.time() if now is None else now
    p = Path(path)
    try:
        with _lock(p):
            entries = read_entries(p)
            out = {e.node for e in active(entries, now=at)}
            unknown = [n for n in nodes if n not in out]
            if unknown:
                raise InputError(f"nodes release: {shorten(', '.join(unknown))} not quarantined in {p} "
                                 f"(quarantined now: {', '.join(sorted(out)) or 'none'}; see `beam-hpc nodes`)")
            gone = set(nodes)
            released = [e for e in active(entries, now=at) if e.node in gone]
            _write(p, [e for e in entries if e.node not in gone], at)
    except LockTimeout as err:
        raise QuarantineBusy(f"quarantine: {err}") from None
    return released


# -- the site's quarantine, as submissions and segments use it ------------------------------------------
def site_path(site: Any) -> str | None:
    """The site's quarantine file, or None when it names none (``site``: a config.site.Site)."""
    return getattr(site, "quarantine", None) or None


def merged(site: Any, exclude: Sequence[str], *, now: float | None = None) -> list[str]:
    """``exclude`` (the run's own exclusions) plus the site's quarantined nodes, in that order,
    without repeats. Raises QuarantineFileError for a damaged file (the login node's exit 2)."""
    path = site_path(site)
    if not path:
        return list(exclude)
    return list(dict.fromkeys([*exclude, *(e.node for e in quarantined(path, now=now))]))


def for_submission(site: Any, groups: Sequence[Any], exclude: Sequence[str]) -> list[str]:
    """What a submission from the login node excludes: the run's own exclusions plus the site's
    quarantine. When the nodes left cannot hold the groups the submission is refused (a job that
    can never start would pend forever), naming the nodes and how to let them back in."""
    full = merged(site, exclude)
    if len(full) == len(exclude):
        return full
    from beam_hpc.lifecycle.exclusions import plan_shortfall

    short = plan_shortfall(groups, full)
    if short:
        raise RuntimeFailure(f"{short}; nodes quarantined by the site ({site_path(site)}) come back with "
                             "`beam-hpc nodes release NAME`")
    return full


def record_failures(site: Any, failed_nodes: Sequence[Mapping[str, str]], *, run: str, run_dir: str,
                    segment: str) -> None:
    """A segment's node failures into the site's quarantine, if it has one. Never raises: the
    segment's own decision and ledger line come first; a quarantine that cannot be written is
    logged (the run still excludes the node through its ledger)."""
    path = site_path(site)
    if not path or not failed_nodes:
        return
    try:
        added = record(path, failed_nodes, run=run, run_dir=run_dir, segment=segment,
                       days=float(getattr(site, "quarantine_days", 7.0)))
    except (OSError, InputError, RuntimeFailure) as err:
        log.error("could not add node(s) %s to the site's quarantine %s: %s",
                  ", ".join(str(f.get("node")) for f in failed_nodes), path, err)
        return
    log.warning("quarantined node(s) %s for every run of the site until %s (%s; release: beam-hpc nodes "
                "release NAME)", ", ".join(e.node for e in added),
                time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(added[0].expires)), path)


def excluded_in_job(site: Any, exclude: Sequence[str]) -> list[str]:
    """:func:`merged` inside the allocation: a damaged quarantine file is logged, not fatal."""
    try:
        return merged(site, exclude)
    except (OSError, InputError) as err:
        log.error("ignoring the site's quarantine: %s", err)
        return list(exclude)
