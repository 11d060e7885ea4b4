"""Contract double of Miles's ``train.py`` entry point (generation and training in turn, also
colocated), tests only.

Same loop as the ``train_async.py`` double (``standin_driver``); the difference Miles has at this
level is which flags each entry accepts: ``train.py`` takes ``--colocate`` and refuses
``--fully-async``.
"""

import sys

from miles.ray.placement_group import create_placement_groups
from standin_driver import run

if __name__ == "__main__":
    run(sys.argv[1:], "train.py", create_placement_groups)
