"""The extra rollout job of a Miles run on the real local Slurm cluster: ``beam-hpc rollout add`` starts
each node's SGLang engines (the stand-in server of tests/support/standins/sglang_standin, which accepts
exactly the flags of SGLang's own parser, recorded in tests/support/fixtures/sglang-server-flags.txt)
and registers them for the run; a segment starting then attaches them (``external_engines.attach``,
what job.runner calls before the driver); ``rollout remove`` stops and deregisters them, and the job
records its nodes' leave. The run itself is submitted (``beam-hpc submit``) to begin an hour later, so its
job pends meanwhile, as a run waiting in the queue does. The chain that attaches such an engine: tests/backends/miles/test_miles_slurm.py.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from miles_run import local_site, miles_recipe
from polling import poll_until

from beam_hpc.backends.miles import external_engines as ee
from beam_hpc.cli.app import main
from beam_hpc.elastic import registry
from beam_hpc.plan.paths import PLAN_FILE
from beam_hpc.plan.plan import load_plan

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
SGLANG_STANDIN = ROOT / "tests" / "support" / "standins" / "sglang_standin"


@pytest.fixture
def base(slurm_cluster) -> Iterator[Path]:  # type: ignore[no-untyped-def]
    with slurm_cluster.scratch_runs("beam-em-") as root:
        yield root


def test_rollout_add_on_a_miles_run_registers_engines_a_segment_attaches_and_remove_takes_back(
        base: Path, slurm_cluster, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    site = local_site()  # the Miles stand-in's env; the engines' image has SGLang: here, its stand-in
    site["env"]["PYTHONPATH"] = os.pathsep.join([str(SGLANG_STANDIN), site["env"]["PYTHONPATH"]])
    recipe_file, site_file, run_site_file = base / "recipe.yaml", base / "site.yaml", base / "run-site.yaml"
    recipe_file.write_text(json.dumps(miles_recipe(base)))  # JSON is YAML
    site_file.write_text(json.dumps(site))
    # The run is submitted to start later (as a user who adds capacity before the run starts might):
    # the run directory exists as `submit` leaves it, its job pends, and no segment runs meanwhile.
    run_site_file.write_text(json.dumps({**site, "sbatch_extra": ["--begin=now+1hour"]}))
    assert main(["submit", str(recipe_file), "--site", str(run_site_file), "--via", "sbatch"]) == 0
    held = re.search(r"submitted job (\d+)", capsys.readouterr().out).group(1)  # type: ignore[union-attr]
    assert set(slurm_cluster.run("squeue", "-h", "-j", held, "-o", "%T|%r").stdout.split()) == {"PENDING|BeginTime"}
    try:
        run = base / "run"
        plan = load_plan(run / PLAN_FILE)

        assert main(["rollout", "add", str(run), "--nodes", "1", "--time", "00:10:00", "--site", str(site_file)]) == 0
        (job,) = [j.job_id for j in registry.extra_jobs(run)]
        assert poll_until(lambda: ee.registered(run), 180), registry.read_events(registry.events_path(run, job))
        (engine,) = ee.registered(run)
        assert engine.job_id == str(job) and engine.tp == ee.gpus_per_engine(plan)
        assert engine.port in ee.engine_ports(plan.site, int(job), 1)  # from the extra job's own band
        assert poll_until(lambda: ee.healthy(engine, 0.5), 60), "the registered engine does not answer /health"
        # what the next segment's driver gets: the run's Miles argv with the engine attached
        argv = ee.attach(plan, [a.replace("{run_dir}", str(run)) for a in plan.driver_argv])
        assert argv[argv.index("--rollout-external-engine-addrs") + 1] == engine.addr and "--use-fault-tolerance" in argv

        assert main(["rollout", "remove", str(run)]) == 0
        assert poll_until(lambda: not ee.registered(run), 120), "the engines were not deregistered"
        assert poll_until(lambda: not ee.healthy(engine, 0.5), 60), "the engine still answers after the job left"

        def left() -> list[dict]:
            return [e for e in registry.read_events(registry.events_path(run, job)) if e["event"] == "left"]

        assert poll_until(lambda: left() and "node" not in left()[-1], 120), registry.read_events(
            registry.events_path(run, job))
        assert {e.get("reason") for e in left() if "node" in e} == {"removed"}, left()
    finally:
        slurm_cluster.run("scancel", held)
