"""Reward throughput on one core: checks per second by answer kind, and a seed-sized rollout.

Why: every rollout of 32 prompts x 8 responses is scored before the trainer can step, so scoring
must stay far below a second. Integers and fractions are settled in-process; radicals go to the
math-verify worker process (one worker here, to measure one core).

    BEAM_HPC_REWARD_WORKERS=1 taskset -c 0 python benchmarks/reward_speed.py [--seconds 2]
"""

from __future__ import annotations

import argparse
import os
import random
import time

os.environ.setdefault("BEAM_HPC_REWARD_WORKERS", "1")

from beam_hpc.reward.scoring import is_equivalent, score_response

KINDS: dict[str, list[tuple[str, str]]] = {
    "integer": [("588", "588"), ("1,000", "1000"), ("12", "21"), ("016", "16"), ("70.0", "70")],
    "fraction": [("\\frac{1}{2}", "0.5"), ("\\dfrac{3}{4}", "3/4"), ("0.33", "\\frac{1}{3}"), ("\\frac{2}{4}", "\\frac12")],
    "radical": [("3\\sqrt{2}", "\\sqrt{18}"), ("2\\sqrt{3}", "\\sqrt{13}"), ("\\frac{\\sqrt{2}}{2}", "\\frac{1}{\\sqrt{2}}")],
    "text/tuple": [("\\text{Tuesday}", "tuesday"), ("(1, 2)", "(1,2)"), ("[1,2)", "[1,2]")],
}


def checks_per_second(pairs: list[tuple[str, str]], seconds: float) -> float:
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for answer, label in pairs:
            is_equivalent(answer, label)
        count += len(pairs)
    return count / (time.perf_counter() - start)


def rollout_seconds(rng: random.Random, radical_share: float) -> float:
    """Score 32 x 8 responses of ~3,000 characters each, as a 4,096-token rollout would give."""
    filler = "Let us reason step by step. " * 110
    responses = []
    for i in range(256):
        if rng.random() < radical_share:
            answer, label = "3\\sqrt{2}", "\\sqrt{18}"
        else:
            label = str(rng.randint(0, 999))
            answer = label if rng.random() < 0.5 else str(rng.randint(0, 999))
        responses.append((f"{filler} so the answer is $\\boxed{{{answer}}}$.", label, 1000 + 12 * i))
    start = time.perf_counter()
    for text, label, tokens in responses:
        score_response(text, label, tokens, max_response_tokens=4096, buffer_tokens=1024)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=2.0, help="time per kind")
    args = parser.parse_args()
    is_equivalent("3\\sqrt{2}", "\\sqrt{18}")  # start the worker; its start-up is not a check
    print(f"{'answer kind':<12} {'checks/s':>12} {'us/check':>10}")
    for kind, pairs in KINDS.items():
        rate = checks_per_second(pairs, args.seconds)
        print(f"{kind:<12} {rate:>12,.0f} {1e6 / rate:>10,.1f}")
    rng = random.Random(0)
    for share in (0.0, 0.25, 1.0):
        seconds = rollout_seconds(rng, share)
        print(f"rollout 32x8, {share:>4.0%} radicals: {seconds * 1000:8.1f} ms")


if __name__ == "__main__":
    main()
