"""Names of the metrics a backend records and `beam-hpc status` / `plot` / the lifecycle read.

Why these names: they are the ones Miles itself writes to TensorBoard (``--use-tensorboard``, the
directory in ``TENSORBOARD_DIR``), read as facts from miles-rl 0.0.2 and radixark/miles@31f1ca96
(``miles/ray/rollout/metrics.py``, ``miles/utils/train_metric_utils.py``,
``miles/backends/training_utils/log_utils.py``), with step = the rollout id: per rollout,
``rollout/raw_reward``, ``rollout/response_len/*``, ``perf/train_time`` + ``perf/train_wait_time``
= ``perf/step_time`` (one whole step; the wait covers generation) and the timers of what ran since
the last step (``perf/save_model_time``); per evaluation set ``<name>``, ``eval/<name>``,
``eval/<name>/response_len/*`` and, with ``--log-reward-category <key>``,
``eval/<name>/error_cat/<value>`` (the fraction of samples whose reward dict holds that value).

The reference backend writes the same names, so one reader serves both. Runs recorded under
beam-hpc's earlier names are read through :data:`LEGACY_TAGS` / :func:`canonical_tag`.
"""

from __future__ import annotations

from collections.abc import Iterable

# -- per rollout (Miles's names) -----------------------------------------------------------------
ROLLOUT_REWARD = "rollout/raw_reward"  # mean reward used for training (correctness + length penalty)
ROLLOUT_CORRECT = "rollout/correct"  # the reference backend's own: fraction of correct responses
ROLLOUT_RESPONSE_LEN = "rollout/response_len/mean"  # mean response tokens
ROLLOUT_TIME = "perf/step_time"  # one rollout step: train_wait (generation) + train
TRAIN_TIME = "perf/train_time"
SAVE_TIME = "perf/save_model_time"  # Miles logs it with the step after the save
POLICY_LAG = "perf/policy_lag"  # the reference backend's own: trainer version minus generating version

# The evaluation set's tags carry its name (the recipe's data.eval_name), as Miles names them from
# --eval-prompt-data. The seed's set is aime25.
DEFAULT_EVAL_NAME = "aime25"
_EVAL_PREFIX = "eval/"
_RESPONSE_LEN = "/response_len/mean"

# -- the second answer checker ---------------------------------------------------------------------
# beam-hpc's reward dict carries Miles's own math checker's verdict under this key, and the Miles
# command asks Miles to log it as a category (--log-reward-category): Miles then writes
# eval/<name>/error_cat/<verdict> = the fraction of eval samples with that verdict.
MILES_CHECK_KEY = "miles_math"
MILES_CORRECT, MILES_WRONG, MILES_UNAVAILABLE = "correct", "wrong", "unavailable"
_ERROR_CAT = "/error_cat/"


def eval_accuracy_tag(eval_name: str) -> str:
    """Accuracy on the evaluation set by beam-hpc's checker (the eval reward key), no length penalty."""
    return f"{_EVAL_PREFIX}{eval_name}"


def eval_response_len_tag(eval_name: str) -> str:
    """Mean response tokens on the evaluation set."""
    return f"{_EVAL_PREFIX}{eval_name}{_RESPONSE_LEN}"


def eval_miles_verdict_tag(eval_name: str, verdict: str) -> str:
    """Fraction of eval samples that Miles's math checker gave ``verdict`` (one of MILES_*)."""
    return f"{_EVAL_PREFIX}{eval_name}{_ERROR_CAT}{verdict}"


def eval_names_in(tags: Iterable[str]) -> list[str]:
    """The evaluation-set names recorded among ``tags`` (sorted): what a run directory really
    recorded, whatever its plan says now. A set is an ``eval/<name>`` with its
    ``eval/<name>/response_len/mean`` beside it (every writer logs both; read through
    :func:`canonical_tag` for old runs), so Miles's other ``eval/...`` scalars without a "/" after
    the name (``eval/<name>-truncated_ratio``, ``-pass@k``, ``-none_reward_ratio``,
    ``eval/skipped_<reason>``) are never taken for a set."""
    tags = set(tags)
    return sorted(t[len(_EVAL_PREFIX):] for t in tags
                  if t.startswith(_EVAL_PREFIX) and len(t) > len(_EVAL_PREFIX) and "/" not in t[len(_EVAL_PREFIX):]
                  and eval_response_len_tag(t[len(_EVAL_PREFIX):]) in tags)


EVAL_ACCURACY = eval_accuracy_tag(DEFAULT_EVAL_NAME)  # the seed's tags, for readers of seed runs
EVAL_RESPONSE_LEN = eval_response_len_tag(DEFAULT_EVAL_NAME)

# -- runs recorded before beam-hpc took Miles's names ------------------------------------------------
LEGACY_TAGS = {
    "rollout/reward": ROLLOUT_REWARD,
    "rollout/response_len": ROLLOUT_RESPONSE_LEN,
    "perf/rollout_time_s": ROLLOUT_TIME,
    "perf/train_time_s": TRAIN_TIME,
    "perf/save_time_s": SAVE_TIME,
}
_LEGACY_RESPONSE_LEN_SUFFIX = "_response_len"  # "eval/<name>_response_len"


def canonical_tag(tag: str) -> str:
    """The current name of a tag an older beam-hpc wrote (itself when it is current)."""
    if tag in LEGACY_TAGS:
        return LEGACY_TAGS[tag]
    if tag.startswith(_EVAL_PREFIX) and tag.endswith(_LEGACY_RESPONSE_LEN_SUFFIX) and "/" not in tag[len(_EVAL_PREFIX):]:
        return eval_response_len_tag(tag[len(_EVAL_PREFIX):-len(_LEGACY_RESPONSE_LEN_SUFFIX)])
    return tag


METRICS_FILE = "metrics.jsonl"  # under <output>/dumps: the reference backend's mirror of its scalars
