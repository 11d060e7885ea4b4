"""benchmarks/cpu_by_process.py on real processes: a child that burns a known amount of CPU is found,
named by its kind (what it runs after exec, not what it was first seen as) and counted; what ran before
the sampler started is not counted."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import benchmark_script
from polling import poll_until

from beam_hpc.node import procs

cpu_by_process = benchmark_script.load("cpu_by_process")

BURN = "import time\nend = time.process_time() + 0.6\nwhile time.process_time() < end: pass\ntime.sleep(0.5)\n"


def test_a_burning_child_is_counted_by_its_kind_and_an_earlier_one_is_not(tmp_path: Path) -> None:
    script = tmp_path / "burner.py"
    script.write_text(BURN)
    # burns 0.5 s of CPU, then idles: all of it before the sampler starts (a script of its own, so that
    # its kind is its alone on a machine where other tests run)
    idler = tmp_path / "idler.py"
    idler.write_text("import time\nend = time.process_time() + 0.5\nwhile time.process_time() < end: pass\n"
                     "while True: time.sleep(0.05)\n")
    before = subprocess.Popen([sys.executable, str(idler)])
    try:
        assert poll_until(lambda: (u := procs.usage(before.pid)) is not None and u.cpu_s >= 0.45, 30, 0.05)
        sampler = cpu_by_process.Sampler(0.05)
        sampler.sample(baseline=True)
        # seen first as the shell, then as what it execs: the kind follows the process's exec
        child = subprocess.Popen(["sh", "-c", f"sleep 0.3; exec {sys.executable} {script}"])
        while child.poll() is None:
            sampler.sample(baseline=False)
            time.sleep(0.05)
        rows = {kind: (cpu, n) for kind, cpu, n in sampler.table()}
    finally:
        before.kill()
        before.wait()
    burned, count = rows[f"python {tmp_path.name}/burner.py"]
    assert count == 1 and 0.4 <= burned <= 2.0, rows
    (idle,) = [e for (pid, _), e in sampler.seen.items() if pid == before.pid]  # seen from the baseline on...
    assert idle.first >= 0.45 and idle.last - idle.first < 0.2, idle  # ...and its 0.5 s before is not counted
    text = cpu_by_process.render(sampler.table(), wall=2.0, cores=2, command=["x"], top=3)
    assert "| process kind | CPU s |" in text and "burner.py" in text
    assert 0.0 < cpu_by_process.gauge_s() < 30.0  # the speed gauge's fixed work, timed in a process of its own
