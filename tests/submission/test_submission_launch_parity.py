"""Launching is one thing (issue 20): five ways in, then a walltime resubmission and a preemption
requeue, all run the same plan, site and segment arguments.

On the real local Slurm cluster, with a site that has everything a site can give the job: a
``module`` shell function defined by its ``setup`` (as ``source /etc/profile.d/modules.sh`` would),
``module_loads``, ``env``, and an extra ``#SBATCH`` line (``--comment``). The tiny recipe is
launched by, one test each (so that xdist runs them side by side):

1. ``beam-hpc submit --via sbatch --num-rollout 100000``: this run is also the chain, in the
   cluster's ``spot`` partition (the site's copy that says so), whose nodes no other test's jobs
   share: once it trains, its time limit is lowered into its 150 s walltime lead
   (LocalSlurmCluster.end_soon), its first segment resubmits itself (passing the total on), the
   resubmitted job is preempted by an ``urgent`` job and requeued, and the requeued segment is
   cancelled once its driver runs;
2. a hand ``sbatch x.sbatch --num-rollout 1`` of a ``beam-hpc render -o`` script (the run directory
   does not exist yet; the plan's own total is 3),
3. ``beam-hpc submit --num-rollout 1`` (submitit),
4. ``beam_hpc.submit(..., num_rollout=1)`` from Python (submitit): its submitit Job handle's state,
   done() and result() follow the job without sacct, and the run it drives is checkpointed,
5. ``beam-hpc execute --num-rollout 1`` (no Slurm) with the laptop site plus the same site lines:
   with no batch script, execute runs those lines in a bash before the segment
   (beam_hpc.cli.execute.apply_site_lines), so its driver must see the same variables and modules.

Every segment writes ``driver.json`` in its segment directory (beam_hpc.job.runner): the driver's
argv, the total it runs to, the site's variables and ``LOADEDMODULES`` as the driver got them. Each
test holds every segment of its run to the same record: the driver command of the plan a dry run of
the same submission makes (run directory, Ray address and total aside; so all five agree with each
other), the segment arguments' total (1, and 100000 passed on through the resubmission and the
requeue), the site's variables with the module function's mark, and the module loaded once. plan.json
stays as submitted, the ledger's start lines say the same totals, and every Slurm job carries the
extra line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from parity_site import COMMENT, MODULE, SEEN_ENV, SITE_LINES, laptop_parity_site, parity_site
from run_watch import chain_finished, diagnostics, segments, wait_for
from slurm_cluster import spot_site

import beam_hpc
from beam_hpc.cli.app import main as cli_main
from beam_hpc.cli.execute import LAPTOP_SITE
from beam_hpc.run import checkpoint_layout

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "recipes" / "tiny.yaml")

PLAN_TOTAL, SEGMENT_TOTAL, CHAIN_TOTAL = 3, 1, 100_000
TIMEOUT_S = 900.0


def launch(test):  # type: ignore[no-untyped-def]
    """The marks of a test that runs the tiny recipe for real (all but the unit test at the end); those
    that go through Slurm are marked ``slurm`` as well."""
    for mark in (pytest.mark.slow, pytest.mark.ray, pytest.mark.e2e):
        test = mark(test)
    return test


def recipe_args(assets, run: Path, *, gpus: bool = True) -> list[str]:  # type: ignore[no-untyped-def]
    from reference_harness import SMALL

    out = ["--output-dir", str(run), "--set", f"num_rollout={PLAN_TOTAL}"]
    gpu_items = ["topology.trainer.gpus_per_node=2", "topology.rollout.gpus_per_node=1"] if gpus else []
    for item in [f"model.path={assets.model_dir}", f"data.dir={assets.data_dir}", *gpu_items, *SMALL]:
        out += ["--set", item]
    return out


def overrides(args: list[str]) -> list[str]:
    """The ``--set`` items of recipe_args, as Python's ``overrides``."""
    return [args[i + 1] for i, a in enumerate(args) if a == "--set"]


def submitted_id(capsys) -> str:  # type: ignore[no-untyped-def]
    return capsys.readouterr().out.split("submitted job ")[1].split()[0]


def records(run: Path) -> dict[str, dict]:
    """Each segment's driver.json, by segment name."""
    return {p.parent.name: json.loads(p.read_text()) for p in sorted((run / "logs").glob("*/driver.json"))}


def normalized(record: dict, run: Path) -> list[str]:
    """The driver's argv with what differs by run and job taken out: the run directory, the Ray
    address (after --ray-address) and the total (compared on its own)."""
    argv = [a.replace(str(run), "<run>").replace("{run_dir}", "<run>") for a in record["argv"]]  # (a plan says {run_dir})
    for flag, stand_in in (("--ray-address", "<ray>"), ("--num-rollout", "<total>")):
        argv[argv.index(flag) + 1] = stand_in
    return argv


@pytest.fixture
def reference(tiny_assets, tmp_path: Path) -> list[str]:  # type: ignore[no-untyped-def]
    """The driver command every launch must run, normalized: the one in the plan that a dry run of
    the submission makes (its ``{ray_address}`` and ``{num_rollout}`` placeholders normalize as the
    filled values do). Nothing is written or submitted."""
    run = tmp_path / "reference"
    sub = beam_hpc.submit(TINY, str(parity_site(tmp_path / "reference-site.yaml")), output_dir=str(run),
                          overrides=overrides(recipe_args(tiny_assets, run)), via="sbatch", dry_run=True)
    assert not run.exists()
    return normalized({"argv": sub.plan.driver_argv}, run)


def ended(run: Path) -> bool:
    segs = segments(run)
    return bool(segs) and all("end" in x for x in segs)


def check_segments(run: Path, reference: list[str], *, total: int, plan_total: int) -> dict[str, dict]:
    """What every segment of ``run`` saw, against the reference; plan.json and the ledger's totals.
    Returns the segments' driver records."""
    recs = records(run)
    assert recs, f"no driver.json\n{diagnostics(run)}"
    for seg, rec in recs.items():
        assert normalized(rec, run) == reference, (seg, rec["argv"])
        assert rec["num_rollout"] == total and rec["argv"][rec["argv"].index("--num-rollout") + 1] == str(total), seg
        assert rec["site_env"] == SEEN_ENV, (seg, rec["site_env"])
        assert rec["loaded_modules"] == MODULE, (seg, rec["loaded_modules"])
    assert os.environ.get("LOADEDMODULES") != MODULE  # the job's, not inherited from this shell
    plan = json.loads((run / "plan.json").read_text())  # as submitted: a segment argument never rewrites it
    assert plan["recipe"]["num_rollout"] == plan_total
    starts = [s["start"]["num_rollout"] for s in segments(run)]
    assert starts and set(starts) == {total}, starts
    return recs


def completed(run: Path) -> None:
    """The run completed (a bring-up that failed on a loaded machine is retried by the lifecycle)."""
    reasons = [s["end"]["reason"] for s in segments(run)]
    assert reasons[-1] == "completed" and set(reasons[:-1]) <= {"node-failure"}, diagnostics(run)


def comment_of(job_id: str) -> str | None:
    out = subprocess.run(["scontrol", "show", "job", "--oneliner", job_id], capture_output=True, text=True,
                         check=False).stdout
    fields = dict(tok.split("=", 1) for tok in out.split() if "=" in tok)
    return fields.get("Comment")


def has_extra_line(job_id: str) -> None:
    """The site's extra ``#SBATCH --comment`` reached the job (checked while Slurm still lists it)."""
    assert comment_of(job_id) == COMMENT, f"the site's extra #SBATCH line did not reach job {job_id}"


def nodes_of(job_id: str) -> str:
    out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%N"], capture_output=True, text=True, check=False).stdout
    return ",".join(x.strip() for x in out.split() if x.strip())


class Chain:
    """The chain's interferences, done as soon as each is due: :meth:`step` is polled until the
    chain is over (a fixed order of waits would let the resubmitted segment reach its own walltime
    before it is preempted)."""

    def __init__(self, cluster, run: Path, first: str) -> None:  # type: ignore[no-untyped-def]
        self.cluster, self.run, self.first = cluster, run, first
        self.shortened = False
        self.second: str | None = None
        self.urgent = ""
        self.state = "walltime"

    def _more_time(self) -> None:
        """The user gives the resubmitted job a longer limit (``scontrol update``: an edited --time is
        fine, the watchdog reads the job's EndTime), so that it is preempted while it trains rather
        than reaching its own walltime during a slow bring-up on a loaded machine."""
        has_extra_line(self.second or "")  # the resubmission carries the site's extra line too
        self.cluster.run("scontrol", "update", f"jobid={self.second}", "TimeLimit=00:20:00", check=False)

    def _follow(self, segs: list[dict]) -> None:
        """A segment that the lifecycle retried (a node failure in a bring-up on a loaded machine)
        hands the chain on to its resubmission: follow it. A chain that stopped fails the test."""
        for seg in segs:
            if seg["segment"] == f"{self.second}-0" and "end" in seg and seg["end"]["reason"] != "preempted":
                nxt = seg["end"]["next"]
                assert nxt["action"] == "resubmit", diagnostics(self.run)
                self.second = str(nxt["job_id"])
                self._more_time()

    def step(self) -> bool:
        """Advance when the next event is there; True once the chain is over."""
        segs, recs = segments(self.run), records(self.run)
        if self.state == "walltime":
            if not self.shortened and (self.run / "dumps" / "metrics.jsonl").is_file():  # it trains: end it soon
                self.cluster.end_soon(self.first)
                self.shortened = True
            for seg in segs:
                if "end" in seg and seg["end"]["reason"] == "walltime":
                    assert seg["end"]["next"]["action"] == "resubmit", diagnostics(self.run)
                    self.second, self.state = str(seg["end"]["next"]["job_id"]), "resubmitted"
                    self._more_time()
                    break
                elif "end" in seg:  # a retried bring-up before the walltime segment: the chain goes on
                    assert seg["end"]["next"]["action"] == "resubmit", diagnostics(self.run)
        elif self.state == "resubmitted":
            self._follow(segs)
            nodes = nodes_of(self.second or "")
            if f"{self.second}-0" in recs and nodes:
                self.urgent = self.cluster.run("sbatch", "--parsable", "-p", "urgent", f"--nodelist={nodes}",
                                               "--exclusive", "-t", "1", "-o", "/dev/null", "--wrap",
                                               "sleep 3").stdout.strip()
                self.state = "preempting"
        elif self.state == "preempting" and any(s["segment"] == f"{self.second}-0" and "end" in s for s in segs):
            self.state = "preempted"
        elif self.state == "preempted":
            urgent_done = not set(self.cluster.job_states(self.urgent)) - {"COMPLETED"}
            if urgent_done and set(self.cluster.job_states(self.second or "")) & {"PENDING", "RUNNING"}:
                # a requeued job may start again after cred_expire (10 s here); let it go at once
                self.cluster.run("scontrol", "update", f"jobid={self.second}", "StartTime=now", check=False)
                self.state = "requeued"
        elif self.state == "requeued" and f"{self.second}-1" in recs:
            assert cli_main(["cancel", str(self.run)]) == 0
            self.state = "cancelled"
        elif self.state == "cancelled" and chain_finished(self.run):
            self.state = "over"
        return self.state == "over"


@launch
@pytest.mark.slurm
def test_submit_via_sbatch_then_a_walltime_resubmission_and_a_preemption_requeue_run_the_same_job(
        slurm_cluster, tiny_assets, tmp_path: Path, capsys, reference) -> None:  # type: ignore[no-untyped-def]
    run = tmp_path / "chain"
    site = spot_site(parity_site(tmp_path / "parity.yaml"), tmp_path / "parity-spot.yaml")
    assert cli_main(["submit", TINY, "--site", str(site), "--via", "sbatch", *recipe_args(tiny_assets, run),
                     "--set", "lifecycle.walltime=00:10:00", "--set", "lifecycle.lead_s=150",
                     "--set", "checkpoint.interval=1000", "--num-rollout", str(CHAIN_TOTAL)]) == 0
    chain_job = submitted_id(capsys)
    has_extra_line(chain_job)
    chain = Chain(slurm_cluster, run, chain_job)
    wait_for("the chain to be over", chain.step, run, timeout=TIMEOUT_S)
    second = chain.second or ""
    assert segments(run)[1]["start"]["resume"]  # a checkpoint exists: --resume, total passed on
    seen = check_segments(run, reference, total=CHAIN_TOTAL, plan_total=CHAIN_TOTAL)
    reasons = [(x["segment"], x["end"]["reason"]) for x in segments(run)]
    assert reasons[0][0] == f"{chain_job}-0" and "walltime" in [r for _, r in reasons], diagnostics(run)
    assert reasons[-2:] == [(f"{second}-0", "preempted"), (f"{second}-1", "cancelled")], reasons
    # the urgent job was sent once the resubmitted segment's driver ran; the requeued one ran its own
    assert {f"{second}-0", f"{second}-1"} <= set(seen), diagnostics(run)


@launch
@pytest.mark.slurm
def test_a_hand_sbatch_of_a_rendered_script_runs_the_same_job(slurm_cluster, tiny_assets, tmp_path: Path,
                                                               monkeypatch, reference) -> None:  # type: ignore[no-untyped-def]
    """Render, then a plain sbatch with the script's own arguments: nothing else prepared."""
    run = tmp_path / "hand"
    monkeypatch.chdir(tmp_path)  # the hand-submitted job's output lands in the submit directory
    script = tmp_path / "hand.sbatch"
    assert cli_main(["render", TINY, "--site", str(parity_site(tmp_path / "parity.yaml")),
                     *recipe_args(tiny_assets, run), "-o", str(script)]) == 0
    assert not run.exists()
    hand = subprocess.run(["sbatch", "--parsable", str(script), "--num-rollout", str(SEGMENT_TOTAL)], capture_output=True,
                          text=True, check=True, cwd=tmp_path).stdout.strip().split(";")[0]
    has_extra_line(hand)
    wait_for("the hand-submitted run to end", lambda: ended(run), run, timeout=TIMEOUT_S)
    check_segments(run, reference, total=SEGMENT_TOTAL, plan_total=PLAN_TOTAL)
    completed(run)
    # its output in the submit directory, linked from the run's logs/
    hand_out = tmp_path / f"{json.loads((run / 'plan.json').read_text())['job_name']}-{hand}.out"
    assert hand_out.is_file() and "segment ended: completed" in hand_out.read_text()
    assert (run / "logs" / f"slurm-{hand}.out").resolve() == hand_out.resolve()

    # the script the resubmissions run: the one submitted (Slurm keeps a het job's script without blank lines)
    def lines(text: str) -> list[str]:
        return [line for line in text.splitlines() if line.strip()]

    assert lines((run / "job.sbatch").read_text()) == lines(script.read_text())


@launch
@pytest.mark.slurm
def test_submit_through_submitit_runs_the_same_job(slurm_cluster, tiny_assets, tmp_path: Path, capsys,
                                                    reference) -> None:  # type: ignore[no-untyped-def]
    run = tmp_path / "via-submitit"
    assert cli_main(["submit", TINY, "--site", str(parity_site(tmp_path / "parity.yaml")),
                     *recipe_args(tiny_assets, run), "--num-rollout", str(SEGMENT_TOTAL)]) == 0
    has_extra_line(submitted_id(capsys))
    wait_for("the submitit run to end", lambda: ended(run), run, timeout=TIMEOUT_S)
    check_segments(run, reference, total=SEGMENT_TOTAL, plan_total=SEGMENT_TOTAL)
    completed(run)


@launch
@pytest.mark.slurm
def test_python_submit_runs_the_same_job_and_its_handle_follows_it(slurm_cluster, tiny_assets, tmp_path: Path,
                                                                    reference) -> None:  # type: ignore[no-untyped-def]
    run = tmp_path / "python"
    sub = beam_hpc.submit(TINY, str(parity_site(tmp_path / "parity.yaml")), output_dir=str(run),
                          num_rollout=SEGMENT_TOTAL, overrides=overrides(recipe_args(tiny_assets, run)))
    assert sub.job is not None and str(sub.job.job_id) == sub.job_id  # a submitit Job handle
    has_extra_line(str(sub.job_id))
    states = set()  # what the handle said while it ran (from squeue: the local cluster keeps no accounts)
    wait_for("the Python-submitted run to end", lambda: states.add(sub.job.state) or ended(run), run, timeout=TIMEOUT_S)
    wait_for("the handle to say done", lambda: states.add(sub.job.state) or sub.job.done(), run, timeout=TIMEOUT_S)
    # the handle follows the first segment: its task returns the segment's exit status (0 = completed; a
    # bring-up the lifecycle retried is 1), so the job itself is COMPLETED either way
    first_end = segments(run)[0]["end"]
    first_completed = first_end["reason"] == "completed"
    assert sub.job.task(0).result() == (0 if first_completed else 1), diagnostics(run)
    assert sub.job.state == "COMPLETED" and {"PENDING", "RUNNING"} & states, states
    assert checkpoint_layout.rollouts_done(run / "checkpoints") == SEGMENT_TOTAL
    check_segments(run, reference, total=SEGMENT_TOTAL, plan_total=SEGMENT_TOTAL)
    completed(run)


@launch
def test_execute_runs_the_same_job_with_the_sites_lines(tiny_assets, tmp_path: Path,
                                                         reference) -> None:  # type: ignore[no-untyped-def]
    """On this machine, no Slurm: the laptop site (no GPUs, so none asked for) with the parity site's
    lines, which execute runs in a bash before the segment (there is no batch script)."""
    run = tmp_path / "execute"
    out = tmp_path / "execute.out"
    with out.open("w") as fh:
        execute = subprocess.Popen([sys.executable, "-m", "beam_hpc.cli.app", "execute", TINY, "--quiet",
                                    "--site", str(laptop_parity_site(tmp_path / "parity-laptop.yaml")),
                                    *recipe_args(tiny_assets, run, gpus=False), "--num-rollout", str(SEGMENT_TOTAL)],
                                   stdout=fh, stderr=subprocess.STDOUT)
        wait_for("execute to end", lambda: execute.poll() is not None, run, timeout=TIMEOUT_S)
    assert execute.returncode == 0, out.read_text()[-3000:]
    check_segments(run, reference, total=SEGMENT_TOTAL, plan_total=SEGMENT_TOTAL)
    completed(run)


def test_execute_takes_the_environment_the_sites_lines_leave(tmp_path: Path) -> None:
    """apply_site_lines on its own: the lines run in the batch script's order (env, setup that defines
    ``module``, module loads), what they export or unset reaches this process, and a failing line
    is a runtime failure naming the site."""
    from beam_hpc.cli.execute import apply_site_lines
    from beam_hpc.config.site import site_from_dict
    from beam_hpc.errors import RuntimeFailure

    saved = dict(os.environ)
    os.environ["BEAM_PARITY_GONE"] = "set before"
    try:
        lines = {**SITE_LINES, "setup": [*SITE_LINES["setup"], "unset BEAM_PARITY_GONE", "echo chatter"]}
        apply_site_lines(site_from_dict({**LAPTOP_SITE, "name": "p", "python": sys.executable, **lines}, "<test>"))
        assert {k: os.environ.get(k) for k in SEEN_ENV} == SEEN_ENV and os.environ["LOADEDMODULES"].endswith(MODULE)
        assert "BEAM_PARITY_GONE" not in os.environ and os.environ["PWD"] == saved.get("PWD", os.environ["PWD"])
        broken = site_from_dict({**LAPTOP_SITE, "name": "broken", "python": sys.executable,
                                 "module_loads": [MODULE]}, "<test>")  # no setup: `module` is not defined
        with pytest.raises(RuntimeFailure, match=r"site broken\) failed with exit code 127"):
            apply_site_lines(broken)
    finally:
        os.environ.clear()
        os.environ.update(saved)
