"""Built-in reward functions, by name in ``reward.function``: ``math``, ``format``, ``exact``.

Each takes one ``RewardInput`` (``dtarl.rewards.functions``) and returns a float:

    math    1.0 iff the response's final answer equals the ground truth's.
            The final answer of a response is, in order: the content of its last
            ``\\boxed{...}`` (braces balanced), the text after its last ``####``
            (GSM8K), else its last number; of the ground truth the same, except that
            one with neither ``\\boxed`` nor ``####`` is the answer as a whole.
            Equal when the normalised strings match (commas, ``$``, spaces and a
            trailing ``.0`` removed), else when ``math-verify`` proves them
            equivalent (fractions, LaTeX, sets, ...).
    format  1.0 iff the whole (stripped) response matches ``reward.format_pattern``
            (``re.fullmatch`` with DOTALL: ``.`` spans lines).
    exact   1.0 iff the stripped response equals the stripped ground truth.
"""

from __future__ import annotations

import re
import threading

from dtarl.errors import ConfigError

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) with balanced
    braces; None when there is none (or it is never closed)."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None


def final_answer(text: str) -> str | None:
    """The final answer of ``text`` (the module docstring's order); None when it has none."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    if "####" in text:
        return text.rsplit("####", 1)[1].strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def ground_truth_answer(text: str) -> str | None:
    """The answer of a ground truth: its ``\\boxed{}`` or ``####`` answer when it has
    one (a whole worked solution), else the whole stripped text."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    if "####" in text:
        return text.rsplit("####", 1)[1].strip()
    return text.strip() or None


def normalize_answer(ans: str) -> str:
    """``"$1,234.0 "`` -> ``"1234"``: the light normalisation both sides get first."""
    s = ans.strip().rstrip(".").replace(",", "").replace("$", "").replace(" ", "")
    s = s.replace("\\!", "").replace("\\,", "")
    if re.fullmatch(r"-?\d+\.0+", s):
        s = s.split(".")[0]
    return s


def _math_verify_equal(gold: str, pred: str) -> bool:
    try:
        from math_verify import parse, verify
    except ImportError:  # a declared dependency; say how to get it
        raise ImportError(
            "the `math` reward needs math-verify: pip install 'math-verify>=0.9'"
        ) from None
    # math-verify's timeouts use signal.alarm, which only the main thread may set.
    main = threading.current_thread() is threading.main_thread()
    timeout = 5 if main else None
    g = parse(f"${gold}$", parsing_timeout=timeout)
    p = parse(f"${pred}$", parsing_timeout=timeout)
    if not g or not p:
        return False
    return bool(verify(g, p, timeout_seconds=timeout))


def answers_equal(gold: str, pred: str) -> bool:
    """Whether final answers ``pred`` and ``gold`` are the same (normalised strings,
    then ``math-verify``)."""
    a, b = normalize_answer(gold), normalize_answer(pred)
    if not a or not b:
        return False
    if a == b:
        return True
    return _math_verify_equal(gold, pred)


def math_reward(x) -> float:
    """``math``: 1.0 iff the response's final answer equals the ground truth's."""
    gold = ground_truth_answer(str(x.ground_truth))
    pred = final_answer(x.response)
    if gold is None or pred is None:
        return 0.0
    return 1.0 if answers_equal(gold, pred) else 0.0


def exact_reward(x) -> float:
    """``exact``: 1.0 iff the stripped response equals the stripped ground truth."""
    return 1.0 if x.response.strip() == str(x.ground_truth).strip() else 0.0


def format_reward(pattern: str):
    """``format``: 1.0 iff the stripped response fullmatches ``pattern`` (DOTALL)."""
    try:
        rx = re.compile(pattern, re.DOTALL)
    except re.error as e:
        raise ConfigError(f"reward.format_pattern={pattern!r} is not a valid regex: {e}") from None

    def format_(x) -> float:
        return 1.0 if rx.fullmatch(x.response.strip()) else 0.0

    return format_


BUILTINS = ("math", "format", "exact")

__all__ = [
    "BUILTINS",
    "answers_equal",
    "exact_reward",
    "final_answer",
    "format_reward",
    "ground_truth_answer",
    "last_boxed",
    "math_reward",
    "normalize_answer",
]
