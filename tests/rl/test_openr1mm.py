"""The openr1mm reward: open-r1-multimodal's accuracy + format (src/open_r1/grpo.py), graded against
solutions in lmms-lab/multimodal-open-r1-8k-verified's form (`<think>..</think>\\n\\n<answer>..</answer>`)."""

from __future__ import annotations

import sys
import types

import pytest

from skyq.config.enums import RewardName
from skyq.rl.rewards import (
    answer_tag,
    get_reward_fn,
    openr1mm_accuracy,
    openr1mm_format,
    openr1mm_reward,
    reference_response,
)

SOLUTION = "<think>The bars show 3, 4 and 5; their sum is 12.</think>\n\n<answer>12</answer>"


@pytest.mark.parametrize(
    ("response", "accuracy", "form"),
    [
        ("<think>add them</think><answer>12</answer>", 1.0, 1.0),
        (
            "<think>first\nadd the bars\nthen check</think>\n<answer>12</answer>",
            1.0,
            1.0,
        ),  # multi-line reasoning
        ("<think>add</think> <answer> 12.0 </answer>", 1.0, 1.0),  # numerically equal
        ("<think>add</think><answer>The total is 12.</answer>", 1.0, 1.0),  # the last number of the tag
        ("<answer>12</answer>", 1.0, 0.0),  # right, but no reasoning block
        ("12", 1.0, 0.0),  # no tags: the whole text is the answer
        ("<think>add</think><answer>13</answer>", 0.0, 1.0),
        ("<think>12</think><answer>13</answer>", 0.0, 1.0),  # the reasoning's number is not the answer
        ("<think>add</think><answer>12", 1.0, 0.0),  # unclosed tag: the whole text is graded, as upstream
        ("Sure! <think>add</think><answer>12</answer>", 1.0, 0.0),  # the format starts the response
        (
            "<think>add</think>\n<answer>12</answer> and more text",
            1.0,
            1.0,
        ),  # a tail after the answer is allowed
        ("", 0.0, 0.0),
    ],
)
def test_accuracy_and_format_of_responses(response, accuracy, form):
    assert openr1mm_accuracy(response, SOLUTION) == accuracy
    assert openr1mm_format(response) == form
    assert openr1mm_reward(response, SOLUTION) == accuracy + form
    assert get_reward_fn(RewardName.openr1mm)(response, SOLUTION) == accuracy + form


@pytest.mark.parametrize(
    ("response", "solution", "accuracy"),
    [
        ("<think>.</think><answer>B</answer>", "<answer>B</answer>", 1.0),  # a choice: the string match
        ("<think>.</think><answer>C</answer>", "<answer>B</answer>", 0.0),
        ("<think>.</think><answer>\\frac{1}{2}</answer>", "<answer>0.5</answer>", 1.0),
        ("<think>.</think><answer>red</answer>", "red", 1.0),  # a solution without tags is the answer
        ("<think>.</think><answer>Red</answer>", "red", 0.0),  # text answers match exactly
    ],
)
def test_accuracy_against_solutions_of_other_forms(response, solution, accuracy):
    assert openr1mm_accuracy(response, solution) == accuracy


def test_math_verify_decides_when_installed(monkeypatch):
    """With math_verify installed, its verdict on the whole texts (gold first) is the symbolic check;
    the answer-tag string match still rescues what it cannot verify."""
    calls = []
    fake = types.ModuleType("math_verify")
    fake.parse = lambda text: text
    fake.verify = lambda gold, target: calls.append((gold, target)) or "sqrt" in target
    monkeypatch.setitem(sys.modules, "math_verify", fake)
    assert openr1mm_accuracy("<answer>\\sqrt{4}</answer>", SOLUTION) == 1.0  # skyq's own check says no
    assert calls == [(SOLUTION, "<answer>\\sqrt{4}</answer>")]
    assert openr1mm_accuracy("<answer>12.0</answer>", SOLUTION) == 0.0  # math_verify said no, tags differ
    assert openr1mm_accuracy("<answer>12</answer>", SOLUTION) == 1.0  # equal tags

    def raising(gold, target):
        raise RuntimeError("unparsable")

    fake.verify = raising
    assert openr1mm_accuracy("<answer>11</answer>", SOLUTION) == 0.0


def test_answer_tag_and_the_supervised_target():
    assert answer_tag("x <answer>\n 7 \n</answer> <answer>8</answer>") == "7"
    assert answer_tag("no tag") is None
    assert reference_response(RewardName.openr1mm, SOLUTION) == SOLUTION
    target = reference_response(RewardName.openr1mm, "12")
    assert openr1mm_reward(target, SOLUTION) == 2.0
    assert reference_response(RewardName.math, "3") == "\\boxed{3}"
    assert reference_response(RewardName.exact_match, "3") == "3"
