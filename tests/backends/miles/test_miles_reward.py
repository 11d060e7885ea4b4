"""Miles's custom reward adapter scores exactly as ``beam_hpc.reward.scoring`` does, and carries
Miles's own checker's verdict beside it.

Miles is real here (miles-rl, tests/support/builders/miles/real_miles.py): the samples are Miles's own
``miles.utils.types.Sample``, and the verdict comes from its ``grade_answer_verl``. The calling
contract (read in radixark/miles@31f1ca961, see the adapter's docstring): Miles loads
``--custom-rm-path`` as ``module.attr``, awaits ``fn(args, sample)`` with one ``Sample`` (or a list
of them under ``--group-rm``), and reads a dict reward through ``args.reward_key`` (training) /
``args.eval_reward_key`` (evaluation).
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
from types import SimpleNamespace
from typing import Any

import pytest
from real_miles import require_miles

from beam_hpc.backends.miles import args as miles_args
from beam_hpc.backends.miles import reward as miles_reward
from beam_hpc.reward.scoring import score_response

ARGS = SimpleNamespace(rollout_max_response_len=4096, reward_key="reward", eval_reward_key="acc")


def sample(response: str, label: str | None, tokens: int) -> Any:
    """A finished Miles sample, as Miles hands it to the reward function."""
    require_miles()
    from miles.utils.types import Sample

    return Sample(prompt="p", response=response, label=label, response_length=tokens, status=Sample.Status.COMPLETED)


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


# Pinned verdicts. beam_correct: beam-hpc's checker; miles: Miles's checker. Each miles literal was
# established once by running miles-rl 0.0.2's own miles.rollout.rm_hub.math_utils.grade_answer_verl
# on the pair (it is never recomputed here). The last three rows are pairs where the two disagree:
# Miles extracts only \boxed{...} (not \fbox or "\boxed 34") and does not evaluate 2^{10}; beam-hpc
# does not read 1e3 as a number.
VERDICTS = [
    ("so the answer is \\boxed{34}", "34", 500, True, "correct"),  # right, short
    ("so the answer is \\boxed{35}", "34", 500, False, "wrong"),  # wrong, short
    ("long ... \\boxed{34}", "34", 3584, True, "correct"),  # right, half-way into the 1,024-token window
    ("long ... \\boxed{34}", "34", 4096, True, "correct"),  # right, at the limit
    ("no box at all", "34", 100, False, "wrong"),
    ("\\boxed{\\frac{1}{2}}", "0.5", 100, True, "correct"),  # a fraction against a decimal: both agree
    ("so \\fbox{34}", "34", 100, True, "wrong"),  # disagree: Miles finds no answer in \fbox
    ("\\boxed{2^{10}}", "1024", 100, True, "wrong"),  # disagree: Miles does not evaluate the power
    ("\\boxed{1e3}", "1000", 100, False, "correct"),  # disagree: beam-hpc takes 1e3 for no number
]


@pytest.mark.parametrize(("response", "label", "tokens", "beam_correct", "miles"), VERDICTS)
def test_same_score_as_the_reference_reward_and_miles_verdict(reward_env: None, response: str, label: str, tokens: int,
                                                              beam_correct: bool, miles: str) -> None:
    got = asyncio.run(miles_reward.reward(ARGS, sample(response, label, tokens)))
    want = score_response(response, label, tokens, max_response_tokens=4096, buffer_tokens=1024, factor=1.0)
    assert want.correct is beam_correct  # the pinned beam-hpc verdict
    assert got == {"reward": want.reward, "acc": 1.0 if beam_correct else 0.0, "pred": want.pred,
                   "penalty": want.penalty, "miles_math": miles}


def test_eval_key_is_accuracy_without_penalty(reward_env: None) -> None:
    """Training reads the penalised reward, evaluation the plain 1/0 correctness."""
    got = asyncio.run(miles_reward.reward(ARGS, sample("\\boxed{7}", "7", 3584)))
    assert got[ARGS.reward_key] == pytest.approx(1.0 - 0.5)
    assert got[ARGS.eval_reward_key] == 1.0


def test_a_list_of_samples_gets_a_list(reward_env: None) -> None:
    samples = [sample("\\boxed{1}", "1", 10), sample("\\boxed{2}", "3", 10)]
    got = asyncio.run(miles_reward.reward(ARGS, samples))
    assert [g["acc"] for g in got] == [1.0, 0.0]


def test_window_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(miles_args.ENV_OVERLONG_BUFFER, "2048")
    monkeypatch.setenv(miles_args.ENV_OVERLONG_FACTOR, "0.5")
    got = asyncio.run(miles_reward.reward(ARGS, sample("\\boxed{7}", "7", 3072)))
    assert got["penalty"] == pytest.approx(-0.25)  # half-way into 2,048 tokens, factor 0.5


def test_clear_errors(monkeypatch: pytest.MonkeyPatch, reward_env: None) -> None:
    with pytest.raises(ValueError, match="--label-key"):
        asyncio.run(miles_reward.reward(ARGS, sample("\\boxed{7}", None, 3)))
    monkeypatch.delenv(miles_args.ENV_OVERLONG_BUFFER)
    with pytest.raises(RuntimeError, match="backends.miles.launch"):
        asyncio.run(miles_reward.reward(ARGS, sample("\\boxed{7}", "7", 3)))
