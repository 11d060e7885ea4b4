"""Miles's custom reward adapter scores exactly as ``beam_hpc.reward.scoring`` does.

Miles cannot be installed here; the contract (read in radixark/miles@31f1ca961, see the
adapter's docstring) is: Miles loads ``--custom-rm-path`` as ``module.attr``, awaits
``fn(args, sample)`` with one ``Sample`` (or a list of them under ``--group-rm``), and reads a
dict reward through ``args.reward_key`` (training) / ``args.eval_reward_key`` (evaluation). The
``Sample`` stand-in below carries the fields Miles's ``Sample`` has that the adapter reads.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
from real_miles import require_miles

from beam_hpc.backends.miles import args as miles_args
from beam_hpc.backends.miles import reward as miles_reward
from beam_hpc.reward.scoring import score_response


@dataclass
class Sample:
    """The fields of miles.utils.types.Sample that a reward function reads."""

    response: str
    label: str | None
    response_length: int


ARGS = SimpleNamespace(rollout_max_response_len=4096, reward_key="reward", eval_reward_key="acc")


@pytest.fixture
def reward_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(miles_args.ENV_OVERLONG_BUFFER, "1024")
    monkeypatch.setenv(miles_args.ENV_OVERLONG_FACTOR, "1.0")


def load_like_miles(path: str):
    """What miles.utils.misc.load_function does with a dotted path."""
    module, _, attr = path.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def test_the_flag_names_an_awaitable_function() -> None:
    fn = load_like_miles(miles_args.REWARD_FUNCTION)
    assert fn is miles_reward.reward and inspect.iscoroutinefunction(fn)


@pytest.mark.parametrize(
    ("response", "label", "tokens"),
    [
        ("so the answer is \\boxed{34}", "34", 500),  # right, short
        ("so the answer is \\boxed{35}", "34", 500),  # wrong, short
        ("long ... \\boxed{34}", "34", 3584),  # right, half-way into the 1,024-token window
        ("long ... \\boxed{34}", "34", 4096),  # right, at the limit
        ("no box at all", "34", 100),
    ],
)
def test_same_score_as_the_reference_reward(reward_env: None, response: str, label: str, tokens: int) -> None:
    require_miles()  # Miles's own checker's verdict is part of the expected answer
    got = asyncio.run(miles_reward.reward(ARGS, Sample(response, label, tokens)))
    want = score_response(response, label, tokens, max_response_tokens=4096, buffer_tokens=1024, factor=1.0)
    from miles.rollout.rm_hub.math_utils import grade_answer_verl  # Miles's own checker (miles-rl)

    assert got == {"reward": want.reward, "acc": 1.0 if want.correct else 0.0, "pred": want.pred,
                   "penalty": want.penalty,
                   "miles_math": "correct" if grade_answer_verl(response, label) else "wrong"}


def test_eval_key_is_accuracy_without_penalty(reward_env: None) -> None:
    """Training reads the penalised reward, evaluation the plain 1/0 correctness."""
    got = asyncio.run(miles_reward.reward(ARGS, Sample("\\boxed{7}", "7", 3584)))
    assert got[ARGS.reward_key] == pytest.approx(1.0 - 0.5)
    assert got[ARGS.eval_reward_key] == 1.0


def test_a_list_of_samples_gets_a_list(reward_env: None) -> None:
    samples = [Sample("\\boxed{1}", "1", 10), Sample("\\boxed{2}", "3", 10)]
    got = asyncio.run(miles_reward.reward(ARGS, samples))
    assert [g["acc"] for g in got] == [1.0, 0.0]


def test_window_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(miles_args.ENV_OVERLONG_BUFFER, "2048")
    monkeypatch.setenv(miles_args.ENV_OVERLONG_FACTOR, "0.5")
    got = asyncio.run(miles_reward.reward(ARGS, Sample("\\boxed{7}", "7", 3072)))
    assert got["penalty"] == pytest.approx(-0.25)  # half-way into 2,048 tokens, factor 0.5


def test_clear_errors(monkeypatch: pytest.MonkeyPatch, reward_env: None) -> None:
    with pytest.raises(ValueError, match="--label-key"):
        asyncio.run(miles_reward.reward(ARGS, Sample("\\boxed{7}", None, 3)))
    monkeypatch.delenv(miles_args.ENV_OVERLONG_BUFFER)
    with pytest.raises(RuntimeError, match="backends.miles.launch"):
        asyncio.run(miles_reward.reward(ARGS, Sample("\\boxed{7}", "7", 3)))
