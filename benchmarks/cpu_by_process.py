"""Where a command's CPU goes, by kind of process: a table of CPU-seconds per kind, for the whole machine.

    python benchmarks/cpu_by_process.py [--interval 0.25] [--markdown FILE] -- COMMAND [ARG ...]

e.g. the whole test suite as CI runs it::

    python benchmarks/cpu_by_process.py --markdown /tmp/suite-cpu.md -- .venv/bin/python -m pytest -q -n 3

Why a sampler of the whole machine and not the command's own rusage: most of what the suite starts
is not its child (Slurm's daemons start the jobs, Ray's raylet starts the actors), so the CPU has to
be found where it is spent. Every ``--interval`` seconds the sampler reads ``/proc/<pid>/stat`` of
every process (through beam_hpc.node.procs) and keeps the last user+system time it saw for each; a
process is named by a short kind (``ray::Trainer``, ``beam_hpc.backends.reference``, ``raylet``,
``ray start``...). Processes that lived less than one interval are missed (their CPU is small by
construction), and what ran before the sampler started is subtracted. The machine should be quiet
otherwise: everything on it is counted.

The same work costs more CPU-seconds on a shared host whose neighbours are busy (two runs of the
same suite on this project's 2-core machine, 40 minutes apart, took 2,082 and 3,177 CPU-s, each
process kind 1.3-2.4x dearer in the second). A speed gauge (a fixed pure-Python workload's
CPU-seconds) is printed before and after the command: compare two runs' tables only with it.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from beam_hpc.node import procs  # noqa: E402


def kind_of(pid: int) -> str:
    """A short name for what the process is: Ray's own title (ray::...), the module a Python runs,
    or the program's name."""
    argv = procs.cmdline(pid)
    if not argv:
        return "?"  # gone, or not readable yet (a process between fork and exec)
    program = os.path.basename(argv[0])
    if program.startswith("ray::"):
        return program.split(".")[0]  # ray::Trainer.train -> ray::Trainer
    if "python" in program and len(argv) > 1:
        if argv[1] == "-c" and len(argv) > 3 and "ray.scripts.scripts" in argv[2]:
            return "ray " + argv[3]  # beam_hpc.node.ray_node.ray_cli_argv
        if argv[1] == "-m" and len(argv) > 2:
            return {"ray.scripts.scripts": "ray start", "ray.util.client.server": "ray client server"}.get(argv[2], argv[2])
        script = next((a for a in argv[1:] if a.endswith(".py")), None)
        if script:
            return "python " + "/".join(Path(script).parts[-2:])
        return "python " + argv[1]
    return program


@dataclass
class Seen:
    kind: str
    first: float  # CPU when first seen (subtracted only for processes that ran before the sampler)
    last: float


class Sampler:
    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.seen: dict[tuple[int, int], Seen] = {}  # (pid, start ticks): a reused pid is another process
        self.stop = threading.Event()
        self.me = os.getpid()

    def sample(self, baseline: bool) -> None:
        for pid in procs.pids():
            if pid == self.me:
                continue
            used = procs.usage(pid)  # one read: the CPU, and the start that tells a reused pid apart
            if used is None:
                continue
            key, cpu = (pid, used.start_ticks), used.cpu_s
            entry = self.seen.get(key)
            if entry is None:
                entry = self.seen[key] = Seen(kind_of(pid), cpu if baseline else 0.0, cpu)
            elif cpu != entry.last and (kind := kind_of(pid)) != "?":
                # named again while it works: a child seen between fork and exec still shows its
                # parent's command line, and Ray's workers rename themselves once they hold an actor
                # (an exited process not yet reaped has no command line left: it keeps its name)
                entry.kind = kind
            entry.last = cpu

    def run(self) -> None:
        self.sample(baseline=True)
        while not self.stop.wait(self.interval):
            self.sample(baseline=False)
        self.sample(baseline=False)

    def table(self) -> list[tuple[str, float, int]]:
        by_kind: dict[str, list[float]] = defaultdict(list)
        for entry in self.seen.values():
            used = entry.last - entry.first
            if used > 0:
                by_kind[entry.kind].append(used)
        return sorted(((k, sum(v), len(v)) for k, v in by_kind.items()), key=lambda row: -row[1])


def gauge_s() -> float:
    """CPU-seconds of a fixed piece of pure-Python work, in a process of its own: the machine's speed
    at that moment. On a shared host the same work costs more CPU-seconds when the neighbours are
    busy, so totals of two runs compare only after dividing by their gauges."""
    code = "import time\nt = time.process_time()\nsum(i * i for i in range(3_000_000))\nprint(time.process_time() - t)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return float(out)


def render(rows: list[tuple[str, float, int]], wall: float, cores: int, command: list[str], top: int,
           gauges: tuple[float, float] | None = None) -> str:
    total = sum(cpu for _, cpu, _ in rows)
    speed = f"; speed gauge {gauges[0]:.3f} s before, {gauges[1]:.3f} s after (lower is faster)" if gauges else ""
    lines = [f"command: `{' '.join(command)}`", "",
             f"wall {wall:.0f} s, CPU {total:.0f} s on {cores} cores ({total / (wall * cores):.0%} busy){speed}", "",
             "| process kind | CPU s | share | processes | CPU s each |", "|---|---:|---:|---:|---:|"]
    for kind, cpu, n in rows[:top]:
        lines.append(f"| {kind} | {cpu:.1f} | {cpu / total:.1%} | {n} | {cpu / n:.2f} |")
    rest = rows[top:]
    if rest:
        lines.append(f"| ({len(rest)} other kinds) | {sum(c for _, c, _ in rest):.1f} | "
                     f"{sum(c for _, c, _ in rest) / total:.1%} | {sum(n for _, _, n in rest)} | |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--interval", type=float, default=0.25, help="seconds between samples")
    parser.add_argument("--top", type=int, default=30, help="rows of the table")
    parser.add_argument("--markdown", type=Path, help="also write the table here")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to measure")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        print("command: give the command to measure after --", file=sys.stderr)
        return 2
    before = gauge_s()
    sampler = Sampler(args.interval)
    thread = threading.Thread(target=sampler.run, daemon=True)
    thread.start()
    started = time.monotonic()
    proc = subprocess.Popen(command)
    try:
        rc = proc.wait()
    except KeyboardInterrupt:
        proc.send_signal(signal.SIGINT)
        rc = proc.wait()
    wall = time.monotonic() - started
    sampler.stop.set()
    thread.join()
    text = render(sampler.table(), wall, os.cpu_count() or 1, command, args.top, (before, gauge_s()))
    print(text)
    if args.markdown:
        args.markdown.write_text(text)
    return rc


if __name__ == "__main__":
    sys.exit(main())
