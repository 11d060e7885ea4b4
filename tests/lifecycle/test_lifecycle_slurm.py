"""The lifecycle end to end: the real local Slurm cluster, the real reference backend, the tiny recipe.

Every run here is submitted as a user does it (``submit(via="sbatch")``: plan, script, login-node
checks, sbatch); all after that is the product's own doing: the segment takes the run lock, writes
the ledger, brings Ray up, runs the backend, and resubmits or requeues itself. The tests only
wait, interfere the way Slurm or a user would (a preempting job, ``scontrol requeue``, SIGKILL,
a second submission, ``beam-hpc cancel``) and read the run directory.

The walltime-and-preemption chain does not wait out a limit: once the first segment trains, the
test lowers its time limit (``scontrol update``, LocalSlurmCluster.end_soon) to end 45-105 s later, inside the
recipe's 150 s lead, so Slurm's USR1 comes at its next time check (slurmctld checks time limits
every 30 s) and the job's own deadline has passed. (A fixed short limit is either slow or, under
load, over before the first rollout.)

That chain runs in the cluster's ``spot`` partition (no other test's jobs on its nodes): its
``urgent`` job preempts that chain's segment and nothing else, also under pytest-xdist.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

import pytest
import run_watch
from job_plans import HOST_SITE, make_test_plan
from real_wandb import have_wandb
from reference_harness import (
    SMALL,
    TinyAssets,
    assert_bitwise_equal,
    load_checkpoint,
    run_backend,
)
from run_watch import chain_finished, diagnostics, segments
from run_watch import read_text as _read
from slurm_cluster import spot_site

from beam_hpc.backends.reference.loop.metrics_log import EVAL_STEP, ROLLOUT_STEP
from beam_hpc.node import procs
from beam_hpc.plan.plan import Plan
from beam_hpc.run import checkpoint_layout, metric_names, tracking

pytestmark = [pytest.mark.slurm, pytest.mark.ray, pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "recipes" / "tiny.yaml"
SITE = ROOT / "env" / "local.yaml"
RUN_TIMEOUT_S = 540  # a shared 2-core machine: bring-up alone can take 30-60 s under load


@pytest.fixture
def runs(slurm_cluster) -> Iterator[Path]:
    """Run directories outside pytest's numbered temp dirs: those are pruned by other pytest
    sessions on the same machine, and a run directory must outlive every segment of its chain.
    One per test (not per module): the chains are independent, so xdist may run them side by side.
    A chain the test left behind (it failed, say) is cancelled before its directory goes."""
    with slurm_cluster.scratch_runs("beam-lc-") as root:
        yield root


# -- helpers --------------------------------------------------------------------------------------------
def chain_overrides(assets: TinyAssets, *, interval: int, walltime: str, lead_s: int,
                    extra: tuple[str, ...] = ()) -> list[str]:
    """The tiny recipe, small, with a checkpoint interval and a walltime lead: every run here."""
    return [f"model.path={assets.model_dir}", f"data.dir={assets.data_dir}", *SMALL,
            f"checkpoint.interval={interval}", f"lifecycle.walltime={walltime}", f"lifecycle.lead_s={lead_s}", *extra]


def submit_run(run_dir: Path, assets: TinyAssets, *, num_rollout: int, interval: int, walltime: str = "00:10:00",
               lead_s: int = 60, resume: bool = False, extra: tuple[str, ...] = (), site: Path = SITE,
               dependency: str | None = None) -> tuple[Plan, str]:
    """The user's path: recipe + overrides -> plan, script, login-node checks, sbatch."""
    from beam_hpc.submission.submit import submit

    overrides = chain_overrides(assets, interval=interval, walltime=walltime, lead_s=lead_s, extra=extra)
    sub = submit(TINY, site, overrides=overrides, output_dir=str(run_dir), num_rollout=num_rollout,
                 resume=resume, via="sbatch", dependency=dependency)
    return sub.plan, str(sub.job_id)


def wait_for(what: str, predicate: Callable[[], object], run_dir: Path, timeout: float = RUN_TIMEOUT_S,
             poll_s: float = 0.5) -> object:
    return run_watch.wait_for(what, predicate, run_dir, timeout, poll_s)


def timeline(run_dir: Path) -> str:
    """One line per segment (printed with -s: the numbers behind the report)."""
    segs = segments(run_dir)
    t0 = segs[0]["start"]["time"] if segs else 0.0
    rows = []
    for s in segs:
        st, en = s["start"], s.get("end") or {}
        rows.append(f"{s['segment']:>8} start +{st['time'] - t0:6.1f}s end +{en.get('time', float('nan')) - t0:6.1f}s "
                    f"rollouts {st['rollouts_at_start']}->{en.get('rollouts_at_end')} {en.get('reason')} "
                    f"next {en.get('next')} timings {en.get('timings')}\n           {en.get('detail')}")
    return "\n".join(rows)


def job_state(job_id: str) -> str:
    out = subprocess.run(["scontrol", "--oneliner", "show", "job", job_id], capture_output=True, text=True, check=False).stdout
    fields = dict(tok.split("=", 1) for tok in out.split() if "=" in tok)
    return fields.get("JobState", "GONE")


def rollout_ids(run_dir: Path) -> list[int]:
    """Rollout ids in the order they were trained, across segments (a re-done one appears twice)."""
    try:
        lines = (run_dir / "dumps" / metric_names.METRICS_FILE).read_text().splitlines(keepends=True)
    except FileNotFoundError:
        return []
    whole = [json.loads(x) for x in lines if x.endswith("\n")]  # a line being written is not a rollout yet
    return [m["rollout_id"] for m in whole if m.get("kind") == "rollout"]


def assert_complete_and_exact(run_dir: Path, plan: Plan, num_rollout: int) -> dict[int, int]:
    """Final rollout count exact, nothing skipped, ledger and dataset cursor agree; returns how
    often each rollout id was trained (re-done rollouts count more than once)."""
    import torch

    ckpt = run_dir / "checkpoints"
    assert checkpoint_layout.latest_iteration(ckpt) == num_rollout - 1
    cursor = torch.load(checkpoint_layout.dataset_state_path(ckpt, num_rollout - 1), weights_only=True)
    assert cursor["sample_offset"] == num_rollout * plan.recipe.batch.prompts
    counts = Counter(rollout_ids(run_dir))
    assert sorted(counts) == list(range(num_rollout)), f"rollouts trained: {sorted(counts)}"
    segs = segments(run_dir)
    assert segs[-1]["end"]["reason"] == "completed" and segs[-1]["end"]["rollouts_at_end"] == num_rollout
    for before, after in pairwise(segs):  # each segment starts where the last complete checkpoint was
        if "end" in before:  # (a segment killed hard has no end line)
            assert after["start"]["rollouts_at_start"] == before["end"]["rollouts_at_end"]
    return counts


def redone(counts: dict[int, int]) -> int:
    return sum(n - 1 for n in counts.values())


def nothing_queued(plan: Plan) -> bool:
    out = subprocess.run(["squeue", "-h", "-n", plan.job_name, "-o", "%i %T"], capture_output=True, text=True, check=False).stdout
    return not out.strip()


# -- walltime and preemption, in one chain ----------------------------------------------------------------
def finished_by(run_dir: Path, job: str) -> bool:
    """The chain is over and its last segment is ``job``'s (a cancelled segment also ends a chain)."""
    return chain_finished(run_dir) and segments(run_dir)[-1]["start"]["job_id"] == job


def change_the_total(run_dir: Path, assets: TinyAssets, *, more: int, **submit_kw) -> tuple[int, str]:
    """What a user does to give a running chain another total: ``beam-hpc cancel`` (no later segment
    of the chain starts; a segment still in its bring-up ends there), waits for its jobs to go, then
    ``submit --resume --num-rollout N`` (the login node refuses while a segment holds the run: retry),
    with N = the rollouts checkpointed so far + ``more``. Called while the chain's next segment is
    queued or bringing Ray up, so nothing trained is thrown away; the chain's length does not depend
    on the machine's speed. Returns (N, the new job)."""
    from beam_hpc.cli.app import main
    from beam_hpc.run.lock import RunLockError

    assert main(["cancel", str(run_dir)]) == 0
    job_name = Plan.load(run_dir / "plan.json").job_name
    wait_for("the cancelled chain's jobs to go", lambda: not subprocess.run(
        ["squeue", "-h", "-n", job_name], capture_output=True, text=True, check=False).stdout.strip(), run_dir)
    # a segment tells a later submission from the cancelled chain by its job's SubmitTime, which has
    # one-second resolution (it must read a whole second past the flag): a user comes seconds later; so does this
    time.sleep(max(0.0, (run_dir / "CANCELLED").stat().st_mtime + 2.1 - time.time()))
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while True:
        target = checkpoint_layout.rollouts_done(run_dir / "checkpoints") + more
        try:
            return target, submit_run(run_dir, assets, num_rollout=target, resume=True, **submit_kw)[1]
        except RunLockError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1)


def _nodes_of(job_id: str) -> str:
    out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%N"], capture_output=True, text=True, check=False).stdout
    return ",".join(x.strip() for x in out.split() if x.strip())


def test_walltime_then_preemption_then_a_new_total_complete_the_run(slurm_cluster, tiny_assets, runs,  # type: ignore[no-untyped-def]
                                                                    capsys) -> None:
    """One chain meets the two interruptions of a run's life, in the cluster's ``spot`` partition:

    1. walltime: once the first segment trains, its limit is lowered into the 150 s lead; it saves
       the rollout in flight on USR1 or its own deadline and resubmits itself with --resume (same
       script, dependency afterany on itself);
    2. preemption: once the resubmitted segment trains, an ``urgent`` job that needs its nodes
       preempts it (USR1 with a 20 s GraceTime): it saves if the grace allows, else relies on the
       last periodic checkpoint (interval 3), and the same job id comes back with
       SLURM_RESTART_COUNT 1 and resumes;
    3. the user gives the run a total (cancel + ``submit --resume --num-rollout N``, see
       change_the_total) and that segment completes it.

    The first target is out of reach, so each interruption lands mid-run however fast the machine.
    Nothing is skipped; nothing is trained twice but what a preemption without a save may cost.

    The chain is also launch parity's first way in (tests/submission/test_submission_launch_parity.py):
    submitted with ``beam-hpc submit --via sbatch`` on the parity site (a module function, a module
    load, env, an extra ``#SBATCH`` line), every segment's driver, the requeued one's included, runs
    the command a dry run of the same submission plans, with the total passed on, the site's
    variables and the module loaded once, and every job carries the extra line."""
    from parity_site import check_driver_record, driver_records, has_extra_line, normalized, parity_site

    import beam_hpc
    from beam_hpc.cli.app import main as cli_main

    run = runs / "chain"
    site = spot_site(parity_site(runs / "parity.yaml"), runs / "spot.yaml")
    wandb = WANDB if have_wandb() else ()  # one W&B run across the chain, checked at the end
    overrides = chain_overrides(tiny_assets, interval=3, walltime="00:10:00", lead_s=150, extra=wandb)
    assert cli_main(["submit", str(TINY), "--site", str(site), "--via", "sbatch", "--output-dir", str(run),
                     *[a for o in overrides for a in ("--set", o)], "--num-rollout", "100000"]) == 0
    first = capsys.readouterr().out.split("submitted job ")[1].split()[0]
    has_extra_line(first)
    plan = Plan.load(run / "plan.json")
    dry = beam_hpc.submit(str(TINY), str(site), output_dir=str(runs / "dry"), overrides=overrides, via="sbatch",
                          dry_run=True)
    reference = normalized(dry.plan.driver_argv, runs / "dry")
    wait_for("a first trained rollout", lambda: rollout_ids(run), run)
    slurm_cluster.end_soon(first)  # its walltime, now: inside the 150 s lead
    second = wait_for("the walltime resubmission",
                      lambda: (s := segments(run)) and "end" in s[0] and s[0]["end"]["next"].get("job_id"), run,
                      poll_s=0.1)
    at_walltime = segments(run)[0]["end"]["rollouts_at_end"]
    wait_for("the resubmitted segment to train", lambda: len(segments(run)) > 1 and len(rollout_ids(run)) > at_walltime,
             run)
    nodes = wait_for("the resubmitted job's nodes", lambda: _nodes_of(second), run)
    urgent = slurm_cluster.run("sbatch", "--parsable", "-p", "urgent", f"--nodelist={nodes}", "--exclusive",
                               "-t", "1", "-o", "/dev/null", "--wrap", "sleep 3").stdout.strip()
    wait_for("the preempted segment's end line", lambda: "end" in segments(run)[1], run)
    wait_for("the urgent job to finish", lambda: job_state(urgent) in ("COMPLETED", "GONE"), run, timeout=120)
    # a requeued job may start again after cred_expire (10 s here); let it go at once
    wait_for("the requeued job to pend", lambda: job_state(second) in ("PENDING", "RUNNING"), run, timeout=60)
    slurm_cluster.run("scontrol", "update", f"jobid={second}", "StartTime=now", check=False)
    wait_for("the requeued segment's driver", lambda: f"{second}-1" in driver_records(run), run)
    has_extra_line(second)  # the resubmission carries the site's extra line too
    n, last = change_the_total(run, tiny_assets, more=5, interval=3, site=site, extra=wandb)
    has_extra_line(last)
    wait_for("the new segment to finish the run", lambda: finished_by(run, last), run)
    segs = segments(run)
    print(f"\nwalltime, preemption, a new total ({n} rollouts):\n{timeline(run)}\n{diagnostics(run)}")
    assert [s["segment"] for s in segs] == [f"{first}-0", f"{second}-0", f"{second}-1", f"{last}-0"], diagnostics(run)
    walltime, preempted, requeued, final = segs
    # 1. the walltime: saved on request, resubmitted with --resume
    assert not walltime["start"]["resume"], diagnostics(run)
    assert walltime["end"]["reason"] == "walltime" and "saved on request" in walltime["end"]["detail"]
    assert walltime["end"]["next"] == {"action": "resubmit", "job_id": second}
    t = walltime["end"]["timings"]
    assert t["save_s"] is not None and t["rollout_s"] > 0
    assert preempted["start"]["resume"] and preempted["start"]["restart"] == 0
    assert preempted["start"]["rollouts_at_start"] == walltime["end"]["rollouts_at_end"]  # nothing lost at the walltime
    # 2. the preemption: the same job id requeued, restart 1 resumes
    assert preempted["end"]["reason"] == "preempted", diagnostics(run)
    assert preempted["end"]["next"] == {"action": "requeue", "job_id": second}
    assert requeued["start"]["restart"] == 1 and requeued["start"]["resume"]
    assert requeued["end"]["reason"] == "cancelled"
    # 3. the new total
    assert final["start"]["resume"] and final["start"]["num_rollout"] == n
    counts = assert_complete_and_exact(run, Plan.load(plan.paths.plan), n)
    # the walltime costs none (the sentinel says "then stop": the reference backend exits right after
    # that save; a Miles run may train on until it is stopped); the preemption at most an interval
    assert redone(counts) <= interval_after(preempted), f"re-done rollouts {counts}"
    assert wait_for("the queue to empty", lambda: nothing_queued(plan), run, timeout=60)
    assert not (run / "run.lock").exists() and not (run / "SAVE_NOW").exists()
    if wandb:
        assert_one_wandb_run(run, plan, n)
    # launch parity: each segment ran the planned command with the total passed on to it
    recs = driver_records(run)
    assert set(recs) == {s["segment"] for s in segs}, (sorted(recs), diagnostics(run))
    for seg, rec in recs.items():
        check_driver_record(seg, rec, run, reference, n if seg == f"{last}-0" else 100_000)


# W&B offline beside TensorBoard (tracking.wandb), and evals (SMALL has none) to see at their steps: the
# walltime chain above runs with them when wandb is installed
WANDB = ("tracking.wandb.project=beam-test", "tracking.wandb.mode=offline", "eval.interval=3")


def assert_one_wandb_run(run: Path, plan: Plan, n: int) -> None:
    """Every segment of the chain (first, resubmitted, requeued, resumed with a new total) logged to
    one W&B run, read back with wandb's own reader from the segments' offline transaction logs:
    every rollout once and in order (a rollout re-done after a preemption keeps the values logged
    first), each evaluation at its step. The reference backend has one writer a segment (its
    driver), so each segment left at most one fragment (none when cancelled in bring-up), and the
    real `wandb sync --dry-run` lists every fragment of the ended chain for one upload."""
    from beam_hpc.run.ledger import read_ledger

    assert plan.driver_env["WANDB_RESUME"] == "allow" and plan.driver_env["WANDB_MODE"] == "offline"
    dirs = tracking.fragment_dirs(run)
    assert len(dirs) >= 3 and all(d.name.startswith("offline-run-") for d in dirs), [d.name for d in dirs]
    rid = tracking.existing_run_id(run)
    segments, _ = read_ledger(run / "ledger.jsonl")
    frags = [tracking.read_fragment(d) for d in dirs]
    owners = [tracking._segment_of(f.start, segments)["segment"] for f in frags]
    assert len(owners) == len(set(owners)), owners  # the reference backend's single writer
    logs = [f.log for f in frags]
    runs_seen = {r["run"]["run_id"] for log in logs for r in tracking.read_records(log) if r.get("type") == "run"}
    assert runs_seen == {rid}
    rows = [h for log in logs for h in tracking.history(log)]
    steps = [h[ROLLOUT_STEP] for h in rows if metric_names.ROLLOUT_REWARD in h]
    assert steps == list(range(n)), steps  # every rollout once, in order
    tag = metric_names.eval_accuracy_tag(plan.recipe.data.eval_name)
    assert [h[EVAL_STEP] for h in rows if tag in h] == list(range(0, n + 1, plan.recipe.eval.interval))
    # the values are TensorBoard's (metrics.jsonl): a re-done rollout keeps what was logged first
    first_logged: dict[int, float] = {}
    for line in (run / "dumps" / metric_names.METRICS_FILE).read_text().splitlines():
        m = json.loads(line)
        if m["kind"] == "rollout":
            first_logged.setdefault(m["rollout_id"], m[metric_names.ROLLOUT_REWARD])
    assert {h[ROLLOUT_STEP]: h[metric_names.ROLLOUT_REWARD] for h in rows if metric_names.ROLLOUT_REWARD in h} == \
        pytest.approx(first_logged)
    summary = tracking.summary(run, [r["segment"] for r in segments])
    assert summary["segments"] == len(segments) and summary["unsynced"] == [r["segment"] for r in segments]
    listing: list[str] = []
    tracking.sync(run, segments, dry_run=True, echo=listing.append)  # the real `wandb sync --dry-run`
    assert f"Would sync {len(dirs)} run(s)" in listing[0], listing
    assert sorted(x.split()[-1] for x in listing[0].splitlines() if x.rstrip().endswith(".wandb")) == \
        sorted(f"{d.name}/run-{rid}.wandb" for d in dirs)


def interval_after(seg: dict) -> int:
    """Rollouts a preemption may cost: none when the grace allowed a save (the reference backend
    stops right after it), else those since the last periodic checkpoint (interval 3 here)."""
    return 0 if "saved on request" in seg["end"]["detail"] else 3


SEED_ENV = "BEAM_LC_SEED"  # replays the interruption points of an earlier run (its seed is printed)


@dataclass(frozen=True)
class Hit:
    """One interruption: ``action`` (requeue: ``scontrol requeue``; kill: SIGKILL to the driver),
    sent once the segment has trained ``after`` new rollouts and then either ``delay_frac`` of a
    rollout step later (``during="rollout"``: the next rollout is in flight) or as soon as a
    checkpoint is being written (``during="save"``: its staging directory exists)."""

    action: str
    after: int
    during: str
    delay_frac: float

    def __str__(self) -> str:
        when = f"+{self.delay_frac:.2f} of a rollout step" if self.during == "rollout" else "the next save begins"
        return f"{self.action} after {self.after} new rollouts, when {when}"


def interruption_points(rng: random.Random) -> list[Hit]:
    """Two requeues and one driver kill in a random order, each at a random point of its segment;
    at least one lands in a rollout and one in a save (random, not only at quiet boundaries). (A
    third requeue, as this test once had, repeated the first two's path for another segment's
    start-up: about 20 s of CPU in CI.)"""
    actions = ["requeue", "requeue", "kill"]
    rng.shuffle(actions)
    during = [rng.choice(("rollout", "save")) for _ in actions]
    if len(set(during)) == 1:
        during[rng.randrange(len(during))] = "save" if during[0] == "rollout" else "rollout"
    return [Hit(a, rng.randint(1, 3), d, round(rng.uniform(0.1, 0.9), 2)) for a, d in zip(actions, during, strict=False)]


def _saving(run_dir: Path, driver: int) -> bool:
    """The running driver is writing a checkpoint: its staging directory (``.iter_N.tmp<its pid>``)
    is beside the iteration dirs (those of killed drivers stay behind, with other pids)."""
    return any((run_dir / "checkpoints").glob(f".iter_*.tmp{driver}"))


def _strike(hit: Hit, run_dir: Path, plan: Plan, cluster) -> tuple[str, str]:
    """Wait for the running segment to reach ``hit``'s point, interrupt it; returns what was going
    on and the name of the segment struck."""
    segs = wait_for("a running segment", lambda: _last_segment(run_dir, ended=False), run_dir, poll_s=0.1)
    job = segs[-1]["start"]["job_id"]
    base = len(rollout_ids(run_dir))
    wait_for(f"{hit.after} new rollouts in segment {segs[-1]['segment']}",
             lambda: len(rollout_ids(run_dir)) >= base + hit.after, run_dir, poll_s=0.05)
    driver = wait_for("the driver's pid", lambda: _driver_pid(plan), run_dir, timeout=10)
    if hit.during == "save":
        wait_for("a save in progress", lambda: _saving(run_dir, driver), run_dir, timeout=60, poll_s=0.01)
    else:
        time.sleep(hit.delay_frac * _last_rollout_s(run_dir))
    trained, saving = len(rollout_ids(run_dir)) - base, _saving(run_dir, driver)
    if hit.action == "requeue":
        cluster.run("scontrol", "requeue", job)
    else:
        os.kill(driver, signal.SIGKILL)
    state = f"{trained} new rollouts trained, checkpoint {checkpoint_layout.latest_iteration(run_dir / 'checkpoints')}"
    name = segs[-1]["segment"]
    return f"{hit} -> sent to {name} with {state}{', a save in progress' if saving else ''}", name


def _ended(run_dir: Path, name: str) -> dict | None:
    """Segment ``name`` once it has its end line. Looked up by name, not as "the last one": the
    segment after a killed driver is a new job that may start, and even finish, between two polls."""
    return next((s for s in segments(run_dir) if s["segment"] == name and "end" in s), None)


def _last_segment(run_dir: Path, *, ended: bool) -> list[dict] | None:
    """The ledger's segments when the last one has (``ended``) or has not yet an end line."""
    segs = segments(run_dir)
    return segs if segs and ("end" in segs[-1]) == ended else None


def _last_rollout_s(run_dir: Path) -> float:
    lines = (run_dir / "dumps" / metric_names.METRICS_FILE).read_text().splitlines(keepends=True)
    whole = [json.loads(x) for x in lines if x.endswith("\n")]
    return float([m[metric_names.ROLLOUT_TIME] for m in whole if m.get("kind") == "rollout"][-1])


def test_two_random_requeues_and_a_killed_driver_lose_at_most_what_was_unsaved(slurm_cluster, tiny_assets, runs,
                                                                               reference_ray) -> None:
    """Two `scontrol requeue` (SIGTERM, no time to save: the segment records it, Slurm requeues
    the same job id, which resumes from the last complete checkpoint) and one SIGKILLed driver (an
    error: the segment resubmits with --resume), each at a random point while a rollout is in
    flight or a checkpoint is being written. The run still ends exact, and its final checkpoint
    (weights, optimizer, RNG, loop state) is bitwise that of an uninterrupted run. The points come
    from a seeded generator: the seed is printed, and $BEAM_LC_SEED draws the same points again
    (where exactly they land still depends on the machine's timing; each is printed)."""
    seed = int(os.environ.get(SEED_ENV) or random.SystemRandom().randrange(1 << 31))
    hits = interruption_points(random.Random(seed))
    print(f"\n{SEED_ENV}={seed}: " + "; ".join(map(str, hits)))
    n, interval = 18, 2  # each segment trains at most ~5 before it is struck: 3 hits fit in any order
    run = runs / "requeue"
    plan, first = submit_run(run, tiny_assets, num_rollout=n, interval=interval)
    # the same recipe and seed in one go, through the backend alone, while the chain waits on Slurm
    whole = runs / "uninterrupted"
    whole_plan = make_test_plan(whole, assets=tiny_assets, site=HOST_SITE,
                                overrides=[*SMALL, f"num_rollout={n}", f"checkpoint.interval={interval}"])
    uninterrupted = ThreadPoolExecutor(1).submit(run_backend, whole_plan.paths.plan, reference_ray)
    sent = []
    for hit in hits:
        what, name = _strike(hit, run, plan, slurm_cluster)
        sent.append(what)
        seg = wait_for(f"the end line of segment {name}", lambda n=name: _ended(run, n), run, timeout=120)
        job = seg["start"]["job_id"]
        if hit.action == "requeue":
            assert seg["end"]["reason"] == "preempted", f"{SEED_ENV}={seed}\n{diagnostics(run)}"
            assert seg["end"]["next"] == {"action": "requeue", "job_id": job}
            # a requeued job may start again only after cred_expire (10 s here): let it go at once
            wait_for("the requeued job to pend", lambda j=job: job_state(j) == "PENDING", run, timeout=60, poll_s=0.2)
            slurm_cluster.run("scontrol", "update", f"jobid={job}", "StartTime=now", check=False)
        else:
            assert seg["end"]["reason"] == "error" and "-9" in seg["end"]["detail"], f"{SEED_ENV}={seed}\n{diagnostics(run)}"
            assert seg["end"]["next"]["action"] == "resubmit"
    wait_for("the run to complete", lambda: chain_finished(run), run)
    segs = segments(run)
    print("\n".join(sent) + f"\nrequeued x2 + killed driver ({n} rollouts):\n{timeline(run)}")
    assert len(segs) == len(hits) + 1 and segs[0]["segment"] == f"{first}-0", diagnostics(run)
    for hit, before, after in zip(hits, segs, segs[1:], strict=False):  # each hit's own follow-up
        # resuming whenever a checkpoint exists (a hit during the first save leaves none: a fresh start)
        assert after["start"]["resume"] == (after["start"]["rollouts_at_start"] > 0), diagnostics(run)
        if hit.action == "requeue":  # the same job id, one restart later
            assert (after["start"]["job_id"], after["start"]["restart"]) == (before["start"]["job_id"],
                                                                            before["start"]["restart"] + 1)
        else:  # a new job, submitted by the failed segment
            assert after["start"]["job_id"] == before["end"]["next"]["job_id"] and after["start"]["restart"] == 0
    counts = assert_complete_and_exact(run, plan, n)
    assert redone(counts) <= interval * len(hits), f"re-done rollouts {counts}"  # at most an interval per hard stop
    uninterrupted.result()
    last = f"iter_{n - 1:07d}"
    compared = assert_bitwise_equal(load_checkpoint(whole / "checkpoints" / last),
                                    load_checkpoint(run / "checkpoints" / last), last)
    assert compared > 50


def _driver_pid(plan: Plan) -> int | None:
    """The reference backend's process of this run (all fake nodes share this host)."""
    for pid in procs.pids():
        argv = procs.cmdline(pid)
        if "beam_hpc.backends.reference" in argv and plan.paths.plan in argv:
            return pid
    return None


# -- the run lock, cancel ------------------------------------------------------------------------------------
def test_second_submission_is_refused_and_cancel_stops_the_chain(slurm_cluster, tiny_assets, runs) -> None:
    """While a segment runs: `submit` onto its output dir is refused on the login node, and a raw
    `sbatch job.sbatch --resume` that gets past it is refused by the run lock in the job (no ledger
    line). Then `beam-hpc cancel` stops the chain: the running job ends as cancelled, nothing else
    is queued, and a later segment of the chain would not start."""
    from beam_hpc.cli.app import main
    from beam_hpc.run.lock import RunLockError

    run = runs / "locked"
    plan, job = submit_run(run, tiny_assets, num_rollout=100_000, interval=2)  # runs until cancelled
    wait_for("the segment to hold the lock", lambda: (run / "run.lock").exists() and segments(run), run)
    with pytest.raises(RunLockError, match=f"in use by job {job}"):
        submit_run(run, tiny_assets, num_rollout=100_000, interval=2, resume=True)
    intruder = slurm_cluster.run("sbatch", "--parsable", f"--output={run}/logs/slurm-%j.out", str(run / "job.sbatch"),
                                 "--resume").stdout.strip()
    wait_for("the intruder to be refused", lambda: job_state(intruder) in ("FAILED", "COMPLETED", "GONE"), run,
             timeout=180)
    assert f"refused: {run} is in use by job {job}" in _read(run / "logs" / f"slurm-{intruder}.out")
    assert not (run / "logs" / f"{intruder}-0").exists()
    assert [s["segment"] for s in segments(run)] == [f"{job}-0"]  # the intruder wrote nothing
    assert job_state(job) == "RUNNING"

    assert main(["cancel", str(run)]) == 0
    wait_for("the cancelled segment's end line", lambda: chain_finished(run), run, timeout=60)
    end = segments(run)[0]["end"]
    assert end["reason"] == "cancelled" and end["next"] == {"action": "none", "job_id": None}
    assert wait_for("the queue to empty", lambda: nothing_queued(plan), run, timeout=60)
    assert (run / "CANCELLED").exists()


def test_a_stale_lock_of_a_killed_job_is_taken_over(slurm_cluster, tiny_assets, runs) -> None:
    """A segment SIGKILLed with its job (no end line, lock left behind) does not block the run:
    Slurm says the job is gone, so the next submission's segment takes the lock over and resumes.
    The first target is out of reach, so the kill always lands mid-run, however fast the machine."""
    run = runs / "stale"
    plan, job = submit_run(run, tiny_assets, num_rollout=100_000, interval=2)
    wait_for("a first checkpoint", lambda: checkpoint_layout.latest_iteration(run / "checkpoints") is not None, run)
    holder = json.loads((run / "run.lock").read_text())
    assert holder["job_id"] == job
    os.kill(holder["pid"], signal.SIGKILL)  # the batch script itself, as the OOM killer would
    wait_for("the killed job to end", lambda: job_state(job) not in ("RUNNING", "COMPLETING"), run, timeout=120)
    assert json.loads((run / "run.lock").read_text()) == holder  # left behind
    assert "end" not in segments(run)[0]  # killed hard: no end line
    wait_for("the orphaned driver to go", lambda: _driver_pid(plan) is None, run, timeout=60)
    n = max(rollout_ids(run)) + 1 + 4
    plan, second = submit_run(run, tiny_assets, num_rollout=n, interval=2, resume=True)
    wait_for("the run to complete", lambda: chain_finished(run), run)
    segs = segments(run)
    assert [s["segment"] for s in segs] == [f"{job}-0", f"{second}-0"]
    assert f"took over the run lock of job {job}" in _read(run / "logs" / f"{second}-0" / "segment.log")
    assert_complete_and_exact(run, plan, n)
    # the segment writes its end line, then lets the lock go as its job ends (seconds later under load)
    assert wait_for("the queue to empty", lambda: nothing_queued(plan), run, timeout=60)
    assert not (run / "run.lock").exists()


# -- failed-node exclusion --------------------------------------------------------------------------------
def test_a_failed_node_is_excluded_from_the_next_segment_and_the_run_completes(slurm_cluster, tiny_assets, runs,
                                                                               monkeypatch) -> None:
    """One node of the cluster goes bad (beam_hpc.node.step's test hook: the first node step to
    reach it claims the node, and every node step on that node fails, as one with a broken disk
    would): the first segment ends as a node failure naming it, the resubmission excludes it, the
    next segment runs on other nodes and completes the run. status lists the node and counts the
    failed segment's GPU-hours as lost.

    The site names a quarantine file (beam_hpc.lifecycle.quarantine): the failure lands there with
    the run, the reason and the time, and another run's first job (run B, submitted after the
    chain) is excluded from the node too; B waits on a dependency that never holds, so it costs
    no allocation, and is cancelled once Slurm shows its ExcNodeList."""
    from beam_hpc.cli.app import main as cli
    from beam_hpc.fault_hooks import BAD_NODE_FILE_VAR
    from beam_hpc.lifecycle.quarantine import quarantined
    from beam_hpc.observe.status import gather
    from beam_hpc.observe.status_table import format_status

    run = runs / "bad-node"
    claim = runs / "bad-node-claim"
    bad_nodes = runs / "site-bad-nodes.json"
    site = runs / "quarantine-site.yaml"
    site.write_text(SITE.read_text() + f"quarantine: {bad_nodes}\nquarantine_days: 1\n")
    monkeypatch.setenv(BAD_NODE_FILE_VAR, str(claim))  # exported to the job by sbatch
    plan, first = submit_run(run, tiny_assets, num_rollout=2, interval=1, site=site,
                             extra=("topology.trainer.gpus_per_node=1", "topology.rollout.gpus_per_node=1"))
    wait_for("the chain to finish", lambda: chain_finished(run), run)
    bad = claim.read_text().strip()
    segs = segments(run)
    print(f"\nbad node {bad}:\n{timeline(run)}")
    assert len(segs) == 2, diagnostics(run)
    end = segs[0]["end"]
    assert end["reason"] == "node-failure" and end["next"]["action"] == "resubmit", diagnostics(run)
    assert [f["node"] for f in end["failed_nodes"]] == [bad] and "bad node" in end["failed_nodes"][0]["why"]
    second = segs[1]["start"]["job_id"]
    assert end["next"]["job_id"] == second and segs[1]["end"]["reason"] == "completed", diagnostics(run)
    started_on = [line.split("nodes: ")[1].rstrip(")") for line in _read(run / "logs" / f"{second}-0" / "segment.log")
                  .splitlines() if "starting node steps of group" in line]
    assert len(started_on) == 2 and all(bad not in nodes.split(",") for nodes in started_on), started_on
    s = gather(run, slurm=False)
    assert [(e["node"], e["segment"]) for e in s["excluded_nodes"]] == [(bad, f"{first}-0")]
    gh = s["gpu_hours"]
    assert gh["gpus"] == 2 and gh["lost"]["failed segments"] > 0 and gh["held"] > gh["lost"]["failed segments"]
    text = format_status(s)
    assert "failed segments" in text and f"excluded   {bad} (since segment {first}-0" in text
    assert wait_for("the queue to empty", lambda: nothing_queued(plan), run, timeout=60)
    # across runs: the site's quarantine holds the node, and run B's first job leaves it out
    (entry,) = quarantined(bad_nodes)
    assert (entry.node, entry.run, entry.run_dir, entry.segment) == (bad, plan.run_id, str(run), f"{first}-0")
    assert "bad node" in entry.why and entry.time == pytest.approx(end["time"], abs=60)
    assert entry.expires == pytest.approx(entry.time + 86400)
    # B waits on a held job, so it pends without an allocation. (Not on the failed job: Slurm forgets a
    # job MinJobAge (30 s) after it ends, and then counts a dependency on it as met: seen in CI)
    blocker = subprocess.run(["sbatch", "--parsable", "--hold", "-o", "/dev/null", "--wrap", "true"],
                             capture_output=True, text=True, check=True).stdout.strip()
    other, b_job = submit_run(runs / "bad-node-b", tiny_assets, num_rollout=2, interval=1, site=site,
                              dependency=f"afterok:{blocker}")
    try:
        shown = subprocess.run(["scontrol", "--oneliner", "show", "job", b_job], capture_output=True, text=True,
                               check=True).stdout
        components = [dict(tok.split("=", 1) for tok in line.split() if "=" in tok) for line in shown.splitlines()]
        assert len(components) == 2, shown  # the het job's trainer and rollout components
        assert all(c.get("ExcNodeList") == bad and c.get("JobState") == "PENDING" for c in components), shown
    finally:
        subprocess.run(["scancel", b_job, blocker], check=False)
    assert cli(["nodes", "--site", str(site), "release", bad]) == 0 and quarantined(bad_nodes) == []
    # a quarantine that leaves too few nodes for the groups refuses the submission (no job pends forever)
    from beam_hpc.errors import RuntimeFailure
    from beam_hpc.lifecycle.quarantine import record
    from beam_hpc.slurm.client import partition_nodes

    members = partition_nodes(plan.groups[0].partition) or []
    record(bad_nodes, [{"node": n, "why": "test"} for n in members[:-1]], run="other", run_dir="/x", segment="1-0", days=1)
    quarantine_before = bad_nodes.read_text()
    with pytest.raises(RuntimeFailure, match=r"1 left, but the recipe's groups need 2 .* `beam-hpc nodes release NAME`"):
        submit_run(runs / "bad-node-c", tiny_assets, num_rollout=2, interval=1, site=site)
    # refused before anything was written: no run directory at all (so no plan.json, job.sbatch, ledger,
    # lock or logs/), and the site's quarantine as it was
    assert not (runs / "bad-node-c").exists(), sorted(str(p) for p in (runs / "bad-node-c").rglob("*"))
    assert bad_nodes.read_text() == quarantine_before
