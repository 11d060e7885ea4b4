"""Boxed-answer correctness plus DAPO's soft overlong punishment: the one scorer every backend uses.

Why one module: the reference backend, the evaluation loop and the Miles custom reward
(:mod:`beam_hpc.backends.miles.reward`) must score a response identically, or a curve from one backend
cannot be compared with the other. It imports no Ray and no torch, so it loads anywhere.

A correct boxed answer earns ``CORRECT_REWARD`` (+1.0), anything else, a missing ``\\boxed{}``
included, ``WRONG_REWARD`` (-1.0): DAPO's rule reward (arXiv 2503.14476, section 2.3). Training adds
:func:`overlong_penalty`; evaluation reports ``RewardResult.correct`` alone (accuracy without the
length penalty, as the seed reports it). Equivalence is decided in two tiers, because a rollout of
32 x 8 responses must score in well under a second while some answers need a computer-algebra
system: an in-process normaliser settles the common cases exactly (signed integers, decimals and
fractions as exact rationals, so 0.33 is *not* 1/3, tuples, intervals, words); the rest goes to
math-verify/sympy in a worker process with a hard timeout (:mod:`beam_hpc.reward.worker`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction

CORRECT_REWARD = 1.0
WRONG_REWARD = -1.0

# Penalty window for the seed's 4,096-token response budget. DAPO used a 4,096-token window on a
# 20,480-token budget (20%). We take 1,024 of 4,096 (25%, the nearest power of two): the penalty
# starts at 3,072 tokens, which is below the seed's initial mean AIME response length (3,148) and
# so explains the length reduction the seed reports, while leaving 3/4 of the budget unpunished.
# The recipe's ``reward.overlong_buffer`` defaults to the same number.
DEFAULT_BUFFER_TOKENS = 1024

# No AIME or DAPO-Math answer comes near this; longer "answers" are rambling, not math to verify.
MAX_ANSWER_CHARS = 1000

_BOX_RE = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")


@dataclass(frozen=True)
class RewardResult:
    """One scored response. ``reward`` = correctness (+1/-1) + ``penalty`` when applied."""

    reward: float
    correct: bool
    pred: str | None
    penalty: float


# ---------------------------------------------------------------------------------------------
# Extraction


def extract_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``, or ``\\boxed x``) in ``text``.

    Nested and escaped braces are handled. An unclosed last box (a truncated response) or an
    empty one gives None: the model's final answer is then unknown, and an earlier box is a draft.
    """
    last = None
    for match in _BOX_RE.finditer(text):
        last = match
    if last is None:
        return None
    i = last.end()
    while i < len(text) and text[i] in " \t":
        i += 1
    if i < len(text) and text[i] == "{":
        content = _braced(text, i)
    else:
        j = i
        while j < len(text) and not text[j].isspace() and text[j] != "$":
            j += 1
        content = text[i:j]
    if content is None or not content.strip():
        return None
    return content.strip()


def _braced(text: str, open_at: int) -> str | None:
    """Content of the brace group opening at ``open_at``; None when it never closes."""
    depth = 0
    i = open_at
    while i < len(text):
        ch = text[i]
        if ch == "\\":  # \{ \} \\ are not group delimiters
            i += 2
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[open_at + 1 : i]
        i += 1
    return None


# ---------------------------------------------------------------------------------------------
# Normalisation: surface forms that never change the value

_DELIMITERS = (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]"))
_SPACING_RE = re.compile(r"\\[!,;: ]|\\q?quad(?![A-Za-z])|\\displaystyle(?![A-Za-z])|~")
_LEFT_RIGHT_RE = re.compile(r"\\(?:left|right|big|Big|bigg|Bigg)(?![A-Za-z])")
_DEGREE_RE = re.compile(r"\^\s*\{?\s*\\circ\s*\}?|\\circ(?![A-Za-z])|\\degree(?![A-Za-z])|°")
_TEXT_CMD = r"\\(?:text|textbf|textit|textrm|textnormal|mbox|mathrm|mathbf|mathit|operatorname)"
_TRAILING_UNIT_RE = re.compile(r"^(?P<value>.*?[\d}])\s*" + _TEXT_CMD + r"\{[^{}]*\}(?:\^\{?\d\}?)?$")
_TEXT_WRAP_RE = re.compile(_TEXT_CMD + r"\s*\{([^{}]*)\}")
_UNIT_WORDS = (
    "degrees|degree|deg|units|unit|square|sq|cm|mm|km|m|meters|metres|inches|inch|in|feet|foot|ft|"
    "yards|yd|miles|mi|mph|seconds|second|sec|s|minutes|minute|min|hours|hour|hr|days|day|weeks|"
    "years|dollars|dollar|cents|cent|percent|points|ways|people|students"
)
_TRAILING_WORD_UNIT_RE = re.compile(r"^(?P<value>[-+.\d/,{}\\a-z]*\d[}]?)\s+(?:" + _UNIT_WORDS + r")(?:\^?\d)?\.?$")
_THOUSANDS_RE = re.compile(r"^[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_LEADING_VAR_RE = re.compile(r"^[A-Za-z](?:_\{?\w+\}?)?\s*=(?!=)")
_CMD_THEN_LETTER_RE = re.compile(r"(\\[A-Za-z]+) +(?=[A-Za-z])")


def normalize_answer(text: str) -> str:
    """A canonical surface form: no math delimiters, spacing, ``\\left``/``\\right``, degree or
    percent signs, ``\\text{}`` units, thousands separators or ``x =`` prefix; ``\\dfrac`` and
    ``\\tfrac`` become ``\\frac``. Whitespace is dropped except where it separates a command from
    a letter (``\\pi r``). Percent is dropped rather than divided by 100, because AIME and DAPO
    labels state percentages as the bare number ("answer in percent: 25")."""
    s = text.strip()
    if _BOX_RE.search(s):
        s = extract_boxed(s) or ""
    s = _strip_delimiters(s)
    s = _SPACING_RE.sub(" ", s)
    s = _LEFT_RIGHT_RE.sub("", s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = _DEGREE_RE.sub("", s)
    s = s.replace("\\%", "").replace("%", "").replace("\\$", "")
    s = s.replace("{,}", ",").strip()
    unit = _TRAILING_UNIT_RE.match(s)
    if unit:
        s = unit.group("value")
    s = _TEXT_WRAP_RE.sub(lambda m: m.group(1), s).strip()
    word_unit = _TRAILING_WORD_UNIT_RE.match(s)
    if word_unit:
        s = word_unit.group("value")
    if s.count("=") == 1 and _LEADING_VAR_RE.match(s):
        s = s.split("=", 1)[1]
    s = s.strip().rstrip(".").strip()
    if _THOUSANDS_RE.match(s.replace(" ", "")):
        s = s.replace(",", "")
    s = _CMD_THEN_LETTER_RE.sub(lambda m: m.group(1) + "\x00", " ".join(s.split()))
    return s.replace(" ", "").replace("\x00", " ")


def _strip_delimiters(s: str) -> str:
    changed = True
    while changed:
        changed = False
        for left, right in _DELIMITERS:
            if len(s) >= len(left) + len(right) and s.startswith(left) and s.endswith(right):
                s = s[len(left) : len(s) - len(right)].strip()
                changed = True
    return s


# ---------------------------------------------------------------------------------------------
# The fast tier: exact answers without a CAS

_NUM = r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)"
_NUMBER_RE = re.compile(rf"^{_NUM}$")
_FRAC_RE = re.compile(rf"^(?P<sign>[+-]?)\\frac(?:\{{(?P<n>{_NUM})\}}|(?P<n1>\d))(?:\{{(?P<d>{_NUM})\}}|(?P<d1>\d))$")
_SLASH_RE = re.compile(rf"^(?P<n>{_NUM})/(?P<d>{_NUM})$")
_POWER_RE = re.compile(r"^(?P<sign>[+-]?)(?P<b>\d+)\^(?:\{(?P<e>\d+)\}|(?P<e1>\d))$")
_PLAIN_TEXT_RE = re.compile(r"^[A-Za-z][A-Za-z '\-]*$")
_MAX_POWER_DIGITS = 400


def as_rational(s: str) -> Fraction | None:
    """The exact value of a normalised numeric answer (integer, decimal, fraction or small integer
    power), or None when it is anything else. Never evaluates a large power."""
    if len(s) > 2 * _MAX_POWER_DIGITS:
        return None
    try:
        if _NUMBER_RE.match(s):
            return Fraction(s)
        m = _FRAC_RE.match(s) or _SLASH_RE.match(s)
        if m:
            groups = m.groupdict()
            den = Fraction(groups.get("d") or groups.get("d1"))
            if den == 0:
                return None
            value = Fraction(groups.get("n") or groups.get("n1")) / den
            return -value if groups.get("sign") == "-" else value
        m = _POWER_RE.match(s)
        if m:
            base, exp = int(m["b"]), int(m["e"] or m["e1"])
            if base > 1 and exp * len(str(base)) > _MAX_POWER_DIGITS:
                return None
            value = Fraction(base**exp)
            return -value if m["sign"] == "-" else value
    except (ValueError, ZeroDivisionError):  # e.g. more digits than int() accepts
        return None
    return None


def _split_tuple(s: str) -> tuple[str, list[str], str] | None:
    """``(a, b)``, ``[a, b)``, ``a, b`` -> (open, items, close); None when not a sequence."""
    open_, close = "(", ")"
    body = s
    if len(s) >= 2 and s[0] in "([" and s[-1] in ")]" and _top_level_ok(s[1:-1]):
        open_, close, body = s[0], s[-1], s[1:-1]
    items, depth, start = [], 0, 0
    for i, ch in enumerate(body):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            items.append(body[start:i])
            start = i + 1
    items.append(body[start:])
    if len(items) < 2 or any(not item for item in items):
        return None
    return open_, items, close


def _top_level_ok(body: str) -> bool:
    """True when the outer brackets enclose the whole string, not ``(1)+(2)``."""
    depth = 0
    for ch in body:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth < 0:
                return False
    return depth == 0


def fast_verdict(answer: str, label: str) -> bool | None:
    """Decide equivalence of two *normalised* answers without a CAS, or None when undecided."""
    if answer == label:
        return True
    a_num, l_num = as_rational(answer), as_rational(label)
    if a_num is not None and l_num is not None:
        return a_num == l_num
    a_seq, l_seq = _split_tuple(answer), _split_tuple(label)
    if a_seq is not None and l_seq is not None:
        if len(a_seq[1]) != len(l_seq[1]) or (a_seq[0], a_seq[2]) != (l_seq[0], l_seq[2]):
            return False
        verdicts = [fast_verdict(a, b) for a, b in zip(a_seq[1], l_seq[1], strict=False)]
        if False in verdicts:
            return False
        return True if all(verdicts) else None
    if (a_seq is None) != (l_seq is None) and (a_num is not None or l_num is not None):
        return False  # a number is never a tuple
    a_text, l_text = _PLAIN_TEXT_RE.match(answer), _PLAIN_TEXT_RE.match(label)
    if a_text and l_text:
        return answer.lower() == label.lower()
    if (a_text and l_num is not None) or (l_text and a_num is not None):
        return False
    return None


# ---------------------------------------------------------------------------------------------
# Public scoring API


def is_equivalent(answer: str, label: str, timeout_s: float = 2.0) -> bool:
    """True when ``answer`` (what the model boxed) equals ``label`` mathematically.

    Safe in any thread and inside Ray workers: the fast tier is plain Python; the CAS tier runs
    in a worker process that is killed when a check takes longer than ``timeout_s`` (the check
    then counts as wrong). Time spent waiting for a free worker or starting one is not counted.
    """
    answer, label = str(answer), str(label)  # labels sometimes arrive as ints from parquet
    if not answer or not label or len(answer) > MAX_ANSWER_CHARS or len(label) > MAX_ANSWER_CHARS:
        return False
    a, b = normalize_answer(answer), normalize_answer(label)
    if not a or not b:
        return False
    verdict = fast_verdict(a, b)
    if verdict is not None:
        return verdict
    from beam_hpc.reward.worker import symbolic_equal

    return symbolic_equal(a, b, timeout_s=timeout_s)


def overlong_penalty(
    response_tokens: int, max_response_tokens: int, buffer_tokens: int, factor: float = 1.0
) -> float:
    """DAPO's Soft Overlong Punishment (Eq. 13), scaled by ``factor``: 0 up to
    ``max - buffer`` tokens, linear down to ``-factor`` at ``max``, ``-factor`` beyond."""
    if max_response_tokens <= 0 or buffer_tokens < 0 or buffer_tokens > max_response_tokens:
        raise ValueError(
            f"overlong_penalty: need 0 <= buffer_tokens ({buffer_tokens}) <= "
            f"max_response_tokens ({max_response_tokens}) and max_response_tokens > 0"
        )
    expected = max_response_tokens - buffer_tokens
    if response_tokens <= expected:
        return 0.0
    if response_tokens > max_response_tokens:
        return -factor
    return (expected - response_tokens) / buffer_tokens * factor


def score_response(
    response: str,
    label: str,
    response_tokens: int,
    *,
    max_response_tokens: int,
    buffer_tokens: int = DEFAULT_BUFFER_TOKENS,
    factor: float = 1.0,
    apply_penalty: bool = True,
    timeout_s: float = 2.0,
) -> RewardResult:
    """Score one response against its label: +1/-1 for the last boxed answer, plus the soft
    overlong penalty when ``apply_penalty`` (training). Evaluation passes ``apply_penalty=False``
    and reads ``correct``."""
    pred = extract_boxed(response)
    correct = pred is not None and is_equivalent(pred, str(label), timeout_s=timeout_s)
    penalty = (
        overlong_penalty(response_tokens, max_response_tokens, buffer_tokens, factor) if apply_penalty else 0.0
    )
    base = CORRECT_REWARD if correct else WRONG_REWARD
    return RewardResult(reward=base + penalty, correct=correct, pred=pred, penalty=penalty)


def score(
    response: str, label: str, response_tokens: int, max_response_tokens: int, penalty_window: int
) -> float:
    """The training reward as one number (correctness + soft overlong penalty, factor 1)."""
    return score_response(
        response, label, response_tokens, max_response_tokens=max_response_tokens, buffer_tokens=penalty_window
    ).reward
