"""Miles's ``--custom-rm-path`` target: score a Miles sample with beam-hpc's own reward.

Why: both backends must score a response identically (``beam_hpc.reward.scoring.score_response``), or
curves from the reference backend and from Miles cannot be compared.

How Miles calls a custom reward (radixark/miles@31f1ca961a94cb860cec3b2dea34ec332bfa8f76, read
for facts only):

- ``miles/rollout/rm_hub/__init__.py``: ``async_rm(args, sample)`` does
  ``rm_function = load_function(args.custom_rm_path)`` (``module.attr``, imported in the rollout
  process) and ``return await rm_function(args, sample, **kwargs)``: the function is a
  **coroutine function** taking Miles's parsed ``args`` and one ``Sample``. ``batched_async_rm``
  awaits the same function with a **list** of samples instead (``--group-rm``, or generate
  functions that return several samples), and then expects a list back; both shapes are served.
- the sample (``miles/utils/types.py`` ``Sample``): ``response`` (decoded text), ``label``
  (from ``--label-key``; ``None`` when the key is missing), ``response_length`` (generated
  tokens), ``status`` (aborted samples are never scored).
- train vs eval: the reward function is not told. Both paths call it the same way
  (``miles/rollout/sglang_rollout.py`` and ``inference_rollout/*``: ``generate_and_rm(...,
  evaluation=...)`` does not pass ``evaluation`` on to the reward). A dict reward is read through
  a key instead: training uses ``sample.reward[args.reward_key]`` (``Sample.get_reward_value``),
  evaluation ``sample.reward[args.eval_reward_key or args.reward_key]``
  (``eval_rollout_single_dataset``), and the eval metric is the mean of those values. So this
  function returns ``{"reward": correctness + overlong penalty, "acc": 1.0/0.0, "pred", "penalty"}``
  and the builder passes ``--reward-key reward --eval-reward-key acc``: evaluation reports accuracy
  without the length penalty, as the seed does. The dict also carries Miles's own checker's verdict
  (``miles_math``: "correct"/"wrong"), and the builder passes ``--log-reward-category miles_math``:
  Miles's ``_compute_reward_cat_metrics`` then logs ``eval/<name>/error_cat/<verdict>`` (and
  ``rollout/error_cat/<verdict>``), the accuracy the seed reported, beside beam-hpc's.

Settings: the length limit is Miles's own ``args.rollout_max_response_len`` (the budget the
responses were generated under); the penalty window and factor, which Miles does not know, come
from ``BEAM_REWARD_OVERLONG_BUFFER`` / ``BEAM_REWARD_OVERLONG_FACTOR``, which the launcher sets
for every Ray worker of the job from the recipe.

Scoring runs in a worker thread (``asyncio.to_thread``) so that a slow symbolic check does not
stall the rollout's event loop, which is also driving generation; ``beam_hpc.reward.scoring`` is safe off
the main thread. Miles passes its objects in; the one Miles import is its checker (beam_hpc.reward.miles_check).
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from beam_hpc.backends.miles.args import ENV_OVERLONG_BUFFER, ENV_OVERLONG_FACTOR
from beam_hpc.reward.miles_check import miles_verdict
from beam_hpc.run.metric_names import MILES_CHECK_KEY


def _penalty_settings() -> tuple[int, float]:
    try:
        buffer = int(os.environ[ENV_OVERLONG_BUFFER])
        factor = float(os.environ.get(ENV_OVERLONG_FACTOR, "1.0"))
    except KeyError:
        raise RuntimeError(
            f"{ENV_OVERLONG_BUFFER} is not set in this Ray worker: start the Miles driver through "
            "`python -m beam_hpc.backends.miles.launch`, which passes the recipe's reward settings"
        ) from None
    except ValueError as err:
        raise RuntimeError(f"{ENV_OVERLONG_BUFFER}/{ENV_OVERLONG_FACTOR}: not a number ({err})") from None
    return buffer, factor


def score_sample(args: Any, sample: Any) -> dict[str, Any]:
    """One Miles sample -> the reward dict (synchronous; see :func:`reward`)."""
    from beam_hpc.reward.scoring import score_response

    if sample.label is None:
        raise ValueError(
            "Miles sample has no label: the prompt data lacks the --label-key field ('label'); "
            "rebuild it with `beam-hpc prepare`"
        )
    buffer, factor = _penalty_settings()
    result = score_response(
        sample.response,
        str(sample.label),
        int(sample.response_length),
        max_response_tokens=int(args.rollout_max_response_len),
        buffer_tokens=buffer,
        factor=factor,
    )
    return {
        "reward": result.reward,
        "acc": 1.0 if result.correct else 0.0,
        "pred": result.pred,
        "penalty": result.penalty,
        # Miles's own checker's verdict: metrics only (never the training reward); Miles logs its
        # per-verdict fractions under --log-reward-category (beam_hpc.reward.miles_check).
        MILES_CHECK_KEY: miles_verdict(sample.response, str(sample.label)),
    }


async def reward(args: Any, sample: Any, **_: Any) -> dict[str, Any] | list[dict[str, Any]]:
    """The ``--custom-rm-path`` entry: one sample -> one dict, a list of samples -> a list."""
    if isinstance(sample, list):
        return list(await asyncio.gather(*(asyncio.to_thread(score_sample, args, s) for s in sample)))
    return await asyncio.to_thread(score_sample, args, sample)
