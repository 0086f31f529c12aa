"""Verifiable rewards: exact match (arith) and the math-answer reward (dapo_math).

A reward function takes the decoded response text and the reference answer and returns a float in
[0, 1]. The math reward reads the model's final answer the way DAPO-style graders do: the last
`\\boxed{...}` if there is one, otherwise the last number in the text; both sides are normalized
(LaTeX wrappers, units of `\\text{}`, thousands separators) and compared as strings, then as numbers.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from fractions import Fraction

from skyq.config.enums import RewardName

RewardFn = Callable[[str, str], float]


def exact_match(response: str, answer: str) -> float:
    """1.0 when the response, stripped of surrounding whitespace, equals the answer."""
    return 1.0 if response.strip() == answer.strip() else 0.0


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`) in `text`, braces balanced; None if absent."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    open_brace = text.find("{", start)
    if open_brace < 0:
        return None
    depth = 0
    for i in range(open_brace, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[open_brace + 1 : i]
    return None  # unbalanced: the answer was cut off, which counts as no answer


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")


def last_number(text: str) -> str | None:
    """The last number in `text` (integers, decimals, `a/b`, thousands commas); None if there is none."""
    matches = _NUMBER.findall(text)
    return matches[-1] if matches else None


def extract_math_answer(response: str) -> str | None:
    """The model's final answer: the last `\\boxed{}` content, else the last number.

    A response that opens a `\\boxed{` it never closes was cut off mid-answer: no answer, rather
    than a number picked out of the unfinished box.
    """
    if "\\boxed" in response or "\\fbox" in response:
        return last_boxed(response)
    return last_number(response)


_LATEX_REMOVALS = ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "$", "^\\circ", "^{\\circ}", "\\%", "%")


def normalize_math_answer(answer: str) -> str:
    """Canonical text of an answer: no spaces, LaTeX sizing/units stripped, `\\dfrac` as `\\frac`."""
    text = answer.strip()
    text = re.sub(r"\\text\{\s*([^}]*)\}", r"\1", text)
    text = re.sub(r"\\(?:mathrm|mathbf)\{([^}]*)\}", r"\1", text)
    for token in _LATEX_REMOVALS:
        text = text.replace(token, "")
    text = text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    text = re.sub(r"\s+", "", text)
    text = re.sub(r"^[a-zA-Z]\s*=", "", text)  # "x=5" answers 5
    text = text.rstrip(".")
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", text):
        text = text.replace(",", "")
    return text


def _as_number(text: str) -> Fraction | None:
    frac = re.fullmatch(r"(-?)\\frac\{(-?\d+)\}\{(\d+)\}", text) or re.fullmatch(r"(-?)\\frac(\d)(\d)", text)
    try:
        if frac:
            value = Fraction(int(frac.group(2)), int(frac.group(3)))
            return -value if frac.group(1) else value
        if re.fullmatch(r"-?\d+/\d+", text):
            numerator, denominator = text.split("/")
            return Fraction(int(numerator), int(denominator))
        if re.fullmatch(r"-?(\d+(\.\d*)?|\.\d+)", text):
            return Fraction(text)
    except ZeroDivisionError:
        return None
    return None


def math_answer_reward(response: str, label: str) -> float:
    """1.0 when the response's final answer equals the label (as normalized text or as a number)."""
    predicted = extract_math_answer(response)
    if predicted is None:
        return 0.0
    predicted, expected = normalize_math_answer(predicted), normalize_math_answer(label)
    if predicted == expected:
        return 1.0
    predicted_value, expected_value = _as_number(predicted), _as_number(expected)
    if predicted_value is not None and predicted_value == expected_value:
        return 1.0
    return 0.0


_REWARDS: dict[RewardName, RewardFn] = {
    RewardName.exact_match: exact_match,
    RewardName.math: math_answer_reward,
}


def get_reward_fn(name: RewardName) -> RewardFn:
    """The reward function of `task.reward`; refuses one this package does not implement."""
    name = RewardName(name)
    if name not in _REWARDS:
        raise ValueError(
            f"task.reward={name.value} has no implementation in skyq.rl.rewards "
            f"(available: {', '.join(r.value for r in _REWARDS)})"
        )
    return _REWARDS[name]
