"""The ``--tmp`` a node group asks Slurm for: decided here, by pure code, from three inputs.

The recipe's need (``training.offload.min_free_gb``, decimal GB as the job's NVMe check counts them,
in Slurm's G rounded up: 2,000 GB -> ``--tmp=1863G``); the site's ``tmp`` (a larger size raises the
request, ``none`` turns it off); and the TmpDisk the group's partition's nodes declare, asked on the
login node (:mod:`beam_hpc.submission.tmp_disk`) and handed to ``make_plan`` as data (``render``
and ``execute`` do not ask). Why Slurm's answer matters: Slurm places ``--tmp`` only on nodes whose
TmpDisk holds it, and nodes whose admins never set it declare 0, so every ``--tmp`` would fail at
submit. So: TmpDisk 0 everywhere -> no ``--tmp`` (the job's NVMe check still refuses a node without
room); fewer nodes than the group needs declare enough -> :class:`InputError` naming the partition,
the largest TmpDisk and the need; enough -> the request stays and keeps the group off small disks.
Every decision carries its reason (``GroupPlan.tmp_why``), which ``submit``, ``--dry-run`` and
``doctor`` show.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from beam_hpc.config.site import TMP_NONE
from beam_hpc.config.slurm_size import SIZE_HINT, gib_text, parse_mib
from beam_hpc.errors import InputError, shorten


@dataclass(frozen=True)
class TmpDisk:
    """What the nodes of one partition declare as node-local disk (Slurm's TmpDisk, MB each)."""

    partition: str  # the partition's own name (also when the site names none: the default one)
    node_mb: tuple[int, ...]


# Slurm's answers, keyed by the partition as the site names it (None: the cluster's default). A
# partition missing from the mapping was asked about but Slurm could not say.
DeclaredTmpDisk = Mapping[str | None, TmpDisk]


@dataclass(frozen=True)
class Need:
    """The node-local disk one group's node must have: the ``--tmp`` text, its size in MB, and the
    field it comes from (the one a fix changes)."""

    request: str
    mib: int
    field: str  # "training.offload.min_free_gb" or "tmp" (the site's)
    value: str  # that field's value, as the user wrote it

    @property
    def source(self) -> str:
        return f"the site's tmp {self.value}" if self.field == "tmp" else f"{self.field} {self.value}"


class TmpDiskTooSmall(InputError):
    """Too few nodes of the partition declare the TmpDisk the group needs: Slurm could not place
    the job. ``problem`` and ``fix`` apart, for the doctor's table."""

    def __init__(self, problem: str, fix: str) -> None:
        self.problem, self.fix = problem, fix
        super().__init__(f"{problem}; {fix}")


@dataclass(frozen=True)
class TmpDecision:
    request: str | None  # the group's --tmp, or None for none
    why: str


def need(site_tmp: str | None, min_free_gb: float) -> Need | None:
    """The larger of the recipe's need and the site's ``tmp``; None when neither asks for any."""
    recipe_mib = math.ceil(min_free_gb * 1e9 / 2**20)
    site_mib = 0
    if site_tmp and site_tmp != TMP_NONE:
        try:
            site_mib = parse_mib(site_tmp)
        except ValueError:  # the site schema refuses it already; a Site built by hand may not
            raise InputError(f"tmp: {shorten(site_tmp)} is not a Slurm size; write {SIZE_HINT}") from None
    if site_mib and site_mib >= recipe_mib:
        return Need(str(site_tmp), site_mib, "tmp", str(site_tmp))
    if recipe_mib > 0:
        gib = math.ceil(recipe_mib / 1024)
        return Need(f"{gib}G", gib * 1024, "training.offload.min_free_gb", f"{min_free_gb:g} GB")
    return None


def decide(group: str, nodes: int, partition: str | None, *, site_tmp: str | None, min_free_gb: float,
           nvme_dir: str, declared: DeclaredTmpDisk | None) -> TmpDecision:
    """The ``--tmp`` of group ``group`` (``nodes`` nodes in ``partition``) that stages optimizer
    state under ``nvme_dir``. ``declared`` None: Slurm was not asked (render, execute). Raises
    TmpDiskTooSmall (an InputError) when Slurm could place the group on too few nodes."""
    guard = (f"the job's NVMe check still refuses a node with less than {min_free_gb:g} GB free under {nvme_dir}"
             if min_free_gb > 0 else f"the job's NVMe check still refuses tmpfs or overlay under {nvme_dir}")
    if site_tmp == TMP_NONE:
        return TmpDecision(None, f"the site's tmp: {TMP_NONE} asks Slurm for no node-local disk; {guard}")
    n = need(site_tmp, min_free_gb)
    if n is None:
        return TmpDecision(None, "nothing to ask: training.offload.min_free_gb is 0 and the site sets no tmp")
    source = n.source
    part_text = f"partition {partition}" if partition else "the default partition"
    if declared is None:
        return TmpDecision(n.request, f"from {source}")
    answer = declared.get(partition)
    if answer is None:
        return TmpDecision(n.request, f"from {source}; Slurm's TmpDisk of {part_text} is not known here, "
                                      "so sbatch judges the request")
    part_text = f"partition {answer.partition}"
    total, largest = len(answer.node_mb), max(answer.node_mb, default=0)
    if largest == 0:
        return TmpDecision(None, f"left out: the {total} node(s) of {part_text} declare no TmpDisk (0: not set in "
                                 f"slurm.conf), so Slurm could place --tmp={n.request} on none; {guard}")
    fit = sum(mb >= n.mib for mb in answer.node_mb)
    if fit < nodes:
        first = "lower tmp in the site" if n.field == "tmp" else f"lower {n.field} if the optimizer state needs less"
        have = f"only {fit} of the {total} nodes of {part_text} declare" if fit else f"no node of {part_text} declares"
        raise TmpDiskTooSmall(
            f"{n.field}: {n.value} needs --tmp={n.request} ({n.mib} MB) on each of the {nodes} {group} node(s), "
            f"but {have} that much TmpDisk (largest {gib_text(largest)}), so Slurm could not place the job",
            f"{first}, set partitions.{group} in the site to a partition whose nodes declare more, or set "
            f"tmp: {TMP_NONE} in the site (the job's NVMe check then guards the disk alone)")
    return TmpDecision(n.request, f"from {source}; {fit} of the {total} nodes of {part_text} declare TmpDisk "
                                  f">= {gib_text(n.mib)}")

