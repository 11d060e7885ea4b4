"""Every bad input gets one clear line and exit 2; a damaged run directory is reported, never a
traceback, and a refused command changes nothing (issue 14, items 1, 4 and 5).

Table-driven. Each case builds a small run directory in ``tmp_path`` with the real writers
(``Plan.write``, ``beam_hpc.run.ledger.append``, ``beam_hpc.run.checkpoint_layout``,
``beam_hpc.run.identity.record_identity``), damages it, runs the real CLI entry point in process
(``beam_hpc.cli.app.main``) and asserts: the exit code, no traceback, the named file, field or flag
in the message, and the run directory unchanged (a sha256 over every path and file content before
and after). The kinds: damaged ledger lines (skipped with a warning naming file and line), damaged
plan.json / checkpoint pointer / identity record (exit 2 naming the file and the repair), resume
rules refused by ``submit --dry-run`` and ``execute --resume`` before anything is written, wrong
paths for status, plot, logs, cancel, image and prepare, argparse misuse, overrides and recipe
files (more of those in tests/config/test_config_input.py); plus valid controls.

Fast: no Slurm and no Ray. ``submit`` runs with ``--dry-run``, or ``--via sbatch`` with an
``sbatch`` on PATH that records being called (the test then fails: nothing may be submitted);
``execute`` has its segment and data preparation replaced by functions that fail the case.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from beam_hpc.backends.registry import plan_for
from beam_hpc.cli.app import main
from beam_hpc.run import checkpoint_layout, ledger, metric_names
from beam_hpc.run.identity import record_identity
from beam_hpc.submission.submit import build_recipe, build_site

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "recipes" / "tiny.yaml")
LOCAL_SITE = str(ROOT / "env" / "local.yaml")
DONE = 4  # rollouts covered by the built run's checkpoint (iteration 3)
POINTER = checkpoint_layout.LATEST_FILE


# -- a run directory, written by the real writers ------------------------------------------------------
def _recipe_args(tmp: Path) -> list[str]:
    return ["--site", LOCAL_SITE, "--output-dir", str(tmp / "run"),
            "--set", f"data.dir={tmp / 'data'}", "--set", f"model.path={tmp / 'data' / 'model'}"]


def build_run(tmp: Path) -> Path:
    """Two segments, a checkpoint of rollout 3 with its manifest and dataset state, the identity
    record, metrics, and log directories of a Slurm and of a local (`execute`) segment."""
    data = tmp / "data"
    data.mkdir()
    run = tmp / "run"
    recipe = build_recipe(TINY, overrides=[f"data.dir={data}", f"model.path={data / 'model'}"], output_dir=str(run))
    for path in (recipe.data.train_path(), recipe.data.eval_path()):  # the files the tiny recipe names
        Path(path).write_text("{}\n")
    plan = plan_for(recipe, build_site(LOCAL_SITE))
    plan.write()
    for job, restart, at, end in (("100", 0, 0, 2), ("101", 0, 2, DONE)):
        ledger.append(plan.paths.ledger, ledger.start_record(
            job_id=job, restart=restart, host="n1", rollouts_at_start=at, num_rollout=20, resume=at > 0,
            walltime_s=1800, lead_s=60, now=1000.0 + 100 * at))
        ledger.append(plan.paths.ledger, ledger.end_record(
            job_id=job, restart=restart, rollouts_at_end=end, reason="walltime", detail="", next_action="resubmit",
            next_job_id=str(int(job) + 1), rollout_s=10.0, save_s=1.0, now=1000.0 + 100 * end))
    ckpt = Path(plan.paths.checkpoints)
    it = checkpoint_layout.iteration_dir(ckpt, DONE - 1)
    it.mkdir(parents=True)
    (it / "model.pt").write_bytes(b"weights" * 100)
    manifest = {f.name: [f.stat().st_size, hashlib.sha256(f.read_bytes()).hexdigest()] for f in it.iterdir()}
    checkpoint_layout.write_atomic(it / "manifest.json", json.dumps(manifest))
    state = checkpoint_layout.dataset_state_path(ckpt, DONE - 1)
    state.parent.mkdir(parents=True)
    state.write_bytes(b"cursor")
    checkpoint_layout.mark_latest(ckpt, DONE - 1)
    record_identity(plan.paths, recipe.identity(), "100-0", has_ckpt=False)
    dumps = Path(plan.paths.dumps)
    dumps.mkdir(parents=True)
    acc = metric_names.eval_accuracy_tag("tiny-add")
    with open(dumps / metric_names.METRICS_FILE, "w") as fh:
        for r in range(DONE):
            fh.write(json.dumps({"rollout_id": r, "time": 1000.0 + 100 * r, metric_names.ROLLOUT_REWARD: 0.1 * r,
                                 metric_names.ROLLOUT_TIME: 10.0, acc: 0.25 * r}) + "\n")
    for seg in ("100-0", "101-0", "l4242-0"):
        d = Path(plan.paths.logs) / seg
        d.mkdir(parents=True)
        (d / "driver.log").write_text(f"rollout 1 of {seg}\nrollout 2 of {seg}\n")
    os.utime(Path(plan.paths.logs) / "l4242-0" / "driver.log", (5e9, 5e9))
    return run


def tree_hash(root: Path) -> str:
    """sha256 over every path under ``root`` and every file's content (what "unchanged" means)."""
    h = hashlib.sha256()
    if not root.exists():
        return "absent"
    for p in sorted(root.rglob("*")):
        h.update(str(p.relative_to(root)).encode() + b"\0")
        h.update(p.read_bytes() if p.is_file() else b"<dir>")
    return h.hexdigest()


# -- damage --------------------------------------------------------------------------------------------
Damage = Callable[[Path], None]


def nothing(run: Path) -> None:
    pass


def ledger_line(line: str | bytes) -> Damage:
    """Insert ``line`` as line 3 of the ledger (between the two segments)."""
    def damage(run: Path) -> None:
        p = run / "ledger.jsonl"
        lines = p.read_bytes().splitlines(keepends=True)
        raw = line if isinstance(line, bytes) else line.encode()
        p.write_bytes(b"".join(lines[:2]) + raw + b"\n" + b"".join(lines[2:]))
    return damage


def start_with(**fields: object) -> str:
    rec = ledger.start_record(job_id="102", restart=0, host="n2", rollouts_at_start=DONE, num_rollout=20,
                              resume=True, walltime_s=1800, lead_s=60, now=2000.0)
    rec.update(fields)
    return json.dumps(rec)


def end_with(**fields: object) -> str:
    rec = ledger.end_record(job_id="100", restart=0, rollouts_at_end=2, reason="walltime", detail="",
                            next_action="resubmit", next_job_id="101", rollout_s=10.0, save_s=1.0, now=1200.0)
    rec.update(fields)
    return json.dumps(rec)


def write(rel: str, content: str | bytes) -> Damage:
    def damage(run: Path) -> None:
        p = run / rel
        if p.is_dir():
            import shutil

            shutil.rmtree(p)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(content if isinstance(content, bytes) else content.encode())
    return damage


def make_dir(rel: str) -> Damage:
    def damage(run: Path) -> None:
        p = run / rel
        p.unlink()
        p.mkdir()
    return damage


def remove(rel: str) -> Damage:
    def damage(run: Path) -> None:
        import shutil

        p = run / rel
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    return damage


def truncate(rel: str, keep: int) -> Damage:
    def damage(run: Path) -> None:
        p = run / rel
        p.write_bytes(p.read_bytes()[:keep])
    return damage


def plan_cut_short(run: Path) -> None:
    p = run / "plan.json"
    p.write_bytes(p.read_bytes()[: len(p.read_bytes()) // 2])


# -- the table -----------------------------------------------------------------------------------------
Argv = Callable[[Path, Path], list[str]]  # (run dir, tmp_path) -> argv


@dataclass
class Case:
    id: str
    argv: Argv
    code: int
    says: list[str]  # substrings of stderr (+ stdout for exit 0)
    damage: Damage = nothing
    one_line: bool = True  # exit 2: exactly one stderr line
    extra: list[str] = field(default_factory=list)  # substrings of stdout


def status(run: Path, tmp: Path) -> list[str]:
    return ["status", str(run), "--no-slurm"]


def status_json(run: Path, tmp: Path) -> list[str]:
    return ["status", str(run), "--no-slurm", "--json"]


def plot(run: Path, tmp: Path) -> list[str]:
    return ["plot", str(run), "-o", str(tmp / "plots")]


def logs(*extra: str) -> Argv:
    return lambda run, tmp: ["logs", str(run), *extra]


def cancel(run: Path, tmp: Path) -> list[str]:
    return ["cancel", str(run)]


def dry_resume(*extra: str) -> Argv:
    return lambda run, tmp: ["submit", TINY, *_recipe_args(tmp), "--dry-run", "--via", "sbatch", "--resume",
                             "--num-rollout", "20", *extra]


def sbatch_resume(*extra: str) -> Argv:
    return lambda run, tmp: ["submit", TINY, *_recipe_args(tmp), "--via", "sbatch", "--resume",
                             "--num-rollout", "20", *extra]


def execute_resume(*extra: str) -> Argv:
    return lambda run, tmp: ["execute", TINY, *_recipe_args(tmp), "--resume", "--quiet", "--num-rollout", "20", *extra]


def render(*extra: str) -> Argv:
    return lambda run, tmp: ["render", TINY, *_recipe_args(tmp), *extra]


def cli(*argv: str) -> Argv:
    return lambda run, tmp: [a.replace("{run}", str(run)).replace("{tmp}", str(tmp)) for a in argv]


LEDGER = "ledger.jsonl:3"
# Ledger lines whose field has the wrong type, or that are no record at all: skipped with a warning
# naming the file and line; status and plot still come out (exit 0).
BAD_LEDGER_LINES: list[tuple[str, str | bytes, str]] = [
    ("rollouts_at_start str", start_with(rollouts_at_start="x"), "rollouts_at_start"),
    ("time null", start_with(time=None), "'time'"),
    ("time str", start_with(time="yesterday"), "'time'"),
    ("time NaN", start_with(time=float("nan")), "'time'"),
    ("time Infinity", start_with(time=float("inf")), "'time'"),
    ("restart str", start_with(restart="0"), "'restart'"),
    ("restart bool", start_with(restart=True), "'restart'"),
    ("job_id int", start_with(job_id=102), "'job_id'"),
    ("segment int", start_with(segment=5), "'segment'"),
    ("segment null", start_with(segment=None), "'segment'"),
    ("event unknown", start_with(event="middle"), "unknown ledger event"),
    ("event missing", json.dumps({"segment": "102-0"}), "unknown ledger event"),
    ("num_rollout str", start_with(num_rollout="20"), "num_rollout"),
    ("num_rollout float", start_with(num_rollout=20.5), "num_rollout"),
    ("resume str", start_with(resume="yes"), "'resume'"),
    ("walltime_s str", start_with(walltime_s="1h"), "walltime_s"),
    ("lead_s null", start_with(lead_s=None), "lead_s"),
    ("host int", start_with(host=5), "'host'"),
    ("rollouts_at_end str", end_with(rollouts_at_end="2"), "rollouts_at_end"),
    ("reason int", end_with(reason=5), "'reason'"),
    ("next str", end_with(next="resubmit"), "'next'"),
    ("next.action int", end_with(next={"action": 5, "job_id": "101"}), "next: field 'action'"),
    ("next.job_id int", end_with(next={"action": "resubmit", "job_id": 101}), "next: field 'job_id'"),
    ("timings list", end_with(timings=[1, 2]), "'timings'"),
    ("timings.rollout_s str", end_with(timings={"rollout_s": "fast", "save_s": 1.0}), "rollout_s"),
    ("ready_s str", end_with(ready_s="x"), "ready_s"),
    ("rollouts_run str", end_with(rollouts_run="3"), "rollouts_run"),
    ("last_save_at dict", end_with(last_save_at={}), "last_save_at"),
    ("a list", "[1, 2]", "not a JSON object"),
    ("a string", '"start"', "not a JSON object"),
    ("a number", "42", "not a JSON object"),
    ("null", "null", "not a JSON object"),
    ("torn", '{"event": "end", "segm', "unreadable"),
    ("not UTF-8", b'{"event": "start", "segment": "\xff\xfe"', "unreadable"),
    ("deep nesting", "[" * 100000 + "]" * 100000, "unreadable"),
]

CASES: list[Case] = []
PLOTTED = ("rollouts_at_start str", "time null", "timings.rollout_s str", "torn")  # charts take ~1 s each
for name, line, says in BAD_LEDGER_LINES:
    CASES.append(Case(f"status ledger {name}", status, 0, [LEDGER, says], ledger_line(line)))
    # the resume estimate reads the same lines (measured timings, ready_s): no crash, nothing written
    CASES.append(Case(f"dry-run resume ledger {name}", dry_resume(), 0, ["dry run: nothing submitted"],
                      ledger_line(line)))
    if name in PLOTTED:
        CASES.append(Case(f"plot ledger {name}", plot, 0, [LEDGER, says], ledger_line(line)))

# plan.json damaged: exit 2 naming the file and the repair, for every reader of it.
BAD_PLANS: list[tuple[str, Damage, str]] = [
    ("a list", write("plan.json", "[1, 2]"), "not a plan"),
    ("a string", write("plan.json", '"plan"'), "not a plan"),
    ("null", write("plan.json", "null"), "not a plan"),
    ("cut short", plan_cut_short, "not valid JSON"),
    ("empty", write("plan.json", ""), "not valid JSON"),
    ("not UTF-8", write("plan.json", b'{"run_id": "\xff"}'), "not UTF-8"),
    ("recipe not a mapping", write("plan.json", '{"recipe": 5}'), "'recipe'"),
    ("a directory", make_dir("plan.json"), "is a directory"),
]
for name, dmg, says in BAD_PLANS:
    for cmd_name, argv in (("status", status), ("plot", plot), ("cancel", cancel)):
        CASES.append(Case(f"{cmd_name} plan.json {name}", argv, 2, ["plan.json", says, "restore it"], dmg))
    # every launch way answers a damaged run directory alike: exit 2 naming the file, nothing written
    for cmd_name, argv in (("submit --dry-run --resume", dry_resume()), ("submit --via sbatch --resume", sbatch_resume()),
                           ("execute --resume", execute_resume()),
                           ("execute", lambda run, tmp: ["execute", TINY, *_recipe_args(tmp), "--quiet"])):
        CASES.append(Case(f"{cmd_name} plan.json {name}", argv, 2, ["plan.json"], dmg))

# The checkpoint pointer is not a number: exit 2 naming it, wherever the run is read.
BAD_POINTERS: list[tuple[str, str | bytes]] = [
    ("letters", "abc\n"), ("empty", ""), ("negative", "-1\n"), ("decimal", "3.5\n"), ("superscript", "²\n"),
    ("not UTF-8", b"\xff\xfe"), ("two numbers", "3 4\n"), ("exponent", "1e3\n"),
]
for name, content in BAD_POINTERS:
    dmg = write(f"checkpoints/{POINTER}", content)
    for cmd_name, argv in (("status", status), ("dry-run resume", dry_resume()), ("execute resume", execute_resume())):
        CASES.append(Case(f"{cmd_name} pointer {name}", argv, 2, [POINTER, "checkpoint pointer is corrupt",
                                                                  "iter_0000003"], dmg))
CASES.append(Case("sbatch resume pointer letters", sbatch_resume(), 2, [POINTER, "corrupt"],
                  write(f"checkpoints/{POINTER}", "abc\n")))

# The resume rules: refused by the dry run as by the real submit and by execute, before any write.
IDENTITY = "checkpoints/run_identity.json"
for cmd_name, make in (("dry-run", dry_resume), ("sbatch", sbatch_resume), ("execute", execute_resume)):
    CASES += [
        Case(f"{cmd_name} resume num_rollout below done", lambda r, t, m=make: m()(r, t) + ["--num-rollout", "2"],
             2, ["num_rollout", f"{DONE} are already done"]),
        Case(f"{cmd_name} resume changed seed", make("--set", "seed=7"), 2, ["identity", "seed"]),
        Case(f"{cmd_name} resume changed model", make("--set", "model.path=/elsewhere/other-model"), 2, ["identity", "model.path"]),
        Case(f"{cmd_name} resume identity record corrupt", make(), 2, ["run_identity.json", "unreadable"],
             write(IDENTITY, "{not json")),
        Case(f"{cmd_name} resume identity record a list", make(), 2, ["run_identity.json", "unreadable"],
             write(IDENTITY, "[]")),
        Case(f"{cmd_name} resume dataset state missing", make(), 2, ["--resume", "dataset state"],
             remove(f"checkpoints/rollout/global_dataset_state_dict_{DONE - 1}.pt")),
        Case(f"{cmd_name} resume checkpoint dir missing", make(), 2, ["--resume", "iter_0000003", "missing"],
             remove("checkpoints/iter_0000003")),
    ]
# A damaged run.lock is nobody's lock: the resume rules still speak (here: too few rollouts).
for name, content in (("a list", "[1]"), ("garbage", "{lock"), ("job_id int", '{"job_id": 5, "host": "h", "pid": -1}')):
    for cmd_name, make in (("sbatch", sbatch_resume), ("execute", execute_resume)):
        CASES.append(Case(f"{cmd_name} resume run.lock {name}", make("--num-rollout", "2"), 2, ["num_rollout"],
                          write("run.lock", content)))
CASES += [
    Case("dry-run fresh onto checkpoints", lambda r, t: [a for a in dry_resume()(r, t) if a != "--resume"], 2,
         ["output_dir", "already holds checkpoints"]),
    Case("execute fresh onto checkpoints", lambda r, t: [a for a in execute_resume()(r, t) if a != "--resume"], 2,
         ["output_dir", "already holds checkpoints"]),
]

# Damage that status reports (exit 0) instead of hiding.
CASES += [
    Case("status truncated model file", status, 0, ["model.pt", "does not match its manifest"],
         truncate("checkpoints/iter_0000003/model.pt", 10)),
    Case("status missing model file", status, 0, ["model.pt", "is missing"], remove("checkpoints/iter_0000003/model.pt")),
    Case("status manifest garbage", status, 0, ["manifest.json"], write("checkpoints/iter_0000003/manifest.json", "{x")),
    Case("status corrupt tensorboard falls back", status_json, 0, ["TensorBoard", "metrics.jsonl"],
         write("tensorboard/events.out.tfevents.1.host", b"\x00garbage" * 50), extra=['"metrics_source": "metrics.jsonl"',
                                                                                   '"accuracy": 0.75']),
    Case("plot corrupt tensorboard falls back", plot, 0, ["TensorBoard", "metrics.jsonl"],
         write("tensorboard/events.out.tfevents.1.host", b"\x00garbage" * 50), extra=["wrote"]),
    Case("status ledger a directory", status, 2, ["ledger.jsonl", "is a directory"], make_dir("ledger.jsonl")),
    Case("status metrics garbage", status, 0, [], write("dumps/metrics.jsonl", b"\xff{[\n{\"rollout_id\": \"x\"}\n")),
]

# Paths: missing, a file instead of a directory, an existing file as -o.
for cmd_name in ("status", "plot", "logs", "cancel"):
    CASES += [
        Case(f"{cmd_name} missing run dir", cli(cmd_name, "{tmp}/nowhere"), 2, ["nowhere", "no such run directory"]),
        Case(f"{cmd_name} a file as run dir", cli(cmd_name, "{run}/plan.json"), 2, ["plan.json", "is a file"]),
    ]
CASES += [
    Case("plot -o an existing file", cli("plot", "{run}", "-o", "{run}/plan.json"), 2, ["-o/--output", "plan.json"]),
    Case("plot -o below a file", cli("plot", "{run}", "-o", "{run}/plan.json/plots"), 2, ["-o/--output", "is a file"]),
    Case("logs --lines negative", logs("--lines", "-5"), 2, ["--lines", "-5", "negative"]),
    Case("logs -n negative", logs("-n", "-1"), 2, ["--lines"]),
    Case("logs --node negative", logs("--node", "-1"), 2, ["--node"]),
    Case("image stage missing image", cli("image", "stage", "--image", "{tmp}/none.sif", "--dest", "{tmp}/st"), 2,
         ["container.image", "none.sif", "does not exist"]),
    Case("image stage image a directory", cli("image", "stage", "--image", "{run}", "--dest", "{tmp}/st"), 2,
         ["container.image", "is a directory"]),
    Case("image stage dest a file", cli("image", "stage", "--image", "{run}/plan.json", "--dest", "{run}/plan.json"),
         2, ["--dest", "is a file"]),
    Case("image build missing def", cli("image", "build", "--def", "{tmp}/none.def", "-o", "{tmp}/x.sif"), 2,
         ["--def", "none.def", "no such file"]),
    Case("image build def a directory", cli("image", "build", "--def", "{run}", "-o", "{tmp}/x.sif"), 2,
         ["--def", "a directory"]),
    Case("image build output a directory", cli("image", "build", "--def", "{run}/plan.json", "-o", "{run}"), 2,
         ["--output", "is a directory"]),
    Case("image build output parent missing", cli("image", "build", "--def", "{run}/plan.json", "-o", "{tmp}/a/b.sif"),
         2, ["--output", "not a directory"]),
    Case("prepare --from-local missing", cli("prepare", "--data-dir", "{tmp}/newdata", "--from-local", "{tmp}/no.jsonl"),
         2, ["--from-local", "no.jsonl", "no such file"]),
    Case("prepare --from-local a directory", cli("prepare", "--data-dir", "{tmp}/newdata", "--from-local", "{run}"),
         2, ["--from-local", "is a directory"]),
    Case("prepare --from-local wrong suffix", cli("prepare", "--data-dir", "{tmp}/newdata", "--from-local",
                                                  f"{{run}}/checkpoints/{POINTER}"), 2, ["--from-local", ".parquet or .jsonl"]),
    Case("prepare --data-dir a file", cli("prepare", "--data-dir", "{run}/plan.json", "--from-local", "{tmp}/no.jsonl"),
         2, ["--data-dir", "is a file"]),
]

# argparse misuse: one line, exit 2, the flag named.
CASES += [
    Case("no command", cli(), 2, ["command"]),
    Case("status without RUN_DIR", cli("status"), 2, ["RUN_DIR"]),
    Case("plot without RUN_DIR", cli("plot"), 2, ["RUN_DIR"]),
    Case("logs --lines not a number", logs("--lines", "abc"), 2, ["--lines", "abc"]),
    Case("logs --group unknown", logs("--group", "chef"), 2, ["--group", "chef"]),
    Case("logs --node not a number", logs("--node", "x"), 2, ["--node"]),
    Case("logs --segment no such id", logs("--segment", "999-0"), 2, ["--segment", "999-0", "no such segment"]),
    Case("logs --segment no such position", logs("--segment", "7"), 2, ["--segment", "7", "give a position"]),
    Case("submit --via unknown", cli("submit", TINY, "--via", "pigeon"), 2, ["--via", "pigeon"]),
    Case("submit --num-rollout not a number", cli("submit", TINY, "--num-rollout", "ten"), 2, ["--num-rollout", "ten"]),
    Case("execute --num-rollout not a number", cli("execute", TINY, "--num-rollout", "1.5"), 2, ["--num-rollout"]),
    Case("unknown flag", cli("status", "{run}", "--colour"), 2, ["--colour"]),
    Case("unknown command", cli("launch"), 2, ["launch"]),
    Case("image without subcommand", cli("image"), 2, ["image_command"]),
    Case("huge flag value shortened", cli("logs", "{run}", "--lines", "9" * 5_000_000 + "x"), 2, ["--lines", "characters"]),
]

# Overrides and recipe files through render (the full set is in tests/config/test_config_input.py).
CASES += [
    Case("--set =5 names the override", render("--set", "=5"), 2, ["'=5'"]),
    Case("--set without =", render("--set", "num_rollout"), 2, ["num_rollout"]),
    Case("--set unknown field", render("--set", "nope=1"), 2, ["nope"]),
    Case("--set bad YAML", render("--set", "num_rollout=["), 2, ["num_rollout"]),
    Case("--set YAML tag", render("--set", "name=!!python/name:os.system"), 2, ["name", "not allowed"]),
    Case("--set 5 MB value shortened", render("--set", "name=" + "x" * 5_000_000), 2, ["name", "characters"]),
    Case("--set 5 MB output_dir shortened", render("--set", "output_dir=/" + "y" * 5_000_000), 2, ["characters"]),
    Case("status of a 5 MB path shortened", lambda r, t: ["status", "/" + "z" * 5_000_000], 2, ["characters"]),
    Case("recipe missing", cli("render", "{tmp}/none.yaml", "--site", LOCAL_SITE), 2, ["none.yaml"]),
    Case("recipe a directory", cli("render", "{run}", "--site", LOCAL_SITE), 2, ["run"]),
    Case("site missing", cli("render", TINY, "--site", "{tmp}/nosite.yaml"), 2, ["nosite"]),
]


def site_with(**fields: object) -> Argv:
    """``submit --dry-run --resume`` of the built run with the local site changed as given (written in tmp)."""
    def argv(run: Path, tmp: Path) -> list[str]:
        data = yaml.safe_load(Path(LOCAL_SITE).read_text()) | fields
        (tmp / "site.yaml").write_text(yaml.safe_dump(data))
        args = _recipe_args(tmp)
        args[1] = str(tmp / "site.yaml")
        return ["submit", TINY, *args, "--dry-run", "--via", "sbatch", "--resume", "--num-rollout", "20"]
    return argv


# The site's --tmp: a size sbatch would refuse is refused when the site is loaded (issue 20 item 4).
CASES += [
    Case("site tmp a fraction", site_with(tmp="1.5T"), 2, ["tmp: not a Slurm size", "1.5T", "2000G"]),
    Case("site tmp a word", site_with(tmp="plenty"), 2, ["tmp", "'plenty'", "none"]),
    Case("site tmp with a space", site_with(tmp="2 T"), 2, ["tmp", "2 T"]),
    Case("control site tmp none", site_with(tmp="none"), 0, ["dry run: nothing submitted"]),
]

# Valid controls: the same run directory, undamaged (or damaged only where the command copes).
CASES += [
    Case("control status", status, 0, [], extra=["rollout 3", "tiny"]),
    Case("control status json", status_json, 0, [], extra=['"problems": []', '"warnings": []']),
    Case("control plot", plot, 0, [], extra=["wrote"]),
    Case("control logs of execute's local segment", logs(), 0, ["l4242-0"], extra=["rollout 2 of l4242-0"]),
    Case("control logs --segment 100-0", logs("--segment", "100-0"), 0, [], extra=["of 100-0"]),
    Case("control logs --segment l4242-0 --lines 1", logs("--segment", "l4242-0", "--lines", "1"), 0, [],
         extra=["rollout 2 of l4242-0"]),
    Case("control logs --lines 0", logs("--lines", "0"), 0, []),
    Case("control logs --list", logs("--list"), 0, [], extra=["driver.log"]),
    Case("control dry-run resume", dry_resume(), 0, ["dry run: nothing submitted"]),
    Case("control dry-run resume torn last line", dry_resume(), 0, ["dry run"], ledger_line('{"torn')),
    Case("control render walltime unquoted", render("--set", "lifecycle.walltime=12:00:00"), 0, []),
    Case("control status without plan.json", status, 0, [], remove("plan.json")),
]


@pytest.fixture
def no_side_effects(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An ``sbatch`` that records being called, a segment and data preparation that must not run,
    and crash logs kept in tmp_path. Returns the file sbatch would write."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    called = tmp_path / "sbatch-called"
    (bindir / "sbatch").write_text(f"#!/bin/sh\necho \"$@\" >> {called}\nexit 1\n")
    (bindir / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}")
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))

    def must_not_run(*_a: object, **_k: object) -> None:
        raise AssertionError("a refused command went on to run")

    import beam_hpc.cli.execute as execute
    import beam_hpc.job.segment as segment

    monkeypatch.setattr(segment, "run_segment", must_not_run)
    monkeypatch.setattr(execute, "ensure_tiny_data", must_not_run)
    return called


def test_the_table_holds_at_least_100_bad_inputs() -> None:
    bad = [c for c in CASES if not c.id.startswith("control")]
    assert len(bad) >= 100, len(bad)
    assert len({c.id for c in CASES}) == len(CASES), "case ids must be unique"


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case: Case, tmp_path: Path, no_side_effects: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = build_run(tmp_path)
    case.damage(run)
    before = tree_hash(run)
    argv = case.argv(run, tmp_path)
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as exited:  # argparse's own refusal (beam-hpc's one-line parser), as `beam-hpc` exits
        code = exited.code  # type: ignore[assignment]
    out, err = capsys.readouterr()
    assert "Traceback" not in err and "Traceback" not in out
    assert "internal error" not in err, err[:2000]
    assert code == case.code, f"exit {code}, expected {case.code}; stderr: {err[:2000]}"
    text = err if case.code else err + out
    for s in case.says:
        assert s in text, f"{s!r} not in: {text[:2000]}"
    for s in case.extra:
        assert s in out, f"{s!r} not in stdout: {out[:2000]}"
    if case.code == 2 and case.one_line:
        assert len(err.strip().splitlines()) == 1, err[:2000]
        assert len(err) < 2000, "a user value was echoed whole"
    assert tree_hash(run) == before, "the run directory changed"
    assert not no_side_effects.exists(), "sbatch was called"
    assert not (tmp_path / "newdata").exists(), "prepare created the data directory before refusing"
