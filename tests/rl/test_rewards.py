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


def test_every_reward_name_has_an_implementation():
    for name in RewardName:
        assert callable(get_reward_fn(name)), name
    with pytest.raises(ValueError, match="not_a_reward"):
        get_reward_fn("not_a_reward")


@pytest.mark.parametrize(
    ("response", "label", "reward"),
    [
        ("Step 1 ... so x = 4.\nAnswer: 42", "42", 1.0),
        ("Answer: \\frac{1}{2}", "0.5", 1.0),  # the last number alone would read 2
        ("Answer: 3\nno wait\nAnswer: 5", "5", 1.0),
        ("Answer: 3\nno wait\nAnswer: 5", "3", 0.0),
        ("Answer: 7 \\boxed{8}", "8", 1.0),  # a box still wins
    ],
)
def test_math_answer_reads_dapo_answer_lines(response, label, reward):
    """DAPO-Math-17k's prompts ask for a last line `Answer: $Answer`: the reward reads that line."""
    assert math_answer_reward(response, label) == reward
