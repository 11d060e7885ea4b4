"""What the segment does when one node of a group is lost mid-run (issue 42): read by the job
script (it asks Slurm for ``--no-kill``, beam_hpc.slurm.script), by the launchers (one step per
node, so that a node's loss ends its own step only, beam_hpc.job.launchers) and by the job (it
tells a lost rollout node from a lost trainer node, beam_hpc.job.runner), so all of them decide
from the plan alone, the same way."""

from __future__ import annotations

from enum import Enum

from beam_hpc.plan.plan import GroupPlan, Plan


class NodeLossAction(Enum):
    """The three answers, from the cheapest loss to the dearest."""

    GO_ON = "go on"  # the segment trains on with the nodes left, and asks for a replacement
    # the segment saves at the next rollout boundary, then goes on once a replacement node has joined
    # its Ray cluster, or ends as a node failure when none can be asked for or it does not come in time
    SAVE_FIRST = "save first"
    END = "end"  # Slurm revokes the job; the next segment resumes from the last checkpoint


def on_node_loss(plan: Plan, group: GroupPlan) -> NodeLossAction:
    """What the loss of one node of ``group`` does to a running segment.

    - ``GO_ON``: the dedicated rollout group of a reference run, with more than one node. Its driver
      drops the lost node's worker and serves its units with the workers left
      (beam_hpc.backends.reference.rollouts.unit_service).
    - ``SAVE_FIRST``: the dedicated rollout group of a Miles run, where a whole engine is left
      on the other nodes. Miles cannot train on with the engines left: its health monitor stops
      the lost engine, and the restart it then asks for before the next weight update waits for
      the engine's own placement-group bundle, which Ray places again only on a node that joins
      the segment's Ray cluster. But the rollout in flight still finishes on the engines left
      (the router sends the retried requests there), and Miles's loop looks for the save sentinel
      after each rollout's training and before that weight update (radixark/miles@31f1ca961
      train.py and train_async.py). So the job keeps running and the segment asks for a save;
      once the checkpoint is in, it asks for a replacement node that joins its Ray cluster in the
      lost node's place (beam_hpc.elastic.ray_replacement), and goes on when it has joined:
      Ray places the bundle there and Miles's restart returns. With no replacement to ask for
      (``lifecycle.max_replacements`` reached or 0, ``lifecycle.replacement_wait_s: 0``) or none
      joined within ``replacement_wait_s``, the segment ends as a node failure: the next segment,
      without the node, loses at most the rollout in flight, where a revoked job loses everything
      since the last periodic checkpoint.
    - ``END``: every other group (a trainer group, a colocated group, a one-node rollout group, a
      rollout group whose every engine spans the lost node), and any group under the recipe's
      ``lifecycle.rollout_node_loss: restart`` (the full-restart policy, kept so that the two can be
      compared on one product): the job has no ``--no-kill`` for it, so Slurm revokes the job and
      the next segment resumes from the last checkpoint."""
    recipe = plan.recipe
    if recipe.lifecycle.rollout_node_loss != "in_place" or group.roles != ("rollout",) or group.nodes < 2:
        return NodeLossAction.END
    if recipe.backend == "reference":
        return NodeLossAction.GO_ON
    if recipe.backend == "miles" and group.nodes > _nodes_per_engine(plan, group):
        return NodeLossAction.SAVE_FIRST
    return NodeLossAction.END


def survives_node_loss(plan: Plan, group: GroupPlan) -> bool:
    """Whether the segment trains on without a lost node of ``group`` (see :func:`on_node_loss`)."""
    return on_node_loss(plan, group) is NodeLossAction.GO_ON


def keeps_the_job(plan: Plan, group: GroupPlan) -> bool:
    """Whether the job must outlive a lost node of ``group`` (``--no-kill``, one step per node):
    to train on without it, or to save before the segment ends."""
    return on_node_loss(plan, group) is not NodeLossAction.END


def _nodes_per_engine(plan: Plan, group: GroupPlan) -> int:
    """Nodes one SGLang engine of the rollout group spans (an engine of 16 GPUs on nodes of 8: 2)."""
    per_engine = plan.recipe.topology.rollout.gpus_per_engine if plan.recipe.topology.rollout else 1
    return max(1, -(-per_engine // group.gpus_per_node)) if group.gpus_per_node > 0 else 1
