"""W&B tracking: the recipe section, the run id kept in the run directory, the driver's environment
(reference and Miles), the key check before submission, and, with the real ``wandb`` offline,
three reference driver processes of one run logging every rollout and evaluation once to one W&B
run, two Miles stand-in segments of three writers each, and ``beam-hpc sync`` uploading the
fragments of each ended segment once, with the real ``wandb sync``, to a local endpoint that records
what W&B would get."""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from real_wandb import recording_wandb_server, require_wandb

from beam_hpc.backends.miles.flags import OWNED_NOT_EMITTED
from beam_hpc.backends.reference.loop.metrics_log import EVAL_STEP, ROLLOUT_STEP, logged_steps
from beam_hpc.backends.registry import driver_command
from beam_hpc.cli.app import main
from beam_hpc.config.recipe import load_recipe
from beam_hpc.config.site import Site
from beam_hpc.errors import InputError
from beam_hpc.run import tracking

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "recipes" / "tiny.yaml"
DEDICATED = ROOT / "recipes" / "dedicated.yaml"
EXAMPLE_SITE = str(ROOT / "env" / "example-site.yaml")
SITE = Site(name="t", container={"runtime": "host"})
OFFLINE_SITE = Site(name="t", container={"runtime": "host"}, compute_internet=False)
WB = ["tracking.wandb.project=beam-test", "tracking.wandb.entity=team"]


def no_key_env(tmp: Path) -> dict[str, str]:
    return {"HOME": str(tmp), "PATH": os.environ.get("PATH", "")}


def test_off_by_default_and_no_wandb_in_the_driver() -> None:
    r = load_recipe(TINY)
    assert r.tracking.wandb is None and tracking.settings_for(r, SITE) is None
    assert not any(k.startswith("WANDB") for k in driver_command(r, SITE).env)


def test_a_misspelt_field_is_refused_by_name() -> None:
    with pytest.raises(InputError, match=r"tracking\.wandb\.projct: unknown field"):
        load_recipe(TINY, ["tracking.wandb.projct=x"])


def test_reference_driver_env_is_static_and_resumes_one_run() -> None:
    env = driver_command(load_recipe(TINY, WB), SITE).env
    assert env == {"WANDB_PROJECT": "beam-test", "WANDB_ENTITY": "team", "WANDB_RUN_GROUP": "tiny",
                   "WANDB_MODE": "online", "WANDB_DIR": "{run_dir}/wandb", "WANDB_RESUME": "allow"}


def test_a_site_without_internet_makes_wandb_offline() -> None:
    r = load_recipe(TINY, WB)
    assert tracking.settings_for(r, OFFLINE_SITE).mode == "offline"
    assert tracking.settings_for(load_recipe(TINY, [*WB, "tracking.wandb.mode=offline"]), SITE).mode == "offline"


def test_the_run_id_is_made_once_and_kept(tmp_path: Path) -> None:
    assert tracking.existing_run_id(tmp_path) is None
    first = tracking.run_id(tmp_path)
    assert first.startswith("beam-") and tracking.run_id(tmp_path) == first
    assert (tmp_path / "wandb" / "run_id").read_text().strip() == first
    assert tracking.run_id(tmp_path / "other") != first


def test_key_lookup_follows_wandb(tmp_path: Path) -> None:
    env = no_key_env(tmp_path)
    assert not tracking.has_api_key(env)
    assert tracking.has_api_key({**env, "WANDB_API_KEY": "k"})
    (tmp_path / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password secret\n")
    assert tracking.has_api_key(env)
    assert not tracking.has_api_key({**env, "WANDB_BASE_URL": "https://wandb.example.org"})  # another host
    other = tmp_path / "n"
    other.write_text("machine wandb.example.org login user password s\n")
    assert tracking.has_api_key({**env, "WANDB_BASE_URL": "https://wandb.example.org", "NETRC": str(other)})


def test_online_without_a_key_exits_2_before_anything_is_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    for k in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "NETRC", "WANDB_BASE_URL"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    out_dir = tmp_path / "run"
    sets = sum((["--set", s] for s in WB), [])
    code = main(["submit", str(DEDICATED), "--site", EXAMPLE_SITE, "--dry-run", "--output-dir", str(out_dir), *sets])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("beam-hpc: error: tracking.wandb.mode: online, but no W&B API key") and "Traceback" not in err
    assert not out_dir.exists()
    # offline needs no key; a key makes online fine
    render = ["render", str(DEDICATED), "--site", EXAMPLE_SITE, "-o", str(tmp_path / "s.sh")]
    assert main([*render, "--set", "tracking.wandb.project=p", "--set", "tracking.wandb.mode=offline"]) == 0
    assert '"--wandb-mode", "offline"' in (tmp_path / "s.sh").read_text()
    monkeypatch.setenv("WANDB_API_KEY", "k")
    assert main([*render, *sets]) == 0
    assert '"--wandb-mode", "online"' in (tmp_path / "s.sh").read_text()


def test_the_run_id_flag_is_owned() -> None:
    """Miles's --wandb-run-id would give each segment a run chosen elsewhere: refused as a pass-through."""
    assert "--wandb-run-id" in OWNED_NOT_EMITTED


def test_the_run_id_file_is_never_seen_empty(tmp_path: Path) -> None:
    """The id file appears whole (a hard link of a written temporary), so two processes making the
    id at once agree, and a reader racing them never reads an empty id."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    pool = ctx.Pool(4)
    try:
        ids = pool.map(tracking.run_id, [tmp_path] * 16)
    finally:
        # close and join, not the with-block's terminate: terminate ends the workers with SIGTERM, and a
        # worker forked from a pytest process where an earlier in-process test installed its own SIGTERM
        # handler keeps that handler and does not die (seen: the fast tier hung here)
        pool.close()
        pool.join()
    assert len(set(ids)) == 1 and ids[0].startswith("beam-")
    assert [p.name for p in (tmp_path / "wandb").iterdir()] == ["run_id"]  # no temporary left behind


def test_a_fragment_is_placed_in_the_segment_that_wrote_it(tmp_path: Path) -> None:
    """Which fragments ``sync`` may upload: those of ended segments, placed by their start time
    in the ledger (a fragment written before a segment's start line is an earlier segment's)."""
    from beam_hpc.run import ledger

    segs = []
    for job, start in (("7", 100.0), ("8", 200.0)):
        ledger.append(tmp_path / "ledger.jsonl", ledger.start_record(
            job_id=job, restart=0, host="n", rollouts_at_start=0, num_rollout=9, resume=False,
            walltime_s=600, lead_s=60, now=start))
    segs, _ = ledger.read_ledger(tmp_path / "ledger.jsonl")
    assert tracking._segment_of(150.0, segs)["segment"] == "7-0" and tracking._segment_of(99.0, segs) is None
    assert tracking._ended(segs[0], segs) and not tracking._ended(segs[1], segs)  # 7-0 killed hard, 8-0 runs
    ledger.append(tmp_path / "ledger.jsonl", ledger.end_record(
        job_id="8", restart=0, rollouts_at_end=3, reason="walltime", detail="", next_action="resubmit",
        next_job_id="9", rollout_s=1.0, save_s=1.0, now=300.0))
    segs, _ = ledger.read_ledger(tmp_path / "ledger.jsonl")
    assert tracking._ended(segs[1], segs)


def test_a_log_without_a_run_record_is_recorded_as_skipped_never_uploaded(tmp_path: Path) -> None:
    """A writer killed before wandb's first flush leaves a log with no run record; W&B's sync cannot
    replay it (and one such file fails the whole call), so once its segment ended it is recorded as
    skipped and the segment as done; while the segment runs it is left."""
    from beam_hpc.run import ledger

    now = time.time()
    rid = tracking.run_id(tmp_path)
    frag = tmp_path / "wandb" / "wandb" / f"offline-run-20260101_000000-{rid}"
    frag.mkdir(parents=True)
    (frag / f"run-{rid}.wandb").write_bytes(b"")
    os.utime(frag, (now - 50, now - 50))
    ledger.append(tmp_path / "ledger.jsonl", ledger.start_record(
        job_id="1", restart=0, host="n", rollouts_at_start=0, num_rollout=3, resume=False,
        walltime_s=600, lead_s=60, now=now - 100))
    segs, _ = ledger.read_ledger(tmp_path / "ledger.jsonl")
    plan = tracking.plan_sync(tmp_path, segs)
    assert (plan.upload, plan.no_record, plan.later) == ({}, [], [(frag.name, "segment 1-0 is still running")])
    ledger.append(tmp_path / "ledger.jsonl", ledger.end_record(
        job_id="1", restart=0, rollouts_at_end=3, reason="completed", detail="", next_action="none",
        next_job_id=None, rollout_s=1.0, save_s=1.0, now=now))
    segs, _ = ledger.read_ledger(tmp_path / "ledger.jsonl")
    plan = tracking.sync(tmp_path, segs, echo=lambda line: None)  # nothing for wandb: it is not called
    assert (plan.upload, plan.no_record, plan.empty) == ({}, [frag.name], ["1-0"])
    assert tracking.summary(tmp_path, ["1-0"])["unsynced"] == [] and tracking.plan_sync(tmp_path, segs).no_record == []


def test_logged_steps_per_tag() -> None:
    rows = [{"eval/a": 1.0, EVAL_STEP: 0, "_step": 0}, {"rollout/r": 1.0, "train/l": 2.0, ROLLOUT_STEP: 0},
            {"rollout/r": 1.0, ROLLOUT_STEP: 1}, {"eval/a": 1.0, EVAL_STEP: 3}]
    assert logged_steps(rows) == {"eval/a": 3, "rollout/r": 1, "train/l": 0}


# -- the real wandb, offline: three driver processes of one run -----------------------------------------

SEGMENT = textwrap.dedent("""
    import sys
    from beam_hpc.backends.reference.loop.metrics_log import MetricsLog, WandbSink
    from beam_hpc.run.tracking import WandbSettings
    run_dir, seg, start, end = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    sink = WandbSink(WandbSettings("beam-test", None, "offline", "tiny"), run_dir, {"segment": seg})
    log = MetricsLog(run_dir + "/tensorboard", run_dir + "/dumps", sink)
    if start == 0:
        log.scalars("eval", 0, {"eval/tiny-add": 0.0})
    for k in range(start, end):  # as the reference driver orders them: rollout k, eval k+1, save k
        log.scalars("rollout", k, {"rollout/raw_reward": k + 100 * seg, "train/loss": -k})
        if (k + 1) % 3 == 0:
            log.scalars("eval", k + 1, {"eval/tiny-add": (k + 1) + 100 * seg})
        if (k + 1) % 2 == 0:
            log.scalars("save", k, {"perf/save_time": 0.5})
    log.close()
""")


def summary_of(run: Path) -> dict:
    from beam_hpc.run.ledger import read_ledger

    return tracking.summary(run, [r["segment"] for r in read_ledger(run / "ledger.jsonl")[0]])


def wandb_listing(out: str) -> list[str]:
    """The files ``wandb sync --dry-run --verbose`` says it would upload (one indented line each)."""
    return sorted(line.split()[-1] for line in out.splitlines() if line.rstrip().endswith(".wandb"))


@pytest.mark.slow  # three wandb processes (offline), each start reads the earlier logs: ~1 min on 2 cores
def test_three_segments_log_every_rollout_once_to_one_run_then_sync_the_ended_ones(tmp_path: Path) -> None:
    require_wandb()
    from beam_hpc.run import ledger

    run = tmp_path / "run"
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "PYTHONPATH": str(ROOT)}
    env.pop("WANDB_API_KEY", None)
    # segment 1: rollouts 0-4; segment 2 resumes from checkpoint 2 and re-does 3-4 before going on
    # to 7; segment 3 resumes from checkpoint 5 and re-does 6-7. The ledger says what a segment
    # would: a start line before its driver, an end line after (none for the third: still running)
    for seg, (start, end) in enumerate([(0, 5), (3, 8), (6, 10)], start=1):
        ledger.append(run / "ledger.jsonl", ledger.start_record(
            job_id=str(seg), restart=0, host="n", rollouts_at_start=start, num_rollout=10, resume=seg > 1,
            walltime_s=600, lead_s=60))
        subprocess.run([sys.executable, "-c", SEGMENT, str(run), str(seg), str(start), str(end)],
                       env=env, check=True, timeout=240)
        if seg < 3:
            ledger.append(run / "ledger.jsonl", ledger.end_record(
                job_id=str(seg), restart=0, rollouts_at_end=end, reason="walltime", detail="",
                next_action="resubmit", next_job_id=str(seg + 1), rollout_s=1.0, save_s=1.0))
    dirs = tracking.fragment_dirs(run)
    assert len(dirs) == 3 and all(d.name.startswith("offline-run-") for d in dirs)  # the reference: one writer
    rid = tracking.existing_run_id(run)
    records = [r for d in dirs for r in tracking.read_records(tracking.transaction_log(d))]
    assert {r["run"]["run_id"] for r in records if r.get("type") == "run"} == {rid}  # one W&B run
    rows = [h for d in dirs for h in tracking.history(tracking.transaction_log(d))]
    rollouts = [(h[ROLLOUT_STEP], h["rollout/raw_reward"]) for h in rows if "rollout/raw_reward" in h]
    # every rollout once, in order; a re-done rollout keeps what its first segment logged
    assert [s for s, _ in rollouts] == list(range(10))
    assert [v for _, v in rollouts] == [100 * (1 if k < 5 else 2 if k < 8 else 3) + k for k in range(10)]
    evals = [(h[EVAL_STEP], h["eval/tiny-add"]) for h in rows if "eval/tiny-add" in h]
    assert evals == [(0, 100 * 0 + 0.0), (3, 103), (6, 206), (9, 309)]
    assert [h[ROLLOUT_STEP] for h in rows if "perf/save_time" in h] == [1, 3, 5, 7, 9]
    assert all(EVAL_STEP not in h or "rollout/raw_reward" not in h for h in rows)
    # TensorBoard stays as it is: every scalar, re-done rollouts included
    assert len((run / "dumps" / "metrics.jsonl").read_text().splitlines()) == 9 + 9 + 7

    segs, _ = ledger.read_ledger(run / "ledger.jsonl")
    assert tracking.summary(run, [r["segment"] for r in segs])["unsynced"] == ["1-0", "2-0", "3-0"]
    # what would be uploaded, said by the real `wandb sync --dry-run` (no server, no key): the two
    # ended segments' fragments in one call; the running third segment's fragment (whose driver has
    # written its exit record: the ledger decides, not the file) is left
    out = subprocess.run([sys.executable, "-m", "beam_hpc.cli.app", "sync", "--dry-run", str(run)], env=env,
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr
    assert "Would sync 2 run(s)" in out.stdout, out.stdout
    assert wandb_listing(out.stdout) == [f"{d.name}/run-{rid}.wandb" for d in dirs[:2]]
    assert f"left {dirs[2].name}: segment 3-0 is still running" in out.stdout
    assert not (run / "wandb" / "synced.json").exists()  # a dry run records nothing

    # the upload itself, by the real `wandb sync`, to a local endpoint that records what W&B would get
    with recording_wandb_server() as (server_env, got):
        sync = [sys.executable, "-m", "beam_hpc.cli.app", "sync", str(run)]
        out = subprocess.run(sync, env={**env, **server_env}, capture_output=True, text=True, timeout=240)
        assert out.returncode == 0, out.stderr
        rows = [(h["rollout/step"], h["rollout/raw_reward"]) for h in got.history() if "rollout/raw_reward" in h]
        assert rows == [(k, 100 * (1 if k < 5 else 2) + k) for k in range(8)]  # segments 1 and 2, in order
        assert got.exit_codes() == [0, 0] and {path for path, _ in got.streams} == {f"e/beam-test/{rid}"}
        assert summary_of(run)["unsynced"] == ["3-0"]
        again = subprocess.run(sync, env={**env, **server_env}, capture_output=True, text=True, timeout=240)
        assert again.returncode == 0 and "nothing to sync" not in again.stdout  # segment 3 is left
        assert got.exit_codes() == [0, 0]  # nothing uploaded twice
        ledger.append(run / "ledger.jsonl", ledger.end_record(
            job_id="3", restart=0, rollouts_at_end=10, reason="completed", detail="", next_action="none",
            next_job_id=None, rollout_s=1.0, save_s=1.0))
        out = subprocess.run(sync, env={**env, **server_env}, capture_output=True, text=True, timeout=240)
        assert out.returncode == 0, out.stderr
        rows = [h["rollout/step"] for h in got.history() if "rollout/raw_reward" in h]
        assert rows == list(range(10)) and got.exit_codes() == [0, 0, 0]
    assert summary_of(run)["unsynced"] == [] and all((d / f"run-{rid}.wandb.synced").exists() for d in dirs)


MILES_INIT = textwrap.dedent("""
    import argparse, sys
    import wandb
    from miles.utils.tracking_utils.wandb_utils import init_wandb_primary
    args = argparse.Namespace(use_wandb=True, wandb_mode="offline", wandb_key=None, wandb_host=None,
                              wandb_random_suffix=False, wandb_group="tiny", rank=0, wandb_team=None,
                              wandb_project="beam-test", env_report=None, wandb_dir=sys.argv[1])
    init_wandb_primary(args)
    print("RUN", wandb.run.id, wandb.run.group)
    wandb.finish()
""")


@pytest.mark.slow  # imports Miles and wandb in two processes: ~20 s on 2 cores
def test_miles_own_init_takes_the_runs_id_from_the_launcher(tmp_path: Path) -> None:
    """miles-rl's init_wandb_primary (no id, no resume in its wandb.init) with the environment the
    launcher gives it: two segments, one W&B run, the group without a random suffix."""
    require_wandb()
    from real_miles import require_miles

    from beam_hpc.backends.miles.launch import wandb_environment

    require_miles()
    assert wandb_environment(tmp_path, {}) == {}
    env = {**os.environ, "WANDB_SILENT": "true", "WANDB_RESUME": "allow"}
    seen = []
    for _ in range(2):
        launch_env = {**env, **wandb_environment(tmp_path, env)}
        out = subprocess.run([sys.executable, "-c", MILES_INIT, str(tmp_path / "wandb")], env=launch_env,
                             capture_output=True, text=True, timeout=240, check=True).stdout
        seen.append(next(line for line in out.splitlines() if line.startswith("RUN ")))
    assert seen == [f"RUN {tracking.existing_run_id(tmp_path)} tiny"] * 2
    assert len(tracking.fragment_dirs(tmp_path)) == 2


def test_sync_refuses_a_run_without_wandb(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sync", str(tmp_path)]) == 2
    assert "has no W&B files" in capsys.readouterr().err


# -- Miles's writers: the stand-in's primary and two secondaries, the real wandb offline ----------------

STANDIN = ROOT / "tests" / "support" / "standins" / "miles_standin"


def miles_segment_argv(run: Path, num_rollout: int) -> tuple[list[str], dict[str, str]]:
    """The Miles flags and driver environment beam-hpc builds for the seed's dedicated recipe with W&B
    offline, placeholders filled, minus the checkpoint and TensorBoard flags (this test is about W&B),
    and the environment the launcher adds (``WANDB_RUN_ID``: beam_hpc.backends.miles.launch)."""
    from beam_hpc.backends.miles.launch import wandb_environment

    cmd = driver_command(load_recipe(DEDICATED, ["tracking.wandb.project=beam-test", "tracking.wandb.mode=offline"]),
                         SITE)
    flags = list(cmd.argv[cmd.argv.index("train_async.py") + 1:])
    for flag in ("--save", "--load", "--save-trigger-sentinel"):
        i = flags.index(flag)
        del flags[i:i + 2]
    flags.remove("--use-tensorboard")
    flags = [f.replace("{run_dir}", str(run)).replace("{num_rollout}", str(num_rollout)) for f in flags]
    env = {k: v.replace("{run_dir}", str(run)) for k, v in cmd.env.items() if k.startswith("WANDB_")}
    return flags, {**env, **wandb_environment(run, env)}


@pytest.mark.slow  # two stand-in segments, three wandb processes each: ~40 s on 2 busy cores
def test_miles_writes_three_fragments_a_segment_and_sync_takes_only_ended_segments(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Miles stand-in's driver (primary) and its trainer and rollout-manager processes
    (secondaries) each write a fragment of the run's one W&B id in every segment; the secondaries,
    killed as Ray ends actors, leave no exit record. `beam-hpc sync` uploads, with the real `wandb
    sync`, the ended segment's three fragments and none of the open one's, the primary last; status
    counts two segments."""
    require_wandb()
    from beam_hpc.run import ledger

    run = tmp_path / "run"
    env = {**os.environ, "WANDB_SILENT": "true", "PYTHONPATH": f"{STANDIN}{os.pathsep}{ROOT}",
           "BEAM_STANDIN_ROLLOUT_S": "0.1",
           # wandb writes an offline log every 15 s; a segment here lasts less, so the secondaries'
           # logs would hold their header only when killed. A short interval stands for a long segment
           "WANDB__TRANSACTION_LOG_FLUSH_INTERVAL": "0.2"}
    env.pop("WANDB_API_KEY", None)
    for seg, num_rollout in ((1, 2), (2, 4)):
        flags, wandb_env = miles_segment_argv(run, num_rollout)
        ledger.append(run / "ledger.jsonl", ledger.start_record(
            job_id=str(seg), restart=0, host="n", rollouts_at_start=0, num_rollout=num_rollout, resume=seg > 1,
            walltime_s=600, lead_s=60))
        subprocess.run([sys.executable, str(STANDIN / "train_async.py"), *flags], env={**env, **wandb_env},
                       check=True, timeout=300)
        if seg == 1:  # the second segment has no end line: it is still running
            ledger.append(run / "ledger.jsonl", ledger.end_record(
                job_id="1", restart=0, rollouts_at_end=2, reason="walltime", detail="", next_action="resubmit",
                next_job_id="2", rollout_s=0.1, save_s=None))
    rid = tracking.existing_run_id(run)
    dirs = tracking.fragment_dirs(run)
    assert len(dirs) == 6 and all(d.name.startswith("offline-run-") and rid in d.name for d in dirs), dirs
    segs, _ = ledger.read_ledger(run / "ledger.jsonl")
    assert tracking.summary(run, [r["segment"] for r in segs])["segments"] == 2  # not 6
    # uploaded for real (as `beam-hpc sync RUN` does) to a local endpoint that records what W&B would
    # get: one replay per fragment, each a resumption of the one run. A fragment without an exit
    # record ends its replay with exit code 1 (wandb-core runreader.go sendExitIfNotSeen), so the
    # secondaries' are sent first and the primary's last: the run ends as the driver did
    with recording_wandb_server() as (server_env, got):
        for k, v in server_env.items():
            monkeypatch.setenv(k, v)
        plan = tracking.sync(run, segs, echo=lambda line: None)
        ended = plan.upload["1-0"]
        assert list(plan.upload) == ["1-0"] and [f.run_id for f in ended] == [rid] * 3  # three writers, one run
        # the primary finished (an exit record), the two secondaries were killed (none)
        assert sorted((f.primary, f.exited) for f in ended) == [(False, False), (False, False), (True, True)]
        assert [why for _, why in plan.later] == ["segment 2-0 is still running"] * 3 and plan.no_record == []
        assert {path for path, _ in got.streams} == {f"e/beam-test/{rid}"} and got.operations.count("UpsertBucket") >= 3
        assert got.exit_codes() == [1, 1, 0]
        assert all((f.path / f"run-{rid}.wandb.synced").exists() for f in ended)
        assert summary_of(run)["unsynced"] == ["2-0"]


def _standin_wandb():
    spec = importlib.util.spec_from_file_location("standin_wandb", STANDIN / "standin_wandb.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("mode", ["offline", "online"])
def test_the_standin_inits_wandb_as_miles_does(mode: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """miles-rl's own init_wandb_primary and init_wandb_secondary, given the flags beam-hpc emits,
    and the stand-in's inits pass wandb.init the same arguments and settings. Online that is W&B's
    shared mode: the primary (x_primary) owns the run's state, and no secondary marks it finished
    (x_update_finish_state=False)."""
    require_wandb()
    from real_miles import require_miles

    require_miles()
    import wandb
    from miles.utils.tracking_utils import wandb_utils

    calls: list[dict] = []
    monkeypatch.setattr(wandb, "init", lambda **kw: calls.append(kw))
    monkeypatch.setattr(wandb, "define_metric", lambda *a, **kw: None)
    monkeypatch.setattr(wandb, "login", lambda **kw: None)
    monkeypatch.setattr(wandb, "run", argparse.Namespace(id="beam-0123456789ab"))
    monkeypatch.setenv("WANDB_MODE", mode)  # Miles's inits set it; the monkeypatch undoes it
    flags, _ = miles_segment_argv(tmp_path / "run", 1)
    flags[flags.index("--wandb-mode") + 1] = mode
    standin = _standin_wandb()
    ours = standin.parse(flags)
    miles_args = argparse.Namespace(**vars(ours), env_report=None)
    wandb_utils.init_wandb_primary(miles_args)
    wandb_utils.init_wandb_secondary(miles_args)
    ours.wandb_run_id = miles_args.wandb_run_id
    miles_primary, miles_secondary = calls
    for theirs, mine in ((miles_primary, standin.primary_init_kwargs(ours)),
                         (miles_secondary, standin.secondary_init_kwargs(ours))):
        assert set(theirs) == set(mine)
        assert {k: v for k, v in theirs.items() if k not in ("settings", "config")} == \
            {k: v for k, v in mine.items() if k not in ("settings", "config")}
        for field in ("mode", "x_primary", "x_update_finish_state"):
            assert getattr(theirs["settings"], field) == getattr(mine["settings"], field), field
    assert miles_secondary["id"] == "beam-0123456789ab" and miles_secondary["resume"] == "allow"
    assert miles_secondary["reinit"] is True and miles_primary["dir"] == miles_secondary["dir"]
    primary, secondary = miles_primary["settings"], miles_secondary["settings"]
    if mode == "online":
        assert (primary.mode, primary.x_primary, primary.x_update_finish_state) == ("shared", True, True)
        assert (secondary.mode, secondary.x_primary, secondary.x_update_finish_state) == ("shared", False, False)
    else:
        assert primary.mode == secondary.mode == "offline"
