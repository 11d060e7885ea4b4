"""The doctor's node half: what only a compute node can say about itself, and the record every
doctor check is reported in (:class:`Check`).

``beam-hpc doctor --in-job`` starts ``python -m beam_hpc.node.checks`` on each node of a small
allocation (one ``srun`` task per node; :mod:`beam_hpc.observe.doctor` collects the answers): a
shared-filesystem canary both ways, node-local scratch that is not tmpfs/overlay or shared and has
room, ``/dev/shm`` large enough for Ray's object store, the GPU count against the site, and a job's
Ray ports free on the node's address, and (pyxis sites) ``enroot`` on the node. Why in ``node``: it judges by the node step's own rules
(:mod:`beam_hpc.node.nvme`, :mod:`beam_hpc.node.ray_node`), so a check cannot drift from what a job
does. It imports no Slurm code: the login side owns ``srun``. The answer is one machine-readable
line on stdout (:data:`NODE_LINE_PREFIX` + a JSON list of checks), a protocol, not text for people.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from beam_hpc.config.site import TMP_NONE, Site
from beam_hpc.config.slurm_size import parse_mib
from beam_hpc.node import nvme, procs
from beam_hpc.slurm.environment import SlurmEnvironment

Status = Literal["pass", "fail", "warn", "skip"]
NODE_LINE_PREFIX = "BEAM-DOCTOR-NODE "
# Filesystems that every node sees: the runtime's list (nvme.py) plus ones only shared paths meet.
SHARED_FS = frozenset(nvme.NETWORK_FS) | {"cephfs", "glusterfs", "fuse.glusterfs", "panfs", "9p", "virtiofs"}
DEFAULT_SCRATCH_GB = 1.0


@dataclass(frozen=True)
class Check:
    """One line of the doctor's report: what was checked, where, the verdict, and the fix."""

    name: str
    status: Status
    detail: str
    fix: str = ""
    where: str = "login"  # "login" or the node name

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


def fs_type(path: str | Path) -> tuple[str, str]:
    """(filesystem type, mount point) of ``path``, or of its nearest existing parent."""
    m = nvme.mount_of(path)
    return m.fstype, m.mountpoint


def existing_parent(path: Path) -> Path:
    """``path`` itself, or its nearest ancestor that exists (what a check can stat)."""
    p = path.absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def node_checks(site: Site, *, canary: Path | None = None, token: str | None = None,
                scratch_gb: float | None = None) -> list[Check]:
    """The checks that only a compute node can answer, for this node."""
    where = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    checks = [_canary_check(canary, token), _scratch_check(site, scratch_gb), _shm_check(site),
              _gpu_check(site), _ports_check(site)]
    if site.container.runtime == "pyxis":
        checks.append(_enroot_check())
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
    (canary / f"ack-{node}-{SlurmEnvironment.current().node_id or 0}").write_text(token + "\n")
    return Check("shared-fs canary", "pass", f"read the login node's token in {canary.parent}")


def scratch_need_gb(site: Site, scratch_gb: float | None) -> float:
    """Free space (decimal GB, as the NVMe check counts) the scratch check asks for: the caller's,
    else the site's ``tmp`` (a Slurm size, in MiB), else a token amount."""
    if scratch_gb is not None:
        return scratch_gb
    if site.tmp and site.tmp != TMP_NONE:
        return parse_mib(site.tmp) * 2**20 / nvme.GB
    return DEFAULT_SCRATCH_GB


def _scratch_check(site: Site, scratch_gb: float | None) -> Check:
    need = scratch_need_gb(site, scratch_gb)
    if not site.scratch:
        return Check("scratch", "skip", "the site has no scratch (node-local disk) configured")
    root = Path(site.scratch)
    base = existing_parent(root)
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


def _enroot_check() -> Check:
    """pyxis runs enroot on the node (as the task's user) to import and start the image."""
    exe = shutil.which("enroot")
    if exe is None:
        return Check("enroot", "fail", "enroot is not on PATH on this node; pyxis needs it to start containers",
                     "ask the admins to install enroot on the compute nodes, or use container.runtime: apptainer")
    try:
        out = subprocess.run([exe, "version"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as err:
        return Check("enroot", "fail", f"{exe} version did not answer ({err})", "check the node's enroot install")
    if out.returncode != 0:
        return Check("enroot", "fail", f"{exe} version exited {out.returncode}: {(out.stderr or out.stdout).strip()[:200]}",
                     "check the node's enroot install (enroot.conf, its runtime and data paths)")
    return Check("enroot", "pass", f"{exe} {out.stdout.strip()}")


def _nvidia_smi_gpus() -> int:
    """GPUs ``nvidia-smi -L`` lists (0 when it fails or hangs)."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def _gpu_check(site: Site) -> Check:
    want = site.gpus_per_node
    if want == 0:
        return Check("gpus", "skip", "the site has gpus_per_node: 0")
    if shutil.which("nvidia-smi"):
        have, source = _nvidia_smi_gpus(), "nvidia-smi -L"
    elif os.environ.get("CUDA_VISIBLE_DEVICES"):
        have = len([d for d in os.environ["CUDA_VISIBLE_DEVICES"].split(",") if d.strip()])
        source = "Slurm's CUDA_VISIBLE_DEVICES (no nvidia-smi)"
    else:
        have, source = SlurmEnvironment.current().gpus_on_node or 0, "SLURM_GPUS_ON_NODE (no nvidia-smi)"
    if have < want:
        return Check("gpus", "fail", f"{have} GPU(s) from {source}; the site says {want} per node",
                     f"set gpus_per_node in the site to {have}, or fix the node's GPUs / the gres request")
    return Check("gpus", "pass", f"{have} GPU(s) from {source} (site: {want})")


def _ports_check(site: Site) -> Check:
    """The ports this node's Ray would bind in a job with this job's id, on the address it would
    use: ray_node's own rules (ray_ports, node_ip), so the check cannot drift from the runtime."""
    from beam_hpc.node.ray_node import LOOPBACK_MAX_NODES, RayNodeError, node_ip, ray_ports
    from beam_hpc.plan.ports import BANDS, ephemeral_overlap

    slurm = SlurmEnvironment.current()
    job = int(slurm.job_id or 0)
    index = slurm.node_id or 0
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
    ephemeral = procs.ephemeral_ports()
    inside = None if ephemeral is None else ephemeral_overlap(site.ray, ephemeral)
    if inside is not None:
        return Check("ray ports", "warn", f"free now, but {inside[0]}-{inside[1]} of the site's port bands lie in this "
                     f"node's ephemeral range {ephemeral[0]}-{ephemeral[1]} (ip_local_port_range), where any "
                     "outgoing connection may take one before Ray binds it",
                     f"move ray.gcs_port_base / port_span so that gcs_port_base + {len(BANDS)} x port_span stays below "
                     f"{ephemeral[0]} (and above Ray's worker ports, 10002-19999)")
    return Check("ray ports", "pass", f"{len(wanted)} ports {min(wanted.values())}-{max(wanted.values())} "
                 f"free on {addr} (for job {job})")


def command(site: Site, *, canary: Path, token: str, scratch_gb: float | None) -> list[str]:
    """The command line of one srun task: this module, with the site and the canary."""
    argv = [site.python, "-m", "beam_hpc.node.checks", "--site-json", site.model_dump_json(),
            "--canary", str(canary), "--token", token]
    return argv + (["--scratch-gb", str(scratch_gb)] if scratch_gb is not None else [])


def parse_answers(stdout: str) -> list[Check]:
    """Every node's checks from the srun tasks' combined stdout (other lines are ignored)."""
    checks: list[Check] = []
    for line in sorted(stdout.splitlines()):
        if line.startswith(NODE_LINE_PREFIX):
            checks += [Check(**c) for c in json.loads(line[len(NODE_LINE_PREFIX):])]
    return checks


def main(argv: list[str] | None = None) -> int:
    """Entry point of one srun task: print this node's checks as one machine-readable line."""
    ap = argparse.ArgumentParser(prog="python -m beam_hpc.node.checks")
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
    sys.exit(main())
