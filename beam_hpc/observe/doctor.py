"""Preflight checks (`beam-hpc doctor`): is this cluster fit for a run, before an allocation is spent?

Two halves, because what can be known differs by place:
- on the login node (:func:`login_checks`): Slurm's commands and controller, the site's
  partitions, GRES and constraints, the account, the container runtime and image, the Python
  that jobs will run, and the shared paths;
- on every node of a small allocation (:func:`in_job_checks` runs :func:`node_checks` through
  ``srun``, one task per node): a shared-filesystem canary written on the login side and read on
  the node (and the other way round), node-local scratch that is not tmpfs/overlay and has room,
  ``/dev/shm`` large enough for Ray's object store, the GPU count against the site, and the Ray
  ports of a job free on the node's address.

With ``--recipe``, one more login-node line: the image's own Miles parses that recipe's driver
command (:func:`miles_parser_check`, the job's pre-Ray check from ``backends.miles.preflight``).

Each check carries the fix for its failure. Nothing here prints for people: the CLI renders the
checks (``format_checks``) and turns any failure into a non-zero exit. The node half is in this
module too (``python -m beam_hpc.observe.doctor --node``, which prints one machine-readable line for the
login side); it needs only the site schema and the runtime's own stdlib-only rules (nvme.py for
filesystems, beam_hpc.node.ray_node for addresses and ports), so the checks cannot drift from what a job does
and a node needs no more than a job does.
"""

from __future__ import annotations

import argparse
import getpass
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from beam_hpc.node import nvme
from beam_hpc.config.site import Site
from beam_hpc.slurm import client as slurm_client
from beam_hpc.slurm.client import gres_counts

if TYPE_CHECKING:
    from beam_hpc.config.recipe import Recipe

Status = Literal["pass", "fail", "warn", "skip"]
NODE_LINE_PREFIX = "BEAM-DOCTOR-NODE "
SLURM_COMMANDS = ("sbatch", "srun", "scontrol", "sinfo", "squeue")
# Filesystems that every node sees: the runtime's list (nvme.py) plus ones only shared paths meet.
SHARED_FS = frozenset(nvme.NETWORK_FS) | {"cephfs", "glusterfs", "fuse.glusterfs", "panfs", "9p", "virtiofs"}
DEFAULT_SCRATCH_GB = 1.0


@dataclass(frozen=True)
class Check:
    name: str
    status: Status
    detail: str
    fix: str = ""
    where: str = "login"  # "login" or the node name

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


def failed(checks: list[Check]) -> bool:
    return any(c.status == "fail" for c in checks)


def format_checks(checks: list[Check]) -> str:
    """The pass/fail table, then one "fix:" line under every failure and warning."""
    from beam_hpc.progress import text_table

    rows = [[c.status.upper(), c.where, c.name, c.detail] for c in checks]
    lines = [text_table(["result", "where", "check", "detail"], rows)]
    todo = [c for c in checks if c.status in ("fail", "warn") and c.fix]
    if todo:
        lines.append("")
        lines += [f"{c.status.upper()} {c.name} ({c.where}): fix: {c.fix}" for c in todo]
    n_fail = sum(c.status == "fail" for c in checks)
    lines.append("")
    lines.append(f"{n_fail} check(s) failed" if n_fail else "all checks passed")
    return "\n".join(lines)


# -- small facts about this machine ------------------------------------------------------------
def fs_type(path: str | Path) -> tuple[str, str]:
    """(filesystem type, mount point) of ``path``, or of its nearest existing parent."""
    m = nvme.mount_of(path)
    return m.fstype, m.mountpoint


def _existing_parent(path: Path) -> Path:
    p = path.absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def slurm_size_gb(text: str) -> float:
    """Slurm's size notation (``--tmp``: plain number = MB; K, M, G, T suffixes) in GB."""
    t = text.strip().upper().rstrip("B")
    scale = {"K": 1 / 1024 ** 2, "M": 1 / 1024, "G": 1.0, "T": 1024.0}
    if t and t[-1] in scale:
        return float(t[:-1]) * scale[t[-1]]
    return float(t) / 1024


def _run(argv: list[str], timeout: float = 20) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(argv, 124, "", f"{argv[0]} did not answer within {timeout:.0f} s")
    except FileNotFoundError:
        return subprocess.CompletedProcess(argv, 127, "", f"{argv[0]}: not found")


def _last_line(res: subprocess.CompletedProcess) -> str:
    text = (res.stderr or res.stdout or "").strip()
    return text.splitlines()[-1] if text else f"exit status {res.returncode}"


# -- login node --------------------------------------------------------------------------------
def login_checks(site: Site, *, output_dir: str | None = None) -> list[Check]:
    """Checks that need no allocation. ``site.python`` must already be resolved ("auto" is the
    submitting interpreter, beam_hpc.submission.submit.build_site)."""
    checks = _slurm_checks(site)
    checks += _account_check(site)
    checks += _container_checks(site)
    checks.append(_python_check(site.python))  # the batch shell's interpreter, outside any container
    checks += _shared_path_checks(site, output_dir)
    return checks


def _partitions(site: Site) -> list[tuple[str, str | None]]:
    """(groups label, partition or None for the cluster default), each partition once."""
    out: dict[str | None, list[str]] = {}
    for group in ("trainer", "rollout"):
        out.setdefault(site.partitions.for_group(group), []).append(group)
    return [("+".join(groups), part) for part, groups in out.items()]


def _slurm_checks(site: Site) -> list[Check]:
    missing = [c for c in SLURM_COMMANDS if shutil.which(c) is None]
    if missing:
        return [Check("slurm commands", "fail", f"not on PATH: {', '.join(missing)}",
                      "load Slurm's module or add its bin directory to PATH (on a login node of the cluster)")]
    checks = [Check("slurm commands", "pass", ", ".join(SLURM_COMMANDS) + " found")]
    try:
        ping = slurm_client.ping()
    except slurm_client.SlurmUnavailable as err:
        checks.append(Check("slurm controller", "fail", f"scontrol ping: {err.last_line}",
                            "check SLURM_CONF and that slurmctld runs (`scontrol ping` must say UP)"))
        return checks
    checks.append(Check("slurm controller", "pass", ping))
    names = slurm_client.partition_names()
    for groups, part in _partitions(site):
        checks += _partition_checks(site, groups, part, names)
    return checks


def _partition_checks(site: Site, groups: str, part: str | None, known: list[str]) -> list[Check]:
    label = f"partition {part or '(default)'}"
    if part is None:
        return [Check(label, "warn", f"{groups}: no partition in the site; Slurm's default partition is used",
                      f"set partitions.{groups.split('+')[0]} in the site to pin it")]
    fields = slurm_client.show_partition(part)
    if fields is None:
        return [Check(label, "fail", f"{groups}: partition {part!r} does not exist",
                      f"set partitions.{groups.split('+')[0]} in the site to one of: {', '.join(known) or '(none)'}")]
    if fields.get("State") != "UP":
        return [Check(label, "fail", f"{groups}: partition {part} is {fields.get('State')}",
                      "pick a partition that is UP (`sinfo -s`) or wait for the admins to bring it up")]
    checks = [Check(label, "pass", f"{groups}: UP, nodes {fields.get('Nodes', '?')}")]
    if site.gpus_per_node > 0:
        checks.append(_gres_check(site, part))
    for group in groups.split("+"):
        constraint = site.constraints.for_group(group)
        if constraint:
            checks.append(_constraint_check(part, group, constraint))
    return checks


def _gres_check(site: Site, part: str) -> Check:
    gres = slurm_client.partition_gres(part)
    counts = gres_counts(gres, site.gres)
    label = f"gres {site.gres} on {part}"
    if not counts or max(counts) < site.gpus_per_node:
        seen = ", ".join(sorted(set(gres.split()))) or "none"
        return Check(label, "fail", f"site wants {site.gres}:{site.gpus_per_node} per node; partition has {seen}",
                     f"set gres and gpus_per_node in the site to what `sinfo -p {part} -o %G` shows")
    return Check(label, "pass", f"{site.gres}:{max(counts)} per node (site uses {site.gpus_per_node})")


def _constraint_check(part: str, group: str, constraint: str) -> Check:
    features = slurm_client.partition_features(part)
    wanted = {w.strip("[]() ").split("*")[0] for w in constraint.replace("|", "&").split("&")}
    missing = sorted(w for w in wanted if w and w not in features)
    label = f"constraint {group}"
    if missing:
        return Check(label, "fail", f"{constraint!r}: no node of {part} has feature(s) {', '.join(missing)}",
                     f"set constraints.{group} to features of {part}: {', '.join(sorted(features)) or '(none)'}")
    return Check(label, "pass", f"{constraint!r} satisfiable in {part}")


def _account_check(site: Site) -> list[Check]:
    if not site.account:
        return [Check("account", "skip", "no account in the site: Slurm charges your default account")]
    if shutil.which("sacctmgr") is None:
        return [Check("account", "skip", f"{site.account!r} not verified: sacctmgr is not available here")]
    user = getpass.getuser()
    res = _run(["sacctmgr", "--noheader", "--parsable2", "show", "associations",
                "where", f"user={user}", f"account={site.account}", "format=Account"], timeout=15)
    if res.returncode != 0:
        return [Check("account", "skip", f"{site.account!r} not verified: sacctmgr could not answer "
                      f"({_last_line(res)})")]
    if site.account not in res.stdout.split():
        return [Check("account", "fail", f"user {user} has no association with account {site.account!r}",
                      f"set account in the site to one of `sacctmgr show associations user={user} format=Account`")]
    return [Check("account", "pass", f"{user} may charge {site.account!r}")]


def _container_checks(site: Site) -> list[Check]:
    c = site.container
    if c.runtime == "host":
        return [Check("container", "skip", "runtime host: no container")]
    exe = shutil.which("apptainer") or shutil.which("singularity")
    checks = [Check("apptainer", "pass", exe) if exe else
              Check("apptainer", "fail", "neither apptainer nor singularity is on PATH",
                    "`module load apptainer` (the site's module_loads), or set container.runtime: host")]
    image = Path(c.image or "")
    if not image.is_file():
        checks.append(Check("image", "fail", f"{image} does not exist",
                            f"build it: beam-hpc image build --output {image}, or fix container.image"))
    elif not os.access(image, os.R_OK) or image.stat().st_size == 0:
        checks.append(Check("image", "fail", f"{image} is empty or not readable by {getpass.getuser()}",
                            f"chmod a+r {image}, or rebuild it with beam-hpc image build"))
    else:
        checks.append(Check("image", "pass", f"{image} ({image.stat().st_size / 1e9:.1f} GB)"))
    return checks


def _python_check(python: str) -> Check:
    res = _run([python, "-c", "import beam_hpc"], timeout=60)
    if res.returncode != 0:
        return Check("python", "fail", f"{python}: cannot import beam_hpc ({_last_line(res)})",
                     "set python in the site to the interpreter of the venv where beam-hpc is installed")
    return Check("python", "pass", f"{python} imports beam_hpc")


def _shared_path_checks(site: Site, output_dir: str | None) -> list[Check]:
    paths = list(site.shared_paths) + ([output_dir] if output_dir else [])
    if not paths:
        return [Check("shared paths", "skip", "the site lists no shared_paths and no --output-dir was given")]
    checks = []
    for raw in paths:
        p = Path(raw)
        base = _existing_parent(p)
        fstype, mnt = fs_type(base)
        label = f"shared {raw}"
        if raw in site.shared_paths and not p.is_dir():
            checks.append(Check(label, "fail", f"{raw} does not exist here",
                                "fix shared_paths in the site: list directories every node mounts (they are bound into the container)"))
        elif not os.access(base, os.W_OK):
            checks.append(Check(label, "fail", f"{base} is not writable by {getpass.getuser()}",
                                "pick a directory you can write on shared storage (project or scratch space)"))
        elif fstype in nvme.REFUSED_FS:
            checks.append(Check(label, "fail", f"on {fstype} ({mnt}): {nvme.REFUSED_FS[fstype]}, not shared",
                                "use a directory on the cluster's shared filesystem (NFS, Lustre, GPFS...)"))
        elif fstype in SHARED_FS:
            checks.append(Check(label, "pass", f"{fstype} at {mnt}"))
        else:
            checks.append(Check(label, "warn", f"{fstype} at {mnt} is usually node-local",
                                "fine only if every node mounts this same disk; `beam-hpc doctor --in-job` "
                                "proves it with a canary"))
    return checks


# -- on a node ---------------------------------------------------------------------------------
def node_checks(site: Site, *, canary: Path | None = None, token: str | None = None,
                scratch_gb: float | None = None) -> list[Check]:
    """The checks that only a compute node can answer, for this node."""
    where = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    checks = [_canary_check(canary, token), _scratch_check(site, scratch_gb), _shm_check(site),
              _gpu_check(site), _ports_check(site)]
    return [Check(c.name, c.status, c.detail, c.fix, where) for c in checks]


def _canary_check(canary: Path | None, token: str | None) -> Check:
    if canary is None or token is None:
        return Check("shared-fs canary", "skip", "no canary: run doctor --in-job from the login node or batch shell")
    try:
        seen = (canary / "login.token").read_text().strip()
    except OSError as err:
        return Check("shared-fs canary", "fail", f"cannot read {canary}/login.token written on the login node ({err})",
                     f"{canary.parent} is not shared with this node; use a path every node mounts")
    if seen != token:
        return Check("shared-fs canary", "fail", f"{canary}/login.token holds another run's token",
                     "a stale copy is visible (not one shared filesystem); use a truly shared path")
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    (canary / f"ack-{node}-{os.environ.get('SLURM_NODEID', '0')}").write_text(token + "\n")
    return Check("shared-fs canary", "pass", f"read the login node's token in {canary.parent}")


def _scratch_check(site: Site, scratch_gb: float | None) -> Check:
    try:
        need = scratch_gb if scratch_gb is not None else (slurm_size_gb(site.tmp) if site.tmp else DEFAULT_SCRATCH_GB)
    except ValueError:
        return Check("scratch", "fail", f"site tmp: {site.tmp!r} is not a Slurm size",
                     "write tmp like 2000G or 2T (a plain number is MB)")
    if not site.scratch:
        return Check("scratch", "skip", "the site has no scratch (node-local disk) configured")
    root = Path(site.scratch)
    base = _existing_parent(root)
    fstype, mnt = fs_type(base)
    fix_local = (f"set scratch in the site to a node-local disk (e.g. /scratch, /local, $TMPDIR on NVMe); "
                 f"{root} is on {fstype}")
    if fstype in nvme.REFUSED_FS:
        return Check("scratch", "fail", f"{root} is on {fstype} ({mnt}): {nvme.REFUSED_FS[fstype]}", fix_local)
    if fstype in SHARED_FS:
        return Check("scratch", "fail", f"{root} is on {fstype} ({mnt}), shared by all nodes, not node-local",
                     fix_local)
    if not os.access(base, os.W_OK):
        return Check("scratch", "fail", f"{base} is not writable here",
                     f"ask the admins for a writable node-local dir, or point scratch at one (now {root})")
    free_gb = nvme.free_bytes(base) / nvme.GB
    if free_gb < need:
        return Check("scratch", "fail", f"{root}: {free_gb:.1f} GB free, need {need:g} GB",
                     "free space there, request nodes with more local disk (site tmp / constraints), "
                     "or lower training.offload.min_free_gb")
    return Check("scratch", "pass", f"{root} on {fstype}, {free_gb:.1f} GB free (need {need:g})")


def _shm_check(site: Site) -> Check:
    try:
        st = os.statvfs("/dev/shm")
    except OSError as err:
        return Check("/dev/shm", "fail", f"cannot stat /dev/shm ({err})",
                     "Ray's object store needs /dev/shm; ask the admins, or bind one into the container")
    size_gb, free_gb = st.f_blocks * st.f_frsize / 1e9, st.f_bavail * st.f_frsize / 1e9
    need = site.ray.object_store_gb
    if size_gb < need:
        return Check("/dev/shm", "fail", f"{size_gb:.1f} GB, smaller than Ray's object store ({need:g} GB)",
                     f"set ray.object_store_gb in the site below {size_gb * 0.9:.1f}, or ask for a larger /dev/shm")
    if free_gb < need:
        return Check("/dev/shm", "warn", f"{free_gb:.1f} GB free of {size_gb:.1f} GB; object store wants {need:g} GB",
                     "something else fills /dev/shm (stale Ray sessions?); clean it or lower ray.object_store_gb")
    return Check("/dev/shm", "pass", f"{size_gb:.1f} GB ({free_gb:.1f} free), object store {need:g} GB")


def _gpu_check(site: Site) -> Check:
    want = site.gpus_per_node
    if want == 0:
        return Check("gpus", "skip", "the site has gpus_per_node: 0")
    if shutil.which("nvidia-smi"):
        res = _run(["nvidia-smi", "-L"])
        have, source = sum(1 for line in res.stdout.splitlines() if line.startswith("GPU ")), "nvidia-smi -L"
    elif os.environ.get("CUDA_VISIBLE_DEVICES"):
        have = len([d for d in os.environ["CUDA_VISIBLE_DEVICES"].split(",") if d.strip()])
        source = "Slurm's CUDA_VISIBLE_DEVICES (no nvidia-smi)"
    else:
        have, source = int(os.environ.get("SLURM_GPUS_ON_NODE", "0") or 0), "SLURM_GPUS_ON_NODE (no nvidia-smi)"
    if have < want:
        return Check("gpus", "fail", f"{have} GPU(s) from {source}; the site says {want} per node",
                     f"set gpus_per_node in the site to {have}, or fix the node's GPUs / the gres request")
    return Check("gpus", "pass", f"{have} GPU(s) from {source} (site: {want})")


def _ports_check(site: Site) -> Check:
    """The ports this node's Ray would bind in a job with this job's id, on the address it would
    use: ray_node's own rules (ray_ports, node_ip), so the check cannot drift from the runtime."""
    from beam_hpc.node.ray_node import LOOPBACK_MAX_NODES, RayNodeError, node_ip, ray_ports

    job = int(os.environ.get("SLURM_JOB_ID", "0") or 0)
    index = int(os.environ.get("SLURM_NODEID", "0") or 0)
    loopback = site.network.ip_source == "loopback"
    try:
        addr = node_ip(site.network, index)
        ports = ray_ports(site.ray, job, index if loopback else 0, LOOPBACK_MAX_NODES if loopback else 1)
    except RayNodeError as err:
        return Check("ray ports", "fail", str(err), "fix the site's network / ray sections as the message says")
    wanted = {k: v for k, v in vars(ports).items() if index == 0 or k not in ("gcs", "client_server")}
    busy = []
    for kind, port in sorted(wanted.items(), key=lambda kv: kv[1]):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((addr, port))
            except OSError as err:
                busy.append(f"{port} ({kind}: {err.strerror})")
    if busy:
        return Check("ray ports", "fail", f"not bindable on {addr}: {', '.join(busy)}",
                     "find the holder (`ss -ltnp`); or move ray.gcs_port_base / port_span in the site")
    return Check("ray ports", "pass", f"{len(wanted)} ports {min(wanted.values())}-{max(wanted.values())} "
                 f"free on {addr} (for job {job})")


# -- through srun ------------------------------------------------------------------------------
def in_job_checks(site: Site, *, nodes: int = 1, canary_root: str | Path | None = None,
                  scratch_gb: float | None = None, wait_s: int = 300,
                  skip_partitions: frozenset[str] = frozenset()) -> list[Check]:
    """Run :func:`node_checks` on ``nodes`` nodes of each of the site's partitions through srun
    (or on the nodes of the allocation this runs in), with a canary in ``canary_root``."""
    inside = bool(os.environ.get("SLURM_JOB_ID"))
    if inside and os.environ.get("SLURM_STEP_ID"):  # already one task per node: just this node
        return node_checks(site, scratch_gb=scratch_gb)
    root = Path(canary_root) if canary_root else Path.cwd()
    token = secrets.token_hex(8)
    canary = root / f".beam-doctor-{token}"
    try:
        canary.mkdir(parents=True)
        (canary / "login.token").write_text(token + "\n")
    except OSError as err:
        return [Check("shared-fs canary", "fail", f"cannot write the canary in {root} ({err})",
                      "give --output-dir a writable directory on shared storage")]
    checks: list[Check] = []
    try:
        targets = [("allocation", None)] if inside else _partitions(site)
        for groups, part in targets:
            if part in skip_partitions:
                checks.append(Check(f"nodes of {part}", "skip", "its partition check failed"))
                continue
            checks += _srun_node_checks(site, part, inside, nodes, canary, token, scratch_gb, wait_s)
    finally:
        shutil.rmtree(canary, ignore_errors=True)
    return checks


def miles_parser_check(site: Site, recipe: "Recipe") -> Check:
    """The image's own Miles parses the recipe's driver command (backends.miles.preflight): the
    same check the job makes on the head node before Ray starts, made here through the image."""
    from beam_hpc.backends.miles import preflight
    from beam_hpc.errors import InputError

    name = f"miles parser ({recipe.name})"
    if recipe.backend != "miles":
        return Check(name, "skip", f"backend {recipe.backend}: no Miles command")
    try:
        verdict = preflight.check_recipe(recipe, site)
    except InputError as err:  # the recipe itself is refused (architecture flags, layout)
        return Check(name, "fail", str(err), "fix the recipe field it names")
    if verdict.ok:
        note = verdict.model_script_note()  # which form of model script the image read, if any
        return Check(name, "pass", f"the image's Miles accepts the driver command ({verdict.seconds:.1f} s)"
                     + (f"; {note}" if note else ""))
    refusal = verdict.refusal() or verdict.error
    first, _, rest = refusal.partition("\n")
    return Check(name, "fail", first, rest.strip().replace("\n", "; ") or "use an image whose Miles accepts it")


def run_doctor(site: Site, *, in_job: bool = False, nodes: int = 1, output_dir: str | None = None,
               scratch_gb: float | None = None, wait_s: int = 300, recipe: "Recipe | None" = None) -> list[Check]:
    """All of `beam-hpc doctor`: the login checks, then (``in_job``) the node checks of every
    partition whose login check passed, the canary living in ``output_dir`` (else the cwd).
    With ``recipe``, also the image's Miles parsing that recipe's driver command."""
    checks = login_checks(site, output_dir=output_dir)
    if recipe is not None:
        checks.append(miles_parser_check(site, recipe))
    if not in_job:
        return checks
    bad = frozenset(c.name.split(" ", 1)[1] for c in checks if c.name.startswith("partition ") and c.status == "fail")
    if any(c.name in ("slurm commands", "slurm controller") and c.status == "fail" for c in checks):
        return checks + [Check("nodes", "skip", "Slurm is not usable from here (see above)")]
    node = in_job_checks(site, nodes=nodes, canary_root=output_dir, scratch_gb=scratch_gb,
                         wait_s=wait_s, skip_partitions=bad)
    canaries = [c for c in node if c.name == "shared-fs canary"]
    if output_dir and canaries and all(c.status == "pass" for c in canaries):
        # the warning "usually node-local" is settled: every node read what the login node wrote
        checks = [Check(c.name, "pass", c.detail + "; the canary proved it shared", where=c.where)
                  if c.name == f"shared {output_dir}" and c.status == "warn" else c for c in checks]
    return checks + sorted(node, key=lambda c: c.where == "login")


def _srun_node_checks(site: Site, part: str | None, inside: bool, nodes: int, canary: Path,
                      token: str, scratch_gb: float | None, wait_s: int) -> list[Check]:
    argv = ["srun", "--ntasks-per-node=1", "--job-name=beam-doctor", "--kill-on-bad-exit=0"]
    if inside:
        argv += [f"--nodes={os.environ.get('SLURM_JOB_NUM_NODES', '1')}", "--overlap"]
    else:
        argv += [f"--nodes={nodes}", "--time=00:05:00", f"--immediate={wait_s}"]
        argv += [f"--partition={part}"] if part else []
        argv += [f"--account={site.account}"] if site.account else []
        argv += [f"--qos={site.qos}"] if site.qos else []
        argv += [f"--gres={site.gres}:{site.gpus_per_node}"] if site.gpus_per_node else []
    argv += [site.python, "-m", "beam_hpc.observe.doctor", "--node", "--site-json", site.model_dump_json(),
             "--canary", str(canary), "--token", token]
    if scratch_gb is not None:
        argv += ["--scratch-gb", str(scratch_gb)]
    env = {k: v for k, v in os.environ.items() if inside or not k.startswith("SLURM_") or k == "SLURM_CONF"}
    label = f"nodes of {part or 'the allocation'}"
    try:
        res = subprocess.run(argv, capture_output=True, text=True, timeout=wait_s + 120, env=env)
    except subprocess.TimeoutExpired:
        return [Check(label, "fail", f"srun did not finish within {wait_s + 120} s",
                      "the partition is busy or nodes hang; retry later or raise --wait")]
    checks: list[Check] = []
    for line in sorted(res.stdout.splitlines()):
        if line.startswith(NODE_LINE_PREFIX):
            checks += [Check(**c) for c in json.loads(line[len(NODE_LINE_PREFIX):])]
    reported = {c.where for c in checks}
    expected = int(os.environ.get("SLURM_JOB_NUM_NODES", "1")) if inside else nodes
    if res.returncode == 0 and 0 < len(reported) < expected:
        checks.append(Check(label, "fail", f"only {len(reported)} of {expected} nodes answered: {', '.join(sorted(reported))}",
                            "look at the silent nodes' slurmd logs; they may be misconfigured or down"))
        return checks
    if res.returncode != 0 or not reported:
        checks.append(Check(label, "fail", f"srun exited {res.returncode}: {_last_line(res)}",
                            "see the partition, gres and account checks above; `srun` must be able to "
                            "start one task per node there"))
        return checks
    for c in list(checks):  # the other direction of the canary: the node's write, seen here
        if c.name == "shared-fs canary" and c.status == "pass":
            acks = list(canary.glob(f"ack-{c.where}-*"))
            if not acks:
                checks[checks.index(c)] = Check(c.name, "fail", f"{c.where} wrote its ack but the login node cannot see it",
                                                "use a path that every node and the login node mount", c.where)
    checks.append(Check(label, "pass", f"{len(reported)} node(s) answered: {', '.join(sorted(reported))}"))
    return checks


def _node_main(argv: list[str] | None = None) -> int:
    """Entry point of one srun task: print this node's checks as one machine-readable line."""
    ap = argparse.ArgumentParser(prog="python -m beam_hpc.observe.doctor")
    ap.add_argument("--node", action="store_true", required=True)
    ap.add_argument("--site-json", required=True)
    ap.add_argument("--canary", type=Path, default=None)
    ap.add_argument("--token", default=None)
    ap.add_argument("--scratch-gb", type=float, default=None)
    args = ap.parse_args(argv)
    site = Site.model_validate(json.loads(args.site_json))
    checks = node_checks(site, canary=args.canary, token=args.token, scratch_gb=args.scratch_gb)
    sys.stdout.write(NODE_LINE_PREFIX + json.dumps([c.to_dict() for c in checks]) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(_node_main())
