"""A Ray cluster the site already runs (site ``ray_address`` + ``ray_token_file``, ``--ray-address``).

The slow test starts a real standalone token-auth Ray cluster, the way a site would run one: a head
labelled ``trainer`` and a worker labelled ``rollout`` on their own loopback addresses, each with one
fake GPU, through beam-hpc's own `ray start` command lines (beam_hpc.node.ray_node) under a tag of the
test's own. The job (beam_hpc.job.runner.run_local, the same JobRunner as inside Slurm) must start no Ray,
name the lacking group while the worker is not there yet, place the smoke tasks on the right nodes
once it is, and leave the cluster as it found it: same node ids, same raylet PIDs, token file in
place. The fast tests cover the site's rules for the two fields and the CLI flags.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from glob import glob
from pathlib import Path

import pytest
from job_plans import SITE_CLUSTER_PORTS, make_test_plan
from polling import gone

from beam_hpc.cli import app as cli
from beam_hpc.config.site import RayPortSpec, site_from_dict, with_existing_ray
from beam_hpc.errors import InputError
from beam_hpc.job.runner import run_local, smoke_driver_argv
from beam_hpc.node import procs
from beam_hpc.node.ray_node import (
    LOOPBACK_MAX_NODES,
    MIN_OBJECT_STORE_BYTES,
    RayNode,
    clean_env,
    ray_env,
    ray_ports,
    ray_start_argv,
    stop_pids,
    sweep,
    tagged_pids,
    temp_dir_for,
    write_token,
)

PORTS = RayPortSpec(**SITE_CLUSTER_PORTS)  # apart from the bands concurrent job tests use
HEAD_IP, WORKER_IP = "127.0.0.40", "127.0.0.41"  # outside the jobs' 127.0.0.10-25
START_TIMEOUT_S = 90.0


class SiteRayCluster:
    """The site's long-lived cluster: ``ray start --block`` per node, stopped by PID at the end."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.tag = f"site-ray-{os.getpid()}"
        self.token = write_token(base / "site-auth")
        self.procs: list[subprocess.Popen] = []
        self.temp_dirs: list[str] = []
        self.address = f"{HEAD_IP}:{ray_ports(PORTS, os.getpid(), 0, LOOPBACK_MAX_NODES).gcs}"

    def start_node(self, index: int, group: str, ip: str) -> None:
        """Start one node and wait until `ray start` says Ray runs there."""
        node = RayNode(group=group, roles=(group,), index=index, ip=ip, head_ip=HEAD_IP,
                       ports=ray_ports(PORTS, os.getpid(), index, LOOPBACK_MAX_NODES), num_cpus=1, num_gpus=1,
                       object_store_bytes=MIN_OBJECT_STORE_BYTES, temp_dir=temp_dir_for(f"site{os.getpid()}", 0, index))
        self.temp_dirs.append(node.temp_dir)
        env = {**clean_env(os.environ), **ray_env(token_path=str(self.token), job_tag=self.tag, node_index=index)}
        log = self.base / f"ray-{group}.log"
        with open(log, "wb") as fh:
            self.procs.append(subprocess.Popen(ray_start_argv(node, sys.executable), env=env, stdout=fh,
                                               stderr=subprocess.STDOUT, start_new_session=True))
        deadline = time.monotonic() + START_TIMEOUT_S
        while "Ray runtime started" not in log.read_text(errors="replace"):
            assert self.procs[-1].poll() is None and time.monotonic() < deadline, \
                f"ray start of the site's {group} node failed:\n{log.read_text(errors='replace')[-3000:]}"
            time.sleep(0.2)

    def raylet_pids(self) -> list[int]:
        found = []
        for pid in tagged_pids(self.tag):
            argv = procs.cmdline(pid)  # [] for one of Ray's workers that has gone meanwhile
            if argv and argv[0].endswith("/raylet"):
                found.append(pid)
        return found

    def alive_nodes(self) -> dict[str, str]:
        """node id -> address of the alive nodes, asked of the cluster with its token."""
        code = ("import json, ray; ray.init(address=%r, log_to_driver=False); "
                "print(json.dumps({n['NodeID']: n['NodeManagerAddress'] for n in ray.nodes() if n['Alive']}))")
        env = {**clean_env(os.environ), **ray_env(token_path=str(self.token), job_tag=f"{self.tag}-probe")}
        out = subprocess.run([sys.executable, "-c", code % self.address], env=env, capture_output=True,
                             text=True, timeout=120, check=False)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    def stop(self) -> None:
        stop_pids([p.pid for p in self.procs if p.poll() is None], grace_s=15.0)
        for p in self.procs:
            p.wait(timeout=15)
        sweep(self.tag, grace_s=2.0)
        for d in self.temp_dirs:
            shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def site_cluster(tmp_path: Path) -> Iterator[SiteRayCluster]:
    cluster = SiteRayCluster(tmp_path)
    try:
        yield cluster
    finally:
        cluster.stop()
    assert gone(lambda: tagged_pids(cluster.tag)) == [], "the test's own cluster was not stopped"


@pytest.mark.slow
@pytest.mark.ray
def test_job_uses_the_sites_cluster_names_a_lacking_group_and_leaves_it_running(tmp_path, site_cluster):
    site = {"ray_address": site_cluster.address, "ray_token_file": str(site_cluster.token)}
    token_text = site_cluster.token.read_text()
    site_cluster.start_node(0, "trainer", HEAD_IP)

    # Only the trainer node is there: the job says what the rollout group lacks, and how to fix it.
    lacking = make_test_plan(tmp_path / "lacking", trainer_nodes=1, rollout_nodes=1, gpus=1, site=site, local_run=True)
    outcome = run_local(lacking, driver_argv=smoke_driver_argv(lacking), ready_timeout_s=1)
    assert outcome.status == "not-ready", outcome.message
    msg = outcome.message
    assert f"existing Ray cluster at {site_cluster.address}" in msg
    assert "group rollout needs 1 node(s) labelled beam-group=rollout with resource(s) beam_rollout and 1 GPU(s)" in msg
    assert "the cluster has 0 such node(s) with 0 GPU(s)" in msg and "group trainer needs" not in msg
    assert f"It has: trainer: {HEAD_IP} (1 GPUs); rollout: none" in msg
    assert f"ray start --address={site_cluster.address} --labels=beam-group=rollout" in msg
    seg = Path(outcome.segment_dir)
    assert not list(seg.glob("node-*.log")) and not (seg / "nodes").exists()  # no node step started
    head_id = json.loads((seg / "ready.json").read_text())["joined"]["trainer"]["hosts"][0]["node_id"]

    # With the rollout node there, the smoke job runs on the site's cluster.
    site_cluster.start_node(1, "rollout", WORKER_IP)
    raylets = site_cluster.raylet_pids()
    assert len(raylets) == 2
    plan = make_test_plan(tmp_path / "run", trainer_nodes=1, rollout_nodes=1, gpus=1, site=site, local_run=True)
    outcome = run_local(plan, driver_argv=smoke_driver_argv(plan), ready_timeout_s=60)
    assert outcome.status == "completed", outcome.message
    smoke = json.loads(Path(plan.output_dir, "smoke.json").read_text())
    assert smoke["ok"] and smoke["address"] == site_cluster.address
    assert {(t["role"], t["ip"]) for t in smoke["tasks"]} == {("trainer", HEAD_IP), ("rollout", WORKER_IP)}
    assert not list(Path(outcome.segment_dir).glob("node-*.log"))  # again no Ray of its own
    ready = json.loads(Path(outcome.segment_dir, "ready.json").read_text())
    ids = {g: [h["node_id"] for h in ready["joined"][g]["hosts"]] for g in ("trainer", "rollout")}
    assert ids["trainer"] == [head_id]  # the first job left the head as it was

    # Nothing of the cluster was stopped or removed; everything of the jobs was.
    assert all(procs.running(p) for p in raylets) and sorted(site_cluster.raylet_pids()) == sorted(raylets)
    assert site_cluster.alive_nodes() == {head_id: HEAD_IP, ids["rollout"][0]: WORKER_IP}
    assert site_cluster.token.read_text() == token_text
    assert all(Path(d).is_dir() for d in site_cluster.temp_dirs)
    for p in (lacking, plan):
        assert gone(lambda p=p: tagged_pids(f"{p.run_id}.l{os.getpid()}.0")) == []  # run_local's job tag
        assert not Path(p.output_dir, ".ray-auth").exists()  # the job made no token of its own
    assert gone(lambda: glob(f"/tmp/beam-l{os.getpid()}.0-*")) == []


LOCAL = {"name": "t", "container": {"runtime": "host"}}


def test_site_names_an_address_only_with_a_token_file():
    with pytest.raises(InputError, match=r"ray_token_file: the site names an existing Ray cluster \(ray_address "
                                          r"10\.0\.0\.1:6379\) but no token file; set ray_token_file"):
        site_from_dict({**LOCAL, "ray_address": "10.0.0.1:6379"}, "s.yaml")
    with pytest.raises(InputError, match="ray_address: ray_token_file is set"):
        site_from_dict({**LOCAL, "ray_token_file": "/etc/ray/token"}, "s.yaml")
    for bad in ("ray://10.0.0.1:10001", "auto", "10.0.0.1", "10.0.0.1:99999"):
        with pytest.raises(InputError, match=f"ray_address: '{bad}' is not the existing cluster's GCS address"):
            site_from_dict({**LOCAL, "ray_address": bad, "ray_token_file": "/t"}, "s.yaml")
    with pytest.raises(InputError, match="ray_token_file: 'token' is relative"):
        site_from_dict({**LOCAL, "ray_address": "h:6379", "ray_token_file": "token"}, "s.yaml")
    site = with_existing_ray(site_from_dict(LOCAL), "h:6379", "/etc/ray/token")
    assert (site.ray_address, site.ray_token_file) == ("h:6379", "/etc/ray/token")
    assert with_existing_ray(site, None, None) is site


def test_cli_ray_address_goes_into_the_plan_and_needs_a_token_file(tmp_path, capsys):
    out = tmp_path / "plan.json"
    common = ["recipes/tiny.yaml", "--site", "env/local.yaml", "--output-dir", str(tmp_path / "run"),
              "--set", f"data.dir={tmp_path}/data", "--set", f"model.path={tmp_path}/model"]
    args = ["render", *common, "-o", str(tmp_path / "job.sbatch"), "--plan-json", str(out),
            "--ray-address", "10.0.0.1:6379"]
    assert cli.main(args) == 2
    assert "ray_token_file: the site names an existing Ray cluster" in capsys.readouterr().err
    assert cli.main(args + ["--ray-token-file", "/etc/ray/token"]) == 0
    site = json.loads(out.read_text())["site"]
    assert (site["ray_address"], site["ray_token_file"]) == ("10.0.0.1:6379", "/etc/ray/token")
    assert (tmp_path / "job.sbatch").stat().st_mode & 0o777 == 0o755  # published whole, executable
    assert not list(tmp_path.glob(".*.tmp")), "render's atomic writes leave no temporary behind"
    capsys.readouterr()
    submit = ["submit", *common, "--ray-address", "10.0.0.1:6379", "--ray-token-file", "/etc/ray/token", "--dry-run"]
    assert cli.main(submit) == 0
    assert "Ray: the site's running cluster at 10.0.0.1:6379 (the job starts none)" in capsys.readouterr().out
