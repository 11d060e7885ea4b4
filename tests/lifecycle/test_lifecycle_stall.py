"""The stall watchdog end to end: the real local Slurm cluster, the real reference backend, the tiny recipe.

A driver that hangs (the reference backend's test hook ``BEAM_TEST_HANG_AFTER_ROLLOUT=k``: after
finishing rollout k it sleeps forever, alive, as a deadlocked driver does) must be noticed within
the stall timeout, its stacks dumped, the segment stopped and resumed from the last checkpoint by
the next one; a hang that repeats at the same rollout must end the chain instead of holding nodes
again and again. Both chains run at once (module fixture): one allocation each, two nodes, so the
module costs about one chain's time.

The hook's variables reach the job the way a user's environment does: ``sbatch`` exports the
submitting process's environment (and a segment's resubmission passes its own on).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import run_watch
from job_plans import HOST_SITE, make_test_plan
from reference_harness import SMALL, TinyAssets, assert_bitwise_equal, load_checkpoint, run_backend
from run_watch import chain_finished, diagnostics, segments
from run_watch import read_text as _read

from beam_hpc.fault_hooks import HANG_AFTER_ROLLOUT_VAR, HANG_TIMES_VAR
from beam_hpc.plan.plan import Plan
from beam_hpc.run import checkpoint_layout, metric_names

pytestmark = [pytest.mark.slurm, pytest.mark.ray, pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "recipes" / "tiny.yaml"
SITE = ROOT / "env" / "local.yaml"
RUN_TIMEOUT_S = 540  # a shared 2-core machine: bring-up alone can take 30-60 s under load
N, INTERVAL = 4, 2  # checkpoints after rollouts 1 and 3
# lifecycle.stall_timeout_s: short, so the test waits little (a healthy rollout here takes well under
# 1 s, a few seconds at load 20; on a host half as fast, a rollout with its save took over 12 s and
# was caught as a stall, so 40 s); the first rollout of a segment keeps its default
STALL_S = 40


@dataclass(frozen=True)
class Chain:
    run: Path
    plan: Plan
    job: str


def _submit(run_dir: Path, assets: TinyAssets, env: dict[str, str]) -> Chain:
    """The user's path (plan, script, login-node checks, sbatch), with the hook's variables in the
    environment sbatch exports to the job."""
    from beam_hpc.submission.submit import submit

    overrides = [f"model.path={assets.model_dir}", f"data.dir={assets.data_dir}", *SMALL,
                 f"checkpoint.interval={INTERVAL}", "lifecycle.walltime=00:10:00", "lifecycle.lead_s=60",
                 f"lifecycle.stall_timeout_s={STALL_S}",
                 # a GPU per node (fake GRES), so that the stall's GPU-hours are not zero
                 "topology.trainer.gpus_per_node=1", "topology.rollout.gpus_per_node=1"]
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        sub = submit(TINY, SITE, overrides=overrides, output_dir=str(run_dir), num_rollout=N, via="sbatch")
    return Chain(run_dir, sub.plan, str(sub.job_id))


@pytest.fixture(scope="module")
def chains(slurm_cluster, tiny_assets) -> Iterator[dict[str, Chain]]:
    """``once``: hangs after rollout 1, which is checkpointed, so the resumed segment starts at 2
    and never meets the hang again. ``twice``: hangs after rollout 2, which is not checkpointed,
    and may hang twice: the resumed segment re-does rollout 2 and hangs there again."""
    root = Path(tempfile.mkdtemp(prefix="beam-stall-", dir="/tmp"))  # outlives every segment of the chains
    started = time.monotonic()
    out = {"once": _submit(root / "once", tiny_assets, {HANG_AFTER_ROLLOUT_VAR: "1"}),
           "twice": _submit(root / "twice", tiny_assets, {HANG_AFTER_ROLLOUT_VAR: "2", HANG_TIMES_VAR: "2"})}
    yield out
    print(f"\nstall chains: {time.monotonic() - started:.0f} s from submission to the last test's end")
    for c in out.values():  # a failed test may leave a segment queued
        subprocess.run(["scancel", "-n", c.plan.job_name], check=False)
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def uninterrupted(chains, tiny_assets, reference_ray) -> Iterator[Callable[[], Path]]:
    """The ``once`` chain's recipe and seed in one go, through the backend alone: started beside the
    chains (which mostly wait on Slurm and on the stall timeout); calling the fixture's value waits
    for it and gives its run directory."""
    whole = chains["once"].run.parent / "uninterrupted"
    with ThreadPoolExecutor(1) as pool:
        plan = make_test_plan(whole, assets=tiny_assets, site=HOST_SITE,
                              overrides=[*SMALL, f"num_rollout={N}", f"checkpoint.interval={INTERVAL}"])
        done = pool.submit(run_backend, plan.paths.plan, reference_ray)
        yield lambda: (done.result(), whole)[1]


def wait_for(what: str, predicate, run_dir: Path, timeout: float = RUN_TIMEOUT_S, poll_s: float = 0.5):
    return run_watch.wait_for(what, predicate, run_dir, timeout, poll_s)


def rollout_times(run_dir: Path) -> dict[int, list[float]]:
    """When each rollout id's metrics row was written (a re-done rollout has two)."""
    out: dict[int, list[float]] = {}
    for line in (run_dir / "dumps" / metric_names.METRICS_FILE).read_text().splitlines():
        row = json.loads(line)
        if row.get("kind") == "rollout":
            out.setdefault(row["rollout_id"], []).append(row["time"])
    return out


def check_stall(seg: dict, *, rollout: int, finished_at: float, run_dir: Path) -> dict:
    """One stalled segment's end line: caught within the timeout + 30 s of the last finished
    rollout, stacks dumped (the driver's shows the hook it hangs in), suspects none."""
    end = seg["end"]
    assert end["reason"] == "stalled", diagnostics(run_dir)
    stall = end["stall"]
    assert (stall["rollout"], stall["last_rollout"], stall["phase"], stall["timeout_s"]) == (rollout, rollout - 1,
                                                                                           "running", STALL_S)
    # timed from the last rollout's own scalar, which is written just before its metrics row
    assert stall["since"] == pytest.approx(finished_at, abs=2.0)
    caught = stall["caught_at"] - stall["since"]
    assert STALL_S <= caught <= STALL_S + 30, f"caught {caught:.1f} s after the last rollout"
    assert stall["suspects"] == [] and stall["skipped"] == [] and stall["silent_nodes"] == []
    dumps = [Path(d) for d in stall["dumps"]]
    assert all(d.parent == run_dir / "logs" / seg["segment"] / "stacks" for d in dumps), dumps
    texts = {d.name: _read(d) for d in dumps}
    hung = [n for n, t in texts.items() if "in hang_after_rollout" in t and "driver.py" in t]
    assert len(hung) == 1, texts  # the driver, stopped in the hook's sleep
    # the trainer and the rollout worker (Ray actors) registered and answered through their node steps
    assert len(dumps) >= 3 and all("most recent call first" in t for t in texts.values()), texts
    print(f"{seg['segment']}: stalled at rollout {rollout}, caught {caught:.1f} s after the last rollout "
          f"(timeout {STALL_S} s), dumps in {stall['seconds']:.1f} s, end line {end['time'] - stall['caught_at']:.1f} s "
          f"later; {len(dumps)} dumps, {stall['not_dumpable']} processes not dumpable")
    return stall


def test_a_hung_driver_is_caught_dumped_and_the_next_segment_completes_the_run(chains, uninterrupted) -> None:
    """The driver hangs after rollout 1 (checkpointed). Within the stall timeout + 30 s the
    segment dumps the stacks of the driver and of every node's Python processes, stops the driver
    and Ray, records ``stalled`` with the dump files, and resubmits; the next segment resumes at
    rollout 2 and completes the run, whose final checkpoint is bitwise that of an uninterrupted
    run. ``status`` counts the stall's GPU-hours as their own cause."""
    from beam_hpc.observe.status import gather
    from beam_hpc.observe.status_table import format_status

    c = chains["once"]
    wait_for("the chain to finish", lambda: chain_finished(c.run), c.run)
    segs = segments(c.run)
    assert len(segs) == 2, diagnostics(c.run)
    first, second = segs
    times = rollout_times(c.run)
    check_stall(first, rollout=2, finished_at=times[1][0], run_dir=c.run)
    assert first["end"]["rollouts_at_end"] == 2 and first["end"]["next"]["action"] == "resubmit"
    assert first["end"]["next"]["job_id"] == second["start"]["job_id"]
    assert second["start"]["resume"] and second["start"]["rollouts_at_start"] == 2
    assert second["end"]["reason"] == "completed" and second["end"]["rollouts_at_end"] == N, diagnostics(c.run)
    assert {k: len(v) for k, v in times.items()} == {0: 1, 1: 1, 2: 1, 3: 1}  # nothing re-done: 1 was saved
    assert checkpoint_layout.latest_iteration(c.run / "checkpoints") == N - 1
    whole = uninterrupted()
    last = f"iter_{N - 1:07d}"
    assert assert_bitwise_equal(load_checkpoint(whole / "checkpoints" / last),
                                load_checkpoint(c.run / "checkpoints" / last), last) > 50
    s = gather(c.run, slurm=False)
    lost = s["gpu_hours"]["lost"]["stalls"]
    # the stalled segment's GPUs (2) idle from rollout 1's end to its end line: at least the timeout
    assert lost >= 2 * STALL_S / 3600 and lost < s["gpu_hours"]["held"], s["gpu_hours"]
    assert [(x["segment"], x["rollout"], x["next"]) for x in s["stalls"]] == [(first["segment"], 2, "resubmit")]
    text = format_status(s)
    assert f"stalled    segment {first['segment']} at rollout 2" in text and "stalls " in text, text


def test_two_stalls_at_the_same_rollout_end_the_chain(chains) -> None:
    """The hang repeats: rollout 2 is not checkpointed, so the resumed segment re-does it and hangs
    after it again. The second stall at rollout 3 ends the chain (exit 1) with a message naming
    the rollout and both segments' stack dumps, instead of a third segment holding nodes."""
    c = chains["twice"]
    wait_for("the chain to stop", lambda: chain_finished(c.run), c.run)
    segs = segments(c.run)
    assert len(segs) == 2, diagnostics(c.run)
    times = rollout_times(c.run)
    assert len(times[2]) == 2, times  # rollout 2 trained in both segments
    one = check_stall(segs[0], rollout=3, finished_at=times[2][0], run_dir=c.run)
    two = check_stall(segs[1], rollout=3, finished_at=times[2][1], run_dir=c.run)
    assert segs[0]["end"]["next"]["action"] == "resubmit" and segs[1]["start"]["rollouts_at_start"] == 2
    end = segs[1]["end"]
    assert end["next"] == {"action": "none", "job_id": None}, diagnostics(c.run)
    assert "stalled twice in a row at rollout 3" in end["detail"], end["detail"]
    assert all(d in end["detail"] for d in one["dumps"] + two["dumps"]), end["detail"]
    log = _read(c.run / "logs" / segs[1]["segment"] / "segment.log")
    assert "the chain stops: stalled twice in a row at rollout 3" in log
    job = segs[1]["start"]["job_id"]
    shown = wait_for("the last job's exit code", lambda: _exit_code(job), c.run, timeout=25, poll_s=0.2)
    assert shown == "1:0", shown


def _exit_code(job: str) -> str | None:
    """``ExitCode`` of a finished job while Slurm still shows it (MinJobAge), None before it ended."""
    out = subprocess.run(["scontrol", "--oneliner", "show", "job", job], capture_output=True, text=True,
                         check=False).stdout
    fields = dict(tok.split("=", 1) for tok in out.split() if "=" in tok)
    if fields.get("JobState") in ("COMPLETED", "FAILED"):
        return fields.get("ExitCode")
    return None
