"""``python -m beam_hpc.backends.reference --plan RUN_DIR/plan.json --ray-address ADDR``.

The process the runtime starts on the head node once Ray is ready (the Plan's ``driver_argv``).
``--ray-address local`` starts a private in-process Ray whose one node carries both group
resources, for ``beam-hpc execute`` and the tests. Progress goes to stdout, one line per rollout.
"""

from __future__ import annotations

import argparse
import sys

from beam_hpc.logging_setup import log_to_stream


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m beam_hpc.backends.reference", description=__doc__.splitlines()[0])
    parser.add_argument("--plan", required=True, help="the run's plan.json (or its run directory)")
    parser.add_argument("--ray-address", default="local", help="Ray GCS address, or 'local' for a private Ray")
    parser.add_argument("--num-rollout", type=int, default=None,
                        help="the total to run to (the segment's; default: the plan's)")
    args = parser.parse_args(argv)
    log_to_stream("stdout")
    from beam_hpc.backends.reference.loop.driver import run

    return run(args.plan, args.ray_address, num_rollout=args.num_rollout)


if __name__ == "__main__":
    sys.exit(main())
