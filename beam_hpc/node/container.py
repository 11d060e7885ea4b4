"""The container seam: how each process of the job gets into the site's image, per runtime.

``apptainer``: the node step runs on the host and wraps ``ray start`` (and the batch host its
driver and readiness poller) in ``apptainer exec --nv --bind ...`` (:func:`container_command`);
never ``--contain[all]``/``--compat`` (Ray needs the host's /tmp and /dev/shm) nor ``--cleanenv``;
the job's variables also go as ``APPTAINERENV_<NAME>`` so the image's values cannot win.
``pyxis`` (NVIDIA/pyxis 0.24.0 at 1075199: ``args.c``, ``pyxis_slurmstepd.c``; enroot at 8ea147d):
Slurm puts the container around the task. The launcher adds :func:`srun_options` to each node step's
srun (image, mounts, a per-job container name, workdir, no home), so the node step starts Ray
unwrapped (:func:`node_step_command`); a batch-host process becomes a one-task ``srun --overlap`` step
in a container of its own name (pyxis does not serialise two steps creating one name).

Why the host's /tmp is among every pyxis container's mounts: enroot mounts a fresh tmpfs on /tmp in
each container (``conf/mounts/10-system.fstab``), and Ray's temp dir, with the Unix sockets through
which the driver's ``ray.init`` reaches the head node's raylet, lives under /tmp (ray_node.TEMP_ROOT).
The node step and the batch host's driver are different containers, so without the mount the driver
finds no socket. Joining the node step's named container instead would depend on which step creates
it first (pyxis joins a RUNNING container and then ignores the joiner's mounts) and fails while the
node step is not up yet; the host's /tmp exists on every node before any step starts, which a
per-job directory would not, and it is what Apptainer binds by default.

pyxis passes the task's environment in, the image's values first except for ``--container-env``'s
names, and sets RANK/LOCAL_RANK per task for PyTorch images: a batch-host step unsets those
(ray_node.TASK_RANK_NAMES) before the driver or the poller starts. ``host`` runs the command as it
is. In the tests a SPANK stand-in does what pyxis and enroot do to the task's mount namespace and
environment, on the host's own filesystem (tests/support/standins/spank/pyxis_standin.c).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from beam_hpc.config.site import Site
from beam_hpc.errors import InputError, RuntimeFailure
from beam_hpc.node.ray_node import TASK_RANK_NAMES, TEMP_ROOT
from beam_hpc.slurm import client as slurm_client
from beam_hpc.slurm.environment import SlurmEnvironment

if TYPE_CHECKING:
    from beam_hpc.node.checks import Check

APPTAINER = "apptainer"
APPTAINER_ENV_PREFIX = "APPTAINERENV_"
SHM = "/dev/shm"
# pyxis's srun options that beam-hpc passes: `srun --help` must list each (pyxis registers them).
PYXIS_IMAGE = "--container-image"
PYXIS_OPTIONS = (PYXIS_IMAGE, "--container-mounts", "--container-name", "--container-workdir",
                 "--container-mount-home", "--no-container-mount-home", "--container-env")
CONTAINER_NAME_PREFIX = "beam-"
BATCH_NAME_SUFFIX = "-batch"  # the batch host's own processes (driver, readiness, checks)


class ContainerError(RuntimeFailure):
    """The site's container runtime cannot start this process here; the message says why."""


@dataclass(frozen=True)
class Command:
    """What to hand to subprocess: the argv and the complete environment."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)


def container_command(
    site: Site,
    argv: Sequence[str],
    env: Mapping[str, str],
    binds: Sequence[str] = (),
    *,
    base: Mapping[str, str] | None = None,
    image: str | None = None,
) -> Command:
    """The command that runs ``argv`` under the site's container runtime.

    ``env`` holds the variables the job sets for this process (token path, Ray's mode, the job
    tag); ``base`` is the inherited environment they are added to (default: this process's).
    Under Apptainer each variable of ``env`` is also passed as ``APPTAINERENV_<NAME>``, so the
    image's own defaults cannot override it, while inherited host variables (PATH,
    LD_LIBRARY_PATH) keep Apptainer's normal treatment. ``binds`` are extra host paths (the run
    directory, the NVMe dir); the site's shared paths, its extra binds, its node-local scratch and
    /dev/shm are always bound. ``image`` overrides the site's image (a node-local staged copy).
    Under pyxis: a one-task srun step on this node of the job (:func:`_pyxis_batch_step`).
    """
    full_env = dict(os.environ if base is None else base)
    full_env.update(env)
    spec = site.container
    if spec.runtime == "host":
        return Command(list(argv), full_env)
    if spec.runtime == "pyxis":
        return _pyxis_batch_step(site, argv, env, binds, full_env)
    sif = image or spec.image
    if not sif:
        raise ValueError("container.image: the apptainer runtime needs the .sif path")
    mounts = _mounts(site, binds)
    cmd = [APPTAINER, "exec", "--nv"]
    for m in mounts:
        cmd += ["--bind", m]
    cmd.append(sif)
    cmd.extend(argv)
    for name, value in env.items():
        if not name.startswith(APPTAINER_ENV_PREFIX) and not name.startswith("APPTAINER_"):
            full_env[APPTAINER_ENV_PREFIX + name] = value
    return Command(cmd, full_env)


def node_step_command(site: Site, argv: Sequence[str], env: Mapping[str, str], binds: Sequence[str] = (),
                      *, base: Mapping[str, str] | None = None, image: str | None = None) -> Command:
    """What a node step runs for ``argv`` (``ray start``): under pyxis the command as it is, with the
    job's variables added, since the launcher's srun already put the node step inside the image
    (:func:`srun_options`); under the other runtimes :func:`container_command`."""
    if site.container.runtime == "pyxis":
        return Command(list(argv), {**(os.environ if base is None else base), **env})
    return container_command(site, argv, env, binds, base=base, image=image)


def node_step_python(site: Site) -> str:
    """The interpreter of ``python -m beam_hpc.node.step``: the image's under pyxis (the step runs
    inside it), else this one (the node step runs on the host, beside the batch shell's Python)."""
    return site.container.python if site.container.runtime == "pyxis" else sys.executable


def container_name(job_id: str) -> str:
    """The pyxis container of one job's node steps: every step of the job on a node shares it (pyxis
    imports the image once per node and name), and no other job's steps can meet it."""
    return f"{CONTAINER_NAME_PREFIX}{job_id}"


def srun_options(site: Site, *, job_id: str, binds: Sequence[str], workdir: str,
                 env_names: Sequence[str] = (), name: str | None = None) -> list[str]:
    """pyxis's options for an ``srun`` of the job (none for the other runtimes): the image, the
    mounts Apptainer would bind (:func:`_mounts`), the job's container name, the working directory,
    home mounted only when the site asks, and ``env_names`` kept over the image's values."""
    spec = site.container
    if spec.runtime != "pyxis":
        return []
    opts = [f"{PYXIS_IMAGE}={spec.image}",
            "--container-mounts=" + ",".join(pyxis_mount(m) for m in pyxis_mounts(site, binds)),
            f"--container-name={name or container_name(job_id)}",
            f"--container-workdir={workdir}",
            "--container-mount-home" if spec.mount_home else "--no-container-mount-home"]
    if env_names:
        opts.append("--container-env=" + ",".join(sorted(env_names)))
    return opts


def pyxis_mounts(site: Site, binds: Sequence[str]) -> list[str]:
    """What a pyxis container of the job mounts: what Apptainer binds (:func:`_mounts`) and the
    host's /tmp, where Ray's sockets are (why: this module's docstring). /tmp comes first: a mount
    lands on what the earlier ones made, so a later one below /tmp is not hidden by it."""
    return _dedupe([TEMP_ROOT, *_mounts(site, binds)])


def pyxis_mount(bind: str) -> str:
    """An Apptainer bind (``src[:dst[:opts]]``, options comma-separated) as a pyxis mount
    (``SRC:DST[:FLAGS]``, flags separated by "+": pyxis uses the comma between mounts)."""
    src, _, rest = bind.partition(":")
    dst, _, opts = rest.partition(":")
    return f"{src}:{dst or src}" + (f":{opts.replace(',', '+')}" if opts else "")


def _pyxis_batch_step(site: Site, argv: Sequence[str], env: Mapping[str, str], binds: Sequence[str],
                      full_env: dict[str, str]) -> Command:
    """A process of the batch host under pyxis: one task on this node (``--relative=0``, the first
    node of het group 0, where the batch shell runs), ``--overlap`` beside the node steps."""
    slurm = SlurmEnvironment.current()
    if not slurm.job_id:
        raise ContainerError("container.runtime: pyxis starts containers through srun, inside a Slurm job "
                             "only; run this in the job (or use a site with runtime apptainer or host here)")
    mounts = pyxis_mounts(site, binds)
    cwd = os.getcwd()
    workdir = cwd if any(_inside(cwd, m) for m in map(_plain_source, mounts) if m) else (binds[0] if binds else "/")
    cmd = ["srun", "--overlap", f"--jobid={slurm.job_id}", *(["--het-group=0"] if slurm.het_size > 1 else []),
           "--nodes=1", "--ntasks=1", "--relative=0", "--mpi=none", "--kill-on-bad-exit=1",
           *srun_options(site, job_id=slurm.job_id, binds=binds, workdir=workdir, env_names=list(env),
                         name=container_name(slurm.job_id) + BATCH_NAME_SUFFIX)]
    # pyxis sets RANK and LOCAL_RANK inside the task (after this command line is built) when the image
    # has PYTORCH_VERSION: the driver, and the process groups a backend starts, must not read them
    cmd += ["env", *(a for n in TASK_RANK_NAMES for a in ("-u", n))]
    # srun is a Slurm client here: the callers' environment has no SLURM_* variables; it gets back the
    # one slurm_env_free keeps (SLURM_CONF: the cluster to ask), and --jobid names the job
    full_env.update((k, v) for k, v in slurm_client.slurm_env_free().items() if k.startswith("SLURM_"))
    return Command(cmd + list(argv), full_env)


def image_file(site: Site) -> str | None:
    """The site's image as a file that must exist on shared storage (an Apptainer .sif, a pyxis
    squashfs path), None for a pyxis enroot URI (pyxis imports it on the nodes) or no container."""
    spec = site.container
    if spec.runtime == "host" or not spec.image:
        return None
    if spec.runtime == "pyxis" and not spec.image.startswith(("/", ".")):
        return None  # pyxis's rule: a path starts with / or .; anything else is a registry image
    return spec.image


def pyxis_srun_problem(help_text: str) -> str | None:
    """What ``srun --help`` lacks of the pyxis options beam-hpc passes (None: it lists them all)."""
    missing = [o for o in PYXIS_OPTIONS if o not in help_text.split()
               and not any(w.startswith(o + "=") for w in help_text.split())]
    if not missing:
        return None
    return (f"container.runtime: pyxis, but `srun --help` does not list {', '.join(missing)}: pyxis is not "
            "loaded here (its plugstack.conf line), or too old; ask the admins for pyxis, or use runtime apptainer")


def check_pyxis_srun(site: Site) -> None:
    """Before a submission: refuse a pyxis site whose srun does not take pyxis's options (InputError,
    exit 2, naming the field), so no job is queued that cannot start its node steps."""
    if site.container.runtime != "pyxis":
        return
    try:
        text = slurm_client.srun_help()
    except slurm_client.SlurmError as err:
        raise InputError(f"container.runtime: pyxis, but `srun --help` failed ({err.last_line}); "
                         "load Slurm's module, or use runtime apptainer") from None
    problem = pyxis_srun_problem(text)
    if problem:
        raise InputError(problem)


def pyxis_login_checks(site: Site) -> list[Check]:
    """``doctor`` on the login node of a pyxis site: srun takes every pyxis option beam-hpc passes,
    and the image is there (a squashfs path) or left to enroot (a registry image)."""
    from beam_hpc.node.checks import Check

    try:
        problem = pyxis_srun_problem(slurm_client.srun_help())
    except slurm_client.SlurmError as err:
        problem = f"`srun --help` failed: {err.last_line}"
    fix = "ask the admins to enable pyxis (plugstack.conf) on this cluster, or set container.runtime: apptainer"
    checks = [Check("pyxis", "fail", problem, fix) if problem else
              Check("pyxis", "pass", f"srun takes {', '.join(PYXIS_OPTIONS)}")]
    image = image_file(site)
    if image is None:
        checks.append(Check("image", "pass", f"{site.container.image}: a registry image, imported by enroot on each node"))
    elif not os.path.isfile(image) or not os.access(image, os.R_OK):
        checks.append(Check("image", "fail", f"{image} is not a readable file",
                            f"build it: beam-hpc image build --runtime enroot --output {image}, or fix container.image"))
    else:
        checks.append(Check("image", "pass", f"{image} ({os.path.getsize(image) / 1e9:.1f} GB)"))
    return checks


def _mounts(site: Site, binds: Sequence[str]) -> list[str]:
    """What every runtime mounts: the site's shared paths and extra binds, its node-local scratch,
    /dev/shm (Ray's object store), then the caller's paths; repeats and covered paths dropped."""
    spec = site.container
    return _dedupe([*site.shared_paths, *spec.binds, *([site.scratch] if site.scratch else []), SHM, *binds])


def _dedupe(binds: Sequence[str]) -> list[str]:
    """Drop repeats, and plain binds (same path inside) that a plain bind of a parent covers."""
    out: list[str] = []
    for b in binds:
        if not b or b in out:
            continue
        src = _plain_source(b)
        if src is not None and any(_inside(src, o) for o in map(_plain_source, out) if o is not None):
            continue
        out.append(b)
    return out


def _plain_source(bind: str) -> str | None:
    """The source of a bind that mounts a path at the same place inside, else None."""
    parts = bind.split(":")
    if len(parts) > 1 and parts[1] != parts[0]:
        return None
    if len(parts) > 2:  # options such as ro change what the container may do: keep it explicit
        return None
    return parts[0].rstrip("/") or "/"


def _inside(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def inside(path: str, mount: str) -> bool:
    """Whether host ``path`` is seen at the same place inside a container that has ``mount``."""
    src = _plain_source(mount)
    return src is not None and _inside(path, src)
