"""One Ray node of the job: its `ray start` command line, environment, ports, address and temp dir.

Why each choice:

- Ports are pinned per job, in bands (:mod:`beam_hpc.plan.ports`), so that two jobs on shared
  nodes never collide, as Ray's fixed defaults (client server 10001, dashboard agent 52365) would.
- Temp dir: one per job and node, short (Ray's AF_UNIX sockets live under it), on node-local /tmp.
- Token authentication: one random token per job (0600, in a 0700 directory on the run
  directory), ``RAY_AUTH_MODE=token`` set explicitly in every process, so that a stray
  ``~/.ray/auth_token`` or a changed Ray default cannot make processes of one job disagree.
- The srun task's PMI/MPI/Slurm variables, and the ranks a container runtime sets per task (pyxis's
  RANK and LOCAL_RANK), are cleared for Ray and all it spawns.
- Simulated nodes on one host use 127.0.0.(10 + index): Ray rewrites 127.0.0.1.

This module imports no Ray code: it only builds command lines and checks the node.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from beam_hpc import fault_hooks
from beam_hpc.config.site import NetworkSpec, RayPortSpec
from beam_hpc.errors import RuntimeFailure
from beam_hpc.files import write_atomic, write_json_atomic  # write_json_atomic: re-exported
from beam_hpc.node import procs
from beam_hpc.plan.paths import SegmentPaths
from beam_hpc.plan.ports import RAY_PORT_KINDS, band_port, highest_port
from beam_hpc.plan.ray_labels import GROUP_LABEL_KEY, GROUP_RESOURCE_PREFIX

PORT_KINDS = RAY_PORT_KINDS  # the port bands: beam_hpc.plan.ports
LOOPBACK_FIRST_HOST = 10  # node i of a loopback simulation is 127.0.0.(10 + i)
LOOPBACK_MAX_NODES = 16  # Ray nodes of one job sharing a host; also the per-job slot stride
SOCKET_PATH_MAX = 107  # AF_UNIX sun_path limit (108 bytes with the NUL)
# The longest socket path Ray creates below its temp dir (session dir name with a 7-digit pid).
RAY_SOCKET_SUFFIX = "/session_2026-12-02_16-53-50_123456_1234567/sockets/plasma_store"
# Node-local. Apptainer binds the host's /tmp by default; under pyxis, enroot gives each container a fresh
# tmpfs there, so the launcher mounts the host's /tmp into every container of the job
# (beam_hpc.node.container.srun_options): Ray's Unix sockets below it must reach the batch host's driver.
TEMP_ROOT = "/tmp"
RAYLET_START_WAIT_S = 180
MIN_OBJECT_STORE_BYTES = 78_643_200  # Ray refuses less than 75 MiB
GB = 10**9

JOB_TAG_VAR = "BEAM_RAY_JOB"  # marks every process of a job's Ray cluster (stragglers by PID)
NODE_TAG_VAR = "BEAM_RAY_NODE"
# Variables of the srun task and of MPI launchers that must not leak into Ray's workers: they describe
# the srun task, and libraries that read them (MPI, Lightning, torch.distributed) would otherwise take
# a Ray worker for rank N of a Slurm step.
CLEARED_PREFIXES = ("SLURM_", "SLURMD_", "PMI_", "PMIX_", "OMPI_", "MPI_", "I_MPI_", "HYDRA_", "MV2_")
# What a container runtime sets per srun task for torch.distributed's env:// rendezvous: pyxis sets RANK
# and LOCAL_RANK from SLURM_PROCID/SLURM_LOCALID when the image has PYTORCH_VERSION (NGC images;
# NVIDIA/pyxis 1075199, pyxis_slurmstepd.c pytorch_setup), enroot's optional hook adds MASTER_ADDR,
# MASTER_PORT and WORLD_SIZE (NVIDIA/enroot 8ea147d, conf/hooks/extra/50-slurm-pytorch.sh). A Ray
# worker or a backend's process group that read them would take itself for rank N of the srun step.
TASK_RANK_NAMES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
CLEARED_NAMES = frozenset({"PMI_RANK", "PMI_SIZE", "RAY_ADDRESS", "RAY_AUTH_TOKEN", *TASK_RANK_NAMES})


class RayNodeError(RuntimeFailure):
    """This node cannot host its Ray node as configured; the message names the setting to change."""


@dataclass(frozen=True)
class RayPorts:
    """Every port one Ray node of the job binds (head-only ones are unused on workers)."""

    gcs: int
    client_server: int
    node_manager: int
    object_manager: int
    dashboard_agent_grpc: int
    dashboard_agent_listen: int
    runtime_env_agent: int
    metrics_export: int


def ray_ports(spec: RayPortSpec, job_num: int, host_slot: int = 0, host_stride: int = 1) -> RayPorts:
    """Ports of one Ray node: ``base + kind * span + (job_num * host_stride + host_slot) % span``.

    ``host_stride`` is 1 on a real cluster (one Ray node of a job per host) and
    LOOPBACK_MAX_NODES when several simulated nodes share a host (``host_slot`` = node index):
    Ray binds most ports on all interfaces, so nodes sharing a host need slots of their own.
    The GCS and client-server ports are the head's (slot 0).
    """
    span, base = spec.port_span, spec.gcs_port_base
    top = highest_port(spec)
    if top > 65535:
        raise RayNodeError(
            f"site ray.gcs_port_base={base} with ray.port_span={span} needs ports up to {top} "
            f"({len(PORT_KINDS)} bands of port_span); lower ray.gcs_port_base or ray.port_span"
        )
    if not 0 <= host_slot < host_stride:
        raise RayNodeError(f"node slot {host_slot} outside 0..{host_stride - 1}")

    def port(kind: str, slot: int) -> int:
        return band_port(spec, kind, job_num * host_stride + slot)

    per_node = {k: port(k, host_slot) for k in PORT_KINDS}
    per_node["gcs"] = port("gcs", 0)
    per_node["client_server"] = port("client_server", 0)
    return RayPorts(**per_node)


def loopback_ip(index: int) -> str:
    """127.0.0.(10 + index): a loopback address Ray does not rewrite (it rewrites 127.0.0.1)."""
    if not 0 <= index < LOOPBACK_MAX_NODES:
        raise RayNodeError(
            f"loopback simulation supports {LOOPBACK_MAX_NODES} nodes per host; node {index} is "
            "beyond that (use network.ip_source: interface or hostname on a real cluster)"
        )
    return f"127.0.0.{LOOPBACK_FIRST_HOST + index}"


def node_ip(network: NetworkSpec, index: int) -> str:
    """The address this node's Ray binds to and advertises, from the site's network setting."""
    if network.ip_source == "loopback":
        return loopback_ip(index)
    if network.ip_source == "interface":
        return _interface_ipv4(network.interface or "")
    host = socket.gethostname()
    try:
        infos = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)
    except socket.gaierror as err:
        raise RayNodeError(
            f"network.ip_source: hostname {host!r} does not resolve ({err}); set "
            "network.ip_source: interface with network.interface (e.g. ib0)"
        ) from None
    ips = [str(i[4][0]) for i in infos]
    routable = [ip for ip in ips if not ip.startswith("127.")]
    if not routable:
        raise RayNodeError(
            f"network.ip_source: hostname {host!r} resolves only to {ips} (loopback), which other "
            "nodes cannot reach; set network.ip_source: interface with network.interface"
        )
    return routable[0]


def _interface_ipv4(name: str) -> str:
    import fcntl
    import struct

    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), siocgifaddr, struct.pack("256s", name[:15].encode()))
        except OSError as err:
            have = ", ".join(n for _, n in socket.if_nameindex())
            raise RayNodeError(
                f"network.interface: {name!r} has no IPv4 address on {socket.gethostname()} "
                f"({err.strerror}); interfaces here: {have}"
            ) from None
    return socket.inet_ntoa(packed[20:24])


def gpus_from_slurm(env: Mapping[str, str]) -> int | None:
    """GPUs Slurm gave this task: SLURM_GPUS_ON_NODE, else the length of CUDA_VISIBLE_DEVICES."""
    from beam_hpc.slurm.environment import SlurmEnvironment

    gpus = SlurmEnvironment(env).gpus_on_node
    if gpus is not None:
        return gpus
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    if cvd is None:
        return None
    return len([d for d in cvd.split(",") if d.strip() and d.strip() != "NoDevFiles"])


def cpus_from_slurm(env: Mapping[str, str]) -> int | None:
    from beam_hpc.slurm.environment import SlurmEnvironment

    return SlurmEnvironment(env).cpus_on_node


def node_private_dir(job_id: str, restart: int, index: int, root: str = TEMP_ROOT) -> str:
    """``/tmp/beam-<job>.<restart>-<node>``: this node's own directory, mode 0700, unique per job,
    segment and node. Ray's temp dir lives inside it (:func:`temp_dir_for`)."""
    return f"{root.rstrip('/')}/beam-{job_id}.{restart}-{index}"


def temp_dir_for(job_id: str, restart: int, index: int, root: str = TEMP_ROOT) -> str:
    """Ray's ``--temp-dir``: ``<node_private_dir>/r``, short enough that Ray's deepest socket path
    stays under the AF_UNIX limit.

    Why one level down: `ray start` makes its ``--temp-dir`` world-writable (mode 0777, seen with
    Ray 2.60), and its sockets and session files sit below it. Inside the node's 0700 directory no
    other user can reach them, whatever mode Ray gives its own directory."""
    path = f"{node_private_dir(job_id, restart, index, root)}/r"
    if len(path) + len(RAY_SOCKET_SUFFIX) >= SOCKET_PATH_MAX:
        raise RayNodeError(
            f"Ray temp dir {path!r} is too long: Ray's sockets below it would exceed "
            f"{SOCKET_PATH_MAX} bytes; use a shorter temp root"
        )
    return path


def temp_dir_prefix(job_id: str, restart: int, root: str = TEMP_ROOT) -> str:
    return f"{root.rstrip('/')}/beam-{job_id}.{restart}-"


def check_object_store(nbytes: int, shm: str = "/dev/shm") -> None:
    """Ray puts its object store in /dev/shm and refuses (or, when allowed, silently goes slow)
    when it does not fit: fail here with the setting to change instead."""
    if nbytes < MIN_OBJECT_STORE_BYTES:
        raise RayNodeError(
            f"site ray.object_store_gb: {nbytes / GB:.3f} GB is below Ray's minimum of "
            f"{MIN_OBJECT_STORE_BYTES / GB:.3f} GB; raise it"
        )
    st = os.statvfs(shm)
    free = st.f_bavail * st.f_frsize
    if nbytes > free:
        raise RayNodeError(
            f"site ray.object_store_gb: {nbytes} bytes do not fit in {shm} on {socket.gethostname()} "
            f"({free} bytes free); lower ray.object_store_gb or ask for nodes with a larger {shm}"
        )


def group_resources(roles: Iterable[str], units: int) -> dict[str, float]:
    """The group's Ray custom resources: one ``beam_<role>`` per role (colocated: both), ``units``
    of each (the node's GPUs, or its CPUs on GPU-less nodes), so a bundle of one GPU plus one
    ``beam_trainer`` can only land on a trainer node."""
    return {f"{GROUP_RESOURCE_PREFIX}{role}": float(max(units, 1)) for role in roles}


@dataclass(frozen=True)
class RayNode:
    """Everything `ray start` needs on one node. ``index`` is the node's index across all groups
    (het group order, then node order); index 0 is the head."""

    group: str
    roles: tuple[str, ...]
    index: int
    ip: str
    head_ip: str
    ports: RayPorts
    num_cpus: int
    num_gpus: int
    object_store_bytes: int
    temp_dir: str

    @property
    def is_head(self) -> bool:
        return self.index == 0

    @property
    def gcs_address(self) -> str:
        return f"{self.head_ip}:{self.ports.gcs}"


# Ray's CLI module imports its `serve`, `job` and state (`list`, `get`, `summary`, `logs`) command
# groups when it loads, each inside a try that skips the group if its import fails (as on a minimal
# Ray). Where they import (Ray Serve comes with fastapi and pandas, which Miles's image and the tests
# have), that is about 0.85 CPU-s of each `ray start`, on every node of every job. Marking the three
# modules absent makes the CLI skip them; `ray start` is untouched. Inline (``python -c``) rather
# than a beam_hpc module, because under Apptainer this runs in the image, which need not hold beam_hpc.
#
# The same code keeps the head from starting Ray Client's server (``ray://``), which beam-hpc never
# uses: one less port that runs code for whoever reaches it, and one less process (about 0.85 CPU-s
# a job). Ray has no flag for it: `ray start --head` starts the server whenever its dependencies
# import, on 10001 unless told a port. The CLI decides that through its own name
# ``get_ray_client_dependency_error``; where that name exists, it is made to report the client as
# absent and the port flag is dropped; where a Ray of the image lacks it, the flag stays and the
# server runs on the job's own port, as before.
#
# And it makes ``ray start`` wait as long as RAY_raylet_start_wait_time_s says (ray_env sets
# RAYLET_START_WAIT_S) for its raylet to register with the GCS. Ray 2.60's `ray start` ignores that
# variable (a constant 30 s in ``ray._private.node.Node.__init__``; only Ray's C++ side reads it): a
# raylet slower than that to register, as on a loaded host or behind a busy head, fails the node
# ("The current node timed out during startup") and the node step starts Ray again from scratch.
# The loop asks ``ray._private.services.get_node``, which raises RuntimeError until the node is
# registered; that call is made to keep asking until the wait is over, so the loop's first answer
# is the registration (or, after the wait, the same error as before).
RAY_CLI_UNUSED_GROUPS = ("ray.serve.scripts", "ray.dashboard.modules.job.cli", "ray.util.state.state_cli")
CLIENT_SERVER_FLAG = "--ray-client-server-port="
LEAN_RAY_CLI = (
    "import sys\n"
    f"for name in {RAY_CLI_UNUSED_GROUPS!r}:\n"
    "    sys.modules[name] = None\n"
    "import ray.scripts.scripts as cli\n"
    "if hasattr(cli, 'get_ray_client_dependency_error'):\n"
    "    cli.get_ray_client_dependency_error = lambda: ImportError('Ray Client is off in beam-hpc jobs')\n"
    f"    sys.argv = [a for a in sys.argv if not a.startswith({CLIENT_SERVER_FLAG!r})]\n"
    "try:\n"
    "    import ray._private.services as services\n"
    "except ImportError:\n"
    "    services = None\n"
    "if sys.argv[1:2] == ['start'] and hasattr(services, 'get_node'):\n"
    "    import os, time\n"
    "    wait_s = float(os.environ.get('RAY_raylet_start_wait_time_s', '30'))\n"
    "    asked = services.get_node\n"
    "    def get_node(*args, **kwargs):\n"
    "        deadline = time.monotonic() + wait_s\n"
    "        while True:\n"
    "            try:\n"
    "                return asked(*args, **kwargs)\n"
    "            except RuntimeError:\n"
    "                if time.monotonic() > deadline:\n"
    "                    raise\n"
    "                time.sleep(0.5)\n"
    "    services.get_node = get_node\n"
    "sys.exit(cli.main())\n"
)


def ray_cli_argv(python: str, *args: str) -> list[str]:
    """A Ray CLI command (``start``, ``status``...) through :data:`LEAN_RAY_CLI`: no PATH lookup of
    ``ray``, and no command groups loaded that it does not run."""
    return [python, "-c", LEAN_RAY_CLI, *args]


def ray_start_argv(node: RayNode, python: str) -> list[str]:
    """``ray start --block`` for one node (see :func:`ray_cli_argv`)."""
    p = node.ports
    units = node.num_gpus or node.num_cpus
    argv = [
        *ray_cli_argv(python, "start", "--block"),
        f"--node-ip-address={node.ip}",
        f"--num-cpus={node.num_cpus}",
        f"--num-gpus={node.num_gpus}",
        f"--object-store-memory={node.object_store_bytes}",
        f"--resources={json.dumps(group_resources(node.roles, units), sort_keys=True)}",
        f"--labels={GROUP_LABEL_KEY}={node.group}",
        f"--temp-dir={node.temp_dir}",
        "--disable-usage-stats",
        f"--node-manager-port={p.node_manager}",
        f"--object-manager-port={p.object_manager}",
        f"--dashboard-agent-grpc-port={p.dashboard_agent_grpc}",
        f"--dashboard-agent-listen-port={p.dashboard_agent_listen}",
        f"--runtime-env-agent-port={p.runtime_env_agent}",
        f"--metrics-export-port={p.metrics_export}",
        "--log-style=record",
        "--log-color=false",
    ]
    if node.is_head:
        # --no-monitor: the autoscaler's monitor process has nothing to scale in a Slurm
        # allocation (its nodes are fixed for the job's life); it is one Python process polling
        # the GCS for as long as the job runs.
        argv += ["--head", f"--port={p.gcs}", f"{CLIENT_SERVER_FLAG}{p.client_server}",
                 "--include-dashboard=false", "--no-monitor"]
    else:
        argv.append(f"--address={node.gcs_address}")
    if fault_hooks.hangs_ray_start(node.index):
        return [python, "-c", "import time\nwhile True: time.sleep(60)", "hung ray start", *argv[3:]]
    return argv


def clean_env(base: Mapping[str, str]) -> dict[str, str]:
    """``base`` without the srun task's and MPI launchers' variables, and without any Ray address
    or token inherited from the caller (the job sets its own)."""
    return {k: v for k, v in base.items() if not k.startswith(CLEARED_PREFIXES) and k not in CLEARED_NAMES}


def ray_env(*, token_path: str, job_tag: str, node_index: int | None = None) -> dict[str, str]:
    """The variables every process of the job's Ray cluster gets (Ray nodes, the readiness
    poller, the driver): token auth (Ray >= 2.52) set explicitly, usage stats off, fast shutdown,
    the job tag."""
    env = {
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": token_path,
        "RAY_USAGE_STATS_ENABLED": "0",
        # else SIGTERM makes a raylet drain for up to 30 s before it exits
        "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",
        # `ray start` waits this long for its raylet to register with the GCS (30 s by default);
        # a busy head (many nodes joining at once, or a loaded login-class host) can take longer,
        # and a timeout there fails the node ("The current node timed out during startup"). Ray's
        # C++ side reads it; its `ray start` does only through LEAN_RAY_CLI.
        "RAY_raylet_start_wait_time_s": str(RAYLET_START_WAIT_S),
        "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
        # When the first driver connects, a raylet starts idle Python workers (one per CPU, up to a
        # limit) in case tasks follow. beam-hpc's drivers start actors, each of which gets a worker
        # of its own when it is created, so the idle ones only cost CPU and memory at every start.
        "RAY_prestart_worker_first_driver": "false",
        "PYTHONUNBUFFERED": "1",
        JOB_TAG_VAR: job_tag,
    }
    if node_index is not None:
        env[NODE_TAG_VAR] = str(node_index)
    return env


# What the segment tells its driver about the job it runs for (the driver's environment has no
# SLURM_* variables: clean_env takes them out, as Ray's processes must not see them).
SEGMENT_VAR = "BEAM_SEGMENT"  # "<job>-<restart>", the ledger's segment id
JOB_NUM_VAR = "BEAM_JOB_NUM"  # the integer that picks the job's slot in every port band


@dataclass(frozen=True)
class DriverJob:
    """The segment a driver runs for, and its job's port slot."""

    segment: str
    job_num: int


def driver_job_env(segment: str, job_num: int) -> dict[str, str]:
    """The variables a segment gives its driver (read back by :func:`driver_job`)."""
    return {SEGMENT_VAR: segment, JOB_NUM_VAR: str(job_num)}


def driver_job(env: Mapping[str, str] | None = None) -> DriverJob | None:
    """The driver's job, from its environment; None for a driver no segment started (a test, a
    developer's own run against a Ray address)."""
    env = os.environ if env is None else env
    segment, num = env.get(SEGMENT_VAR), env.get(JOB_NUM_VAR, "")
    return DriverJob(segment, int(num)) if segment and num.isdigit() else None


def make_private_dir(path: str | Path) -> None:
    """``path`` as a directory only its owner can enter (0700), whatever the umask."""
    Path(path).mkdir(mode=0o700, exist_ok=True)
    os.chmod(path, 0o700)


def write_token(directory: str | Path) -> Path:
    """A fresh random token in ``directory/token`` (file 0600, directory 0700), written atomically."""
    d = Path(directory)
    d.parent.mkdir(parents=True, exist_ok=True)
    for p in (d.parent, d):
        make_private_dir(p)
    target = d / "token"
    write_atomic(target, secrets.token_hex(32), mode=0o600)
    return target


def tagged_pids(job_tag: str, node_index: int | None = None, proc: str = "/proc") -> list[int]:
    """PIDs on this host whose environment carries the job's tag (and node index, if given), and
    every process below them.

    Ray's processes inherit the environment of `ray start`, so this finds exactly this job's Ray
    processes, never another job's or another user's; they are then stopped by PID. The processes
    below count too: a raylet's agents rename themselves (``ray::DashboardAgent``), which can
    overwrite the environment /proc shows, tag included, and once their raylet is gone they live on
    as orphans no tag finds.
    """
    want = f"{JOB_TAG_VAR}={job_tag}".encode()
    want_node = f"{NODE_TAG_VAR}={node_index}".encode() if node_index is not None else None
    me = os.getpid()
    found = []
    for pid in procs.pids(proc):
        items = procs.environ(pid, proc) if pid != me else None
        if items is not None and want in items and (want_node is None or want_node in items):
            found.append(pid)
    return [p for p in procs.with_descendants(found, proc) if p != me] if found else []


def stop_pids(pids: Iterable[int], grace_s: float) -> list[int]:
    """SIGTERM, wait up to ``grace_s``, then SIGKILL what is left; returns the PIDs killed hard."""
    pids = list(pids)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    alive = pids
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [p for p in alive if procs.running(p)]
    for pid in alive:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    return alive


def set_parent_death_signal(sig: int = signal.SIGTERM) -> None:
    """For ``preexec_fn``: the kernel sends ``sig`` to the child when its parent dies, even by
    SIGKILL, so a Ray node or a driver never outlives the process that owns it (Linux only)."""
    import ctypes
    import sys

    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, sig, 0, 0, 0)


def sweep(job_tag: str, node_index: int | None = None, grace_s: float = 3.0) -> list[int]:
    """Stop every process of this job (or of one of its nodes) still running on this host."""
    pids = tagged_pids(job_tag, node_index)
    if pids:
        stop_pids(pids, grace_s)
    return pids


@dataclass(frozen=True)
class ClusterRuntime:
    """The facts of one segment's Ray cluster that exist only once Slurm has started the job.

    The job writes them to ``<segment dir>/runtime.json`` on the shared run directory before it
    starts any node step; every node step reads them from there. ``nonce`` is also passed on each
    node step's command line: a node that reads a different (or no) nonce does not see the run
    directory the batch host wrote, which is the shared-filesystem canary.
    """

    job_id: str
    job_num: int
    restart: int
    job_tag: str
    head_ip: str
    gcs_port: int
    host_stride: int
    token_path: str
    segment_dir: str
    nonce: str
    deadline: float  # epoch seconds by which every node must have joined
    nodelists: dict[str, list[str]]
    temp_root: str = TEMP_ROOT
    existing: bool = False  # the site's own Ray cluster (site ray_address): the job started none of it

    @property
    def address(self) -> str:
        return f"{self.head_ip}:{self.gcs_port}"

    @property
    def path(self) -> Path:
        return SegmentPaths(self.segment_dir).runtime

    @property
    def node_dir(self) -> Path:
        return SegmentPaths(self.segment_dir).node_reports

    def node_report(self, group: str, index: int) -> Path:
        return SegmentPaths(self.segment_dir).node_report(group, index)

    def node_log(self, group: str, index: int) -> Path:
        return SegmentPaths(self.segment_dir).node_log(group, index)

    def node_name(self, group: str, index: int) -> str:
        names = self.nodelists.get(group) or []
        return names[index] if index < len(names) else f"{group} node {index}"

    def write(self) -> Path:
        write_json_atomic(self.path, asdict(self))
        return self.path

    @classmethod
    def load(cls, path: str | Path) -> ClusterRuntime:
        return cls(**json.loads(Path(path).read_text()))

