"""Names of the metrics a backend records and `beam-hpc status` / `plot` read.

One place for the names, so writer and readers cannot drift apart. Every scalar is logged to
TensorBoard (``<output>/tensorboard``) with the rollout id as the step, and mirrored as one JSON
line per event in ``<output>/dumps/metrics.jsonl`` ({"kind": ..., "rollout_id": ..., <tag>: value})
so that tools without TensorBoard can read them too.
"""

from __future__ import annotations

from collections.abc import Iterable

ROLLOUT_REWARD = "rollout/reward"  # mean shaped reward (correctness + length penalty)
ROLLOUT_CORRECT = "rollout/correct"  # fraction of correct responses
ROLLOUT_RESPONSE_LEN = "rollout/response_len"  # mean response tokens
ROLLOUT_TIME = "perf/rollout_time_s"  # wall time of the rollout step (generate + train)
TRAIN_TIME = "perf/train_time_s"
SAVE_TIME = "perf/save_time_s"
POLICY_LAG = "perf/policy_lag"  # trainer version minus the version that generated the rollout

# The evaluation set's tags carry its name (the recipe's data.eval_name), as Miles names them from
# --eval-prompt-data: "eval/<name>" and "eval/<name>_response_len". The seed's set is aime25.
DEFAULT_EVAL_NAME = "aime25"
_EVAL_PREFIX = "eval/"
_RESPONSE_LEN_SUFFIX = "_response_len"


def eval_accuracy_tag(eval_name: str) -> str:
    """Accuracy on the evaluation set, without the length penalty."""
    return f"{_EVAL_PREFIX}{eval_name}"


def eval_response_len_tag(eval_name: str) -> str:
    """Mean response tokens on the evaluation set."""
    return f"{_EVAL_PREFIX}{eval_name}{_RESPONSE_LEN_SUFFIX}"


def eval_names_in(tags: Iterable[str]) -> list[str]:
    """The evaluation-set names whose accuracy tag appears among ``tags`` (sorted): what a run
    directory really recorded, whatever its plan says now."""
    return sorted(t[len(_EVAL_PREFIX):] for t in tags
                  if t.startswith(_EVAL_PREFIX) and "/" not in t[len(_EVAL_PREFIX):]
                  and not t.endswith(_RESPONSE_LEN_SUFFIX) and len(t) > len(_EVAL_PREFIX))


EVAL_ACCURACY = eval_accuracy_tag(DEFAULT_EVAL_NAME)  # the seed's tags, for readers of seed runs
EVAL_RESPONSE_LEN = eval_response_len_tag(DEFAULT_EVAL_NAME)

METRICS_FILE = "metrics.jsonl"  # under <output>/dumps
