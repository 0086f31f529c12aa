"""Rewards: exact match and the math-answer reward."""

from __future__ import annotations

import pytest

from skyq.config.enums import RewardName
from skyq.rl.rewards import extract_math_answer, get_reward_fn, last_boxed, math_answer_reward


def test_exact_match_strips_whitespace_only():
    fn = get_reward_fn(RewardName.exact_match)
    assert fn(" 7 ", "7") == 1.0
    assert fn("77", "7") == 0.0


@pytest.mark.parametrize(
    ("response", "label", "reward"),
    [
        ("so the answer is \\boxed{42}.", "42", 1.0),
        ("first \\boxed{1} then \\boxed{2}", "2", 1.0),
        ("first \\boxed{1} then \\boxed{2}", "1", 0.0),
        ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("\\boxed{\\dfrac{3}{4}}", "\\frac{3}{4}", 1.0),
        ("\\boxed{x = 5}", "5", 1.0),
        ("\\boxed{1,000}", "1000", 1.0),
        ("\\boxed{90^\\circ}", "90", 1.0),
        ("\\boxed{10\\text{ cm}}", "10cm", 1.0),
        ("There are 3 cats and 12 dogs, so 15 animals.", "15", 1.0),
        ("The result is -7/3", "-7/3", 1.0),
        ("no answer here", "3", 0.0),
        ("cut off \\boxed{12", "12", 0.0),
        ("\\boxed{\\frac{1}{0}}", "1", 0.0),
    ],
)
def test_math_answer_reward_cases(response, label, reward):
    assert math_answer_reward(response, label) == reward


def test_last_boxed_balances_nested_braces():
    assert last_boxed("\\boxed{\\frac{a}{b^{2}}}") == "\\frac{a}{b^{2}}"
    assert extract_math_answer("the value is 2.50") == "2.50"


def test_unimplemented_reward_is_refused_with_the_key():
    with pytest.raises(ValueError, match="task.reward=openr1mm"):
        get_reward_fn(RewardName.openr1mm)
