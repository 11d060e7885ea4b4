"""Site profiles: what one cluster needs (partitions, account, GPUs, container, paths, network).

Kept apart from the recipe so that one recipe runs on many clusters, and so that what may change
between segments of a run (partitions, account) is clearly not part of the run's identity.
Imports no Slurm, Ray or torch code.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationError, model_validator

from beam_hpc.recipe import RecipeError, _format_errors, _Strict, load_yaml

Runtime = Literal["apptainer", "host"]
IpSource = Literal["interface", "hostname", "loopback"]


class ContainerSpec(_Strict):
    """``apptainer``: every node step runs inside the image (``exec --nv``, never ``--containall``,
    which breaks Ray's /tmp and /dev/shm). ``host``: no container (laptops, tests)."""

    runtime: Runtime = "apptainer"
    image: str | None = None  # .sif on shared storage
    binds: list[str] = Field(default_factory=list)  # extra "src[:dst[:opts]]"
    stage_to_local: bool = False  # copy the .sif to node-local disk once per node
    python: str = "python3"  # interpreter inside the container (or on the host)


class NetworkSpec(_Strict):
    """How a node finds the address Ray and NCCL bind to. ``interface``: the IPv4 address of
    ``interface`` (e.g. ib0); ``hostname``: what the node's hostname resolves to; ``loopback``:
    127.0.0.(10 + node index), for a multi-node cluster simulated on one host (tests)."""

    ip_source: IpSource = "hostname"
    interface: str | None = None


class RayPortSpec(_Strict):
    """One port set per job: the GCS port is ``gcs_port_base + job_id % port_span``, the node
    manager and object manager ports follow it, so concurrent jobs on shared nodes never clash."""

    gcs_port_base: int = Field(20000, ge=1024, le=60000)
    port_span: int = Field(2000, ge=1)
    object_store_gb: float = Field(2.0, gt=0)


class PerGroup(_Strict):
    """A value per node group; ``rollout`` falls back to ``trainer`` when unset."""

    trainer: str | None = None
    rollout: str | None = None

    def for_group(self, group: str) -> str | None:
        return self.rollout if group == "rollout" and self.rollout is not None else self.trainer


PartitionSpec = PerGroup


class Site(_Strict):
    name: str
    partitions: PerGroup = Field(default_factory=PerGroup)
    constraints: PerGroup = Field(default_factory=PerGroup)  # --constraint per group
    account: str | None = None
    qos: str | None = None
    exclusive: bool = False  # --exclusive on every component
    tmp: str | None = None  # --tmp: node-local disk each node must have (e.g. "2000G")
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

    @model_validator(mode="after")
    def _consistent(self) -> "Site":
        if self.container.runtime == "apptainer" and not self.container.image:
            raise ValueError(
                "container.image: the apptainer runtime needs the .sif path; build it with "
                "`beam-hpc image build` or set container.runtime: host"
            )
        if self.network.ip_source == "interface" and not self.network.interface:
            raise ValueError("network.interface: ip_source is 'interface' but no interface is named (e.g. ib0)")
        return self


def site_from_dict(data: dict, source: str = "<site>") -> Site:
    try:
        return Site.model_validate(data)
    except ValidationError as err:
        raise RecipeError(_format_errors(source, err, kind="site profile")) from None


def load_site(path: str | Path) -> Site:
    return site_from_dict(load_yaml(path), str(path))


def find_site(name_or_path: str, search_dir: Path | None = None) -> Path:
    """A site is a path or a name of a file under env/ (``local`` -> env/local.yaml)."""
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") or p.exists():
        return p
    base = search_dir or Path.cwd() / "env"
    cand = base / f"{name_or_path}.yaml"
    if not cand.exists():
        have = sorted(x.stem for x in base.glob("*.yaml")) if base.is_dir() else []
        raise RecipeError(f"site {name_or_path!r}: no {cand}; known sites: {', '.join(have) or 'none'}")
    return cand
