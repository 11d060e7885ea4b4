"""`beam-hpc execute RECIPE`: the whole run on this machine, no Slurm and no GPU needed.

The embedded default (`recipes/tiny.yaml`) runs the same code path as a Slurm segment: the Plan,
the run lock and ledger, one node step per group started as local processes (loopback addresses,
token-authenticated Ray), the reference backend's RL loop, checkpoints, teardown. Only the
launcher differs (``beam_hpc.job.launchers.LocalLauncher`` instead of ``srun``), and the site is the
built-in laptop profile below unless ``--site`` names another. With no batch script, that site's
lines (env, setup, module loads) run in a bash first, and the segment gets the environment they leave.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

LAPTOP_SITE = {
    "name": "laptop",
    "gpus_per_node": 0,
    "mem": None,
    "container": {"runtime": "host"},
    "network": {"ip_source": "loopback"},
    # 61000-65399 (eleven bands of 400): above Linux's ephemeral range (32768-60999), whose ports
    # any program's outgoing connection may hold, and above Ray's worker ports (10002-19999).
    "ray": {"gcs_port_base": 61000, "port_span": 400, "object_store_gb": 0.3},
}


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from beam_hpc.cli.app import _common_recipe_args

    p = subparsers.add_parser("execute", help="run a recipe on this machine (no Slurm), e.g. recipes/tiny.yaml")
    _common_recipe_args(p)
    p.add_argument("--resume", action="store_true", help="continue the run in the output directory")
    p.add_argument("--quiet", action="store_true", help="no live per-rollout lines")
    p.set_defaults(func=cmd_execute)


def laptop_site():  # type: ignore[no-untyped-def]
    from beam_hpc.config.site import site_from_dict

    return site_from_dict({**LAPTOP_SITE, "python": sys.executable}, "<built-in laptop site>")


# What bash sets for itself, not what the site's lines set: left as this process has them.
_SHELL_OWN = frozenset({"_", "SHLVL", "PWD", "OLDPWD"})


def apply_site_lines(site) -> None:  # type: ignore[no-untyped-def]
    """Run the site's lines (``beam_hpc.slurm.script.site_lines``: env, then setup, then module loads)
    in bash, as a batch script runs them before the segment, and take the environment they leave
    into this process, so the segment and all it starts see the site's variables and modules."""
    from beam_hpc.errors import RuntimeFailure
    from beam_hpc.slurm.script import site_lines

    lines = site_lines(site)
    if not lines:
        return
    # the lines' own output goes to stderr; the environment they leave comes back on fd 3
    script = "\n".join(["set -eo pipefail", "exec 3>&1 1>&2", *lines, "env -0 >&3"])
    res = subprocess.run(["bash", "-c", script], stdout=subprocess.PIPE, check=False)
    if res.returncode != 0:
        raise RuntimeFailure(f"the site's lines (env, setup, module_loads of site {site.name}) failed with exit "
                             f"code {res.returncode}; their output is above")
    env = dict(item.split("=", 1) for item in res.stdout.decode(errors="replace").split("\0") if "=" in item)
    for key in set(os.environ) - set(env) - _SHELL_OWN:
        del os.environ[key]  # unset by the site's lines (e.g. a module unload)
    os.environ.update({k: v for k, v in env.items() if k not in _SHELL_OWN})


def ensure_tiny_data(recipe) -> bool:  # type: ignore[no-untyped-def]
    """The tiny recipe's data is generated, in the upstream schemas, and goes through `prepare`
    like real data; done once (prepare skips verified files)."""
    if not recipe.backend_options.get("tiny_data"):
        return False
    if Path(recipe.data.train_path()).is_file() and Path(recipe.data.eval_path()).is_file():
        return False
    from beam_hpc.data.prepare import prepare
    from beam_hpc.data.tiny import SET_NAME, write_tiny_sources

    with tempfile.TemporaryDirectory(prefix="beam-tiny-src-") as tmp:
        # seed 0: the data set the shipped tiny model was built against (its eval problems excluded)
        sources = write_tiny_sources(Path(tmp), seed=0)
        prepare(Path(recipe.data.dir), from_local=sources, progress=True, eval_file=Path(recipe.data.eval_path()).name,
                set_name=SET_NAME)
    return True


def _follow_driver_log(logs_dir: Path, since: float, stop: threading.Event) -> None:
    """Print the driver's per-rollout lines as they are written (the live view of `execute`);
    the tailing itself is beam_hpc.observe.logs.follow, the same code as `beam-hpc logs --follow`."""
    from beam_hpc.observe.logs import follow
    from beam_hpc.plan.paths import DRIVER_LOG

    current: Path | None = None
    while current is None and not stop.is_set():
        found = [p for p in logs_dir.glob(f"*/{DRIVER_LOG}") if p.stat().st_mtime >= since - 1]
        current = max(found, key=lambda p: p.stat().st_mtime) if found else None
        if current is None:
            stop.wait(0.5)
    if current is None:
        return
    for line in follow(logs_dir.parent, current, switch_segments=False, stop=stop.is_set, start_at_end=False):
        if "rollout" in line or "eval" in line or "checkpoint" in line:
            print(line, end="", flush=True)


def cmd_execute(args: argparse.Namespace) -> int:
    from beam_hpc.backends.registry import plan_for
    from beam_hpc.job import segment
    from beam_hpc.plan.segment_args import SegmentArgs
    from beam_hpc.submission.request import SubmitRequest, Via
    from beam_hpc.submission.run_guard import check_before_submit
    from beam_hpc.submission.submit import build_recipe, build_site, lift_cancel

    recipe = build_recipe(
        args.recipe, overrides=args.overrides, output_dir=args.output_dir, num_rollout=args.num_rollout,
        no_async_training=args.no_async_training, base_dir=Path.cwd(),
    )
    from beam_hpc.config.site import with_existing_ray

    site = with_existing_ray(build_site(args.site) if args.site else laptop_site(), args.ray_address, args.ray_token_file)
    request = SubmitRequest(plan=plan_for(recipe, site), via=Via.LOCAL,
                            segment=SegmentArgs(resume=args.resume, num_rollout=args.num_rollout))
    plan = request.plan
    check_before_submit(recipe, resume=args.resume)  # a damaged run directory: exit 2, nothing written
    apply_site_lines(site)
    if ensure_tiny_data(recipe):
        print(f"prepared the tiny data set in {recipe.data.dir}")
    if recipe.backend_options.get("smollm2_model"):  # here, once, so a missing wheel is one line, not an actor's traceback
        from beam_hpc.backends.reference.model.smollm2_model import materialise

        print(f"SmolLM2-135M-Instruct: {materialise(recipe.model.path)}")
    plan.write()
    lift_cancel(plan)  # running it again is the user's intent (a local segment has no SubmitTime to compare)
    print(f"run {plan.run_id}: {recipe.name} on this machine -> {plan.output_dir}")
    if recipe.eval.interval > 0:
        print(f"eval every {recipe.eval.interval} rollouts on {recipe.data.eval_title()} "
              f"({recipe.data.eval_name}: {recipe.data.eval_path()})")
    stop = threading.Event()
    follower = None
    if not args.quiet:
        Path(plan.paths.logs).mkdir(parents=True, exist_ok=True)
        follower = threading.Thread(target=_follow_driver_log, args=(Path(plan.paths.logs), time.time(), stop), daemon=True)
        follower.start()
    try:
        code = segment.run_segment(plan.paths.plan, request.segment)
    finally:
        stop.set()
        if follower is not None:
            follower.join(timeout=2)
    print(f"{'done' if code == 0 else 'failed'}: see `beam-hpc status {plan.output_dir}` and `beam-hpc plot {plan.output_dir}`")
    return code
