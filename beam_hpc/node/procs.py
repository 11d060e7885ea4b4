"""What the kernel says of a process, read from ``/proc``: the one reader of ``/proc/<pid>/stat``
and its neighbours (cmdline, exe, status, environ, fd, and this process's mount table) for the job,
the node steps and the tests.

Why one: ``stat`` is easy to parse wrongly (the command name in field 2 may hold spaces and
parentheses, so the fields are counted from its last ``)``), and "is it still running" must mean
the same everywhere: a zombie (``Z``) or dead (``X``) process has ended, only its parent's reap
is late. Processes end between a listing and a read, so no function raises for one that is gone:
each answers with a value that says so (``GONE``, None, False or empty). Linux only, as the job is.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple

PROC = "/proc"
MOUNTS = f"{PROC}/self/mounts"
GONE = "gone"  # state() of a process that no longer exists (or cannot be read)
ENDED_STATES = frozenset({"Z", "X"})  # zombie, dead: ended, whatever its parent does
# Field numbers of proc(5)'s /proc/<pid>/stat, counted as the manual does (1 = pid, 2 = comm).
_STATE, _PPID, _UTIME, _STIME, _STARTTIME = 3, 4, 14, 15, 22


def _stat_fields(pid: int | str, proc: str = PROC) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` from field 3 on (counted from the name's last ``)``), or
    None when the process is gone."""
    try:
        text = Path(f"{proc}/{pid}/stat").read_bytes()
    except OSError:
        return None
    _, paren, rest = text.rpartition(b")")
    return [f.decode() for f in rest.split()] if paren else None


def _stat_field(pid: int | str, number: int, proc: str = PROC) -> str | None:
    """Field ``number`` (>= 3) of ``/proc/<pid>/stat``, or None when the process is gone."""
    fields = _stat_fields(pid, proc)
    if fields is None or len(fields) <= number - 3:
        return None
    return fields[number - 3]


class MountEntry(NamedTuple):
    mountpoint: str
    fstype: str


def mounts(mounts_file: str = MOUNTS) -> list[MountEntry]:
    """The mount table as this process sees it, in the kernel's order (a later line is mounted over
    an earlier one at the same point), with proc(5)'s octal escapes (``\\040`` ...) undone."""
    out = []
    with open(mounts_file) as fh:
        for line in fh:
            parts = line.split()
            if len(parts) >= 3:
                out.append(MountEntry(_unescape(parts[1]), parts[2]))
    return out


def _unescape(field_text: str) -> str:
    """/proc/mounts writes space, tab, newline and backslash as octal escapes (\\040 ...)."""
    out, i = [], 0
    while i < len(field_text):
        if field_text[i] == "\\" and field_text[i + 1 : i + 4].isdigit():
            out.append(chr(int(field_text[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field_text[i])
            i += 1
    return "".join(out)


class Usage(NamedTuple):
    """A process's CPU so far, and when it started: the pair names one process where pids are reused."""

    start_ticks: int  # clock ticks after boot (field 22)
    cpu_s: float  # user + system seconds (fields 14 and 15)


def usage(pid: int | str, proc: str = PROC) -> Usage | None:
    """The process's :class:`Usage`, from one read of its stat line; None when it is gone."""
    fields = _stat_fields(pid, proc)
    if fields is None or len(fields) <= _STARTTIME - 3:
        return None
    cpu = (int(fields[_UTIME - 3]) + int(fields[_STIME - 3])) / os.sysconf("SC_CLK_TCK")
    return Usage(int(fields[_STARTTIME - 3]), cpu)


def state(pid: int | str) -> str:
    """The kernel's one-letter state (R, S, D, T, Z...), or :data:`GONE`."""
    return _stat_field(pid, _STATE) or GONE


def running(pid: int | str) -> bool:
    """The process exists and has not ended (a zombie has ended; only its parent can reap it)."""
    return state(pid) not in (GONE, *ENDED_STATES)


def parent(pid: int | str, proc: str = PROC) -> int | None:
    """The parent's pid, or None when the process is gone."""
    value = _stat_field(pid, _PPID, proc)
    return int(value) if value is not None and value.isdigit() else None


def ephemeral_ports(proc: str = PROC) -> tuple[int, int] | None:
    """The ports the kernel hands out for outgoing connections and ``bind(port 0)`` on this machine
    (``net.ipv4.ip_local_port_range``), or None where it cannot be read. A Ray port inside it can
    be taken by any process's connection at any moment."""
    try:
        low, high = Path(proc, "sys/net/ipv4/ip_local_port_range").read_text().split()[:2]
        return int(low), int(high)
    except (OSError, ValueError):
        return None


def boot_time() -> float | None:
    """When the machine booted (epoch seconds, ``btime`` of /proc/stat)."""
    try:
        lines = Path(f"{PROC}/stat").read_text().splitlines()
    except OSError:
        return None
    return next((float(line.split()[1]) for line in lines if line.startswith("btime ")), None)


def start_ticks(pid: int | str, proc: str = PROC) -> int | None:
    """When the process started, in clock ticks after boot (field 22): with the pid, names one process
    even where pids are reused. None when it is gone."""
    value = _stat_field(pid, _STARTTIME, proc)
    return int(value) if value is not None and value.isdigit() else None


def start_time(pid: int | str = "self") -> float | None:
    """When the process started (epoch seconds), or None when that cannot be read."""
    ticks, boot = start_ticks(pid), boot_time()
    if ticks is None or boot is None:
        return None
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def pids(proc: str = PROC) -> list[int]:
    """Every process on this host now (those of other users too)."""
    return sorted(int(e.name) for e in os.scandir(proc) if e.name.isdigit())


def with_descendants(roots: list[int], proc: str = PROC) -> list[int]:
    """``roots`` and every process below them now (children, their children, ...), sorted."""
    below: dict[int, list[int]] = {}
    for pid in pids(proc):
        ppid = parent(pid, proc)
        if ppid is not None:
            below.setdefault(ppid, []).append(pid)
    found, todo = set(roots), list(roots)
    while todo:
        for child in below.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return sorted(found)


def cmdline(pid: int | str) -> list[str]:
    """The process's argv ([] when it is gone, or for a kernel thread)."""
    try:
        raw = Path(f"{PROC}/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def executable(pid: int | str) -> str | None:
    """The path of the program the process runs, or None (gone, or another user's)."""
    try:
        return os.readlink(f"{PROC}/{pid}/exe")
    except OSError:
        return None


def environ(pid: int | str, proc: str = PROC) -> list[bytes] | None:
    """The process's environment as ``NAME=value`` items (as it was at exec), or None (gone, or
    another user's)."""
    try:
        return Path(f"{proc}/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None


def open_files(pid: int | str, proc: str = PROC) -> dict[int, str]:
    """What each of the process's file descriptors points at (a path, or ``pipe:[..]``/``socket:[..]``),
    by descriptor number; {} when it is gone or another user's."""
    found: dict[int, str] = {}
    try:
        fds = os.listdir(f"{proc}/{pid}/fd")
    except OSError:
        return found
    for fd in fds:
        try:
            found[int(fd)] = os.readlink(f"{proc}/{pid}/fd/{fd}")
        except (OSError, ValueError):
            continue  # closed between the listing and the read
    return found


def catches(pid: int | str, sig: int) -> bool:
    """The process has a handler for signal ``sig`` (``SigCgt`` of /proc/<pid>/status)."""
    try:
        for line in Path(f"{PROC}/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False
