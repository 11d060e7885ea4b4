"""Every ``SLURM_*`` variable beam-hpc reads, read here and only here.

Why one place: Slurm describes an allocation through environment variables whose spelling and
scope are easy to get wrong (plain ``SLURM_JOB_NODELIST`` describes het group 0 only; the other
groups have ``_HET_GROUP_<i>`` twins; ``SLURM_NODEID`` exists only in a task of a step; a job
started by another job inherits the parent's values). Lightning's ``SLURMEnvironment`` takes the
same approach. Everything here is a pure reading of a mapping (``os.environ`` by default), so it is
tested with plain dicts and nothing else in beam-hpc spells a ``SLURM_`` name (the one exception:
:func:`beam_hpc.slurm.client.slurm_env_free`, which removes them all, and the node step's
environment cleaner, which removes them by prefix).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field


def _int(value: str | None, default: int | None = None) -> int | None:
    try:
        return int(str(value).strip())
    except (TypeError, ValueError):
        return default


@dataclass(frozen=True)
class SlurmEnvironment:
    """What Slurm told this process about its job, step and node."""

    env: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))

    @classmethod
    def current(cls) -> SlurmEnvironment:
        return cls(dict(os.environ))

    def _get(self, name: str) -> str | None:
        value = self.env.get(name)
        return value if value not in (None, "") else None

    # -- the job -------------------------------------------------------------------------------
    @property
    def job_id(self) -> str | None:
        """The job's id (a het job's leader id); None outside Slurm."""
        return self._get("SLURM_JOB_ID")

    @property
    def in_job(self) -> bool:
        return self.job_id is not None

    @property
    def restart_count(self) -> int:
        """0, then 1, 2, ... each time Slurm requeued the job (same id)."""
        return _int(self._get("SLURM_RESTART_COUNT"), 0) or 0

    @property
    def het_size(self) -> int:
        """Components of a heterogeneous job (1 for a plain job)."""
        return _int(self._get("SLURM_HET_SIZE"), 1) or 1

    def _group_var(self, base: str, group: int) -> str | None:
        if self.het_size > 1:
            return self._get(f"{base}_HET_GROUP_{group}")
        return self._get(base) if group == 0 else None

    def component_id(self, group: int) -> str | None:
        """The job id of het component ``group`` (steps of that component are addressed by it)."""
        return self._group_var("SLURM_JOB_ID", group) or (self.job_id if group == 0 else None)

    def nodelist(self, group: int) -> str:
        """Slurm's compressed node list of component ``group`` (``n[1-2],n4``)."""
        return self._group_var("SLURM_JOB_NODELIST", group) or ""

    def num_nodes(self, group: int) -> int | None:
        return _int(self._group_var("SLURM_JOB_NUM_NODES", group))

    def ntasks(self, group: int) -> int | None:
        return _int(self._group_var("SLURM_NTASKS", group))

    @property
    def job_num_nodes(self) -> int:
        return _int(self._get("SLURM_JOB_NUM_NODES"), 1) or 1

    # -- this task / node ---------------------------------------------------------------------
    @property
    def step_id(self) -> str | None:
        return self._get("SLURM_STEP_ID")

    @property
    def node_id(self) -> int | None:
        """This task's node index in its step (one task per node: the node's index in its group)."""
        for name in ("SLURM_NODEID", "SLURM_PROCID"):
            value = _int(self._get(name))
            if value is not None:
                return value
        return None

    @property
    def procid(self) -> int | None:
        return _int(self._get("SLURM_PROCID"))

    @property
    def gpus_on_node(self) -> int | None:
        """GPUs Slurm gave this node (the batch shell's node belongs to het group 0)."""
        return _int(self._get("SLURM_GPUS_ON_NODE"))

    @property
    def cpus_on_node(self) -> int | None:
        return _int(self._get("SLURM_CPUS_ON_NODE"))
