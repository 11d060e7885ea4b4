"""Site profiles: what one cluster needs (partitions, account, GPUs, container, paths, network).

Kept apart from the recipe so that one recipe runs on many clusters, and so that what may change
between segments of a run (partitions, account) is clearly not part of the run's identity.
Imports no Slurm, Ray or torch code.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from beam_hpc.config.recipe import _format_errors, _Strict, load_yaml
from beam_hpc.config.slurm_size import SIZE_HINT, parse_mib
from beam_hpc.errors import InputError, shorten

Runtime = Literal["apptainer", "pyxis", "host"]
RUNTIMES = ("apptainer", "pyxis", "host")
RUNTIME_ALIASES = {"none": "host"}  # ``runtime: none`` reads as "no container": the host runtime
TMP_NONE = "none"  # site ``tmp: none``: no --tmp in any request
IpSource = Literal["interface", "hostname", "loopback"]


class ContainerSpec(_Strict):
    """``apptainer``: every node step runs inside the image (``exec --nv``, never ``--containall``,
    which breaks Ray's /tmp and /dev/shm). ``pyxis``: Slurm's pyxis plugin (enroot underneath)
    starts every node step inside the image (``srun --container-image``; ``image`` is a squashfs
    path or an enroot URI such as ``nvcr.io#nvidia/pytorch:24.01-py3``). ``host`` (or ``none``): no
    container (laptops, tests)."""

    runtime: Runtime = "apptainer"
    image: str | None = None  # .sif on shared storage (apptainer); .sqsh or enroot URI (pyxis)
    binds: list[str] = Field(default_factory=list)  # extra "src[:dst[:opts]]"
    stage_to_local: bool = False  # copy the .sif to node-local disk once per node (apptainer)
    mount_home: bool = False  # pyxis: bind the user's home (--container-mount-home); else never
    python: str = "python3"  # interpreter inside the container (or on the host)

    @field_validator("runtime", mode="before")
    @classmethod
    def _known_runtime(cls, value: object) -> object:
        value = RUNTIME_ALIASES.get(value, value) if isinstance(value, str) else value
        if value not in RUNTIMES:
            raise ValueError(f"{value!r} is not a container runtime; use one of {', '.join(RUNTIMES)} "
                             "(none = host: no container)")
        return value


class NetworkSpec(_Strict):
    """How a node finds the address Ray and NCCL bind to. ``interface``: the IPv4 address of
    ``interface`` (e.g. ib0); ``hostname``: what the node's hostname resolves to; ``loopback``:
    127.0.0.(10 + node index), for a multi-node cluster simulated on one host (tests)."""

    ip_source: IpSource = "hostname"
    interface: str | None = None


class RayPortSpec(_Strict):
    """One port set per job: the GCS port is ``gcs_port_base + job_id % port_span``, the node
    manager and object manager ports follow it, so concurrent jobs on shared nodes never clash."""

    gcs_port_base: int = Field(20000, ge=1024, le=65000)
    port_span: int = Field(2000, ge=1)
    object_store_gb: float = Field(2.0, gt=0)


class PerGroup(_Strict):
    """A value per node group; ``rollout`` falls back to ``trainer`` when unset."""

    trainer: str | None = None
    rollout: str | None = None

    def for_group(self, group: str) -> str | None:
        return self.rollout if group == "rollout" and self.rollout is not None else self.trainer


PartitionSpec = PerGroup


def _left_out_while_unset(value: object) -> bool:
    """A field added after runs were made stays out of the site's dump while unset: a plan records a
    digest of that dump (beam_hpc.plan.plan.inputs_sha), so a new key in every dump would make every
    existing run's plan.json read as edited and re-render every script (as the recipe's
    lifecycle.rollout_node_loss, at its default)."""
    return value is None


class Site(_Strict):
    name: str
    partitions: PerGroup = Field(default_factory=PerGroup)
    # Where the replacement of a rollout node lost mid-segment is submitted (beam_hpc.elastic.replace),
    # e.g. a backfill or scavenger partition with idle nodes, so that the lost capacity comes back
    # without waiting in the run's own queue; checked against the cluster as `rollout add --partition`
    # checks it, and when it cannot take the job the replacement goes to the rollout group's own
    # partition. Unset: the rollout group's own partition (partitions.rollout, else partitions.trainer).
    replacement_partition: str | None = Field(None, min_length=1, exclude_if=_left_out_while_unset)
    constraints: PerGroup = Field(default_factory=PerGroup)  # --constraint per group
    account: str | None = None
    qos: str | None = None
    exclusive: bool = False  # --exclusive on every component
    # --tmp of a group that stages optimizer state on node-local disk: at least this (e.g. "2000G"),
    # more when the recipe needs more; "none": never ask Slurm for node-local disk (the job's NVMe
    # check alone guards it). Unset: the recipe's need. See beam_hpc.plan.local_disk.
    tmp: str | None = None
    gres: str = "gpu"  # GRES name for GPUs; requests become --gres=<gres>:<n>
    gpus_per_node: int = Field(8, ge=0)  # what one node of the partition has
    cpus_per_node: int | None = Field(None, ge=1)
    mem: str | None = "0"  # --mem per node; "0" = all of it
    container: ContainerSpec = Field(default_factory=ContainerSpec)
    network: NetworkSpec = Field(default_factory=NetworkSpec)
    ray: RayPortSpec = Field(default_factory=RayPortSpec)
    shared_paths: list[str] = Field(default_factory=list)  # must be the same on every node
    scratch: str | None = None  # node-local disk root; None -> the recipe's nvme_dir as given
    module_loads: list[str] = Field(default_factory=list)
    setup: list[str] = Field(default_factory=list)  # shell lines run before the job's python
    env: dict[str, str] = Field(default_factory=dict)  # exported in the job (e.g. NCCL settings)
    sbatch_extra: list[str] = Field(default_factory=list)  # extra "#SBATCH" flags, e.g. "--exclusive"
    # Interpreter on the batch host with beam-hpc installed; "auto" = the one that ran `submit`.
    python: str = "python3"
    # A Ray cluster the site already runs (its GCS as host:port): the job then starts no Ray, checks
    # readiness against that cluster and leaves it running. Its nodes must carry the group label and
    # resources (beam-group=<group>, beam_<group>). The token file is required: beam-hpc talks to a
    # long-lived shared cluster only with Ray's token authentication.
    ray_address: str | None = None
    ray_token_file: str | None = None
    # A file shared by every run of the site: nodes that failed in any run stay out of every run's
    # submissions for quarantine_days, or until `beam-hpc nodes release NAME`
    # (beam_hpc.lifecycle.quarantine). Absolute: the batch host and the login node both write it.
    quarantine: str | None = None
    quarantine_days: float = Field(7.0, gt=0)
    # false: the compute nodes cannot reach the internet, so a recipe's W&B tracking runs offline in
    # the job and `beam-hpc sync RUN` uploads it from the login node (beam_hpc.run.tracking).
    compute_internet: bool = True

    @property
    def node_python(self) -> str:
        """The one answer to "which Python runs beam-hpc or backend code on a node": the
        container's interpreter inside the image (Apptainer or pyxis), else the site's own (``python:
        auto`` is resolved when the site is loaded, to the interpreter that submitted the run)."""
        return self.container.python if self.container.runtime != "host" else self.python

    @field_validator("tmp", mode="before")
    @classmethod
    def _tmp_is_a_slurm_size(cls, value: object) -> object:
        """A size Slurm's ``--tmp`` takes, checked at load so that sbatch never refuses it later."""
        if value is None or value == TMP_NONE:
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            value = str(value)  # YAML ``tmp: 500000``: a bare number is MB, as Slurm reads it
        try:
            parse_mib(value)  # type: ignore[arg-type]
        except ValueError:
            raise ValueError(f"not a Slurm size; write {SIZE_HINT}, or {TMP_NONE} to ask Slurm for no "
                             "node-local disk") from None
        return value

    @model_validator(mode="after")
    def _consistent(self) -> Site:
        if self.container.runtime == "apptainer" and not self.container.image:
            raise ValueError(
                "container.image: the apptainer runtime needs the .sif path; build it with "
                "`beam-hpc image build` or set container.runtime: host"
            )
        if self.container.runtime == "pyxis":
            _check_pyxis(self)
        if self.network.ip_source == "interface" and not self.network.interface:
            raise ValueError("network.interface: ip_source is 'interface' but no interface is named (e.g. ib0)")
        _check_existing_ray(self.ray_address, self.ray_token_file)
        if self.quarantine is not None and not self.quarantine.startswith("/"):
            raise ValueError(f"quarantine: {self.quarantine!r} is relative; give an absolute path on shared "
                             "storage (e.g. /shared/beam/bad-nodes.json)")
        return self


def _check_pyxis(site: Site) -> None:
    """What pyxis needs of the site: an image it can take, and mount paths its option can carry."""
    c = site.container
    if not c.image:
        raise ValueError("container.image: the pyxis runtime needs a squashfs path or an enroot URI "
                         "([USER@][REGISTRY#]IMAGE[:TAG]); build a squashfs with `beam-hpc image build --runtime enroot`")
    if "://" in c.image:
        raise ValueError(f"container.image: {shorten(c.image)}: pyxis takes [USER@][REGISTRY#]IMAGE[:TAG] "
                         "without a scheme (it imports it as docker://), or a squashfs path")
    if c.stage_to_local:
        raise ValueError("container.stage_to_local: under pyxis, enroot imports and unpacks the image on each node "
                         "itself (set its data path to node-local disk in enroot.conf); remove stage_to_local")
    binds = [":".join(b.split(":")[:2]) for b in c.binds]  # a bind's options may hold commas (pyxis: "+")
    for name, paths in (("container.binds", binds), ("shared_paths", site.shared_paths),
                        ("scratch", [site.scratch or ""])):
        bad = [p for p in paths if "," in p]
        if bad:
            raise ValueError(f"{name}: {shorten(bad[0])} holds a comma, which separates mounts in pyxis's "
                             "--container-mounts; use a path without one")


def _check_existing_ray(address: str | None, token_file: str | None) -> None:
    """An existing cluster is named by its GCS address and always comes with its token file."""
    if address is None:
        if token_file is not None:
            raise ValueError(
                f"ray_address: ray_token_file is set ({token_file}) but no ray_address; name the existing "
                "Ray cluster's GCS address (host:port, --ray-address) or remove ray_token_file"
            )
        return
    host, _, port = address.rpartition(":")
    if not host or "/" in address or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(
            f"ray_address: {address!r} is not the existing cluster's GCS address as host:port "
            "(e.g. 10.0.0.1:6379); Ray Client (ray://) and 'auto' addresses are not supported"
        )
    if token_file is None:
        raise ValueError(
            f"ray_token_file: the site names an existing Ray cluster (ray_address {address}) but no token "
            "file; set ray_token_file (or --ray-token-file) to the file that holds that cluster's auth token "
            "(the cluster must run with RAY_AUTH_MODE=token): beam-hpc does not talk to a cluster without it"
        )
    if not token_file.startswith("/"):
        raise ValueError(f"ray_token_file: {token_file!r} is relative; give an absolute path that the batch host can read")


def with_existing_ray(site: Site, address: str | None, token_file: str | None) -> Site:
    """The site with ``--ray-address`` / ``--ray-token-file`` applied (each only when given)."""
    if address is None and token_file is None:
        return site
    data = site.model_dump(mode="json")
    if address is not None:
        data["ray_address"] = address
    if token_file is not None:
        data["ray_token_file"] = token_file
    return site_from_dict(data, f"site {site.name} with --ray-address/--ray-token-file")


def site_from_dict(data: dict, source: str = "<site>") -> Site:
    """Validate a site profile. ``python: auto`` becomes the interpreter running this code, once,
    here: the batch script then runs the same beam-hpc install that submitted it, and the job
    never has to guess which Python it was meant to use."""
    if data.get("python") == "auto":
        data = {**data, "python": sys.executable}
    try:
        return Site.model_validate(data)
    except ValidationError as err:
        raise InputError(_format_errors(source, err, kind="site profile")) from None


def load_site(path: str | Path) -> Site:
    """A site profile file, read by the same strict YAML reader as recipes, then validated."""
    return site_from_dict(load_yaml(path, kind="site profile"), str(path))


def find_site(name_or_path: str, search_dir: Path | None = None) -> Path:
    """A site is a path or a name of a file under env/ (``local`` -> env/local.yaml)."""
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") and not p.exists():
        raise InputError(f"site {shorten(name_or_path)}: no such site profile file; check the path or name one under env/")
    if p.suffix in (".yaml", ".yml") or p.exists():
        return p
    base = search_dir or Path.cwd() / "env"
    cand = base / f"{name_or_path}.yaml"
    if not cand.exists():
        have = sorted(x.stem for x in base.glob("*.yaml")) if base.is_dir() else []
        raise InputError(f"site {shorten(name_or_path)}: no {cand}; known sites: {', '.join(have) or 'none'}")
    return cand
