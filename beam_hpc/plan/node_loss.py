"""Which node groups a run goes on without one node of (issue 42): read by the job script (it
asks Slurm for ``--no-kill``, beam_hpc.slurm.script) and by the job (it tells a lost rollout node
from a lost trainer node, beam_hpc.job.runner), so both decide from the plan alone, the same way."""

from __future__ import annotations

from beam_hpc.plan.plan import GroupPlan, Plan


def survives_node_loss(plan: Plan, group: GroupPlan) -> bool:
    """Whether the segment goes on when one node of ``group`` is lost mid-run: the dedicated
    rollout group of a reference run, with more than one node. Its driver drops the lost node's
    worker and serves its units with the workers left (beam_hpc.backends.reference.rollouts.unit_service);
    a colocated group holds the trainer, and a Miles run's driver is not taught to go on without
    an engine's node, so those end the segment as before. The recipe's
    ``lifecycle.rollout_node_loss: restart`` turns it off for every group: the job then has no
    ``--no-kill``, so Slurm revokes it on any node's failure and it resumes from its checkpoint
    (the full-restart policy, kept so that the two can be compared on one product)."""
    return (plan.recipe.lifecycle.rollout_node_loss == "in_place" and plan.recipe.backend == "reference"
            and group.roles == ("rollout",) and group.nodes > 1)
