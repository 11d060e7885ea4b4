"""Recipe schema, site profiles, the Plan and the rendered script: fast, no Slurm needed (one slow
test asks the local cluster's sinfo what TmpDisk its nodes declare, through `submit --dry-run`).

The bad-input table of issue 2 is covered here through the real CLI entry point, one rule per
case: exit status 2, one line on stderr naming the field, the value and the fix, no traceback.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from beam_hpc.backends.registry import plan_for
from beam_hpc.cli.app import main
from beam_hpc.config.recipe import load_recipe
from beam_hpc.plan.plan import Plan, fill
from beam_hpc.slurm.script import render_script
from beam_hpc.submission.submit import build_recipe, build_site

ROOT = Path(__file__).resolve().parents[2]
SEED = ("dedicated", "colocated", "lora")


def recipe_path(name: str) -> str:
    return str(ROOT / "recipes" / f"{name}.yaml")


def site_path(name: str) -> str:
    return str(ROOT / "env" / f"{name}.yaml")


def test_seed_defaults_are_the_seeds() -> None:
    for name in SEED:
        r = load_recipe(recipe_path(name))
        assert (r.batch.prompts, r.batch.responses_per_prompt, r.batch.updates_per_rollout) == (32, 8, 1)
        assert (r.tokens.max_prompt, r.tokens.max_response) == (1024, 4096)
        assert (r.eval.interval, r.eval.samples_per_prompt) == (5, 8)
        assert r.checkpoint.interval == 20
        assert (r.training.eps_clip, r.training.eps_clip_high) == (0.2, 0.28)
        assert r.reward.type == "boxed" and 0 < r.reward.overlong_buffer < r.tokens.max_response
    ded, col, lora = (load_recipe(recipe_path(n)) for n in SEED)
    assert ded.topology.trainer.nodes * ded.topology.trainer.gpus_per_node == 64
    assert ded.topology.rollout.nodes * ded.topology.rollout.gpus_per_node == 32
    assert ded.training.async_training and ded.training.offload.target == "nvme"
    assert ded.training.offload.nvme_dir == "/scratch/beam-optimizer" and ded.training.offload.min_free_gb >= 2000
    assert col.training.colocated and not col.training.async_training and col.topology.rollout is None
    assert col.topology.trainer.nodes * col.topology.trainer.gpus_per_node == 64
    assert lora.training.mode == "lora" and lora.training.async_training
    gpus = lambda g: g.nodes * g.gpus_per_node  # noqa: E731
    assert gpus(lora.topology.trainer) + gpus(lora.topology.rollout) == 32


@pytest.mark.parametrize("name,nodes,gpus,ngroups", [("dedicated", 12, 96, 2), ("colocated", 8, 64, 1), ("lora", 4, 32, 2)])
def test_plan_groups_and_serialisation(name: str, nodes: int, gpus: int, ngroups: int) -> None:
    plan = plan_for(load_recipe(recipe_path(name)), build_site(site_path("example-site")))
    assert (plan.total_nodes, plan.total_gpus, len(plan.groups)) == (nodes, gpus, ngroups)
    assert plan.groups[0].name == "trainer" and plan.groups[0].het_index == 0
    if ngroups == 1:
        assert plan.groups[0].roles == ("trainer", "rollout")
    else:
        assert plan.groups[1].roles == ("rollout",) and not plan.groups[1].stage_nvme
    again = Plan.from_dict(json.loads(plan.to_json()))
    assert again == plan
    # Pure: the same inputs give the same plan, byte for byte.
    assert plan_for(load_recipe(recipe_path(name)), build_site(site_path("example-site"))).to_json() == plan.to_json()


def test_plan_nvme_dir_is_per_run_and_job() -> None:
    plan = plan_for(load_recipe(recipe_path("dedicated")), build_site(site_path("example-site")))
    assert plan.nvme.enabled and plan.nvme.root == "/scratch/beam-optimizer"
    assert fill(plan.nvme.job_dir, job_id="77") == f"/scratch/beam-optimizer/{plan.run_id}/77"
    with pytest.raises(KeyError):
        fill("{not_a_placeholder}")


def test_render_hetjob_script_shape() -> None:
    plan = plan_for(load_recipe(recipe_path("dedicated")), build_site(site_path("example-site")))
    text = render_script(plan)
    sb = [line for line in text.splitlines() if line.startswith("#SBATCH")]
    assert sb.count("#SBATCH hetjob") == 1
    split = sb.index("#SBATCH hetjob")
    first, second = sb[:split], sb[split + 1:]
    for job_level in ("--job-name=", "--time=1-00:00:00", "--signal=B:USR1@", "--requeue", "--open-mode=append", "--output="):
        assert any(job_level in s for s in first), job_level
        assert not any(job_level in s for s in second), job_level
    assert "#SBATCH --nodes=8" in first and "#SBATCH --nodes=4" in second
    assert "#SBATCH --gres=gpu:8" in first and "#SBATCH --gres=gpu:8" in second
    assert "#SBATCH --tmp=2000G" in first and not any("--tmp" in s for s in second)
    assert "#SBATCH --constraint=h200&nvme" in first and "#SBATCH --constraint=h200" in second
    assert '-m beam_hpc.job.segment --plan - --script "$0" "$@" <<\'BEAM_PLAN_JSON\'' in text  # the plan follows
    assert text.rstrip().endswith("\nBEAM_PLAN_JSON")
    colocated = render_script(plan_for(load_recipe(recipe_path("colocated")), build_site(site_path("example-site"))))
    assert "#SBATCH hetjob" not in colocated


def test_committed_sbatch_scripts_are_fresh() -> None:
    """sbatch/ holds the rendered seed scripts for the example site; regenerate with
    `beam-hpc render recipes/X.yaml --site env/example-site.yaml -o sbatch/X.sbatch`."""
    for name in SEED:
        plan = plan_for(load_recipe(recipe_path(name)), build_site(site_path("example-site")))
        want = render_script(plan, source=f"{name}.yaml + site example-site")
        have = (ROOT / "sbatch" / f"{name}.sbatch").read_text()
        assert have == want, f"sbatch/{name}.sbatch is stale: re-render it (see this test's docstring)"


def test_overrides_and_seed_flags() -> None:
    r = build_recipe(recipe_path("dedicated"), overrides=["batch.prompts=16"], num_rollout=200,
                     no_async_training=True, output_dir="/x/run")
    assert (r.batch.prompts, r.num_rollout, r.training.async_training, r.output_dir) == (16, 200, False, "/x/run")


def test_execute_resolves_relative_paths(tmp_path: Path) -> None:
    r = build_recipe(recipe_path("tiny"), base_dir=tmp_path)
    assert r.output_dir == str(tmp_path / "runs" / "tiny") and r.data.dir == str(tmp_path / "runs" / "tiny-data")


BAD = [
    # (rule, recipe, extra args, field that must be named, value that must be named)
    ("unknown key", "dedicated", ["--set", "training.eps_clip_hihg=0.3"], "training.eps_clip_hihg", "0.3"),
    ("wrong type", "dedicated", ["--set", "batch.prompts=many"], "batch.prompts", "many"),
    ("zero count", "dedicated", ["--set", "topology.trainer.nodes=0"], "topology.trainer.nodes", "0"),
    ("negative count", "dedicated", ["--set", "num_rollout=-5"], "num_rollout", "-5"),
    ("gpus per engine", "dedicated", ["--set", "topology.rollout.gpus_per_engine=12"], "gpus_per_engine", "12"),
    ("lead >= walltime", "dedicated", ["--set", "lifecycle.walltime=00:10:00", "--set", "lifecycle.lead_s=900"], "lifecycle.lead_s", "900"),
    ("penalty window", "dedicated", ["--set", "reward.overlong_buffer=4096"], "reward.overlong_buffer", "4096"),
    ("relative path", "dedicated", ["--output-dir", "runs/x"], "output_dir", "runs/x"),
    ("colocated + async", "colocated", ["--set", "training.async_training=true"], "training.async_training", "true"),
    ("lora + nvme", "lora", ["--set", "training.offload.target=nvme"], "training.offload.target", "nvme"),
    ("bad walltime", "dedicated", ["--set", "lifecycle.walltime=soon"], "lifecycle.walltime", "soon"),
]


@pytest.mark.parametrize("rule,name,extra,field,value", BAD, ids=[b[0] for b in BAD])
def test_bad_input_exits_2_with_one_line(rule: str, name: str, extra: list[str], field: str, value: str,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["render", recipe_path(name), "--site", site_path("example-site"), *extra])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert field in lines[0] and value in lines[0].lower(), lines[0]
    assert "Traceback" not in err


def test_missing_paths_refused_before_submit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["submit", recipe_path("tiny"), "--site", site_path("local"), "--via", "sbatch",
                 "--output-dir", str(tmp_path / "run"), "--set", f"data.dir={tmp_path}/nodata",
                 "--set", f"model.path={tmp_path}/m"])
    err = capsys.readouterr().err
    assert code == 2 and "data.dir" in err and "beam-hpc prepare" in err
    assert not (tmp_path / "run").exists(), "nothing may be written before the input is valid"


def test_bad_site_and_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    site = tmp_path / "s.yaml"
    site.write_text("name: s\ncontainer: {runtime: apptainer}\n")
    assert main(["render", recipe_path("dedicated"), "--site", str(site)]) == 2
    assert "container.image" in capsys.readouterr().err
    assert main(["render", str(tmp_path / "nope.yaml")]) == 2
    assert "no such recipe file" in capsys.readouterr().err


def test_trainer_tmp_comes_from_min_free_gb_unless_the_site_asks_for_more() -> None:
    from beam_hpc.plan.local_disk import decide

    def tmp(site_tmp: str | None, min_free_gb: float) -> str | None:  # Slurm not asked (render)
        return decide("trainer", 1, "p", site_tmp=site_tmp, min_free_gb=min_free_gb, nvme_dir="/nvme",
                      declared=None).request

    assert tmp(None, 2000) == "1863G"  # 2e12 bytes in GiB, rounded up
    assert tmp("2000G", 2000) == "2000G" and tmp("3T", 2000) == "3T"
    assert tmp("100G", 2000) == "1863G"  # the recipe needs more than the site asks
    assert tmp(None, 0) is None and tmp("500G", 0) == "500G"
    assert tmp("none", 2000) is None  # the site turns the request off
    example = build_site(site_path("example-site"))
    plan = plan_for(load_recipe(recipe_path("dedicated")), example.model_copy(update={"tmp": None}))
    assert plan.group("trainer").tmp == "1863G" and plan.group("rollout").tmp is None
    assert plan.group("trainer").tmp_why == "from training.offload.min_free_gb 2000 GB"  # Slurm not asked
    off = plan_for(load_recipe(recipe_path("dedicated")), example.model_copy(update={"tmp": "none"}))
    assert off.group("trainer").tmp is None and "tmp: none" in off.group("trainer").tmp_why
    assert "#SBATCH --tmp" not in render_script(off)


def test_slurms_declared_tmp_disk_decides_the_trainers_tmp() -> None:
    """make_plan with Slurm's answer as data (beam_hpc.submission.tmp_disk asks it on the login node)."""
    from beam_hpc.errors import InputError
    from beam_hpc.plan.local_disk import TmpDisk

    recipe = load_recipe(recipe_path("dedicated"))  # 8 trainer nodes on gpu-h200, 2,000 GB each
    site = build_site(site_path("example-site")).model_copy(update={"tmp": None})

    def trainer(*node_mb: int) -> tuple[str | None, str]:
        g = plan_for(recipe, site, tmp_disk={"gpu-h200": TmpDisk("gpu-h200", node_mb)}).group("trainer")
        return g.tmp, g.tmp_why

    tmp, why = trainer(*(0,) * 16)  # TmpDisk never set in slurm.conf: every --tmp would be unplaceable
    assert tmp is None and "16 node(s) of partition gpu-h200 declare no TmpDisk" in why
    assert "NVMe check still refuses a node with less than 2000 GB free under /scratch/beam-optimizer" in why
    assert "#SBATCH --tmp" not in render_script(plan_for(recipe, site, tmp_disk={"gpu-h200": TmpDisk("gpu-h200", (0,))}))
    tmp, why = trainer(*(3_000_000,) * 8, *(100_000,) * 8)
    assert tmp == "1863G" and "8 of the 16 nodes of partition gpu-h200 declare TmpDisk >= 1907712 MB" in why
    with pytest.raises(InputError) as err:
        trainer(*(3_000_000,) * 7, *(100_000,) * 9)
    assert "only 7 of the 16 nodes of partition gpu-h200" in str(err.value) and "largest 3000000 MB" in str(err.value)
    with pytest.raises(InputError, match="training.offload.min_free_gb: 2000 GB needs --tmp=1863G .* no node of "
                                         "partition gpu-h200 declares that much TmpDisk .largest 100000 MB"):
        trainer(*(100_000,) * 16)
    big = site.model_copy(update={"tmp": "2T"})  # the site asks more than the recipe: its fix names tmp
    with pytest.raises(InputError, match="^tmp: 2T needs --tmp=2T .*lower tmp in the site"):
        plan_for(recipe, big, tmp_disk={"gpu-h200": TmpDisk("gpu-h200", (2_000_000,) * 16)})
    unknown = plan_for(recipe, site, tmp_disk={}).group("trainer")  # asked, but Slurm could not say
    assert unknown.tmp == "1863G" and "not known here" in unknown.tmp_why
    lora = plan_for(load_recipe(recipe_path("lora")), site, tmp_disk={"gpu-h200": TmpDisk("gpu-h200", (0,))})
    assert all(g.tmp is None and g.tmp_why == "" for g in lora.groups)  # nothing staged: nothing asked


@pytest.mark.slow
@pytest.mark.slurm
def test_submit_dry_run_asks_the_cluster_for_tmp_disk(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The local cluster declares TmpDisk 3,000,000 MB on n1-n10 and 100,000 MB on n11-n12: the
    seed's 1863G fits its 8 trainer nodes, 16 trainer nodes or 4,000 GB are refused (exit 2, one
    line), and ``tmp: none`` asks for nothing. Dry runs: no job is queued."""
    args = ["submit", recipe_path("dedicated"), "--site", site_path("local"), "--dry-run", "--via", "sbatch",
            "--output-dir", str(tmp_path / "run"), "--set", f"data.dir={tmp_path}", "--set", f"model.path={tmp_path}"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert ("local disk, trainer: --tmp=1863G (from training.offload.min_free_gb 2000 GB; 10 of the 12 nodes of "
            "partition debug declare TmpDisk >= 1907712 MB (1863G))") in out
    assert main([*args, "--set", "topology.trainer.nodes=16"]) == 2  # (Megatron needs 8k nodes here)
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "only 10 of the 12 nodes of partition debug" in err
    assert main([*args, "--set", "training.offload.min_free_gb=4000"]) == 2
    err = capsys.readouterr().err
    assert "needs --tmp=3726G (3815424 MB)" in err and "no node of partition debug" in err
    assert "largest 3000000 MB (2929G)" in err and "tmp: none" in err
    site = yaml.safe_load(Path(site_path("local")).read_text()) | {"tmp": "none"}
    (tmp_path / "site.yaml").write_text(yaml.safe_dump(site))
    assert main([*args[:3], str(tmp_path / "site.yaml"), *args[4:], "--set", "training.offload.min_free_gb=4000"]) == 0
    assert "local disk, trainer: no --tmp (the site's tmp: none asks Slurm for no node-local disk" in capsys.readouterr().out
    assert not (tmp_path / "run").exists()


