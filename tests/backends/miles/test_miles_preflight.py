"""The pre-Ray check: the image's Miles parses the exact driver command; refusals name the setting.

These run a contract double of an older Miles (a ``miles.utils.arguments.parse_args`` that knows
every flag beam-hpc emits except the four miles-rl 0.0.2 lacks) through the real check process and
the container seam's host runtime; ``test_miles_real.py`` runs the same check on the real miles-rl.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from miles_facts import MILES_MAIN, QWEN3_30B_A3B

from beam_hpc.backends import registry
from beam_hpc.backends.miles import preflight
from beam_hpc.backends.miles.flags import SOURCES
from beam_hpc.config.recipe import load_recipe
from beam_hpc.config.site import Site
from beam_hpc.observe import doctor

ROOT = Path(__file__).resolve().parents[3]
OLD_MILES_LACKS = ("--save-trigger-sentinel", "--stream-optimizer-state-to-disk", "--offload-train-disk-dir",
                   "--offload-train-target")

FAKE_ARGUMENTS = '''
import argparse, json, os, sys
KNOWN = json.loads(os.environ["FAKE_MILES_FLAGS"])
def parse_args():
    p = argparse.ArgumentParser(prog=os.path.basename(sys.argv[0]))
    for flag in KNOWN:
        p.add_argument(flag, nargs="*")
    args, unknown = p.parse_known_args()
    if unknown:
        p.error("unrecognized arguments: " + " ".join(unknown))
    hf = getattr(args, "hf_checkpoint")[0]
    cfg = json.load(open(os.path.join(hf, "config.json")))
    if args.hidden_size is None or int(args.hidden_size[0]) != cfg["hidden_size"]:
        raise AssertionError(f"hf_validate_args failed: hidden_size in hf config {cfg['hidden_size']} is not "
                             f"equal to hidden_size {args.hidden_size}")
    return args
'''


@pytest.fixture
def fake_miles(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    pkg = tmp_path / "fake" / "miles" / "utils"
    pkg.mkdir(parents=True)
    (pkg.parent / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "arguments.py").write_text(FAKE_ARGUMENTS)
    arch_flags = ["--num-layers", "--hidden-size", "--ffn-hidden-size", "--num-attention-heads", "--swiglu",
                  "--normalization", "--norm-epsilon", "--disable-bias-linear", "--position-embedding-type",
                  "--rotary-base", "--vocab-size", "--untie-embeddings-and-output-weights", "--group-query-attention",
                  "--num-query-groups", "--kv-channels", "--qk-layernorm", "--rotary-percent", "--num-experts",
                  "--moe-ffn-hidden-size", "--moe-router-topk", "--moe-layer-freq", "--moe-token-dispatcher-type",
                  "--moe-grouped-gemm", "--moe-permute-fusion", "--moe-router-dtype", "--moe-aux-loss-coeff",
                  "--moe-router-score-function", "--moe-token-drop-policy"]
    known = [f for f in SOURCES if f not in OLD_MILES_LACKS] + arch_flags
    monkeypatch.setenv("FAKE_MILES_FLAGS", json.dumps(known))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path / "fake"), str(ROOT)]))
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    return tmp_path


def plan_for(tmp: Path, name: str, *overrides: str):  # type: ignore[no-untyped-def]
    r = load_recipe(ROOT / "recipes" / f"{name}.yaml",
                    ["model.miles_model_script=null", f"model.path={tmp}/model", f"output_dir={tmp}/run", *overrides])
    site = Site(name="t", container={"runtime": "host"}, python=sys.executable)
    return registry.plan_for(r, site)


def test_check_argv_is_the_drivers_with_harmless_placeholders(tmp_path: Path) -> None:
    argv = ["py", "-m", "beam_hpc.backends.miles.launch", "--plan", "p", "--ray-address", "{ray_address}",
            "--model-script", "/root/m.sh", "--model-script-var", "A=1", "--", "train.py",
            "--offload-train-disk-dir", "{nvme_dir}", "--x", "{head_ip}"]
    got = preflight.check_argv(argv, "python3", str(tmp_path))
    assert got[:3] == ["python3", "-m", preflight.CHECK_MODULE]
    assert got[3:8] == ["--model-script", "/root/m.sh", "--model-script-var", "A=1", "--"]
    assert got[8] == "train.py" and "{" not in " ".join(got) and got[-1] == "127.0.0.1"


def test_refusal_names_the_setting_behind_each_unknown_flag() -> None:
    v = preflight.Verdict(False, "train_async.py: error: unrecognized arguments: --save-trigger-sentinel /r/SAVE_NOW",
                          ("--save-trigger-sentinel", "--offload-train-target", "--made-up"))
    msg = v.refusal() or ""
    assert "unrecognized arguments: --save-trigger-sentinel" in msg
    assert "--save-trigger-sentinel: from lifecycle.save_on_request" in msg and "save_on_request: false" in msg
    assert "--offload-train-target: from training.offload.target; set training.offload.target: cpu" in msg
    assert "--made-up: not set by beam-hpc" in msg
    assert preflight.Verdict(True).refusal() is None


@pytest.mark.slow  # a check process imports torch and transformers: 3-8 s each
def test_in_job_check_refuses_flags_an_older_miles_lacks(fake_miles: Path) -> None:
    """check_in_job(plan) is the one function the job calls on the head node before Ray."""
    msg = preflight.check_in_job(plan_for(fake_miles, "colocated"))
    assert msg is not None
    for flag in OLD_MILES_LACKS:
        assert f"  {flag}: from {SOURCES[flag]}" in msg, flag
    assert "lifecycle.save_on_request: false" in msg


@pytest.mark.slow  # a check process imports torch and transformers: 3-8 s each
def test_in_job_check_accepts_what_the_older_miles_knows(fake_miles: Path) -> None:
    plan = plan_for(fake_miles, "dedicated", "training.offload.target=cpu", "lifecycle.save_on_request=false")
    assert "--save-trigger-sentinel" not in plan.driver_argv
    assert preflight.check_in_job(plan) is None


@pytest.mark.slow  # a check process imports torch and transformers: 3-8 s each
def test_in_job_check_quotes_miless_validation(fake_miles: Path) -> None:
    plan = plan_for(fake_miles, "dedicated", "training.offload.target=cpu", "lifecycle.save_on_request=false")
    cfg = fake_miles / "model" / "config.json"
    cfg.write_text(json.dumps({**QWEN3_30B_A3B, "hidden_size": 4096}))  # the model changed after submit
    msg = preflight.check_in_job(plan) or ""
    assert "AssertionError: hf_validate_args failed: hidden_size in hf config 4096" in msg


@pytest.mark.slow  # a check process imports torch and transformers: 3-8 s each
def test_deferred_model_script_is_read_and_checked_in_the_image(fake_miles: Path) -> None:
    script = fake_miles / "image-only.sh"
    plan = plan_for(fake_miles, "dedicated", "training.offload.target=cpu", "lifecycle.save_on_request=false",
                    f"model.miles_model_script={script}")  # not there at plan time: deferred
    assert "--model-script" in plan.driver_argv
    script.write_text("MODEL_ARGS=(\n  --hidden-size 4096\n)\n")
    msg = preflight.check_in_job(plan) or ""
    assert "hidden_size in " in msg and "is 2048 but --hidden-size 4096" in msg


@pytest.mark.slow  # a check process imports torch and transformers: 3-8 s each
def test_deferred_python_model_script_is_run_by_the_images_miles(fake_miles: Path) -> None:
    """Miles main's form: the image's Python calls model_args() through the image's Miles loader
    (here the fixture's double, importable as miles.utils.external_utils.model_args_utils), with
    model.miles_model_script_vars in its environment; the verdict says which form it found."""
    loader = fake_miles / "fake" / "miles" / "utils" / "external_utils"
    loader.mkdir()
    (loader / "__init__.py").write_text("")
    (loader / "model_args_utils.py").write_text((MILES_MAIN / "miles" / "utils" / "external_utils" /
                                                 "model_args_utils.py").read_text())
    script = fake_miles / "image-only" / "qwen3-30B-A3B.py"
    plan = plan_for(fake_miles, "dedicated", "training.offload.target=cpu", "lifecycle.save_on_request=false",
                    f"model.miles_model_script={script}", "model.miles_model_script_vars={MODEL_ARGS_NUM_LAYERS: '48'}")
    assert "--model-script" in plan.driver_argv  # not there at plan time: deferred
    script.parent.mkdir()
    script.write_text((MILES_MAIN / "scripts" / "models" / "qwen3-30B-A3B.py").read_text())
    verdict = preflight.check_plan(plan)
    assert verdict.ok, verdict.refusal()
    assert verdict.model_script_note() == (f"model script {script}: Python model_args() through the image's Miles "
                                           f"loader, {len(_read(script))} words of architecture flags")


def _read(script: Path) -> list[str]:
    from beam_hpc.backends.miles.model_script import read_model_script

    return read_model_script(str(script), {"MODEL_ARGS_NUM_LAYERS": "48"})


def test_reference_plans_are_not_checked(tmp_path: Path) -> None:
    from beam_hpc.submission.submit import build_recipe

    r = build_recipe(ROOT / "recipes" / "tiny.yaml", base_dir=tmp_path)
    assert preflight.check_in_job(registry.plan_for(r, Site(name="t", container={"runtime": "host"}))) is None


@pytest.mark.slow  # a check process imports torch and transformers: 3-8 s each
def test_doctor_line(fake_miles: Path) -> None:
    site = Site(name="t", container={"runtime": "host"}, python=sys.executable)
    r = load_recipe(ROOT / "recipes" / "dedicated.yaml",
                    ["model.miles_model_script=null", f"model.path={fake_miles}/model", f"output_dir={fake_miles}/run"])
    check = doctor.miles_parser_check(site, r)
    assert check.status == "fail" and "unrecognized arguments" in check.detail
    assert "lifecycle.save_on_request: false" in check.fix
    # A readable Python model script in a Miles checkout: read at submit time, and doctor says so.
    script = MILES_MAIN / "scripts" / "models" / "qwen3-30B-A3B.py"
    ok = doctor.miles_parser_check(site, r.model_copy(update={
        "training": r.training.model_copy(update={"offload": r.training.offload.model_copy(update={"target": "cpu"})}),
        "lifecycle": r.lifecycle.model_copy(update={"save_on_request": False}),
        "model": r.model.model_copy(update={"miles_model_script": str(script)})}))
    assert ok.status == "pass", ok
    assert f"model script {script}: Python model_args() through the login node's Miles loader" in ok.detail
    bad = doctor.miles_parser_check(site, load_recipe(ROOT / "recipes" / "dedicated.yaml", [
        "model.miles_model_script=null", f"model.path={fake_miles}/none"]))
    assert bad.status == "fail" and "architecture flags" in bad.detail


@pytest.mark.slow  # a check process imports torch and transformers: 3-8 s each
def test_a_segment_ends_before_ray_when_the_images_miles_refuses(fake_miles: Path) -> None:
    """The hook in the job (beam_hpc.job.segment via backends.prestart): the segment ends with
    Miles's own refusal in its ledger line, never starts a node step, and the chain stops."""
    from beam_hpc.job.segment import Segment
    from beam_hpc.run import ledger

    plan = plan_for(fake_miles, "colocated")
    plan.write()
    seg = Segment(plan.paths.plan, env={"PATH": os.environ["PATH"]})
    assert seg.run() == 1
    (record,), _ = ledger.read_ledger(plan.paths.ledger)
    end = record["end"]
    assert end["reason"] == "error" and end["next"]["action"] == "none"
    assert "unrecognized arguments" in end["detail"] and "lifecycle.save_on_request" in end["detail"]
    segment_dir = plan.paths.segment(record["start"]["job_id"], 0)
    assert not Path(segment_dir.driver_log).exists() and not list(Path(segment_dir.root).glob("node-*.log"))
