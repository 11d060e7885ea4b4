"""`beam-hpc status`, `plot` and `logs` on run directories with several segments.

Two run directories:
- a REAL one (test_status_and_plot_of_a_real_two_segment_run, slow): the reference backend run
  twice through its real entry point, the first segment stopping after a checkpoint and the second
  resuming from it; the ledger lines around them written with beam_hpc.run.ledger as the job does.
  status and plot read exactly what the backend wrote (torch's SummaryWriter, metrics.jsonl).
- a hand-made one (``build_run``, fast), in the documented formats and with the project's own
  writers (plan_for, beam_hpc.run.ledger, checkpoint_layout, tensorboard's EventFileWriter, the
  metrics.jsonl lines of metric_names), for what a real run cannot produce on demand: a segment
  killed hard (start line, no end line) and a rollout re-done after it, with known times, so that
  goodput, durations and ETA are checked against hand-computed numbers.

The hand-made story: job 100 runs rollouts 0-5 and stops at walltime (resubmits 101); job 101
runs 6-8, checkpoints 7, and is killed hard during 8; its requeue 101-1 redoes 8 (in 12 s instead
of 10) and finishes 8-11. So the kept rollout time is 8*10 + 12 + 3*10 = 122 s of 80 + 40 + 50 =
170 s allocated.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
from io import StringIO
from pathlib import Path

import numpy as np
import pytest

from beam_hpc.backends.registry import plan_for
from beam_hpc.cli.app import main
from beam_hpc.data.prepare import prepare
from beam_hpc.data.tiny import PREPARED_EVAL_NAME, write_tiny_sources
from beam_hpc.observe import logs as run_logs
from beam_hpc.observe.eval_set import eval_set_of
from beam_hpc.observe.plot import charts_for, plot_run
from beam_hpc.observe.status import gather
from beam_hpc.observe.status_table import format_status
from beam_hpc.progress import Progress
from beam_hpc.run import checkpoint_layout, ledger, metric_names
from beam_hpc.run.scalars import read_scalars
from beam_hpc.submission.submit import build_recipe, build_site

ROOT = Path(__file__).resolve().parents[2]
T0 = 1_700_000_000.0
TOTAL = 12
# (job, restart, start, end or None (killed), rollouts run, checkpoint after, next action, next job)
SEGMENTS = [
    ("100", 0, T0, T0 + 80, range(0, 6), 5, "resubmit", "101"),
    ("101", 0, T0 + 100, None, range(6, 9), 7, None, None),
    ("101", 1, T0 + 160, T0 + 210, range(8, 12), 11, "none", None),
]
EVALS = {4: (0.2, 20.0), 9: (0.35, 24.0), 11: (0.5, 27.0)}  # rollout -> (accuracy, response length)


def _tb_event(wall: float, step: int, values: dict[str, float]):
    from tensorboard.compat.proto import event_pb2, summary_pb2

    summary = summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag=t, simple_value=v) for t, v in values.items()])
    return event_pb2.Event(wall_time=wall, step=step, summary=summary)


TINY_EVAL = ("tiny-add", "tiny two-digit addition (held-out)")  # recipes/tiny.yaml's data.eval_name/label


def build_run(run: Path, recorded_eval_name: str | None = None) -> Path:
    """The hand-made run of the tiny recipe (its data prepared in <run>/runs/tiny-data, 30 eval
    rows); ``recorded_eval_name`` writes the eval tags under another name than the plan's, as a run
    from before the recipe named its evaluation set did (``aime25``)."""
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    recipe = build_recipe(str(ROOT / "recipes" / "tiny.yaml"), output_dir=str(run), base_dir=run,
                          num_rollout=TOTAL)
    plan_for(recipe, build_site("local", search_dir=ROOT / "env")).write()
    eval_name = recorded_eval_name or recipe.data.eval_name
    eval_tags = (metric_names.eval_accuracy_tag(eval_name), metric_names.eval_response_len_tag(eval_name))
    prepare(Path(recipe.data.dir), from_local=write_tiny_sources(run / "src", n_train=40), progress=False,
            eval_file=PREPARED_EVAL_NAME)  # as `beam-hpc prepare --tiny` names it
    ckpt = run / "checkpoints"
    metrics = run / "dumps" / metric_names.METRICS_FILE
    metrics.parent.mkdir(parents=True)
    for job, restart, start, end, rollouts, ckpt_at, action, nxt in SEGMENTS:
        ledger.append(run / "ledger.jsonl", ledger.start_record(
            job_id=job, restart=restart, host="n1", rollouts_at_start=rollouts.start, num_rollout=TOTAL,
            resume=rollouts.start > 0, walltime_s=1800, lead_s=60, now=start))
        seg_logs = run / "logs" / f"{job}-{restart}"
        seg_logs.mkdir(parents=True)
        writer = EventFileWriter(str(run / "tensorboard"), filename_suffix=f".{job}-{restart}")
        t = start + 5
        for r in rollouts:
            step_s = 12.0 if restart == 1 and r == 8 else 10.0
            t += step_s
            values = {metric_names.ROLLOUT_REWARD: 0.1 + 0.05 * r, metric_names.ROLLOUT_TIME: step_s}
            if r in EVALS:
                values[eval_tags[0]], values[eval_tags[1]] = EVALS[r]
            writer.add_event(_tb_event(t, r, values))
            with metrics.open("a") as fh:
                fh.write(json.dumps({"kind": "rollout", "rollout_id": r, "time": t, **values}) + "\n")
            if r == ckpt_at:
                checkpoint_layout.iteration_dir(ckpt, r).mkdir(parents=True)
                checkpoint_layout.dataset_state_path(ckpt, r).parent.mkdir(parents=True, exist_ok=True)
                checkpoint_layout.dataset_state_path(ckpt, r).write_bytes(b"cursor")
                checkpoint_layout.mark_latest(ckpt, r)
        writer.close()
        for name in ("driver.log", "node-trainer-0.log", "node-rollout-0.log"):
            (seg_logs / name).write_text(f"{name} of {job}-{restart}\n")
            os.utime(seg_logs / name, (t + 5, t + 5))
        if end is not None:
            ledger.append(run / "ledger.jsonl", ledger.end_record(
                job_id=job, restart=restart, rollouts_at_end=ckpt_at + 1,
                reason="walltime" if action == "resubmit" else "completed", detail="", next_action=action,
                next_job_id=nxt, rollout_s=10.0, save_s=1.0, now=end))
    (run / "logs" / "slurm-100.out").write_text("batch shell of job 100\n")
    return run


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_run(tmp_path_factory.mktemp("observe") / "run")


# -- status ------------------------------------------------------------------------------------
STATUS_FIELDS = {"schema", "run_dir", "run_id", "job_name", "recipe", "backend", "state", "segments",
                 "segment_count", "job_ids", "restarts", "rollouts", "last_checkpoint", "eval", "reward",
                 "goodput", "eta", "slurm", "metrics_source", "warnings", "generated_at", "gpu_hours",
                 "excluded_nodes"}
SEGMENT_FIELDS = {"segment", "job_id", "restart", "host", "start", "end", "end_estimated", "duration_s",
                  "rollouts_at_start", "rollouts_at_end", "reason", "detail", "next_action", "next_job_id",
                  "timings", "state"}


def test_status_json_has_every_field_and_the_right_numbers(run_dir: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["status", str(run_dir), "--json", "--no-slurm"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert STATUS_FIELDS <= set(s)
    assert s["metrics_source"] == "tensorboard" and s["recipe"] == "tiny" and s["state"] == "completed"
    assert [r["segment"] for r in s["segments"]] == ["100-0", "101-0", "101-1"]
    assert all(SEGMENT_FIELDS <= set(r) for r in s["segments"])
    assert (s["segment_count"], s["job_ids"], s["restarts"]) == (3, ["100", "101"], 1)
    first, killed, last = s["segments"]
    assert (first["reason"], first["next_action"], first["next_job_id"], first["duration_s"]) == ("walltime", "resubmit", "101", 80.0)
    # killed hard: no end line; its end is estimated from its newest log (written 5 s after rollout 8)
    assert killed["state"] == "killed" and killed["end_estimated"] and killed["duration_s"] == pytest.approx(40.0)
    assert (last["reason"], last["rollouts_at_start"], last["rollouts_at_end"]) == ("completed", 8, 12)
    assert s["rollouts"] == {**s["rollouts"], "done": 12, "generated": 12, "total": 12, "fraction": 1.0}
    assert s["last_checkpoint"]["iteration"] == 11 and s["last_checkpoint"]["problems"] == []
    assert s["last_checkpoint"]["path"].endswith("iter_0000011")
    ev = s["eval"]
    assert (ev["name"], ev["label"], ev["accuracy_tag"]) == (*TINY_EVAL, "eval/tiny-add")
    assert (ev["accuracy"], ev["response_len"], ev["rollout"]) == (0.5, 27.0, 11)
    assert ev["aime25_accuracy"] is None and ev["aime25_response_len"] is None  # not AIME2025 data
    assert ev["data"]["rows"] == 30 and ev["data"]["file"] == str(run_dir / "runs" / "tiny-data" / PREPARED_EVAL_NAME)
    assert s["reward"]["value"] == pytest.approx(0.1 + 0.05 * 11) and s["reward"]["rollout"] == 11
    g = s["goodput"]
    assert (g["kept_rollout_s"], g["allocated_s"]) == (pytest.approx(122.0), pytest.approx(170.0))
    assert g["value"] == pytest.approx(122 / 170)
    assert s["eta"]["remaining_rollouts"] == 0 and s["eta"]["eta_s"] == 0.0
    assert s["slurm"]["job_id"] is None  # the chain ended: next action "none"


def test_status_midway_eta_and_table(run_dir: Path, tmp_path: Path) -> None:
    """The same run as it was during the killed segment: 8 checkpointed, 9 generated."""
    mid = tmp_path / "mid"
    shutil.copytree(run_dir, mid)
    lines = (mid / "ledger.jsonl").read_text().splitlines()
    (mid / "ledger.jsonl").write_text("\n".join(lines[:3]) + "\n{\"torn\n")  # 100-0 both, 101-0 start
    checkpoint_layout.mark_latest(mid / "checkpoints", 7)
    shutil.rmtree(mid / "logs" / "101-1")
    shutil.rmtree(mid / "tensorboard")  # and read from dumps/metrics.jsonl instead
    metrics = mid / "dumps" / metric_names.METRICS_FILE
    metrics.write_text("".join(x + "\n" for x in metrics.read_text().splitlines() if json.loads(x)["time"] <= T0 + 140))
    s = gather(mid, slurm=False)
    assert s["metrics_source"] == "metrics.jsonl" and s["state"] == "unknown"
    assert s["segments"][-1]["state"] == "open" and len(s["warnings"]) == 1
    assert s["segments"][-1]["duration_s"] == pytest.approx(40.0)  # its newest log, 5 s after rollout 8
    assert (s["rollouts"]["done"], s["rollouts"]["generated"]) == (8, 9)
    # allocated 80 + 40 s for 8 kept rollouts -> 15 s each; 3 of 12 still to generate
    assert s["eta"]["s_per_rollout_allocated"] == pytest.approx(15.0)
    assert (s["eta"]["remaining_rollouts"], s["eta"]["eta_s"]) == (3, pytest.approx(45.0))
    assert s["slurm"]["job_id"] == "101" and s["slurm"]["note"] == "not asked (--no-slurm)"
    checkpoint_layout.mark_latest(mid / "checkpoints", 5)
    s = gather(mid, slurm=False)
    assert s["rollouts"]["done"] == 6
    table = format_status(s)
    for needle in ("state      unknown", "6 of 12 checkpointed", "100-0", "101-0", "walltime", "resubmit 101",
                   "eval       tiny two-digit addition (held-out): accuracy 0.200", "[eval/tiny-add]",
                   "eval data  " + str(run_dir / "runs" / "tiny-data" / PREPARED_EVAL_NAME) + ": 30 rows", "goodput"):
        assert needle in table, needle
    assert "AIME" not in table


def test_status_counts_wandb_segments_not_fragments(run_dir: Path, tmp_path: Path) -> None:
    """Offline, Miles leaves three fragments a segment (its driver, first trainer rank and rollout
    manager each write one: beam_hpc.run.tracking): status counts the ledger's segments, and a
    segment is uploaded once `beam-hpc sync` recorded it, whatever its fragments number."""
    from beam_hpc.run import tracking

    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    rid = tracking.run_id(run)
    for i, _segment in enumerate(SEGMENTS):
        for writer in range(3):  # names only: status reads no transaction log
            (run / "wandb" / "wandb" / f"offline-run-2026010{i + 1}_00000{writer}-{rid}").mkdir(parents=True)
    (run / "wandb" / "synced.json").write_text(json.dumps({"fragments": {}, "segments": ["100-0"]}))
    w = gather(run, slurm=False)["wandb"]
    assert (w["segments"], w["fragments"], w["offline"]) == (3, 9, 3)
    assert (w["synced"], w["unsynced"]) == (["100-0"], ["101-0", "101-1"])
    assert (f"tracking   W&B run {rid}: 2 of 3 offline segment(s) not yet synced; upload the ended ones: "
            f"beam-hpc sync {run}") in format_status(gather(run, slurm=False))


def test_status_refuses_a_directory_that_is_no_run(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["status", str(tmp_path)]) == 2
    assert "no plan.json and no ledger.jsonl" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.slurm
def test_status_shows_the_live_slurm_job(slurm_cluster, tmp_path: Path) -> None:
    """A real job on the local cluster carries the run on: status asks Slurm about it."""
    run = tmp_path / "live"
    run.mkdir()
    res = slurm_cluster.run("sbatch", "--parsable", "-p", "debug", "-N1", "-o", "/dev/null", "--wrap", "sleep 60")
    job = res.stdout.strip().split(";")[0]
    try:
        deadline = time.monotonic() + 30
        while "RUNNING" not in slurm_cluster.job_states(job) and time.monotonic() < deadline:
            time.sleep(0.3)
        ledger.append(run / "ledger.jsonl", ledger.start_record(
            job_id=job, restart=0, host="n1", rollouts_at_start=0, num_rollout=10, resume=False,
            walltime_s=600, lead_s=60))
        s = gather(run)
        assert s["state"] == "running" and s["slurm"]["reachable"] and s["slurm"]["state"] == "RUNNING"
        assert s["slurm"]["components"][0]["NodeList"].startswith("n")
        assert s["segments"][0]["state"] == "running"
    finally:
        slurm_cluster.run("scancel", job, check=False)
    slurm_cluster.wait_for_job(job, timeout=60)
    s = gather(run)
    assert s["slurm"]["state"] in ("CANCELLED", "GONE") and s["segments"][0]["state"] == "killed"


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.e2e
def test_status_and_plot_of_a_real_two_segment_run(tiny_assets, reference_ray, tmp_path: Path) -> None:
    """The real reference backend, twice: the first segment stops after its checkpoint of rollout 1
    (backend_options.stop_after_rollout), the second resumes from it and completes 4 rollouts.
    The ledger lines around each are written with beam_hpc.run.ledger, as the job does; the driver's
    output goes to the segment's driver.log. What is read back is what the backend wrote."""
    import socket

    from job_plans import HOST_SITE, make_test_plan
    from reference_harness import SMALL, run_backend

    run = tmp_path / "real"
    common = [*SMALL, "num_rollout=4", "eval.interval=2", "checkpoint.interval=2"]
    segments = [("9001", ["backend_options.stop_after_rollout=1"], "walltime", "resubmit", "9002"),
                ("9002", [], "completed", "none", None)]
    for job, extra, reason, action, nxt in segments:
        plan = make_test_plan(run, assets=tiny_assets, site=HOST_SITE, overrides=common + extra).paths.plan
        ckpt = run / "checkpoints"
        ledger.append(run / "ledger.jsonl", ledger.start_record(
            job_id=job, restart=0, host=socket.gethostname(), rollouts_at_start=checkpoint_layout.rollouts_done(ckpt),
            num_rollout=4, resume=job != "9001", walltime_s=600, lead_s=60))
        proc = run_backend(plan, reference_ray)
        (run / "logs" / f"{job}-0").mkdir(parents=True)
        (run / "logs" / f"{job}-0" / "driver.log").write_text(proc.stdout + proc.stderr)
        ledger.append(run / "ledger.jsonl", ledger.end_record(
            job_id=job, restart=0, rollouts_at_end=checkpoint_layout.rollouts_done(ckpt), reason=reason, detail="",
            next_action=action, next_job_id=nxt, rollout_s=None, save_s=None))
    s = gather(run, slurm=False)
    assert STATUS_FIELDS <= set(s) and s["metrics_source"] == "tensorboard" and s["state"] == "completed"
    assert [(r["segment"], r["rollouts_at_start"], r["rollouts_at_end"]) for r in s["segments"]] == [
        ("9001-0", 0, 2), ("9002-0", 2, 4)]
    assert s["rollouts"]["done"] == s["rollouts"]["generated"] == s["rollouts"]["total"] == 4
    assert s["last_checkpoint"]["iteration"] == 3 and not s["last_checkpoint"]["problems"]
    assert s["eval"]["name"] == "tiny-add" and s["eval"]["data"]["rows"] == 30
    assert 0 <= s["eval"]["accuracy"] <= 1 and s["eval"]["response_len"] > 0 and s["eval"]["rollout"] == 4
    assert s["reward"]["rollout"] == 3 and 0 < s["goodput"]["value"] <= 1
    assert "resumed from checkpoint 1" in run_logs.find_log(run).read_text()
    result = plot_run(run)
    assert result.source == "tensorboard" and len(result.written) == 3, result.skipped
    for png in result.written:
        _check_png(png)


# -- plot --------------------------------------------------------------------------------------
def _check_png(path: Path) -> None:
    from PIL import Image

    assert path.stat().st_size > 10_000, path
    img = np.asarray(Image.open(path).convert("RGB")).astype(int)
    assert img.shape == (450, 800, 3)
    assert img.std() > 10 and len(np.unique(img.reshape(-1, 3), axis=0)) > 50  # not blank
    # the segment boundaries: dashed tab:red (214, 39, 40) vertical lines
    red = (abs(img[..., 0] - 214) < 30) & (abs(img[..., 1] - 39) < 30) & (abs(img[..., 2] - 40) < 30)
    assert red.sum() > 100, f"{path}: no segment boundary drawn"
    # the curve: tab:blue (31, 119, 180)
    blue = (abs(img[..., 0] - 31) < 30) & (abs(img[..., 1] - 119) < 30) & (abs(img[..., 2] - 180) < 30)
    assert blue.sum() > 200, f"{path}: no curve drawn"


@pytest.mark.slow
def test_plot_writes_the_seeds_curves_and_reward(run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "plots"
    assert main(["plot", str(run_dir), "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "eval set: tiny two-digit addition (held-out) (tiny-add); data " in printed and ": 30 rows" in printed
    charts = charts_for(eval_set_of(json.loads((run_dir / "plan.json").read_text()), frozenset()))
    assert sorted(p.name for p in out.glob("*.png")) == sorted(c.filename for c in charts) == [
        "reward.png", "tiny-add_accuracy.png", "tiny-add_response_length.png"]
    for c in charts:
        _check_png(out / c.filename)
    # without event files the same charts come from dumps/metrics.jsonl
    copy = tmp_path / "nojsonl"
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns("tensorboard"))
    result = plot_run(copy)
    assert result.source == "metrics.jsonl" and len(result.written) == 3
    assert all(p.parent == copy / "plots" for p in result.written)


def test_plot_of_a_run_without_metrics_says_so(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    ledger.append(tmp_path / "ledger.jsonl", ledger.start_record(
        job_id="1", restart=0, host="n1", rollouts_at_start=0, num_rollout=5, resume=False, walltime_s=60, lead_s=10))
    assert main(["plot", str(tmp_path)]) == 1
    out = capsys.readouterr()
    assert "skipped aime25_accuracy.png" in out.out and "nothing to plot yet" in out.err
    assert "eval set: AIME2025 (aime25); data eval file unknown: rows unknown" in out.out  # no plan.json


# -- which evaluation set ------------------------------------------------------------------------
def test_the_eval_set_is_named_from_the_plan_and_the_seed_keeps_aime25(run_dir: Path) -> None:
    plan = json.loads((run_dir / "plan.json").read_text())
    tiny = eval_set_of(plan, frozenset())
    assert (tiny.name, tiny.label, tiny.accuracy_tag) == (*TINY_EVAL, "eval/tiny-add")
    assert [c.title for c in charts_for(tiny)] == [
        "tiny two-digit addition (held-out) accuracy", "tiny two-digit addition (held-out) mean response length",
        "Rollout reward"]
    seed = plan_for(build_recipe(str(ROOT / "recipes" / "dedicated.yaml")), build_site("local", search_dir=ROOT / "env"))
    ev = eval_set_of(json.loads(seed.to_json()), frozenset())
    assert (ev.name, ev.label, ev.accuracy_tag, ev.response_len_tag) == (
        "aime25", "AIME2025", metric_names.EVAL_ACCURACY, metric_names.EVAL_RESPONSE_LEN)
    assert [c.filename for c in charts_for(ev)][:2] == ["aime25_accuracy.png", "aime25_response_length.png"]
    assert ev.data.rows is None and "no manifest.json" in ev.data.describe()  # /shared/data/beam is not here


def test_an_old_run_with_aime25_tags_still_shows_status_and_plots(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Written before the recipe named its eval set: tags eval/aime25. Read under the tag it has,
    with the plan's label when the plan names the set (the data is the plan's), and as the seed's
    AIME2025 when the plan has no eval_name at all (a plan from before the field)."""
    old = build_run(tmp_path / "old", recorded_eval_name="aime25")
    s = gather(old, slurm=False)
    assert (s["eval"]["name"], s["eval"]["label"], s["eval"]["accuracy"], s["eval"]["rollout"]) == (
        "aime25", TINY_EVAL[1], 0.5, 11)
    assert "eval       tiny two-digit addition (held-out): accuracy 0.500" in format_status(s)
    result = plot_run(old)
    assert sorted(p.name for p in result.written) == ["aime25_accuracy.png", "aime25_response_length.png", "reward.png"]
    plan = json.loads((old / "plan.json").read_text())
    del plan["recipe"]["data"]["eval_name"], plan["recipe"]["data"]["eval_label"]
    (old / "plan.json").write_text(json.dumps(plan))
    assert main(["status", str(old), "--json", "--no-slurm"]) == 0
    ev = json.loads(capsys.readouterr().out)["eval"]
    assert (ev["name"], ev["label"], ev["accuracy"], ev["aime25_accuracy"], ev["aime25_response_len"]) == (
        "aime25", "AIME2025", 0.5, 0.5, 27.0)
    assert ev["data"]["rows"] == 30


def test_the_eval_data_line_never_trusts_the_manifest(run_dir: Path, tmp_path: Path) -> None:
    data = json.loads((run_dir / "plan.json").read_text())["recipe"]["data"]
    work = tmp_path / "data"
    shutil.copytree(Path(data["dir"]), work)
    plan = {"recipe": {"data": {**data, "dir": str(work)}}}
    manifest, eval_file = work / "manifest.json", work / data["eval"]

    def line() -> str:
        ev = eval_set_of(plan, frozenset())
        assert (ev.data.rows is None) == ("unknown" in ev.data.describe())
        return ev.data.describe()

    assert line() == f"{eval_file}: 30 rows (prepare manifest)"
    good = manifest.read_text()
    for broken, why in ((good[: len(good) // 2], "manifest.json unreadable"), ("[1, 2]", "does not describe"),
                        (good.replace('"rows": 30', '"rows": "thirty"'), "malformed")):
        manifest.write_text(broken)
        assert why in line() and "rows unknown" in line()
    manifest.write_text(good)
    eval_file.write_text(eval_file.read_text().replace("+", "-", 1))  # same size, other content
    assert "sha256 differs" in line()
    eval_file.write_text("{}\n")
    assert "size differs" in line()
    manifest.unlink()
    assert line() == f"{eval_file}: rows unknown (no manifest.json beside it)"
    plan["recipe"]["data"].pop("eval")
    assert "eval file unknown" in line()


def test_scalars_keep_the_last_attempt_of_a_redone_rollout(run_dir: Path) -> None:
    sc = read_scalars(run_dir)
    times = sc.by_step(metric_names.ROLLOUT_TIME)
    assert sorted(times) == list(range(12)) and times[8].value == 12.0


def test_reading_scalars_leaves_tensorboard_s_own_log_quiet(run_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The stall watchdog reads the scalars every few seconds; TensorBoard's INFO line at each
    read ("No path found after .../events.out.tfevents...") stays out of the segment's log."""
    with caplog.at_level(logging.INFO):
        assert read_scalars(run_dir).source == "tensorboard"
    assert [r.getMessage() for r in caplog.records if r.name.startswith("tensorboard")] == []


# -- logs --------------------------------------------------------------------------------------
def test_logs_finds_the_right_file(run_dir: Path, capsys: pytest.CaptureFixture) -> None:
    assert run_logs.segments(run_dir) == ["100-0", "101-0", "101-1"]
    assert run_logs.find_log(run_dir).name == "driver.log" and run_logs.find_log(run_dir).parent.name == "101-1"
    assert run_logs.find_log(run_dir, group="rollout", segment=0) == run_dir / "logs" / "100-0" / "node-rollout-0.log"
    assert run_logs.find_log(run_dir, node=0, segment="101-0").name == "node-trainer-0.log"
    with pytest.raises(run_logs.LogNotFoundError, match="node-trainer-3.log.*it has: .*driver.log"):
        run_logs.find_log(run_dir, group="trainer", node=3)
    with pytest.raises(run_logs.LogNotFoundError, match="--segment 7"):
        run_logs.find_log(run_dir, segment=7)
    assert main(["logs", str(run_dir), "--group", "trainer", "--segment", "-2"]) == 0
    assert capsys.readouterr().out == "node-trainer-0.log of 101-0\n"
    assert main(["logs", str(run_dir), "--segment", "0", "--list"]) == 0
    assert capsys.readouterr().out.splitlines()[0].endswith("slurm-100.out")


def test_log_names_are_the_ones_the_job_writes() -> None:
    from beam_hpc.node.ray_node import ClusterRuntime

    rt = ClusterRuntime(job_id="5", job_num=5, restart=0, job_tag="t", head_ip="127.0.0.10", gcs_port=1,
                        host_stride=1, token_path="", segment_dir="/r/logs/5-0", nonce="", deadline=0.0,
                        nodelists={})
    assert rt.node_log("rollout", 2) == Path("/r/logs/5-0", run_logs.node_log_name("rollout", 2))


def test_logs_follow_moves_on_to_the_next_segment(tmp_path: Path) -> None:
    seg0 = tmp_path / "logs" / "7-0"
    seg0.mkdir(parents=True)
    (seg0 / "driver.log").write_text("old\n")

    def writer() -> None:
        with open(seg0 / "driver.log", "a") as fh:
            fh.write("rollout 1\nroll")
            fh.flush()
            time.sleep(0.2)
            fh.write("out 2\n")
        seg1 = tmp_path / "logs" / "7-1"
        seg1.mkdir()
        (seg1 / "driver.log").write_text("resumed\n")

    deadline = time.monotonic() + 10
    t = threading.Thread(target=writer)
    t.start()
    got: list[str] = []
    for line in run_logs.follow(tmp_path, seg0 / "driver.log", switch_segments=True, poll_s=0.05,
                                start_at_end=False, stop=lambda: time.monotonic() > deadline):
        got.append(line)
        if len(got) == 5:
            break
    t.join()
    assert got == ["old\n", "rollout 1\n", "rollout 2\n", f"==> {tmp_path / 'logs' / '7-1' / 'driver.log'} <==\n",
                   "resumed\n"]


# -- progress ----------------------------------------------------------------------------------
def test_progress_in_a_log_and_on_a_terminal() -> None:
    log = StringIO()
    with Progress("staging image", total=1000, unit="B", stream=log, interactive=False) as bar:
        for _ in range(10):
            bar.update(100)
    lines = log.getvalue().splitlines()
    assert len(lines) == 10 and "100%" in lines[-1] and "1000 B" in lines[-1] and "[" + "#" * 24 + "]" in lines[-1]
    tty = StringIO()
    with Progress("convert", stream=tty, interactive=True) as bar:
        bar.update(3)
    assert tty.getvalue().startswith("\rconvert: 3 ") and tty.getvalue().endswith("\n")
    quiet = StringIO()
    with Progress("x", total=2, stream=quiet, enabled=False) as bar:
        bar.update(2)
    assert quiet.getvalue() == "" and bar.done == 2


def test_status_shows_gpu_hours_lost_by_cause_and_the_excluded_nodes(tmp_path: Path) -> None:
    """A hand-made ledger: a walltime segment (bring-up 360 s, one rollout of 300 s re-done, saved
    600 s before its end), a node failure on n3 (100 s, nothing kept), and an old-style completed
    segment whose line lacks the accounting fields (so the figures are partial)."""
    from job_plans import make_test_plan

    from beam_hpc.lifecycle import exclusions
    from beam_hpc.plan.plan import Plan

    run = tmp_path / "run"
    gpus = Plan.load(make_test_plan(run, trainer_nodes=1, rollout_nodes=1, gpus=2).paths.plan).total_gpus
    assert gpus == 4
    t0, path = 1_700_000_000.0, run / "ledger.jsonl"
    for job, start, end, a, b, reason, extra in [
        ("200", t0, t0 + 3600, 0, 10, "walltime", dict(ready_s=360.0, rollouts_run=11, rollout_s=300.0,
                                                       last_save_at=t0 + 3000)),
        ("201", t0 + 3700, t0 + 3800, 10, 10, "node-failure",
         dict(failed_nodes=[{"node": "n3", "why": "node step failed: NVMe check"}])),
        ("202", t0 + 3900, t0 + 4900, 10, 14, "completed", {}),
    ]:
        ledger.append(path, ledger.start_record(job_id=job, restart=0, host="n1", rollouts_at_start=a,
                                                num_rollout=14, resume=a > 0, walltime_s=3600, lead_s=60, now=start))
        rec = ledger.end_record(job_id=job, restart=0, rollouts_at_end=b, reason=reason, detail="", next_action="none",
                                next_job_id=None, rollout_s=extra.pop("rollout_s", None), save_s=None, now=end, **extra)
        if job == "202":  # written by an older beam-hpc: no accounting fields at all
            rec = {k: v for k, v in rec.items() if k not in ("ready_s", "rollouts_run", "last_save_at", "failed_nodes")}
        ledger.append(path, rec)
    s = gather(run, slurm=False, now=t0 + 5000)
    gh = s["gpu_hours"]
    h = gpus / 3600
    assert gh["gpus"] == gpus and gh["partial"] is True
    assert gh["held"] == pytest.approx((3600 + 100 + 1000) * h)
    assert gh["lost"] == pytest.approx({"bring-up and restart": 360 * h, "rollouts re-done": 300 * h,
                                        "walltime tail after the last save": 300 * h,
                                        "checkpoint found damaged": 0.0, "failed segments": 100 * h, "stalls": 0.0})
    assert gh["useful"] == pytest.approx((3600 - 960 + 1000) * h)
    assert gh["goodput"] == pytest.approx(gh["useful"] / gh["held"])
    assert s["excluded_nodes"] == [{"node": "n3", "why": "node step failed: NVMe check", "segment": "201-0",
                                    "time": t0 + 3800}]
    text = format_status(s)
    assert f"GPU-hours  {gh['held']:,.2f} held by {gpus} GPUs" in text and "partial" in text
    assert f"failed segments {100 * h:,.2f}" in text and f"bring-up and restart {360 * h:,.2f}" in text
    assert "excluded   n3 (since segment 201-0: node step failed: NVMe check)" in text
    exclusions.record_cleared(run, ["all"])  # submit --resume --include-node all
    s = gather(run, slurm=False, now=t0 + 5000)
    assert s["excluded_nodes"] == [] and "excluded " not in format_status(s)
