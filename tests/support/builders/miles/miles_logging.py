"""Miles's own metric logging (miles-rl 0.0.2), run on this machine for the tests.

What Miles writes to TensorBoard is decided by its code: ``miles/ray/rollout.py``
(``_log_rollout_data``, ``_log_eval_rollout_data`` and the ``compute_*`` helpers they call),
``miles/utils/train_metric_utils.py`` (``log_perf_data_raw``: ``perf/train_time``,
``perf/step_time``, ``perf/save_model_time``), ``miles/backends/training_utils/log_utils.py``
(``log_rollout_data``: ``rollout/raw_reward``) and ``miles/utils/tracking_utils`` (the TensorBoard
writer in ``TENSORBOARD_DIR``). This module calls that code, unchanged, from the installed package.

The one seam: ``miles/ray/rollout.py`` cannot be imported here, because its first lines import
SGLang's GPU runtime (triton, CUDA graphs). So its top-level *logging functions* are compiled from
the installed file itself (``ast``; the file's own line numbers, so a traceback points into Miles)
into a namespace holding exactly the names they use, imported from Miles. Nothing is copied into
beam-hpc; if Miles changes these functions, the tests run the changed code.
"""

from __future__ import annotations

import argparse
import ast
import logging
import os
from pathlib import Path
from typing import Any

# The logging section of miles/ray/rollout.py (miles-rl 0.0.2), by function name.
ROLLOUT_LOGGING = ("_log_eval_rollout_data", "_log_rollout_data", "compute_metrics_from_samples",
                   "compute_perf_metrics_from_samples", "_compute_zero_std_metrics", "_compute_spec_metrics",
                   "_compute_prefix_cache_metrics", "_compute_reward_cat_metrics")


def rollout_logging() -> dict[str, Any]:
    """The functions of :data:`ROLLOUT_LOGGING`, compiled from the installed miles/ray/rollout.py."""
    import miles
    import numpy as np
    from miles.utils import tracking_utils
    from miles.utils.iter_utils import group_by
    from miles.utils.metric_utils import (
        compute_pass_rate,
        compute_rollout_step,
        compute_statistics,
        dict_add_prefix,
        has_repetition,
    )
    from miles.utils.misc import load_function
    from miles.utils.types import Sample

    path = Path(miles.__file__).parent / "ray" / "rollout.py"
    tree = ast.parse(path.read_text(), str(path))
    keep = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in ROLLOUT_LOGGING]
    missing = set(ROLLOUT_LOGGING) - {n.name for n in keep}
    assert not missing, f"{path} no longer defines {sorted(missing)}: re-read Miles's logging"
    ns: dict[str, Any] = {"np": np, "Any": Any, "Sample": Sample, "tracking_utils": tracking_utils,
                          "group_by": group_by, "compute_pass_rate": compute_pass_rate,
                          "compute_rollout_step": compute_rollout_step, "compute_statistics": compute_statistics,
                          "dict_add_prefix": dict_add_prefix, "has_repetition": has_repetition,
                          "load_function": load_function, "logger": logging.getLogger("miles.ray.rollout")}
    exec(compile(ast.Module(body=keep, type_ignores=[]), str(path), "exec"), ns)  # noqa: S102 - Miles's own code
    return {name: ns[name] for name in ROLLOUT_LOGGING}


def miles_args(**overrides: Any) -> argparse.Namespace:
    """The attributes Miles's logging reads, at Miles's parser defaults, plus beam-hpc's command's
    ``--use-tensorboard --reward-key reward --eval-reward-key acc --log-reward-category miles_math``."""
    values = dict(custom_eval_rollout_log_function_path=None, custom_rollout_log_function_path=None,
                  load_debug_rollout_data=None, log_passrate=False, n_samples_per_eval_prompt=1,
                  n_samples_per_prompt=2, rollout_batch_size=2, global_batch_size=4,
                  wandb_always_use_train_step=False, use_tensorboard=True, tb_project_name=None,
                  tb_experiment_name=None, use_wandb=False, use_mlflow=False, use_prometheus=False,
                  log_reward_category="miles_math", reward_key="reward", eval_reward_key="acc",
                  sglang_speculative_algorithm=None, rollout_num_gpus=1, advantage_estimator="grpo",
                  ci_test=False, log_multi_turn=False, log_correct_samples=False, true_on_policy_mode=False)
    values.update(overrides)
    return argparse.Namespace(**values)


def start_tensorboard(args: argparse.Namespace, tensorboard_dir: str) -> None:
    """Miles's tracking start-up, writing where beam-hpc's launcher points it (TENSORBOARD_DIR).
    Miles's TensorBoard adapter is a per-process singleton: one directory per test process."""
    from miles.utils import tracking_utils

    os.environ["TENSORBOARD_DIR"] = tensorboard_dir
    tracking_utils.init_tracking(args, primary=True)
