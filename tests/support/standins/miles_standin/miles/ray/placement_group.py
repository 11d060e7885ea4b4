"""Contract double of ``miles/ray/placement_group.py`` (radixark/miles@31f1ca961), for tests only.

Written for beam-hpc from the facts of Miles's module, not copied: what the placement patch
relies on is kept exactly; everything else Miles does there (rollout manager, train groups) is
left out. The contract:

- module globals ``placement_group`` (Ray's function, imported by name), ``sort_key`` and
  ``_get_placement_group_layout``, looked up at call time by ``_create_placement_group`` /
  ``create_placement_groups``;
- one PACK placement group of ``{"GPU": 1, "CPU": 1}`` bundles, awaited with ``ray.get(pg.ready())``;
- a one-GPU probe actor per bundle reports ``(node IP, GPU id)``; bundles are sorted with
  ``sort_key((bundle_index, node_ip, gpu_id))``; the first ``rollout_offset`` sorted bundles train;
- the layout (``_get_placement_group_layout``, lines 92-105 there): with ``rollout_external`` it is
  ``(actor GPUs, actor GPUs)`` before ``colocate`` is looked at (lines 97-99), so the rollout's slice
  is empty; colocated ``(max(actor, rollout), 0)``; else ``(actor + rollout, actor)`` (Miles adds
  ``eval_num_gpus``, which beam-hpc never sets).
"""

import ray
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy


@ray.remote(num_gpus=1)
class InfoActor:
    def get_ip_and_gpu_id(self):
        return ray.util.get_node_ip_address(), ray.get_gpu_ids()[0]


def sort_key(x):
    _index, node_ip, gpu_id = x
    return ([int(part) for part in node_ip.split(".")], gpu_id)


def _create_placement_group(num_gpus):
    if num_gpus == 0:
        return None, [], []
    bundles = [{"GPU": 1, "CPU": 1} for _ in range(num_gpus)]
    pg = placement_group(bundles, strategy="PACK")
    ray.get(pg.ready())
    probes = [
        InfoActor.options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=i)
        ).remote()
        for i in range(num_gpus)
    ]
    found = ray.get([p.get_ip_and_gpu_id.remote() for p in probes])
    for p in probes:
        ray.kill(p)
    ordered = sorted(((i, ip, gpu) for i, (ip, gpu) in enumerate(found)), key=sort_key)
    return pg, [i for i, _, _ in ordered], [gpu for _, _, gpu in ordered]


def _get_placement_group_layout(args):
    actor_gpus = args.actor_num_nodes * args.actor_num_gpus_per_node
    if getattr(args, "rollout_external", False):
        return actor_gpus, actor_gpus
    if args.colocate:
        return max(actor_gpus, args.rollout_num_gpus), 0
    return actor_gpus + args.rollout_num_gpus, actor_gpus


def create_placement_groups(args):
    num_gpus, rollout_offset = _get_placement_group_layout(args)
    pg, indices, gpu_ids = _create_placement_group(num_gpus)
    return {
        "actor": (pg, indices, gpu_ids),
        "rollout": (pg, indices[rollout_offset:], gpu_ids[rollout_offset:]),
    }
