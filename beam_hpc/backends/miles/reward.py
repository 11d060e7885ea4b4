"""Miles's ``--custom-rm-path`` target: score a Miles sample with beam-hpc's own reward.

Why: both backends must score a response identically (``beam_hpc.reward.scoring.score_response``), or
curves from the reference backend and from Miles cannot be compared.

Miles (radixark/miles@31f1ca96, read for facts only) awaits the function with its parsed ``args``
and one ``Sample`` (``async_rm``) or a list of them (``batched_async_rm``), and does not tell train
from eval: it reads a dict reward through ``--reward-key`` in training and ``--eval-reward-key`` in
eval. So :func:`reward` returns ``{"reward": correctness + overlong penalty, "acc", "pred", "penalty",
"miles_math"}``, and the argument builder passes ``--reward-key reward --eval-reward-key acc`` (eval
without the length penalty, as the seed reports it) and ``--log-reward-category miles_math`` (Miles's
own checker's verdict, logged as ``eval/<name>/error_cat/<verdict>``). The length limit is Miles's
``args.rollout_max_response_len``; the penalty window and factor come from the environment the
launcher sets from the recipe. Scoring runs in a worker thread, off the rollout's event loop.
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
    """The ``--custom-rm-path`` entry: one sample -> one dict, a list of samples -> a list.

    Miles loads it with ``load_function(args.custom_rm_path)`` and awaits it
    (``miles/rollout/rm_hub/__init__.py``: ``async_rm`` with one sample, ``batched_async_rm`` with a
    list, e.g. under ``--group-rm``). Of the ``Sample`` (``miles/utils/types.py``) it reads
    ``response`` (decoded text), ``label`` (from ``--label-key``; None when missing) and
    ``response_length`` (generated tokens); aborted samples are never scored. Training reads
    ``sample.reward[args.reward_key]``, evaluation ``sample.reward[args.eval_reward_key]``
    (``eval_rollout_single_dataset``)."""
    if isinstance(sample, list):
        return list(await asyncio.gather(*(asyncio.to_thread(score_sample, args, s) for s in sample)))
    return await asyncio.to_thread(score_sample, args, sample)
