"""beam_hpc.node.ray_node: ports, addresses, `ray start` command lines, environment, token, stragglers."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from polling import gone, poll_until

from beam_hpc.config.site import NetworkSpec, RayPortSpec, load_site
from beam_hpc.node.ray_node import (
    LEAN_RAY_CLI,
    LOOPBACK_MAX_NODES,
    PORT_KINDS,
    ClusterRuntime,
    RayNode,
    RayNodeError,
    check_object_store,
    clean_env,
    gpus_from_slurm,
    group_resources,
    loopback_ip,
    node_ip,
    node_private_dir,
    ray_env,
    ray_ports,
    ray_start_argv,
    sweep,
    tagged_pids,
    temp_dir_for,
    write_token,
)

ROOT = Path(__file__).resolve().parents[2]
LOCAL_SITE = load_site(ROOT / "env" / "local.yaml")


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except OSError:
        return 32768


def test_ports_are_distinct_per_kind_and_per_job_and_stay_in_their_bands():
    spec = RayPortSpec(gcs_port_base=21000, port_span=1000)
    a, b = ray_ports(spec, 1234), ray_ports(spec, 1235)
    values = list(vars(a).values())
    assert len(set(values)) == len(PORT_KINDS)
    assert not set(values) & set(vars(b).values()), "two concurrent jobs must not share a port"
    assert a.gcs == 21000 + 1234 % 1000
    for k, kind in enumerate(PORT_KINDS):
        assert 21000 + k * 1000 <= getattr(a, kind) < 21000 + (k + 1) * 1000


def test_loopback_nodes_of_one_job_get_distinct_node_ports_but_one_gcs():
    spec = LOCAL_SITE.ray
    nodes = [ray_ports(spec, 77, i, LOOPBACK_MAX_NODES) for i in range(4)]
    assert len({n.gcs for n in nodes}) == 1 and len({n.client_server for n in nodes}) == 1
    per_node = [p for n in nodes for k, p in vars(n).items() if k not in ("gcs", "client_server")]
    assert len(per_node) == len(set(per_node))
    other_job = [p for i in range(4) for p in vars(ray_ports(spec, 78, i, LOOPBACK_MAX_NODES)).values()]
    assert not set(per_node) & set(other_job)


def test_local_site_ports_stay_below_the_ephemeral_range():
    top = LOCAL_SITE.ray.gcs_port_base + len(PORT_KINDS) * LOCAL_SITE.ray.port_span
    assert top <= _ephemeral_low()


def test_port_bands_beyond_65535_are_refused_naming_the_fields():
    with pytest.raises(RayNodeError, match="ray.gcs_port_base=60000 with ray.port_span=2000"):
        ray_ports(RayPortSpec(gcs_port_base=60000, port_span=2000), 1)


def test_loopback_addresses_skip_127_0_0_1_and_are_bounded():
    assert loopback_ip(0) == "127.0.0.10" and loopback_ip(3) == "127.0.0.13"
    assert node_ip(NetworkSpec(ip_source="loopback"), 2) == "127.0.0.12"
    with pytest.raises(RayNodeError, match="loopback simulation supports"):
        loopback_ip(LOOPBACK_MAX_NODES)


def test_interface_address_is_read_from_the_kernel_and_a_wrong_name_is_explained():
    assert node_ip(NetworkSpec(ip_source="interface", interface="lo"), 0) == "127.0.0.1"
    with pytest.raises(RayNodeError, match="network.interface: 'nope0'"):
        node_ip(NetworkSpec(ip_source="interface", interface="nope0"), 0)


def test_gpu_count_comes_from_slurm_then_cuda_visible_devices():
    assert gpus_from_slurm({"SLURM_GPUS_ON_NODE": "2", "CUDA_VISIBLE_DEVICES": "0"}) == 2
    assert gpus_from_slurm({"CUDA_VISIBLE_DEVICES": "0,1,2"}) == 3
    assert gpus_from_slurm({"CUDA_VISIBLE_DEVICES": ""}) == 0
    assert gpus_from_slurm({}) is None


def _node(index: int, roles=("trainer",), gpus=2, group="trainer") -> RayNode:
    return RayNode(group=group, roles=roles, index=index, ip=loopback_ip(index), head_ip=loopback_ip(0),
                   ports=ray_ports(LOCAL_SITE.ray, 42, index, LOOPBACK_MAX_NODES), num_cpus=2, num_gpus=gpus,
                   object_store_bytes=200_000_000, temp_dir=temp_dir_for("42", 0, index))


def _flags(argv: list[str]) -> dict[str, str]:
    return dict(a[2:].split("=", 1) for a in argv if a.startswith("--") and "=" in a)


def test_head_argv_pins_ports_labels_resources_and_turns_dashboard_and_stats_off():
    node = _node(0)
    argv = ray_start_argv(node, "/py")
    assert argv[:5] == ["/py", "-c", LEAN_RAY_CLI, "start", "--block"]
    f = _flags(argv)
    assert "--head" in argv and "--disable-usage-stats" in argv
    assert f["port"] == str(node.ports.gcs) and f["include-dashboard"] == "false"
    assert f["node-ip-address"] == "127.0.0.10" and f["num-gpus"] == "2" and f["num-cpus"] == "2"
    assert f["labels"] == "beam-group=trainer"
    assert json.loads(f["resources"]) == {"beam_trainer": 2.0}
    assert f["temp-dir"] == "/tmp/beam-42.0-0/r"
    for kind in ("node-manager", "object-manager", "dashboard-agent-grpc", "dashboard-agent-listen",
                 "runtime-env-agent", "metrics-export", "ray-client-server"):
        assert f[f"{kind}-port"].isdigit()
    assert "address" not in f


def _run_lean_cli(tmp_path: Path, *, has_client_check: bool) -> dict[str, object]:
    """LEAN_RAY_CLI run against a stand-in ``ray.scripts.scripts`` (a module of two names: the
    client check, where ``has_client_check``, and ``main``, which prints what the real CLI would
    get: its argv and whether Ray Client counts as installed). The real CLI is run by
    tests/job/test_job_slurm.py; this covers the branch a Ray without the name takes."""
    pkg = tmp_path / "ray" / "scripts"
    pkg.mkdir(parents=True)
    (tmp_path / "ray" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    check = "def get_ray_client_dependency_error():\n    return None\n" if has_client_check else ""
    (pkg / "scripts.py").write_text(
        "import json, sys\n" + check
        + "def main():\n"
        "    err = globals().get('get_ray_client_dependency_error', lambda: None)()\n"
        "    print(json.dumps({'argv': sys.argv[1:], 'client': err is None}))\n"
        "    return 0\n")
    out = subprocess.run([sys.executable, "-c", LEAN_RAY_CLI, "start", "--head", "--port=1",
                          "--ray-client-server-port=2"], env={**os.environ, "PYTHONPATH": str(tmp_path)},
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def test_lean_cli_turns_ray_client_off_where_it_can_and_keeps_the_jobs_port_where_it_cannot(tmp_path):
    off = _run_lean_cli(tmp_path / "a", has_client_check=True)
    assert off == {"argv": ["start", "--head", "--port=1"], "client": False}
    kept = _run_lean_cli(tmp_path / "b", has_client_check=False)  # never Ray's default 10001
    assert kept == {"argv": ["start", "--head", "--port=1", "--ray-client-server-port=2"], "client": True}


def test_worker_argv_joins_the_head_and_colocated_nodes_carry_both_group_resources():
    node = _node(1, roles=("trainer", "rollout"))
    f = _flags(ray_start_argv(node, "python3"))
    assert "--head" not in ray_start_argv(node, "python3")
    assert f["address"] == f"127.0.0.10:{node.ports.gcs}"
    assert json.loads(f["resources"]) == {"beam_trainer": 2.0, "beam_rollout": 2.0}
    assert group_resources(("rollout",), 0) == {"beam_rollout": 1.0}  # GPU-less nodes still pin


def test_temp_dir_is_short_enough_for_ray_sockets():
    path = temp_dir_for("123456789", 12, 15)
    assert path == "/tmp/beam-123456789.12-15/r"  # inside the node's private directory
    assert path.startswith(node_private_dir("123456789", 12, 15) + "/")
    with pytest.raises(RayNodeError, match="too long"):
        temp_dir_for("1", 0, 0, root="/tmp/" + "x" * 60)


def test_object_store_must_fit_dev_shm_and_ray_minimum():
    check_object_store(100_000_000)
    with pytest.raises(RayNodeError, match="do not fit in /dev/shm"):
        check_object_store(10**18)
    with pytest.raises(RayNodeError, match="below Ray's minimum"):
        check_object_store(1000)


def test_env_drops_launcher_variables_and_sets_token_mode_explicitly(tmp_path):
    base = {"PATH": "/bin", "SLURM_PROCID": "3", "SLURM_STEP_ID": "1", "PMI_RANK": "3", "PMIX_RANK": "3",
            "OMPI_COMM_WORLD_RANK": "3", "RAY_AUTH_TOKEN": "stale", "RAY_ADDRESS": "elsewhere:6379",
            "CUDA_VISIBLE_DEVICES": "0,1",
            # pyxis sets these per task in a PyTorch image, enroot's optional hook the rest: torch.distributed
            # in a Ray worker would take itself for rank 3 of the srun step
            "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "n1", "MASTER_PORT": "61000"}
    cleaned = clean_env(base)
    assert cleaned == {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "0,1"}
    env = ray_env(token_path=str(tmp_path / "token"), job_tag="run.7.0", node_index=2)
    assert env["RAY_AUTH_MODE"] == "token" and env["RAY_AUTH_TOKEN_PATH"] == str(tmp_path / "token")
    assert env["RAY_USAGE_STATS_ENABLED"] == "0" and env["BEAM_RAY_JOB"] == "run.7.0"
    assert env["BEAM_RAY_NODE"] == "2"


def test_token_is_private_random_and_written_atomically(tmp_path):
    t1 = write_token(tmp_path / ".ray-auth" / "7-0")
    t2 = write_token(tmp_path / ".ray-auth" / "8-0")
    assert stat.S_IMODE(t1.stat().st_mode) == 0o600
    assert stat.S_IMODE(t1.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(t1.parent.parent.stat().st_mode) == 0o700
    assert len(t1.read_text()) == 64 and t1.read_text() != t2.read_text()
    assert not [p for p in t1.parent.iterdir() if p.name != "token"]


def test_runtime_round_trips_and_names_nodes(tmp_path):
    rt = ClusterRuntime(job_id="7", job_num=7, restart=1, job_tag="r.7.1", head_ip="127.0.0.10", gcs_port=21007,
                        host_stride=16, token_path="/x/token", segment_dir=str(tmp_path), nonce="ab",
                        deadline=1.0, nodelists={"trainer": ["n1", "n2"], "rollout": ["n3"]})
    rt.write()
    back = ClusterRuntime.load(rt.path)
    assert back == rt and back.address == "127.0.0.10:21007"
    assert back.node_name("rollout", 0) == "n3" and back.node_name("rollout", 5) == "rollout node 5"


def _sleeper(tag: str) -> subprocess.Popen:
    env = dict(os.environ, BEAM_RAY_JOB=tag, BEAM_RAY_NODE="0")
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env)


def test_sweep_stops_exactly_this_jobs_processes_by_pid():
    mine, other = _sleeper("test-sweep.1.0"), _sleeper("test-sweep.2.0")
    try:
        poll_until(lambda: mine.pid in tagged_pids("test-sweep.1.0"), 5, 0.05)
        assert tagged_pids("test-sweep.1.0", node_index=0) == [mine.pid]
        assert gone(lambda: tagged_pids("test-sweep.1.0", node_index=1)) == []
        assert sweep("test-sweep.1.0", grace_s=2.0) == [mine.pid]
        assert mine.wait(timeout=5) != 0
        assert other.poll() is None, "another job's process must survive"
    finally:
        for p in (mine, other):
            p.kill()
            p.wait()


def test_no_bundled_site_puts_a_port_band_where_the_kernel_hands_out_ports() -> None:
    """Every band (Ray's, the weight sync's, the engines', the rollout service's) of env/*.yaml and of
    `execute`'s own laptop site lies outside this machine's ephemeral range and above Ray's worker
    ports. (The laptop site's runtime-env agent port once sat at 44217, inside the range: another
    process held it and the rollout node's raylet died mid-run, failing `execute`.)"""
    from beam_hpc.cli.execute import LAPTOP_SITE
    from beam_hpc.config.site import site_from_dict
    from beam_hpc.node import procs
    from beam_hpc.plan.ports import BANDS, ephemeral_overlap, highest_port

    ephemeral = procs.ephemeral_ports() or (32768, 60999)
    sites = {p.name: load_site(p) for p in sorted((ROOT / "env").glob("*.yaml"))}
    sites["execute's laptop site"] = site_from_dict({**LAPTOP_SITE, "python": sys.executable}, "<laptop>")
    for name, site in sites.items():
        assert ephemeral_overlap(site.ray, ephemeral) is None, (name, site.ray, ephemeral)
        assert site.ray.gcs_port_base > 19999 and highest_port(site.ray, BANDS) <= 65535, (name, site.ray)
    # and the check itself finds an overlap where there is one
    assert ephemeral_overlap(RayPortSpec(gcs_port_base=20000, port_span=1500), (32768, 60999)) == (32768, 36499)
