"""Tasks: deterministic data order, correct answers, the dapo_math JSONL loader (tests/rl/test_datasets.py: the file formats)."""

from __future__ import annotations

import json
import random

import pytest

from skyq.config.enums import ArithOp, RewardName, TaskName
from skyq.config.schema import TaskConfig
from skyq.rl.datasets import DatasetError
from skyq.rl.tasks import TaskError, build_task
from skyq.rl.tokenizer import ArithTokenizer, TokenizerError


def test_tokenizer_round_trip_and_fits_tiny_vocab():
    tok = ArithTokenizer()
    tok.check_fits(32)
    ids = tok.encode("3+4=", add_bos=True, add_eos=True)
    assert ids[0] == tok.bos_token_id and ids[-1] == tok.eos_token_id
    assert tok.decode(ids) == "3+4="
    assert tok.decode([tok.encode("5")[0], 31, tok.eos_token_id, tok.encode("6")[0]]) == "5\ufffd"
    with pytest.raises(TokenizerError, match="'x'"):
        tok.encode("3x4")
    with pytest.raises(TokenizerError, match="model.vocab_size"):
        tok.check_fits(16)


@pytest.mark.parametrize("op", [ArithOp.copy, ArithOp.add_mod10])
def test_arith_prompts_are_deterministic_per_seed_and_step(op):
    cfg = TaskConfig(arith_op=op)
    a, b = build_task(cfg, seed=1), build_task(cfg, seed=1)
    assert a.prompts(5, 16) == b.prompts(5, 16)
    assert a.prompts(5, 16) != a.prompts(6, 16)
    assert a.prompts(5, 16) != build_task(cfg, seed=2).prompts(5, 16)


def test_arith_answers_and_rewards():
    task = build_task(TaskConfig(arith_op=ArithOp.add_mod10), seed=0)
    tok = task.tokenizer
    for prompt in task.prompts(0, 50):
        text = tok.decode(prompt.token_ids)
        a, b = int(text[0]), int(text[2])
        assert prompt.answer == str((a + b) % 10)
        assert task.reward(prompt, tok.encode(prompt.answer, add_eos=True)) == 1.0
        assert task.reward(prompt, tok.encode(prompt.answer + "1")) == 0.0
        assert task.reward(prompt, tok.encode(str((a + b + 1) % 10), add_eos=True)) == 0.0
    copy = build_task(TaskConfig(arith_op=ArithOp.copy), seed=0)
    for prompt in copy.prompts(0, 10):
        assert copy.tokenizer.decode(prompt.token_ids) == prompt.answer + "="


def test_supervised_examples_target_the_answer():
    task = build_task(TaskConfig(arith_op=ArithOp.add_mod10), seed=0)
    for ex in task.supervised_examples(20, random.Random(3)):
        text = task.tokenizer.decode(ex.prompt_ids)
        assert task.tokenizer.decode(ex.target_ids) == str((int(text[0]) + int(text[2])) % 10)
        assert ex.target_ids[-1] == task.tokenizer.eos_token_id


def test_arith_refuses_too_short_lengths():
    with pytest.raises(TaskError, match="task.max_prompt_length=3"):
        build_task(TaskConfig(max_prompt_length=3), seed=0)
    with pytest.raises(TaskError, match="task.max_response_length=1"):
        build_task(TaskConfig(max_response_length=1), seed=0)


def test_dapo_math_reads_local_jsonl_in_a_seeded_order(tmp_path):
    path = tmp_path / "math.jsonl"
    rows = [{"prompt": f"{i}+{i}=", "label": str(2 * i)} for i in range(10)]
    rows.append({"prompt": [{"role": "user", "content": "1234567890+1234567890="}], "label": "x"})
    path.write_text("\n".join(json.dumps(r) for r in rows))
    cfg = TaskConfig(name=TaskName.dapo_math, reward=RewardName.math, dataset=str(path), max_prompt_length=12)
    task = build_task(cfg, seed=0, tokenizer=ArithTokenizer())
    assert len(task.records) == 10  # the overlong chat prompt is skipped
    epoch = task.prompts(0, 10)
    assert sorted(p.answer for p in epoch) == sorted(r["label"] for r in rows[:10])
    assert task.prompts(0, 10) == build_task(cfg, seed=0, tokenizer=ArithTokenizer()).prompts(0, 10)
    prompt = epoch[0]
    tok = task.tokenizer
    assert task.reward(prompt, tok.encode(f"= {prompt.answer}", add_eos=True)) == 1.0


def test_dapo_math_never_downloads(tmp_path):
    cfg = TaskConfig(name=TaskName.dapo_math, reward=RewardName.math, dataset="dapo-math-17k")
    with pytest.raises(DatasetError, match="never downloads"):
        build_task(cfg, seed=0, tokenizer=ArithTokenizer())
    with pytest.raises(TaskError, match="tokenizer"):
        build_task(cfg, seed=0)


@pytest.mark.parametrize(("op", "count"), [(ArithOp.add_mod10, 100), (ArithOp.copy, 10)])
def test_arith_eval_prompts_are_the_whole_problem_space_once(op, count):
    """Every distinct problem exactly once, each with its right answer, the same for any seed."""
    task = build_task(TaskConfig(arith_op=op), seed=0)
    prompts = task.eval_prompts()
    texts = [task.tokenizer.decode(p.token_ids) for p in prompts]
    assert len(prompts) == count and len(set(texts)) == count
    for text, p in zip(texts, prompts, strict=True):
        digits = [int(c) for c in text if c.isdigit()]
        assert p.answer == str(sum(digits) % 10 if op is ArithOp.add_mod10 else digits[0]), text
    assert build_task(TaskConfig(arith_op=op), seed=7).eval_prompts() == prompts


def test_dapo_math_evaluates_the_eval_dataset_and_needs_one(tmp_path):
    train, held_out = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    train.write_text("\n".join(json.dumps({"prompt": f"{i}+1=", "label": str(i + 1)}) for i in range(5)))
    held_out.write_text("\n".join(json.dumps({"prompt": f"{i}+2=", "label": str(i + 2)}) for i in range(3)))
    cfg = TaskConfig(name=TaskName.dapo_math, reward=RewardName.math, dataset=str(train))
    cfg.eval.dataset = str(held_out)
    task = build_task(cfg, seed=0, tokenizer=ArithTokenizer())
    assert [p.answer for p in task.eval_prompts()] == ["2", "3", "4"]  # file order
    cfg.eval.dataset = None
    with pytest.raises(TaskError, match="task.eval.dataset"):
        build_task(cfg, seed=0, tokenizer=ArithTokenizer()).eval_prompts()
