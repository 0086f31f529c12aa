"""Verifiable rewards: exact match (arith), the math-answer reward (dapo_math) and openr1mm
(multimodal_open_r1).

A reward function takes the decoded response text and the reference answer and returns a float: in
[0, 1], except openr1mm's accuracy + format sum, in [0, 2]. The math reward reads the model's final answer
the way DAPO-style graders do: the last `\\boxed{...}` if there is one, else the rest of the last
`Answer:` line (the form DAPO-Math-17k's prompts ask for), else the last number in the text; both sides
are normalized (LaTeX wrappers, units of `\\text{}`, thousands separators) and compared as strings, then
as numbers.
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


_ANSWER_LINE = re.compile(r"Answer\s*:[ \t]*(.*)")


def extract_math_answer(response: str) -> str | None:
    """The model's final answer: the last `\\boxed{}` content, else the rest of the last `Answer:` line,
    else the last number.

    A response that opens a `\\boxed{` it never closes was cut off mid-answer: no answer, rather
    than a number picked out of the unfinished box.
    """
    if "\\boxed" in response or "\\fbox" in response:
        return last_boxed(response)
    answer_lines = [line.strip() for line in _ANSWER_LINE.findall(response) if line.strip()]
    if answer_lines:
        return answer_lines[-1]
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


def math_answers_equal(predicted: str, expected: str) -> bool:
    """Whether two final answers are the same, as normalized text or as numbers."""
    predicted, expected = normalize_math_answer(predicted), normalize_math_answer(expected)
    if predicted == expected:
        return True
    predicted_value, expected_value = _as_number(predicted), _as_number(expected)
    return predicted_value is not None and predicted_value == expected_value


def math_answer_reward(response: str, label: str) -> float:
    """1.0 when the response's final answer equals the label (as normalized text or as a number)."""
    predicted = extract_math_answer(response)
    return 1.0 if predicted is not None and math_answers_equal(predicted, label) else 0.0


_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_OPENR1_FORMAT = re.compile(r"<think>.*?</think>\s*<answer>.*?</answer>", re.DOTALL)


def answer_tag(text: str) -> str | None:
    """The stripped content of the first `<answer>...</answer>` in `text`; None if there is none."""
    match = _ANSWER_TAG.search(text)
    return match.group(1).strip() if match else None


def _math_verify_equal(response: str, solution: str) -> bool | None:
    """math_verify's verdict on the two whole texts; None when math_verify is not installed."""
    try:
        from math_verify import parse, verify
    except ImportError:
        return None
    try:
        return bool(verify(parse(solution), parse(response)))
    except Exception:  # math_verify raises on text it cannot parse: not verified, as upstream treats it
        return False


def openr1mm_accuracy(response: str, solution: str) -> float:
    """1.0 when the response's answer is the solution's, checked as math, then as text.

    Math: math_verify on the whole texts when it is installed; otherwise skyq's math-answer check on the
    `<answer>` contents (each side's whole text when it has no tag): the contents as the answer, or the
    final answer read out of them (`The total is 12.`). Text: equal stripped `<answer>` contents (or whole
    texts), which also grades non-numeric answers (a choice letter, a word).
    """
    predicted, expected = answer_tag(response), answer_tag(solution)
    predicted = response.strip() if predicted is None else predicted
    expected = solution.strip() if expected is None else expected
    verified = _math_verify_equal(response, solution)
    if verified is None:
        verified = math_answers_equal(predicted, expected) or math_answer_reward(predicted, expected) == 1.0
    return 1.0 if verified or predicted == expected else 0.0


def openr1mm_format(response: str) -> float:
    """1.0 when the response starts with `<think>...</think>`, then (after whitespace) `<answer>...</answer>`."""
    return 1.0 if _OPENR1_FORMAT.match(response) else 0.0


def openr1mm_reward(response: str, solution: str) -> float:
    """open-r1-multimodal's GRPO reward: accuracy + format, each 0 or 1 (its trainer sums its rewards).

    Implemented from the definitions of `accuracy_reward` and `format_reward` in
    EvolvingLMMs-Lab/open-r1-multimodal, src/open_r1/grpo.py, the recipe that trained on
    lmms-lab/multimodal-open-r1-8k-verified (whose `solution` column holds
    `<think>...</think><answer>...</answer>`). Accuracy: symbolic verification (math_verify) of the response
    against the solution, else equal `<answer>` contents (whole texts where a side has no tag). Format:
    `<think>.*?</think>\\s*<answer>.*?</answer>` matched at the response's start.

    Two differences: without math_verify installed the symbolic check is skyq's math-answer reward on the
    `<answer>` contents; and the format's `.` spans newlines (upstream's pattern has no DOTALL, so there a
    reasoning of more than one line never earns the format reward).
    """
    return openr1mm_accuracy(response, solution) + openr1mm_format(response)


def reference_response(reward: RewardName, answer: str) -> str:
    """A response that earns `reward`'s full score for `answer` (the target of a supervised warm-up)."""
    reward = RewardName(reward)
    if reward is RewardName.math:
        return f"\\boxed{{{answer}}}"
    if reward is RewardName.openr1mm:
        if openr1mm_format(answer):
            return answer  # the dataset's solution: a reasoning and an answer, already in the format
        return f"<think></think><answer>{answer}</answer>"
    return answer


_REWARDS: dict[RewardName, RewardFn] = {
    RewardName.exact_match: exact_match,
    RewardName.math: math_answer_reward,
    RewardName.openr1mm: openr1mm_reward,
}


def get_reward_fn(name: RewardName) -> RewardFn:
    """The reward function of `task.reward` (every RewardName has one: tests/rl/test_rewards.py)."""
    return _REWARDS[RewardName(name)]
