"""Ask Slurm, on the login node, what node-local disk (TmpDisk) the staging groups' partitions
declare, so that the plan's ``--tmp`` is one Slurm can place (the decision itself is pure:
:mod:`beam_hpc.plan.local_disk`).

Data flows one way: recipe + site say which partitions matter, Slurm's answer goes into
``make_plan(..., tmp_disk=...)`` as data, and the plan records the decision and its reason in
each group (``tmp``, ``tmp_why``). Only partitions of groups that stage optimizer state on
node-local disk are asked, and none when the site says ``tmp: none``. When Slurm cannot answer
(no sinfo here, a controller that does not answer, a partition it does not know), the partition is
left out of the answer and the request stays as the recipe makes it: sbatch then judges it, and
``doctor`` says why Slurm could not be asked.
"""

from __future__ import annotations

from beam_hpc.config.recipe import Recipe
from beam_hpc.config.site import TMP_NONE, Site
from beam_hpc.plan.local_disk import DeclaredTmpDisk, TmpDisk
from beam_hpc.plan.plan import Plan
from beam_hpc.slurm import client as slurm_client


def staging_partitions(recipe: Recipe, site: Site) -> list[str | None]:
    """The partitions (as the site names them; None: the default) whose nodes stage optimizer
    state: the trainer group's, when the recipe offloads to node-local disk."""
    if recipe.training.offload.target != "nvme" or site.tmp == TMP_NONE:
        return []
    return [site.partitions.for_group("trainer")]


def ask(partition: str | None, *, timeout: float = 20) -> TmpDisk | None:
    """What the nodes of ``partition`` declare; None when Slurm does not know it. Raises
    SlurmUnavailable when Slurm cannot be asked."""
    answer = slurm_client.tmp_disk(partition, timeout=timeout)
    if answer is None:
        return None
    return TmpDisk(answer.partition, tuple(answer.tmp_disk_mb[n] for n in sorted(answer.tmp_disk_mb)))


def declared_tmp_disk(recipe: Recipe, site: Site) -> DeclaredTmpDisk:
    """Slurm's answer for every staging partition it can give one for (see the module docstring)."""
    out: dict[str | None, TmpDisk] = {}
    for partition in staging_partitions(recipe, site):
        try:
            answer = ask(partition)
        except slurm_client.SlurmUnavailable:
            continue  # not known here: the plan keeps the request and says so
        if answer is not None:
            out[partition] = answer
    return out


def describe(plan: Plan) -> list[str]:
    """One line per group that stages on node-local disk: its ``--tmp`` (or none) and why.
    ``submit`` and ``--dry-run`` print them."""
    return [f"local disk, {g.name}: {'--tmp=' + g.tmp if g.tmp else 'no --tmp'} ({g.tmp_why})"
            for g in plan.groups if g.tmp_why]
