"""Contract double of Miles's ``train_async.py`` entry point (asynchronous, dedicated pools), tests only.

As Miles's entry points do, it imports ``create_placement_groups`` by name at the top (so beam-hpc's
placement patch must work on a name bound before patching), refuses ``--colocate`` with Miles's
own assertion, and runs the loop that ``standin_driver`` describes: placement probe under a Ray
cluster, resume from ``--load``, rollouts, saves at the interval and at the sentinel, stop at
``--num-rollout``; everything it saw goes to ``<--dump-details>/standin*.json``.
"""

import sys

from miles.ray.placement_group import create_placement_groups
from standin_driver import run

if __name__ == "__main__":
    run(sys.argv[1:], "train_async.py", create_placement_groups)
