"""What Miles writes is what beam-hpc reads: status, plot and the lifecycle on miles-rl's own logging.

miles-rl 0.0.2's logging code (tests/support/builders/miles/miles_logging.py: ``_log_rollout_data``,
``_log_eval_rollout_data``, the trainer's ``log_rollout_data``, ``log_perf_data_raw``, Miles's
TensorBoard tracking) runs on real ``Sample`` objects, scored by beam-hpc's Miles reward function,
into a run directory's ``tensorboard/``, as in a Miles segment that ran three rollouts, saved once,
and then failed, and a later segment (a process of its own) that ran one more rollout and failed
before its next save. Each segment's own end-of-segment code (``Segment._finish``: segment_metrics,
decide, the ledger's end line) and `status` / `plot` read it; the tests check what the segments
decided from their ledger end lines. The Miles stand-in double's names are checked against the same
code, and a run directory from before the rename (old tags) still reads and plots.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from real_miles import require_miles

from beam_hpc.backends.registry import plan_for
from beam_hpc.job.segment import Segment
from beam_hpc.lifecycle.segment_metrics import metrics_offset, segment_metrics
from beam_hpc.observe.plot import plot_run
from beam_hpc.observe.status import gather
from beam_hpc.observe.status_table import format_status
from beam_hpc.plan.paths import RunPaths
from beam_hpc.run import checkpoint_layout, ledger, metric_names
from beam_hpc.run.scalars import read_scalars
from beam_hpc.submission.submit import build_recipe, build_site

ROOT = Path(__file__).resolve().parents[3]
# eval (response, label) pairs: right, wrong, a fraction against a decimal, no answer at all, and a
# pair the two checkers judge differently (beam-hpc evaluates the power; Miles's checker does not)
EVAL = [("\\boxed{34}", "34"), ("\\boxed{35}", "34"), ("\\boxed{\\frac{1}{2}}", "0.5"), ("no box", "7"),
        ("\\boxed{2^{10}}", "1024")]
# Pinned verdicts on EVAL: beam-hpc's checker, and Miles's (each established once by running miles-rl
# 0.0.2's grade_answer_verl on the pair; the same pairs are pinned in test_miles_reward.py's table)
EVAL_ACC = [1.0, 0.0, 1.0, 0.0, 1.0]  # 3 of 5
EVAL_MILES = ["correct", "wrong", "correct", "wrong", "wrong"]  # 2 of 5
EVAL_LENGTHS = [100, 200, 300, 400, 500]

# A later segment of the run, in a process of its own as every segment is (outside Slurm its id is
# l<pid>): its pre-run checks and start line (Segment._prepare, resuming from the checkpoint), its
# metrics mark, then, once the test has logged its rollout as Miles and the driver "failed", its end.
LATER_SEGMENT = """
import sys
from beam_hpc.job.segment import Segment
from beam_hpc.lifecycle.segment_metrics import metrics_offset
seg = Segment(sys.argv[1], resume=True, env={})
assert seg._prepare() is None
seg.metrics_offset = metrics_offset(seg.paths)
print("started", flush=True)
sys.stdin.readline()
sys.exit(seg._finish("error", "driver exited with 1"))
"""


def _scored(responses: list[tuple[str, str]], lengths: list[int], monkeypatch: pytest.MonkeyPatch, args):  # type: ignore[no-untyped-def]
    """Real Miles samples, scored by beam-hpc's --custom-rm-path function as Miles calls it."""
    from miles.utils.types import Sample

    from beam_hpc.backends.miles import args as miles_cmd
    from beam_hpc.backends.miles.reward import reward

    monkeypatch.setenv(miles_cmd.ENV_OVERLONG_BUFFER, "16")
    samples = [Sample(prompt="p", response=r, label=lab, response_length=n, status=Sample.Status.COMPLETED)
               for (r, lab), n in zip(responses, lengths, strict=True)]
    for s in samples:
        s.reward = asyncio.run(reward(args, s))
    return samples


def _one_process_group():  # type: ignore[no-untyped-def]
    """A one-rank gloo group for the trainer's logging (it gathers over the data-parallel group)."""
    import torch.distributed as dist
    from miles.backends.training_utils.parallel import GroupInfo, ParallelState, set_parallel_state

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    g = GroupInfo(rank=0, size=1, group=dist.group.WORLD, gloo_group=dist.group.WORLD)
    set_parallel_state(ParallelState(intra_dp=g, intra_dp_cp=g, cp=g, tp=g, pp=g, ep=g, etp=g))
    return dist


@pytest.fixture(scope="module")
def miles_segment(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A Miles segment as Miles logs it: rollouts 0-2 (a save after rollout 1, evals after 1 and
    2), then its driver fails. The ledger's start line is written as Segment.run writes it (the
    segment's id is ``l<pid>`` outside Slurm); the end line by the segment's own ``_finish``.
    ``status`` is what `beam-hpc status` showed then. Then a later segment (LATER_SEGMENT) resumes
    from the checkpoint, runs rollout 2 again and fails before it saves."""
    require_miles()
    from miles.backends.training_utils.log_utils import log_rollout_data
    from miles.utils.timer import Timer
    from miles.utils.train_metric_utils import log_perf_data_raw
    from miles_logging import miles_args, rollout_logging, start_tensorboard

    mp = pytest.MonkeyPatch()
    run = tmp_path_factory.mktemp("miles-run") / "run"
    recipe = build_recipe(str(ROOT / "recipes" / "tiny.yaml"), output_dir=str(run), base_dir=run, num_rollout=10)
    plan = plan_for(recipe, build_site("local", search_dir=ROOT / "env"))
    plan.write()
    paths = plan.paths
    args = miles_args(rollout_max_response_len=64)
    start_tensorboard(args, paths.tensorboard)
    fns = rollout_logging()
    ledger.append(paths.ledger, ledger.start_record(job_id=f"l{os.getpid()}", restart=0, host="h", rollouts_at_start=0,
                                                    num_rollout=10, resume=False, walltime_s=600, lead_s=60))
    mark = metrics_offset(paths)
    dist = _one_process_group()
    timer = Timer()
    try:
        for k in range(3):
            train = _scored([("\\boxed{2}", "2"), ("\\boxed{3}", "2")], [10 + k, 40 + k], mp, args)
            fns["_log_rollout_data"](k, args, train, None, 2.0)
            log_rollout_data(k, args, {"raw_reward": [s.get_reward_value(args) for s in train],
                                       "response_lengths": [s.response_length for s in train],
                                       "loss_masks": [], "total_lengths": [s.response_length + 5 for s in train]})
            timer.add("train_wait", 2.0)
            timer.add("train", 1.0 + k)
            log_perf_data_raw(k, args, True, None)  # resets the timer, as after each step's training
            if k >= 1:  # eval on W_(k+1), logged at step k as Miles's train loop does
                ev = _scored(EVAL, EVAL_LENGTHS, mp, args)
                fns["_log_eval_rollout_data"](k, args, {"aime25": {"rewards": [s.reward["acc"] for s in ev],
                                                                   "samples": ev}}, None)
            if k == 1:  # Megatron's save, timed by Miles's @timer on save_model; tracker written last
                checkpoint_layout.iteration_dir(paths.checkpoints, 1).mkdir(parents=True)
                checkpoint_layout.write_atomic(checkpoint_layout.dataset_state_path(paths.checkpoints, 1), b"x")
                checkpoint_layout.mark_latest(paths.checkpoints, 1)
                timer.add("save_model", 0.75)
        _flush_miles()
        # the driver fails here: the segment's own end-of-segment code reads what Miles wrote, decides,
        # and writes its ledger line (outside Slurm, so a resubmission is only decided, not sent)
        seg = Segment(paths.plan, env={})
        seg.metrics_offset = mark
        seg._finish("error", "driver exited with 1")
        m = segment_metrics(paths, mark)
        done = checkpoint_layout.rollouts_done(paths.checkpoints)
        status = gather(run, slurm=False)
        later = subprocess.Popen([sys.executable, "-c", LATER_SEGMENT, paths.plan], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)
        try:
            assert later.stdout is not None and later.stdout.readline() == "started\n", "the later segment did not start"
            train = _scored([("\\boxed{2}", "2"), ("\\boxed{3}", "2")], [12, 42], mp, args)  # rollout 2 again
            fns["_log_rollout_data"](2, args, train, None, 2.0)
            timer.add("train_wait", 2.0)
            timer.add("train", 3.0)
            log_perf_data_raw(2, args, True, None)
            _flush_miles()
        finally:
            later.communicate("the driver exited with 1\n", timeout=60)  # no save: the driver failed first
    finally:
        dist.destroy_process_group()
        mp.undo()
    return {"run": run, "metrics": m, "done": done, "status": status, "later_exit": later.returncode,
            "truth_acc": [s.reward["acc"] for s in ev],
            "truth_miles": [s.reward[metric_names.MILES_CHECK_KEY] for s in ev]}


def _flush_miles() -> None:
    """Flush Miles's TensorBoard writer (finish_tracking would close it)."""
    from miles.utils.tracking_utils import _manager

    for backend in _manager._backends:
        backend._adapter._writer.flush()


@pytest.mark.slow  # imports Miles's logging, torch.distributed and sympy: ~15 s on a loaded 2-core machine
def test_the_lifecycle_reads_what_miles_wrote_of_a_failed_segment(miles_segment: dict) -> None:
    m = miles_segment["metrics"]
    # three steps ran (perf/step_time = train_wait + train: 3, 4, 5 s); the save's 0.75 s came with step 2
    assert (m.rollouts_run, m.rollout_s, m.save_s) == (3, pytest.approx(4.0), pytest.approx(0.75))
    assert miles_segment["done"] == 2
    (seg, later), warnings = ledger.read_ledger(RunPaths(str(miles_segment["run"])).ledger)
    assert not warnings and seg["end"]["rollouts_run"] == 3 and seg["end"]["reason"] == "error"
    assert seg["end"]["rollouts_at_end"] == 2 and "error after 2 new rollouts" in seg["end"]["detail"], seg["end"]
    # what the segment decided: go on from the new checkpoint (outside Slurm nothing is sent)
    assert seg["end"]["detail"].startswith("driver exited with 1 -> error after 2 new rollouts; continuing with "
                                           "--resume"), seg["end"]["detail"]
    assert seg["end"]["timings"] == {"rollout_s": pytest.approx(4.0), "save_s": pytest.approx(0.75)}
    # the later segment ran rollout 2 again but never saved: a failure after rollouts without a new
    # checkpoint, retried once (not "before its first rollout": Miles's step time counted the rollout)
    assert miles_segment["later_exit"] == 1 and later["segment"] != seg["segment"]
    assert (later["start"]["rollouts_at_start"], later["start"]["resume"]) == (2, True), later["start"]
    assert (later["end"]["reason"], later["end"]["rollouts_run"], later["end"]["rollouts_at_end"]) == ("error", 1, 2)
    assert later["end"]["detail"].startswith("driver exited with 1 -> error without a new checkpoint; retrying once"), \
        later["end"]["detail"]
    status = miles_segment["status"]  # as `beam-hpc status` showed the run after its first segment
    (row,) = status["segments"]
    assert (row["reason"], row["rollouts_run"], row["rollouts_at_end"]) == ("error", 3, 2)
    assert status["rollouts"]["generated"] == 3 and status["eta"]["s_per_rollout_step"] == pytest.approx(4.0)
    assert "0->2 (3 run)" in format_status(status)
    # the next segment's walltime lead is sized from these measurements
    assert ledger.measured_timings([seg]) == {"rollout_s": pytest.approx(4.0), "save_s": pytest.approx(0.75)}
    # GPU-hour accounting (the tiny plan holds no GPU, so in seconds): the rollout run after the last
    # checkpoint (3 run, 2 kept) is lost as re-done work
    from beam_hpc.run.accounting import REDONE, segment_time

    assert segment_time(seg, next_start=None, now=seg["end"]["time"]).lost_s[REDONE] > 0


@pytest.mark.slow  # imports Miles's logging, torch.distributed and sympy: ~15 s on a loaded 2-core machine
def test_status_and_plot_show_what_miles_logged(miles_segment: dict, tmp_path: Path) -> None:
    run = miles_segment["run"]
    sc = read_scalars(run)
    assert sc.source == "tensorboard"
    # the names beam-hpc reads are among those Miles wrote
    for tag in (metric_names.ROLLOUT_REWARD, metric_names.ROLLOUT_RESPONSE_LEN, metric_names.ROLLOUT_TIME,
                metric_names.TRAIN_TIME, metric_names.SAVE_TIME, metric_names.eval_accuracy_tag("aime25"),
                metric_names.eval_response_len_tag("aime25")):
        assert tag in sc.series, (tag, sorted(sc.series))
    status = miles_segment["status"]  # as `beam-hpc status` showed the run after its first segment
    ev = status["eval"]
    # the reward function gave the pinned verdicts, and status shows their means (3 of 5, 2 of 5)
    assert miles_segment["truth_acc"] == EVAL_ACC and miles_segment["truth_miles"] == EVAL_MILES
    assert ev["name"] == "aime25" and ev["rollout"] == 2
    assert ev["accuracy"] == pytest.approx(0.6)
    assert ev["response_len"] == pytest.approx(300.0)
    assert ev["miles_checker"]["state"] == "measured"
    assert ev["miles_checker"]["accuracy"] == pytest.approx(0.4)
    # rewards as the reward function returned them: +1 and -1 (no penalty at these lengths)
    assert status["reward"]["value"] == pytest.approx(0.0) and status["reward"]["rollout"] == 2
    assert status["reward"]["response_len"] == pytest.approx((12 + 42) / 2)  # rollout 2's two responses
    text = format_status(status)
    assert "(beam-hpc checker)" in text and "(Miles checker)" in text
    result = plot_run(run, tmp_path / "plots")
    assert sorted(p.name for p in result.written) == ["aime25_accuracy.png", "aime25_response_length.png",
                                                      "reward.png"], result.skipped



def _standin_tags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> set[str]:
    spec = importlib.util.spec_from_file_location("standin_driver", ROOT / "tests/support/standins/miles_standin/standin_driver.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    monkeypatch.setenv("TENSORBOARD_DIR", str(tmp_path / "tensorboard"))
    args = mod.parse(["--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1", "--dump-details", str(tmp_path),
                      "--use-tensorboard", "--eval-interval", "1", "--eval-prompt-data", "aime25", "x.jsonl",
                      "--log-reward-category", "miles_math"])
    metrics = mod.Metrics(args)
    metrics.rollout(0, 1.0)
    metrics.saved(0.5)
    metrics.rollout(1, 1.0)
    metrics.writer.close()
    return set(read_scalars(tmp_path).series)


@pytest.mark.slow  # imports Miles's logging, torch.distributed and sympy: ~15 s on a loaded 2-core machine
def test_the_standin_writes_names_miles_writes(miles_segment: dict, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    miles_tags = set(read_scalars(miles_segment["run"]).series)
    standin = _standin_tags(tmp_path, monkeypatch)
    assert standin <= miles_tags, sorted(standin - miles_tags)
    read = {metric_names.ROLLOUT_REWARD, metric_names.ROLLOUT_RESPONSE_LEN, metric_names.ROLLOUT_TIME,
            metric_names.SAVE_TIME, metric_names.eval_accuracy_tag("aime25"),
            metric_names.eval_response_len_tag("aime25"),
            metric_names.eval_miles_verdict_tag("aime25", metric_names.MILES_CORRECT)}
    assert read <= standin, sorted(read - standin)


def test_a_run_directory_with_the_old_tags_still_reads_and_plots(tmp_path: Path) -> None:
    """Written as beam-hpc wrote dumps/metrics.jsonl before it took Miles's names."""
    run = tmp_path / "old"
    (run / "dumps").mkdir(parents=True)
    lines = []
    for r in range(3):
        lines.append({"kind": "rollout", "rollout_id": r, "rollout/reward": 0.1 * r, "rollout/response_len": 50.0 + r,
                      "perf/rollout_time_s": 2.0, "perf/train_time_s": 1.0})
        lines.append({"kind": "eval", "rollout_id": r, "eval/tiny-add": 0.25 * r, "eval/tiny-add_response_len": 9.0})
    lines.append({"kind": "save", "rollout_id": 2, "perf/save_time_s": 0.5})
    (run / "dumps" / metric_names.METRICS_FILE).write_text("".join(json.dumps(x) + "\n" for x in lines))
    ledger.append(str(run / "ledger.jsonl"), ledger.start_record(job_id="1", restart=0, host="h", rollouts_at_start=0,
                                                                  num_rollout=3, resume=False, walltime_s=600, lead_s=60))
    status = gather(run, slurm=False)
    assert status["eval"]["name"] == "tiny-add" and status["eval"]["accuracy"] == pytest.approx(0.5)
    assert status["eval"]["response_len"] == pytest.approx(9.0)
    assert status["eval"]["miles_checker"]["state"] == "not recorded"
    assert status["reward"]["value"] == pytest.approx(0.2) and status["eta"]["s_per_rollout_step"] == 2.0
    result = plot_run(run)
    assert sorted(p.name for p in result.written) == ["reward.png", "tiny-add_accuracy.png",
                                                      "tiny-add_response_length.png"], result.skipped
    assert result.written[0].parent == run / "plots"


def test_without_miles_the_checker_says_unavailable_and_status_shows_it(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The boundary: where Miles cannot be imported (a laptop running the reference backend), the
    verdict is "unavailable", logged as such, and status shows the word, not a number."""
    from beam_hpc.reward import miles_check

    monkeypatch.setitem(sys.modules, "miles.rollout.rm_hub.math_utils", None)  # import fails as without miles
    miles_check._checker.cache_clear()
    try:
        assert not miles_check.miles_available()
        verdicts = [miles_check.miles_verdict("\\boxed{2}", "2")] * 2
    finally:
        miles_check._checker.cache_clear()
    assert verdicts == [metric_names.MILES_UNAVAILABLE] * 2
    run = tmp_path / "run"
    (run / "dumps").mkdir(parents=True)
    values = {metric_names.eval_accuracy_tag("tiny-add"): 1.0, metric_names.eval_response_len_tag("tiny-add"): 9.0,
              **{metric_names.eval_miles_verdict_tag("tiny-add", v): f
                 for v, f in miles_check.verdict_fractions(verdicts).items()}}
    (run / "dumps" / metric_names.METRICS_FILE).write_text(json.dumps({"rollout_id": 0, "time": 1.0, **values}) + "\n")
    ledger.append(str(run / "ledger.jsonl"), ledger.start_record(job_id="1", restart=0, host="h", rollouts_at_start=0,
                                                                  num_rollout=3, resume=False, walltime_s=600, lead_s=60))
    status = gather(run, slurm=False)
    assert status["eval"]["accuracy"] == 1.0 and status["eval"]["miles_checker"]["state"] == "unavailable"
    assert "unavailable (Miles checker)" in format_status(status)
