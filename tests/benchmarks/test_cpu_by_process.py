"""benchmarks/cpu_by_process.py on real processes: a child that burns a known amount of CPU is found,
named by its kind and counted; what ran before the sampler started is not counted."""

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
    # burns 0.5 s of CPU, then idles: all of it before the sampler starts
    before = subprocess.Popen([sys.executable, "-c", "import time\nend = time.process_time() + 0.5\n"
                               "while time.process_time() < end: pass\nwhile True: time.sleep(0.05)"])
    try:
        assert poll_until(lambda: (u := procs.usage(before.pid)) is not None and u.cpu_s >= 0.45, 30, 0.05)
        sampler = cpu_by_process.Sampler(0.05)
        sampler.sample(baseline=True)
        child = subprocess.Popen([sys.executable, str(script)])
        while child.poll() is None:
            sampler.sample(baseline=False)
            time.sleep(0.05)
        rows = {kind: (cpu, n) for kind, cpu, n in sampler.table()}
    finally:
        before.kill()
        before.wait()
    burned, count = rows[f"python {tmp_path.name}/burner.py"]
    assert count == 1 and 0.4 <= burned <= 2.0, rows
    assert rows.get("python -c", (0.0, 0))[0] < 0.2, rows  # the earlier process's 0.5 s is not counted
    text = cpu_by_process.render(sampler.table(), wall=2.0, cores=2, command=["x"], top=3)
    assert "| process kind | CPU s |" in text and "burner.py" in text
    assert 0.0 < cpu_by_process.gauge_s() < 30.0  # the speed gauge's fixed work, timed in a process of its own
