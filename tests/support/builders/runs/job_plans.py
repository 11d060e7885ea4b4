"""Plans and batch scripts for the tests: the tiny recipe, reshaped; the one plan builder.

Real recipe validation and real make_plan; only the topology, NVMe settings, recipe overrides,
the model and data (the tiny assets) and (when a test needs the cluster to stay up) the driver
differ from recipes/tiny.yaml, and the site is env/local.yaml (updated) or the bare host.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path

from reference_harness import TinyAssets

from beam_hpc.backends.registry import plan_for
from beam_hpc.config.recipe import apply_overrides, load_yaml, recipe_from_dict
from beam_hpc.config.site import site_from_dict
from beam_hpc.plan.plan import DriverCommand, Plan, make_plan

ROOT = Path(__file__).resolve().parents[4]
HOLD_DRIVER = ROOT / "tests" / "support" / "programs" / "ray_hold_driver.py"


# Port bands for jobs a test starts itself, outside the local Slurm cluster (run_local, a node step
# started by hand): their job number is a pid or a made-up id, so on env/local.yaml's bands
# (21000-26499) they could take the very ports of a cluster job running beside them under xdist
# (Ray binds them on all interfaces, so the loopback addresses do not keep them apart). Seen once:
# a local run whose pid was 45 mod 125 held Slurm job 45's GCS port. These bands are their own:
# 26500-29799 (eleven bands of 300), above the shared cluster's last band (its elastic service,
# 26000-26499) and below test_existing_ray's site cluster (30000+). Two local runs meet only if
# their pids are equal mod 300 while both run; local runs are few and short.
LOCAL_RUN_PORTS = {"gcs_port_base": 26500, "port_span": 300}
# Port bands for the jobs of a private Slurm cluster (tests/support/cluster/private_cluster.py) that
# start Ray: its job ids (FIRST_JOB_ID + (pid % 1000) * 100 + k) fall in the shared cluster's port
# slots as often as not (a slot is 16 x job id mod 500), and both clusters' jobs run on the same
# loopback addresses. Seen twice: the outage chain's second segment, private job 875902, held the GCS
# port of the shared cluster's job 27 (21432), whose `ray start` then failed three times. 20000-20989:
# above Ray's worker ports (10002-19999), below env/local.yaml's bands; one private cluster at a time
# uses them (the other one's jobs are sleepers or local runs).
PRIVATE_CLUSTER_PORTS = {"gcs_port_base": 20000, "port_span": 90}
# Ports of test_existing_ray's long-lived "site" cluster (Ray's eight bands, 30000-32399): above
# every band above, below the kernel's ephemeral range (32768).
SITE_CLUSTER_PORTS = {"gcs_port_base": 30000, "port_span": 300}
# The bare host: no Slurm, no container, every other field its default. What the reference
# backend's own tests run on (they start the backend by hand, on a Ray of their own).
HOST_SITE = {"name": "test", "container": {"runtime": "host"}}


def make_test_plan(output_dir: Path, *, trainer_nodes: int | None = None, rollout_nodes: int = 0, gpus: int = 2,
                   nvme: tuple[str, float] | None = None, driver: list[str] | None = None,
                   site: dict | None = None, local_run: bool = False, assets: TinyAssets | None = None,
                   overrides: Sequence[str] = ()) -> Plan:
    """tiny.yaml with ``trainer_nodes`` + ``rollout_nodes`` (0: colocated) nodes of ``gpus``
    fake GPUs (None: tiny.yaml's own topology), NVMe staging under ``nvme = (dir, min_free_gb)``,
    the tiny ``assets`` as model and data (else paths under ``output_dir``), then the recipe
    ``overrides`` (``key.path=value``). ``site``: fields that update env/local.yaml, or a whole
    site (one with a name, e.g. HOST_SITE). The plan is written. ``local_run``: the test starts
    the job itself, not through Slurm, so its Ray ports come from ``LOCAL_RUN_PORTS``."""
    d = load_yaml(ROOT / "recipes" / "tiny.yaml")
    d["output_dir"] = str(output_dir)
    d["model"]["path"] = str(assets.model_dir if assets else output_dir / "model")
    d["data"]["dir"] = str(assets.data_dir if assets else output_dir / "data")
    if trainer_nodes is not None:
        d["topology"] = {"trainer": {"nodes": trainer_nodes, "gpus_per_node": gpus}}
        if rollout_nodes:
            d["topology"]["rollout"] = {"nodes": rollout_nodes, "gpus_per_node": gpus, "gpus_per_engine": 1}
        else:
            d["training"]["colocated"] = True
            d["training"]["async_training"] = False
    if nvme is not None:
        d["training"]["offload"] = {"target": "nvme", "nvme_dir": nvme[0], "min_free_gb": nvme[1]}
    apply_overrides(d, list(overrides))
    site_data = dict(site) if site and "name" in site else {**load_yaml(ROOT / "env" / "local.yaml"), **(site or {})}
    if local_run:
        site_data["ray"] = {**site_data["ray"], **LOCAL_RUN_PORTS}
    plan = plan_for(recipe_from_dict(d, "test recipe"), site_from_dict(site_data, "test site"))
    if driver is not None:
        # the plan records its driver command (a hand edit of it is refused on load): make it with this one
        plan = make_plan(plan.recipe, plan.site, driver=DriverCommand(tuple(driver), plan.driver_env))
    plan.write()
    Path(plan.paths.logs).mkdir(parents=True, exist_ok=True)  # Slurm opens --output before the job
    return plan


def hold_driver(marker: Path, release: Path) -> list[str]:
    """A driver that connects to the job's Ray with the job's token, touches ``marker`` and
    stays until ``release`` exists: keeps the cluster up while a test pokes at it."""
    return [sys.executable, str(HOLD_DRIVER), "--ray-address", "{ray_address}",
            "--marker", str(marker), "--release", str(release)]


def batch_script(plan: Plan, *job_args: str) -> Path:
    """The run's heterogeneous sbatch script (beam_hpc.slurm.script: its #SBATCH lines and site
    block) with the job runner as its body and the batch log under the run's logs/, as beam-hpc's
    own sbatch lines put it."""
    from beam_hpc.slurm.script import batch_job, render_batch

    body = (f"cd {ROOT}", f"exec {sys.executable} -m beam_hpc.job.runner --plan {plan.paths.plan} {' '.join(job_args)}")
    job = dataclasses.replace(batch_job(plan, body=body), output=plan.paths.batch_log("%j"), notes=())
    path = Path(plan.output_dir, "job.sbatch")
    path.write_text(render_batch(job))
    return path
