"""Names of the metrics a backend records and `beam-hpc status` / `plot` read.

One place for the names, so writer and readers cannot drift apart. Every scalar is logged to
TensorBoard (``<output>/tensorboard``) with the rollout id as the step, and mirrored as one JSON
line per event in ``<output>/dumps/metrics.jsonl`` ({"kind": ..., "rollout_id": ..., <tag>: value})
so that tools without TensorBoard can read them too.
"""

ROLLOUT_REWARD = "rollout/reward"  # mean shaped reward (correctness + length penalty)
ROLLOUT_CORRECT = "rollout/correct"  # fraction of correct responses
ROLLOUT_RESPONSE_LEN = "rollout/response_len"  # mean response tokens
ROLLOUT_TIME = "perf/rollout_time_s"  # wall time of the rollout step (generate + train)
TRAIN_TIME = "perf/train_time_s"
SAVE_TIME = "perf/save_time_s"
POLICY_LAG = "perf/policy_lag"  # trainer version minus the version that generated the rollout
EVAL_ACCURACY = "eval/aime25"  # accuracy without the length penalty
EVAL_RESPONSE_LEN = "eval/aime25_response_len"  # mean response tokens on the eval set

METRICS_FILE = "metrics.jsonl"  # under <output>/dumps
