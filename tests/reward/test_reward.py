"""The reward: boxed extraction, answer equivalence (both tiers, real math-verify in real worker
processes), DAPO's soft overlong penalty, and safety in threads, Ray actors and on hostile input."""

from __future__ import annotations

import threading
import time

import pytest

from beam_hpc.reward.scoring import (
    CORRECT_REWARD,
    DEFAULT_BUFFER_TOKENS,
    WRONG_REWARD,
    RewardResult,
    extract_boxed,
    is_equivalent,
    overlong_penalty,
    score,
    score_response,
)

# (model's answer, label, equivalent?) -- every form the issue lists, true and false.
PAIRS: list[tuple[str, str, bool]] = [
    # AIME-style integers
    ("70", "70", True),
    ("588", "588", True),
    ("016", "16", True),
    ("0", "0", True),
    ("12", "21", False),
    ("588", "589", False),
    ("117", "171", False),
    ("-5", "-5", True),
    ("-5", "5", False),
    ("+5", "5", True),
    ("1,000", "1000", True),
    ("1{,}000", "1000", True),
    ("1\\,000", "1000", True),
    ("1,000,000", "1000000", True),
    ("1,000", "100", False),
    ("12.0", "12", True),
    ("12.00", "12", True),
    ("12.5", "12", False),
    ("007", "7", True),
    ("1e3", "1000", False),
    # fractions
    ("\\frac{1}{2}", "1/2", True),
    ("\\dfrac{1}{2}", "\\frac{1}{2}", True),
    ("\\tfrac{3}{4}", "3/4", True),
    ("\\frac12", "\\frac{1}{2}", True),
    ("\\frac{2}{4}", "\\frac{1}{2}", True),
    ("-\\frac{1}{2}", "\\frac{-1}{2}", True),
    ("-\\frac{1}{2}", "\\frac{1}{2}", False),
    ("\\frac{1}{3}", "\\frac{1}{4}", False),
    ("\\frac{10}{3}", "\\frac{3}{10}", False),
    # decimals vs fractions
    ("0.5", "\\frac{1}{2}", True),
    (".5", "1/2", True),
    ("0.25", "\\frac14", True),
    ("0.33", "\\frac{1}{3}", False),
    ("0.333", "1/3", False),
    ("1.5", "\\frac{3}{2}", True),
    ("1.05", "\\frac{21}{20}", True),
    ("0.2", "\\frac{1}{4}", False),
    # radicals, pi, powers
    ("3\\sqrt{2}", "\\sqrt{18}", True),
    ("2\\sqrt{3}", "\\sqrt{12}", True),
    ("2\\sqrt{3}", "\\sqrt{13}", False),
    ("\\frac{\\sqrt{2}}{2}", "\\frac{1}{\\sqrt{2}}", True),
    ("\\sqrt{2}", "1.414", False),
    ("\\sqrt[3]{8}", "2", True),
    ("2+\\sqrt{3}", "\\sqrt{3}+2", True),
    ("2-\\sqrt{3}", "\\sqrt{3}-2", False),
    ("2\\pi", "\\pi \\cdot 2", True),
    ("2\\pi", "3\\pi", False),
    ("\\pi^2", "\\pi\\cdot\\pi", True),
    ("\\frac{\\pi}{4}", "\\frac{1}{4}\\pi", True),
    ("2^{10}", "1024", True),
    ("2^{10}", "1000", False),
    ("2^5", "32", True),
    ("10^{3}", "1000", True),
    ("x^2+2x+1", "(x+1)^2", True),
    ("x^2+1", "(x+1)^2", False),
    # percent and degrees
    ("25\\%", "25", True),
    ("25%", "25", True),
    ("25\\%", "26", False),
    ("30^\\circ", "30", True),
    ("30^{\\circ}", "30", True),
    ("30°", "30", True),
    ("30^\\circ", "60", False),
    # \text{} units and words
    ("5\\text{ cm}", "5", True),
    ("5 \\text{cm}^2", "5", True),
    ("12 \\text{ inches}", "12", True),
    ("5\\text{ cm}", "6", False),
    ("36 degrees", "36", True),
    ("\\$45", "45", True),
    ("45 dollars", "54", False),
    # \left / \right and $...$
    ("\\left(1, 2\\right)", "(1,2)", True),
    ("$42$", "42", True),
    ("$$\\frac{1}{2}$$", "0.5", True),
    ("\\(7\\)", "7", True),
    ("$42$", "24", False),
    ("x = 5", "5", True),
    ("n=12", "21", False),
    # tuples and intervals
    ("(1,2)", "(1, 2)", True),
    ("(1,2)", "(2,1)", False),
    ("(1,2,3)", "(1,2)", False),
    ("1, 2", "(1,2)", True),
    ("(\\frac{1}{2}, 3)", "(0.5, 3)", True),
    ("[1,2)", "[1, 2)", True),
    ("[1,2)", "[1,2]", False),
    ("(1,2)", "[1,2]", False),
    ("(-\\infty, 3]", "(-\\infty,3]", True),
    ("(-\\infty, 3]", "(-\\infty,3)", False),
    ("\\{1,2\\}", "\\{2,1\\}", True),
    ("(1,2)", "12", False),
    # plain text answers
    ("\\text{Tuesday}", "Tuesday", True),
    ("tuesday", "Tuesday", True),
    ("Wednesday", "Tuesday", False),
    ("\\text{(B)}", "(B)", True),
    ("B", "C", False),
    ("\\text{yes}", "no", False),
    ("yes", "5", False),
    # empty / degenerate
    ("", "5", False),
    ("5", "", False),
]


def test_table_is_large_and_balanced() -> None:
    assert len(PAIRS) >= 80
    assert sum(eq for *_, eq in PAIRS) >= 30 and sum(not eq for *_, eq in PAIRS) >= 30


@pytest.mark.parametrize(("answer", "label", "expected"), PAIRS)
def test_equivalence_table(answer: str, label: str, expected: bool) -> None:
    assert is_equivalent(answer, label) is expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so the answer is \\boxed{42}.", "42"),
        ("\\boxed{1} then \\boxed{2}", "2"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed{\\sqrt{\\frac{a}{b}}}", "\\sqrt{\\frac{a}{b}}"),
        ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),
        ("$\\boxed 5$", "5"),
        ("\\boxed {7}", "7"),
        ("\\fbox{9}", "9"),
        ("no box here: 42", None),
        ("\\boxed{}", None),
        ("\\boxed{12} ... \\boxed{3", None),  # truncated last box: the final answer is unknown
        ("\\boxedx{3}", None),
    ],
)
def test_extract_boxed(text: str, expected: str | None) -> None:
    assert extract_boxed(text) == expected


def test_overlong_penalty_boundaries_and_window() -> None:
    # The seed's budget and our window: punishment starts after 3072 tokens.
    assert overlong_penalty(0, 4096, 1024) == 0.0
    assert overlong_penalty(3072, 4096, 1024) == 0.0
    assert overlong_penalty(3073, 4096, 1024) == pytest.approx(-1 / 1024)
    assert overlong_penalty(3584, 4096, 1024) == pytest.approx(-0.5)
    assert overlong_penalty(4096, 4096, 1024) == pytest.approx(-1.0)
    assert overlong_penalty(5000, 4096, 1024) == -1.0
    assert overlong_penalty(3584, 4096, 1024, factor=0.5) == pytest.approx(-0.25)
    # DAPO's own setting (20,480 with a 4,096 window).
    assert overlong_penalty(18432, 20480, 4096) == pytest.approx(-0.5)
    # A zero window is a hard cliff at the limit.
    assert overlong_penalty(4096, 4096, 0) == 0.0 and overlong_penalty(4097, 4096, 0) == -1.0
    with pytest.raises(ValueError, match="buffer_tokens"):
        overlong_penalty(10, 100, 200)


def test_score_response_training_and_eval() -> None:
    right, wrong = "... so \\boxed{34}", "... so \\boxed{43}"
    kw = {"max_response_tokens": 4096, "buffer_tokens": DEFAULT_BUFFER_TOKENS}
    assert score_response(right, "34", 100, **kw) == RewardResult(CORRECT_REWARD, True, "34", 0.0)
    assert score_response(wrong, "34", 100, **kw) == RewardResult(WRONG_REWARD, False, "43", 0.0)
    assert score_response("no box", "34", 100, **kw) == RewardResult(WRONG_REWARD, False, None, 0.0)
    long_right = score_response(right, "34", 3584, **kw)
    assert long_right.correct and long_right.penalty == pytest.approx(-0.5)
    assert long_right.reward == pytest.approx(0.5)
    assert score_response(wrong, "34", 4096, **kw).reward == pytest.approx(-2.0)
    # Evaluation: correctness only, whatever the length.
    evaluated = score_response(right, "34", 4096, apply_penalty=False, **kw)
    assert evaluated == RewardResult(CORRECT_REWARD, True, "34", 0.0)
    assert score(right, "34", 3584, 4096, 1024) == pytest.approx(0.5)


def test_same_verdicts_from_eight_threads() -> None:
    expected = [is_equivalent(a, b) for a, b, _ in PAIRS]
    results: dict[int, list[bool]] = {}
    errors: list[BaseException] = []

    def run(k: int) -> None:
        try:
            results[k] = [is_equivalent(a, b) for a, b, _ in PAIRS]
        except BaseException as err:  # noqa: BLE001 - surfaced below; a thread's exception is otherwise lost
            errors.append(err)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert all(results[k] == expected for k in range(8))


def test_pathological_input_is_bounded_and_checker_recovers() -> None:
    from beam_hpc.reward.worker import SymbolicChecker

    tower = "10^{10^{10^{10}}}"  # math-verify without a timeout never returns on this
    checker = SymbolicChecker(max_workers=1)
    try:
        assert checker.check("\\sqrt{8}", "2\\sqrt{2}", 2.0)  # started: start-up is not check time
        start = time.monotonic()
        assert checker.check(tower, "1", 0.5) is False
        assert time.monotonic() - start < 0.5 + 1.0  # the bound plus slack for a loaded machine
        assert checker.check("\\sqrt{8}", "2\\sqrt{2}", 2.0)  # its only worker was killed; a new one answers
    finally:
        checker.close()

    # The public API, from a non-main thread (where math-verify's SIGALRM timeout would raise).
    is_equivalent("\\sqrt{8}", "2\\sqrt{2}")
    elapsed: list[float] = []
    verdicts: list[bool] = []

    def run() -> None:
        start = time.monotonic()
        verdicts.append(is_equivalent(tower, "1", timeout_s=0.5))
        elapsed.append(time.monotonic() - start)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert verdicts == [False] and elapsed[0] < 0.5 + 1.0


@pytest.mark.slow
@pytest.mark.ray
def test_ray_actor_agrees_with_main_thread_while_threads_run(monkeypatch: pytest.MonkeyPatch) -> None:
    ray = pytest.importorskip("ray")
    # A private in-process cluster; the auth mode is set explicitly (Ray caches it per process, and
    # later tests in this process join token-less shared clusters).
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")

    @ray.remote(num_cpus=0)
    class Scorer:
        def check(self, pairs: list[tuple[str, str]]) -> list[bool]:
            from beam_hpc.reward.scoring import is_equivalent

            return [is_equivalent(a, b) for a, b in pairs]

    pairs = [(a, b) for a, b, _ in PAIRS]
    expected = [eq for *_, eq in PAIRS]
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        actor = Scorer.remote()
        pending = actor.check.remote(pairs)
        thread_results: list[list[bool]] = []
        threads = [
            threading.Thread(target=lambda: thread_results.append([is_equivalent(a, b) for a, b in pairs]))
            for _ in range(8)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert ray.get(pending, timeout=120) == expected
        assert thread_results == [expected] * 8
    finally:
        ray.shutdown()

