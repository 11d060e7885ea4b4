"""Miles's W&B writers in the Miles stand-in: the primary in the driver, two secondaries in processes
of their own, with the real ``wandb``. Tests only.

Facts, from radixark/miles 31f1ca961 (``miles/utils/tracking_utils/wandb_utils.py``, ``base.py``,
``tracking.py``; miles-rl 0.0.2 has the same calls, without ``init_timeout``):

- ``train.py`` calls ``init_tracking(args)`` in the driver: ``init_wandb_primary`` calls
  ``wandb.init(entity=--wandb-team, project, group, name, config, dir=--wandb-dir)`` with no ``id``
  and no ``resume`` (beam-hpc's launcher gives the id through ``WANDB_RUN_ID``), with
  ``settings=Settings(init_timeout=300, mode="offline")`` offline and ``mode="shared",
  x_primary=True`` online; ``--disable-wandb-random-suffix`` makes group and name ``--wandb-group``.
  It then keeps ``args.wandb_run_id = wandb.run.id``.
- ``init_wandb_secondary`` runs in the first trainer rank (``backends/megatron_utils/actor.py``,
  ``init_tracking(args, primary=False)`` when ``is_first_replica_megatron_main_rank``) and in the
  rollout manager (``ray/rollout/rollout_manager.py``, in ``__init__``): ``wandb.init(id=
  args.wandb_run_id, entity, project, config=args.__dict__, resume="allow", reinit=True,
  dir=--wandb-dir)``, ``mode="offline"`` offline, ``mode="shared", x_primary=False,
  x_update_finish_state=False`` online: the primary owns the run's state, no secondary finishes it.
- ``_init_wandb_common`` defines the step metrics (``train/*`` on ``train/step``, ``rollout/*`` on
  ``rollout/step``, ``eval/*`` on ``eval/step``, ``perf/*`` on ``rollout/step``).
- Only the driver finishes (``train.py``: ``finally: finish_tracking()``). The secondaries are Ray
  actors; Ray ends them when the driver's job ends, without running their ``atexit`` handlers
  (checked with Ray 2.60.0: an actor that logged offline and was ended so left a ``.wandb`` log of
  its 7-byte header only: wandb 0.31 writes the offline log every 15 s,
  ``x_transaction_log_flush_interval``, and never closed it).

So each segment leaves three ``offline-run-*`` directories of one id under ``--wandb-dir``: the
driver's, with an exit record; the trainer's and the rollout manager's, without one, and holding
only what wandb had flushed. Here the secondaries are subprocesses of the driver (each Miles writer
is its own process), fed one line per rollout, and killed with SIGKILL once the primary finished,
as Ray ends them. What each logs is this double's own values under Miles's names.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from typing import Any

ROLES = ("trainer", "rollout_manager")  # the first trainer rank and the rollout manager
ENV_VARS_LOGGED = ("SLURM_JOB_ID",)  # _compute_config_for_logging's whitelist
DRIVER_ONLY_ENV = ("WANDB_SERVICE", "WANDB_RUN_ID", "WANDB_RESUME", "WANDB_PROJECT", "WANDB_ENTITY",
                   "WANDB_RUN_GROUP", "WANDB_MODE", "WANDB_DIR")


def parse(argv: list[str]) -> argparse.Namespace:
    """Miles's W&B flags (``miles/utils/arguments.py``); every other flag is the driver's."""
    p = argparse.ArgumentParser(prog="miles-standin-wandb", add_help=False)
    p.add_argument("--use-wandb", action="store_true")
    p.add_argument("--wandb-mode", default=None)
    p.add_argument("--wandb-key", default=None)
    p.add_argument("--wandb-host", default=None)
    p.add_argument("--wandb-team", default=None)
    p.add_argument("--wandb-group", default=None)
    p.add_argument("--wandb-project", default=None)
    p.add_argument("--disable-wandb-random-suffix", dest="wandb_random_suffix", action="store_false")
    p.add_argument("--wandb-dir", default=None)
    p.add_argument("--sglang-enable-metrics", action="store_true")
    args, _unknown = p.parse_known_args(argv)
    args.rank = 0
    return args


def _offline(args: argparse.Namespace) -> bool:
    return (args.wandb_mode or os.environ.get("WANDB_MODE")) == "offline"


def _settings(**kwargs: Any) -> Any:
    import wandb

    return wandb.Settings(init_timeout=300.0, **kwargs)


def primary_init_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """What ``init_wandb_primary`` passes to ``wandb.init``."""
    if args.wandb_random_suffix:  # beam-hpc always disables the suffix; kept for the comparison test
        from wandb.sdk.lib.runid import generate_id

        group = f"{args.wandb_group}_{generate_id()}"
        name = f"{group}-RANK_{args.rank}"
    else:
        group = name = args.wandb_group
    config = {**vars(args), "env_vars": {k: v for k, v in os.environ.items() if k in ENV_VARS_LOGGED}}
    kwargs: dict[str, Any] = {"entity": args.wandb_team, "project": args.wandb_project, "group": group,
                              "name": name, "config": config,
                              "settings": _settings(mode="offline") if _offline(args)
                              else _settings(mode="shared", x_primary=True)}
    if args.wandb_dir:
        kwargs["dir"] = args.wandb_dir
    return kwargs


def secondary_init_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """What ``init_wandb_secondary`` passes to ``wandb.init`` (no SGLang metrics endpoint here)."""
    settings = (dict(mode="offline") if _offline(args)
                else dict(mode="shared", x_primary=False, x_update_finish_state=False))
    kwargs: dict[str, Any] = {"id": args.wandb_run_id, "entity": args.wandb_team, "project": args.wandb_project,
                              "config": dict(vars(args)), "resume": "allow", "reinit": True,
                              "settings": _settings(**settings)}
    if args.wandb_dir:
        kwargs["dir"] = args.wandb_dir
    return kwargs


def _init(kwargs: dict[str, Any], args: argparse.Namespace) -> None:
    import wandb

    if args.wandb_mode:
        os.environ["WANDB_MODE"] = args.wandb_mode  # as both Miles inits do
    if args.wandb_dir:
        os.makedirs(args.wandb_dir, exist_ok=True)
    wandb.init(**kwargs)
    wandb.define_metric("train/step")
    wandb.define_metric("train/*", step_metric="train/step")
    wandb.define_metric("rollout/step")
    wandb.define_metric("rollout/*", step_metric="rollout/step")
    wandb.define_metric("eval/step")
    wandb.define_metric("eval/*", step_metric="eval/step")
    wandb.define_metric("perf/*", step_metric="rollout/step")


class Writers:
    """The primary, in this process, and the two secondaries, each a process fed one line a rollout."""

    def __init__(self, args: argparse.Namespace) -> None:
        import wandb

        _init(primary_init_kwargs(args), args)
        args.wandb_run_id = wandb.run.id
        self.run_id = wandb.run.id
        state = json.dumps(vars(args))
        # a Ray actor is started by its node's raylet, not by the driver: it has neither the driver's
        # wandb service (WANDB_SERVICE: sharing it, wandb refuses the id as "in use") nor the
        # driver command's W&B variables (beam-hpc's WORKER_ENV passes none); the id reaches it in
        # args, as in Miles. What the site's environment sets (WANDB_SILENT, WANDB__*) stays.
        env = {k: v for k, v in os.environ.items() if k not in DRIVER_ONLY_ENV}
        self.children = [subprocess.Popen([sys.executable, __file__, role], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, text=True, env=env) for role in ROLES]
        for child in self.children:  # Miles creates both before the first rollout
            child.stdin.write(state + "\n")
            child.stdin.flush()
            self._wait_for(child, "ready")

    @staticmethod
    def _wait_for(child: subprocess.Popen, word: str) -> None:
        """Read the child's stdout up to ``word`` (wandb may print there too: passed on to stderr)."""
        for line in child.stdout:
            if line.strip() == word:
                return
            sys.stderr.write(line)
        raise RuntimeError(f"a W&B secondary of the Miles stand-in ended before {word!r} (exit {child.wait()})")

    def rollout(self, rollout_id: int) -> None:
        for child in self.children:
            child.stdin.write(f"{rollout_id}\n")
            child.stdin.flush()
            self._wait_for(child, "logged")  # handed to wandb (on disk at its next flush)

    def close(self) -> None:
        """``finish_tracking()`` in the driver; then the actors end as Ray ends them: killed."""
        import wandb

        wandb.finish()
        for child in self.children:
            os.kill(child.pid, signal.SIGKILL)
            child.wait()


def start(argv: list[str]) -> Writers | None:
    """The writers of one launch, or None without ``--use-wandb``."""
    args = parse(argv)
    return Writers(args) if args.use_wandb else None


def _secondary(role: str) -> None:
    """One secondary: init as Miles does, then log what this role logs for each rollout id read."""
    import wandb

    args = argparse.Namespace(**json.loads(sys.stdin.readline()))
    _init(secondary_init_kwargs(args), args)
    print("ready", flush=True)
    for line in sys.stdin:
        k = int(line)
        if role == "trainer":
            wandb.log({"train/step": k, "train/loss": 1.0 / (k + 1), "train/grad_norm": 0.5})
        else:
            wandb.log({"rollout/step": k, "rollout/raw_reward": -1.0 + 0.1 * k})
        print("logged", flush=True)


if __name__ == "__main__":
    _secondary(sys.argv[1])
