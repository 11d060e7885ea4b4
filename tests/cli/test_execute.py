"""`beam-hpc execute`: the embedded default, end to end on this machine, through the real CLI.

Real parts: the tiny model and data (built by the project's code), two local node steps with
token-authenticated Ray on loopback addresses, the reference backend's RL loop, the ledger and
checkpoints. The run is README's main command as shipped (recipes/tiny.yaml: 20 rollouts of
32 x 8, async), only with the test session's model and data directories, and it must learn: this is
the suite's one 20-rollout learning run (the sync modes compute what each other computes, bit for bit:
tests/backends/reference/test_reference_backend.py).
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from beam_hpc.cli.app import main
from beam_hpc.run import checkpoint_layout
from beam_hpc.run.ledger import read_ledger

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.e2e
def test_execute_tiny_end_to_end(tmp_path: Path, tiny_assets, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    from reference_harness import assert_learned

    run = tmp_path / "run"
    args = ["execute", str(REPO / "recipes" / "tiny.yaml"), "--output-dir", str(run),
            "--set", f"model.path={tiny_assets.model_dir}", "--set", f"data.dir={tiny_assets.data_dir}"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "rollout 20/20" in out, out  # the live one-line-per-rollout view
    # what the eval measures, by its name (data.eval_name), in the live view and the metrics
    assert "eval every 5 rollouts on tiny two-digit addition (held-out) (tiny-add: " in out, out
    assert "eval after 20 rollouts: tiny-add accuracy " in out and "aime25" not in out and "AIME" not in out
    evals = [json.loads(x) for x in (run / "dumps" / "metrics.jsonl").read_text().splitlines() if '"eval"' in x]
    assert evals and all("eval/tiny-add" in m and "eval/tiny-add/response_len/mean" in m for m in evals)
    assert_learned(run, "eval/tiny-add")  # the embedded default as shipped learns
    assert checkpoint_layout.rollouts_done(run / "checkpoints") == 20
    assert checkpoint_layout.latest_iteration(run / "checkpoints") == 19
    assert checkpoint_layout.resume_problems(run / "checkpoints") == []
    segments, warnings = read_ledger(run / "ledger.jsonl")
    assert not warnings
    ends = [s["end"] for s in segments]
    assert [e["reason"] for e in ends] == ["completed"]
    placement = json.loads((run / "placement.json").read_text())
    assert placement["trainer"]["group"] == "trainer"
    assert placement["nodes"][placement["trainer"]["node_id"]]["group"] == "trainer"
    assert all(a["group"] == "rollout" for a in placement["rollout"])
    # A second execute onto the finished run without --resume is refused (exit 2, one line).
    assert main(args) == 2
    assert "--resume" in capsys.readouterr().err
    # `beam-hpc logs` reads a run made by execute (its local segment directory l<pid>-<restart>)
    assert main(["logs", str(run), "--lines", "2"]) == 0
    logged = capsys.readouterr()
    assert "driver.log" in logged.err and "/l" in logged.err and logged.out.strip()

    # Resuming with a changed model is refused before anything is written (issue 14): no new
    # plan.json, ledger line or log, so the right resume still works afterwards.
    def digest() -> list[tuple[str, bytes]]:
        return [(str(p), p.read_bytes() if p.is_file() else b"") for p in sorted(run.rglob("*"))]

    before = digest()
    assert main([*args, "--resume", "--num-rollout", "25", "--set", "model.path=/elsewhere/model"]) == 2
    err = capsys.readouterr().err
    assert "identity" in err and "model.path" in err and "Traceback" not in err
    assert digest() == before

    # README's cluster quick start reads a run with `status`, `logs` and `plot`: those lines, as
    # written there, run on this real run (tests/test_docs.py checks that they are there and parse).
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    quick = [shlex.split(line, comments=True)[1:] for line in readme.splitlines()
             if line.startswith(("beam-hpc status ", "beam-hpc logs ", "beam-hpc plot "))]
    assert len(quick) == 3, quick
    for argv in quick:
        assert main([str(run) if a == "/shared/runs/beam-dedicated" else a for a in argv]) == 0, argv
    shown = capsys.readouterr()
    assert "20 of 20" in shown.out and "tiny-add" in shown.out and "Traceback" not in shown.err, shown
    assert sorted(p.name for p in (run / "plots").glob("*.png")), "plot wrote no chart into <run>/plots"
