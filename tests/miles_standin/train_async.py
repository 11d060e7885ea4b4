"""Contract double of Miles's ``train_async.py`` entry point, for tests only.

It imports ``create_placement_groups`` by name at the top, as Miles's entry points do, parses the
topology flags it needs from Miles's argv, creates the placement group, checks where a GPU task
on each bundle really runs, and writes what it saw to ``<--dump-details>/standin.json``: argv,
the driver environment, the layout, and the environment a Ray worker of the job sees.
"""

import argparse
import json
import os
import sys

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from miles.ray.placement_group import create_placement_groups


@ray.remote(num_gpus=0.4, num_cpus=0.4)
def where(env_names):
    return ray.util.get_node_ip_address(), ray.get_gpu_ids(), {k: os.environ.get(k) for k in env_names}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--actor-num-nodes", type=int, required=True)
    p.add_argument("--actor-num-gpus-per-node", type=int, required=True)
    p.add_argument("--rollout-num-gpus", type=int, default=0)
    p.add_argument("--colocate", action="store_true")
    p.add_argument("--dump-details", required=True)
    args, _unknown = p.parse_known_args()
    pgs = create_placement_groups(args)
    env_names = ["TENSORBOARD_DIR", "BEAM_REWARD_OVERLONG_BUFFER", "MILES_HOST_IP"]
    report = {"argv": sys.argv, "env": {k: os.environ.get(k) for k in ("MASTER_ADDR", "MILES_HOST_IP")}}
    for role in ("actor", "rollout"):
        pg, indices, gpu_ids = pgs[role]
        n = args.actor_num_nodes * args.actor_num_gpus_per_node if role == "actor" else len(indices)
        refs = [
            where.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=b)
            ).remote(env_names)
            for b in indices[:n]
        ]
        report[role] = [{"node": ip, "gpus": gpus, "expected_gpu": gpu_ids[i], "worker_env": env}
                        for i, (ip, gpus, env) in enumerate(ray.get(refs))]
    os.makedirs(args.dump_details, exist_ok=True)
    with open(os.path.join(args.dump_details, "standin.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
