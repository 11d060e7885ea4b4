"""The Miles driver on the head node: patch placement, then run Miles's own entry point in-process.

``python -m beam_hpc.backends.miles.launch --plan P --ray-address A --head-ip IP [--ifname IF]
[--group-label K] [--miles-dir D] [--placement-timeout S] [--model-script SH [--model-script-var N=V ...]]
-- train_async.py <Miles flags>`` (``--model-script``: a model script only the image could read; its
flags are appended here, by the same ``architecture.expand_deferred`` the preflight check uses).

Why a launcher of our own instead of Miles's ``scripts/run_*.py``: those ``pkill`` sglang and Ray and
start their own Ray head, which on a shared Slurm node would kill other jobs' processes; here the
allocation's Ray is already up and ready, so this process only connects to it and stops nothing.
Miles's placement must be patched in the very process that creates the placement group
(:mod:`beam_hpc.backends.miles.placement`), so the entry point runs here through ``runpy``, exactly
as ``python train_async.py ...`` would. Before that, a resuming segment's checkpoint is checked
(:mod:`beam_hpc.backends.miles.checkpoint`), and the placement proof goes to ``placement.json``.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import runpy
import sys
from collections.abc import Mapping
from pathlib import Path

from beam_hpc.backends.miles.architecture import MODEL_SCRIPT_OPTION, MODEL_SCRIPT_VAR_OPTION, expand_deferred
from beam_hpc.backends.miles.args import ENTRY_ASYNC, ENTRY_SYNC, WORKER_ENV
from beam_hpc.backends.miles.checkpoint import (
    FULL_READ_MAX_BYTES,
    SHARDED_BACKEND,
    IterationCheck,
    ResumeChoice,
    check_pinned,
    prepare_resume,
)
from beam_hpc.backends.miles.placement import DEFAULT_TIMEOUT_S, PlacementLayout, apply_placement_patch
from beam_hpc.errors import InputError, RuntimeFailure
from beam_hpc.files import write_json_atomic
from beam_hpc.logging_setup import log_to_stream, module_logger
from beam_hpc.plan.paths import RunPaths
from beam_hpc.plan.ray_labels import GROUP_LABEL_KEY
from beam_hpc.run import tracking
from beam_hpc.run.checkpoint_layout import LATEST_FILE

logger = module_logger(__name__)  # also run as python -m

PLACEMENT_MODULE = "miles.ray.placement_group"


class LaunchError(RuntimeFailure):
    """The driver cannot start Miles (bad invocation, Miles not importable)."""


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """Launcher options before ``--``; after it, the entry point and Miles's flags, untouched."""
    if "--" not in argv:
        raise LaunchError("usage: python -m beam_hpc.backends.miles.launch [options] -- train_async.py|train.py <Miles flags>")
    cut = argv.index("--")
    p = argparse.ArgumentParser(prog="python -m beam_hpc.backends.miles.launch")
    p.add_argument("--plan", required=True, help="the run's plan.json; its directory is the run directory")
    p.add_argument("--ray-address", required=True, help="the allocation's Ray cluster (host:port)")
    p.add_argument("--head-ip", required=True, help="this node's address on the cluster network")
    p.add_argument("--ifname", default=None, help="network interface for NCCL/Gloo (site network.interface)")
    p.add_argument("--group-label", default=GROUP_LABEL_KEY, help="Ray node label that names a node's group")
    p.add_argument("--miles-dir", default=None, help="Miles checkout (default: where `import miles` resolves)")
    p.add_argument("--placement-timeout", type=float, default=DEFAULT_TIMEOUT_S)
    p.add_argument(MODEL_SCRIPT_OPTION, default=None,
                   help="Miles model script read here (inside the image) for its MODEL_ARGS, appended to Miles's flags")
    p.add_argument(MODEL_SCRIPT_VAR_OPTION, action="append", default=[], metavar="NAME=VALUE",
                   help="a variable of the model script (model.miles_model_script_vars)")
    p.add_argument("--checkpoint-full-read-max-bytes", type=int, default=FULL_READ_MAX_BYTES,
                   help="resume check: fully load checkpoints up to this size, check metadata and sizes above (0: never)")
    opts = p.parse_args(argv[:cut])
    rest = argv[cut + 1:]
    if not rest or rest[0] not in (ENTRY_ASYNC, ENTRY_SYNC):
        raise LaunchError(f"after --: the Miles entry point ({ENTRY_ASYNC} or {ENTRY_SYNC}), then its flags")
    try:  # the architecture flags of a script only the image can read (architecture.expand_deferred)
        rest = [rest[0], *expand_deferred(opts.model_script, opts.model_script_var, rest[1:])]
    except InputError as err:
        raise LaunchError(str(err)) from None
    return opts, rest


def driver_environment(head_ip: str, ifname: str | None) -> dict[str, str]:
    """What this process exports before Miles starts: ``MASTER_ADDR`` and ``MILES_HOST_IP`` = the
    head's address (Miles's HTTP servers and router advertise ``MILES_HOST_IP`` instead of guessing
    an interface) and, with a site network interface, the NCCL, Gloo and NVSHMEM interface names. The
    job-wide part (``args.WORKER_ENV``) reaches every Ray worker through ``ray.init(runtime_env=...)``;
    per-node values belong to each node step's ``ray start`` environment."""
    env = {"MASTER_ADDR": head_ip, "MILES_HOST_IP": head_ip}
    if ifname:
        env.update({"NCCL_SOCKET_IFNAME": ifname, "GLOO_SOCKET_IFNAME": ifname,
                    "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME": ifname})
    return env


def wandb_environment(run_dir: Path, environ: Mapping[str, str]) -> dict[str, str]:
    """``WANDB_RUN_ID`` of the run's one W&B run where W&B is on (``args.driver_env`` set
    ``WANDB_RESUME``): Miles's ``init_wandb_primary`` passes no id, so wandb takes it from here."""
    return {"WANDB_RUN_ID": tracking.run_id(run_dir)} if environ.get("WANDB_RESUME") else {}


def worker_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The job-wide variables every Ray worker of this job gets (see ``beam_hpc.backends.miles.args.WORKER_ENV``)."""
    return {k: environ[k] for k in WORKER_ENV if k in environ}


def find_entry(entry: str, miles_dir: str | None) -> Path:
    """``train.py`` / ``train_async.py`` at the root of the Miles checkout."""
    if miles_dir is None:
        spec = importlib.util.find_spec("miles")
        if spec is None or not spec.submodule_search_locations:
            raise LaunchError("`import miles` fails here: run inside the Miles image, or pass --miles-dir")
        root = Path(next(iter(spec.submodule_search_locations))).parent
    else:
        root = Path(miles_dir)
    path = root / entry
    if not path.is_file():
        raise LaunchError(f"{path}: no such Miles entry point; pass --miles-dir <checkout with {entry}>")
    return path


def _miles_checkpoint_flags(miles_argv: list[str]) -> argparse.Namespace:
    """The three Miles/Megatron flags the resume check reads (``--flag V`` or ``--flag=V``); the rest
    is Miles's business. No abbreviations, so ``--load-debug-rollout-data`` is not ``--load``."""
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    p.add_argument("--load")
    p.add_argument("--ckpt-format")
    p.add_argument("--ckpt-step", type=int)
    known, _ = p.parse_known_args(miles_argv)
    return known


def check_resume(miles_argv: list[str], *, full_read_max_bytes: int = FULL_READ_MAX_BYTES,
                 ) -> ResumeChoice | IterationCheck | None:
    """Check the checkpoint this segment resumes from, falling back in the pointer when it is broken.

    Runs only when the argv resumes: ``--load`` names a directory with a checkpoint pointer (without
    one Miles starts from ``--ref-load``, and there is nothing to check) and the format is
    ``torch_dist`` (Megatron's default). ``--ckpt-step N`` is checked as given, never replaced.
    Raises ``CheckpointCheckError`` when nothing can be resumed from.
    """
    flags = _miles_checkpoint_flags(miles_argv)
    if flags.load is None:
        return None
    if flags.ckpt_format not in (None, SHARDED_BACKEND):
        logger.info("--ckpt-format %s: the resume check knows only %s; not checked", flags.ckpt_format, SHARDED_BACKEND)
        return None
    if not (Path(flags.load) / LATEST_FILE).is_file():
        logger.info("no %s under --load %s: Miles starts from --ref-load", LATEST_FILE, flags.load)
        return None
    if flags.ckpt_step is not None:
        return check_pinned(flags.load, flags.ckpt_step, full_read_max_bytes=full_read_max_bytes)
    return prepare_resume(flags.load, full_read_max_bytes=full_read_max_bytes)


def record_placement(run_dir: Path, layout: PlacementLayout) -> None:
    write_json_atomic(RunPaths(str(run_dir)).placement, layout.as_dict(), indent=2)


def main(argv: list[str] | None = None) -> None:
    """Connect to the allocation's Ray cluster, patch Miles's placement, run its entry point."""
    log_to_stream()
    opts, rest = parse_args(sys.argv[1:] if argv is None else argv)
    entry = find_entry(rest[0], opts.miles_dir)
    run_dir = Path(opts.plan).resolve().parent
    check_resume(rest[1:], full_read_max_bytes=opts.checkpoint_full_read_max_bytes)  # before Ray: fail fast
    os.environ.update(driver_environment(opts.head_ip, opts.ifname))
    os.environ.update(wandb_environment(run_dir, os.environ))

    import ray

    ray.init(address=opts.ray_address, runtime_env={"env_vars": worker_environment(os.environ)})
    if opts.miles_dir is not None:
        sys.path.insert(0, str(Path(opts.miles_dir).resolve()))
    module = importlib.import_module(PLACEMENT_MODULE)
    apply_placement_patch(
        module,
        label_key=opts.group_label,
        timeout_s=opts.placement_timeout,
        on_layout=lambda layout: record_placement(run_dir, layout),
    )
    logger.info("running %s with %d Miles arguments against Ray at %s", entry, len(rest) - 1, opts.ray_address)
    # What `python train_async.py ...` would see: its directory first on sys.path, its argv.
    sys.path.insert(0, str(entry.parent))
    sys.argv = [str(entry), *rest[1:]]
    runpy.run_path(str(entry), run_name="__main__")


if __name__ == "__main__":
    main()
