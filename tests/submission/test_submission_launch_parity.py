"""Launching is one thing (issue 20): five ways in, then a walltime resubmission and a preemption
requeue, all run the same plan, site and segment arguments.

On the real local Slurm cluster, with a site that has everything a site can give the job: a
``module`` shell function defined by its ``setup`` (as ``source /etc/profile.d/modules.sh`` would),
``module_loads``, ``env``, and an extra ``#SBATCH`` line (``--comment``). The tiny recipe is
launched by

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
5. ``beam-hpc execute --num-rollout 1`` (no Slurm: no batch script, so only the driver's argv and
   total count; the laptop site, which has no GPUs).

Each launch waits for the previous one's Ray to be ready, then they run side by side: bring-ups at
once time out on a 2-core machine, the rest overlaps. Every segment writes ``driver.json`` in its segment directory (beam_hpc.job.runner): the
driver's argv, the total it runs to, the site's variables and ``LOADEDMODULES`` as the driver got
them. All of them must agree (run directory and Ray address aside), the totals must be the segment
arguments' (1, and 100000 passed on through the resubmission and the requeue), plan.json stays as
submitted, the ledger's start lines say the same totals, and every Slurm job carries the extra line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from parity_site import COMMENT, MODULE, SEEN_ENV, parity_site
from run_watch import chain_finished, diagnostics, segments, wait_for
from slurm_cluster import spot_site

import beam_hpc
from beam_hpc.cli.app import main as cli_main
from beam_hpc.run import checkpoint_layout

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.slurm, pytest.mark.ray, pytest.mark.e2e]

PLAN_TOTAL, SEGMENT_TOTAL, CHAIN_TOTAL = 3, 1, 100_000
TIMEOUT_S = 900.0


def recipe_args(assets, run: Path, *, gpus: bool = True) -> list[str]:  # type: ignore[no-untyped-def]
    from reference_harness import SMALL

    out = ["--output-dir", str(run), "--set", f"num_rollout={PLAN_TOTAL}"]
    gpu_items = ["topology.trainer.gpus_per_node=2", "topology.rollout.gpus_per_node=1"] if gpus else []
    for item in [f"model.path={assets.model_dir}", f"data.dir={assets.data_dir}", *gpu_items, *SMALL]:
        out += ["--set", item]
    return out


def ready(run: Path) -> bool:
    """Ray is up for a segment of ``run`` (or the segment already ended)."""
    return any((run / "logs").glob("*/ready.json")) or any("end" in s for s in segments(run))


def submitted_id(capsys) -> str:  # type: ignore[no-untyped-def]
    return capsys.readouterr().out.split("submitted job ")[1].split()[0]


def records(run: Path) -> dict[str, dict]:
    """Each segment's driver.json, by segment name."""
    return {p.parent.name: json.loads(p.read_text()) for p in sorted((run / "logs").glob("*/driver.json"))}


def normalized(record: dict, run: Path) -> list[str]:
    """The driver's argv with what differs by run and job taken out: the run directory, the Ray
    address (after --ray-address) and the total (compared on its own)."""
    argv = [a.replace(str(run), "<run>") for a in record["argv"]]
    for flag, stand_in in (("--ray-address", "<ray>"), ("--num-rollout", "<total>")):
        argv[argv.index(flag) + 1] = stand_in
    return argv


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
    """The chain's interferences, done as soon as each is due: :meth:`step` is called from every
    wait of the test, so the launches can go on meanwhile (a fixed order of waits would let the
    resubmitted segment reach its own walltime before it is preempted)."""

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


def test_five_launch_ways_a_resubmission_and_a_requeue_run_the_same_job(
        slurm_cluster, tiny_assets, tmp_path: Path, capsys, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    site = parity_site(tmp_path / "parity.yaml")
    tiny = str(REPO / "recipes" / "tiny.yaml")
    runs = {name: tmp_path / name for name in ("chain", "hand", "via-submitit", "python", "execute")}
    monkeypatch.chdir(tmp_path)  # the hand-submitted job's output lands in the submit directory

    # 1. the CLI through sbatch; this run is also the chain (in spot; its limit lowered into the 150 s lead)
    assert cli_main(["submit", tiny, "--site", str(spot_site(site, tmp_path / "parity-spot.yaml")), "--via", "sbatch",
                     *recipe_args(tiny_assets, runs["chain"]),
                     "--set", "lifecycle.walltime=00:10:00", "--set", "lifecycle.lead_s=150",
                     "--set", "checkpoint.interval=1000", "--num-rollout", str(CHAIN_TOTAL)]) == 0
    chain_job = submitted_id(capsys)
    has_extra_line(chain_job)
    chain = Chain(slurm_cluster, runs["chain"], chain_job)

    def wait(what: str, predicate, run: Path) -> None:  # type: ignore[no-untyped-def]
        wait_for(what, lambda: chain.step() is not None and predicate(), run, timeout=TIMEOUT_S)

    wait("the chain's Ray", lambda: ready(runs["chain"]), runs["chain"])

    # 2. render, then a plain sbatch with the script's own arguments: nothing else prepared
    script = tmp_path / "hand.sbatch"
    assert cli_main(["render", tiny, "--site", str(site), *recipe_args(tiny_assets, runs["hand"]), "-o", str(script)]) == 0
    assert not runs["hand"].exists()
    hand = subprocess.run(["sbatch", "--parsable", str(script), "--num-rollout", str(SEGMENT_TOTAL)], capture_output=True,
                          text=True, check=True, cwd=tmp_path).stdout.strip().split(";")[0]
    has_extra_line(hand)
    wait("the hand-submitted job's Ray", lambda: ready(runs["hand"]), runs["hand"])
    # 3. the CLI through submitit
    assert cli_main(["submit", tiny, "--site", str(site), *recipe_args(tiny_assets, runs["via-submitit"]),
                     "--num-rollout", str(SEGMENT_TOTAL)]) == 0
    via_submitit = submitted_id(capsys)
    has_extra_line(via_submitit)
    wait("the submitit job's Ray", lambda: ready(runs["via-submitit"]), runs["via-submitit"])
    # 4. Python
    args = recipe_args(tiny_assets, runs["python"])
    sub = beam_hpc.submit(tiny, str(site), output_dir=str(runs["python"]), num_rollout=SEGMENT_TOTAL,
                          overrides=[args[i + 1] for i, a in enumerate(args) if a == "--set"])
    assert sub.job is not None and str(sub.job.job_id) == sub.job_id  # a submitit Job handle
    has_extra_line(str(sub.job_id))
    states = set()  # what the handle said while it ran (from squeue: the local cluster keeps no accounts)
    wait("the Python-submitted job's Ray", lambda: states.add(sub.job.state) or ready(runs["python"]), runs["python"])
    # 5. execute, on this machine (the laptop site: no GPUs, so none asked for)
    execute = subprocess.Popen([sys.executable, "-m", "beam_hpc.cli.app", "execute", tiny, "--quiet",
                                *recipe_args(tiny_assets, runs["execute"], gpus=False),
                                "--num-rollout", str(SEGMENT_TOTAL)],
                               stdout=(tmp_path / "execute.out").open("w"), stderr=subprocess.STDOUT)

    # everything ends: the launches by themselves, the chain once the requeued segment runs
    def done(name: str) -> bool:
        segs = segments(runs[name])
        return bool(segs) and all("end" in x for x in segs)

    for name in ("hand", "via-submitit", "python"):
        wait(f"the {name} run to end", lambda name=name: done(name), runs[name])
    wait("the python job's handle to say done", lambda: states.add(sub.job.state) or sub.job.done(), runs["python"])
    # the handle follows the first segment (its exit status: 0 = completed, then COMPLETED); a bring-up
    # the lifecycle retried is 1
    first_end = segments(runs["python"])[0]["end"]
    completed = first_end["reason"] == "completed"
    assert sub.job.task(0).result() == (0 if completed else 1), diagnostics(runs["python"])
    assert sub.job.state == ("COMPLETED" if completed else "FAILED") and {"PENDING", "RUNNING"} & states, states
    assert checkpoint_layout.rollouts_done(runs["python"] / "checkpoints") == SEGMENT_TOTAL
    wait("execute to end", lambda: execute.poll() is not None, runs["execute"])
    assert execute.returncode == 0, (tmp_path / "execute.out").read_text()[-3000:]
    wait("the chain to be over", lambda: chain.state == "over", runs["chain"])
    second = chain.second or ""
    assert segments(runs["chain"])[1]["start"]["resume"]  # a checkpoint exists: --resume, total passed on

    # what every segment saw
    seen = {name: records(run) for name, run in runs.items()}
    for name, recs in seen.items():
        assert recs, f"{name}: no driver.json\n{diagnostics(runs[name])}"
    reference = normalized(next(iter(seen["hand"].values())), runs["hand"])
    for name, recs in seen.items():
        for seg, rec in recs.items():
            assert normalized(rec, runs[name]) == reference, (name, seg)
            total = CHAIN_TOTAL if name == "chain" else SEGMENT_TOTAL
            assert rec["num_rollout"] == total and rec["argv"][rec["argv"].index("--num-rollout") + 1] == str(total)
            if name != "execute":  # no batch script there
                assert rec["site_env"] == SEEN_ENV, (name, seg, rec["site_env"])
                assert rec["loaded_modules"] == MODULE, (name, seg, rec["loaded_modules"])
    reasons = [(x["segment"], x["end"]["reason"]) for x in segments(runs["chain"])]
    assert reasons[0][0] == f"{chain_job}-0" and "walltime" in [r for _, r in reasons], diagnostics(runs["chain"])
    assert reasons[-2:] == [(f"{second}-0", "preempted"), (f"{second}-1", "cancelled")], reasons
    # the urgent job was sent once the resubmitted segment's driver ran; the requeued one ran its own
    assert {f"{second}-0", f"{second}-1"} <= set(seen["chain"]), diagnostics(runs["chain"])
    for name, run in runs.items():
        plan = json.loads((run / "plan.json").read_text())  # as submitted: a segment argument never rewrites it
        assert plan["recipe"]["num_rollout"] == (CHAIN_TOTAL if name == "chain" else
                                                 PLAN_TOTAL if name == "hand" else SEGMENT_TOTAL), name
        starts = [s["start"]["num_rollout"] for s in segments(run)]
        assert starts and set(starts) == {CHAIN_TOTAL if name == "chain" else SEGMENT_TOTAL}, (name, starts)
        if name != "chain":  # (a bring-up that failed on a loaded machine is retried by the lifecycle)
            reasons = [s["end"]["reason"] for s in segments(run)]
            assert reasons[-1] == "completed" and set(reasons[:-1]) <= {"node-failure"}, diagnostics(run)
    # the hand-submitted job: its output in the submit directory, linked from the run's logs/
    hand_out = tmp_path / f"{json.loads((runs['hand'] / 'plan.json').read_text())['job_name']}-{hand}.out"
    assert hand_out.is_file() and "segment ended: completed" in hand_out.read_text()
    assert (runs["hand"] / "logs" / f"slurm-{hand}.out").resolve() == hand_out.resolve()
    # the script the resubmissions run: the one submitted (Slurm keeps a het job's script without blank lines)
    def lines(text: str) -> list[str]:
        return [line for line in text.splitlines() if line.strip()]

    assert lines((runs["hand"] / "job.sbatch").read_text()) == lines(script.read_text())
    assert os.environ.get("LOADEDMODULES") != MODULE  # the job's, not inherited from this shell
