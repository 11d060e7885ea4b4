"""beam_hpc.plan.paths: every run- and segment-directory name, spelled once."""

from __future__ import annotations

from pathlib import Path

from beam_hpc.plan.paths import RunPaths, SegmentPaths, batch_log_name, node_log_name


def test_run_and_segment_paths_spell_every_name() -> None:
    run = RunPaths("/r")
    assert (run.plan, run.ledger, run.script, run.smoke) == ("/r/plan.json", "/r/ledger.jsonl", "/r/job.sbatch",
                                                             "/r/smoke.json")
    assert (run.sentinel, run.cancel_flag, run.lock) == ("/r/SAVE_NOW", "/r/CANCELLED", "/r/run.lock")
    assert run.identity == "/r/checkpoints/run_identity.json"
    assert (run.placement, run.convert) == ("/r/placement.json", "/r/convert")
    assert run.batch_log("%j") == "/r/logs/slurm-%j.out" and batch_log_name("7") == "slurm-7.out"
    seg = run.segment("7", 1)
    assert seg == run.segment_named("7-1") == SegmentPaths(run.segment_logs("7", 1)) and seg.name == "7-1"
    assert seg.segment_log == Path("/r/logs/7-1/segment.log") and seg.driver_log == Path("/r/logs/7-1/driver.log")
    assert seg.ready.name == "ready.json" and seg.readiness_log.name == "readiness.log"
    assert seg.outcome.name == "outcome.json" and seg.runtime.name == "runtime.json"
    assert seg.node_log("trainer", 0) == Path("/r/logs/7-1", node_log_name("trainer", 0)) == Path(
        "/r/logs/7-1/node-trainer-0.log")
    assert seg.node_log("rollout", "%t").name == "node-rollout-%t.log"
    assert seg.node_report("rollout", 2) == Path("/r/logs/7-1/nodes/rollout-2.json")
    assert seg.srun_log("trainer").name == "srun-trainer.log"
    assert seg.ray_logs("trainer", 3) == Path("/r/logs/7-1/ray-logs/trainer-3")


def test_names_are_imported_from_their_home_not_through_plan_py() -> None:
    """plan/plan.py re-exported RunPaths (its old home) and the Ray label names; the re-exports are
    gone, and no module may lean on plan.plan's own imports again."""
    import ast

    from beam_hpc.plan import paths, ray_labels

    homes = {name: mod for mod in (paths, ray_labels) for name, obj in vars(mod).items()
             if not name.startswith("_") and not isinstance(obj, type(ast))
             and getattr(obj, "__module__", mod.__name__) == mod.__name__ and name != "annotations"}
    root = Path(__file__).resolve().parents[2]
    found = []
    for path in [*root.joinpath("beam_hpc").rglob("*.py"), *root.joinpath("tests").glob("*.py"),
                 *root.joinpath("benchmarks").glob("*.py")]:
        text = path.read_text()
        if "beam_hpc.plan.plan import" not in text:
            continue
        for node in ast.walk(ast.parse(text, str(path))):
            if isinstance(node, ast.ImportFrom) and node.module == "beam_hpc.plan.plan":
                found += [f"{path.relative_to(root)}:{node.lineno} {a.name}" for a in node.names if a.name in homes]
    assert found == [], f"import these from {sorted({homes[f.rsplit(' ', 1)[1]].__name__ for f in found})}: {found}"
