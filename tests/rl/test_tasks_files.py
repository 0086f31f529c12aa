"""Dataset tasks built from the user's files in the seed layouts, through a real tokenizer directory and
its chat template: conf/task/dapo_math.yaml's keys read DAPO-Math-17k's layout and AIME-2024's for eval,
conf/task/multimodal_open_r1.yaml's read lmms-lab's open-r1 layout; overlong prompts are dropped and
counted (tests/rl/test_dapo_math_run.py runs dapo_math with an AIME eval file).

The tokenizer is a character-level one (every printable ASCII character, plus pad/bos/eos and an `<image>`
special token) built with `tokenizers` and saved with a chat template: no hub.
"""

from __future__ import annotations

import base64
import random
import string
from dataclasses import replace
from pathlib import Path

import pytest
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from skyq.config.store import compose, to_object
from skyq.rl.images import decode
from skyq.rl.tasks import OPEN_R1_QUESTION_SUFFIX, TaskError, build_task, tokenizer_for
from tests.rl.test_datasets import dapo_row, png, write_jsonl

CHAT_TEMPLATE = (
    "<bos>{% for m in messages %}<{{ m['role'] }}>{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}<image>{% else %}{{ p['text'] }}"
    "{% endif %}{% endfor %}{% endif %}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)
SOLUTION = "<think>There are three circles.</think>\n\n<answer>3</answer>"


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("tokenizer")
    vocab = {
        t: i for i, t in enumerate(["<pad>", "<bos>", "<eos>", "<image>", *sorted(set(string.printable))])
    }
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        extra_special_tokens={"image_token": "<image>"},
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    return directory


def task_config(overrides: list[str]):
    return to_object(compose(overrides)).task


def build(task_cfg, tokenizer_dir: Path, seed: int = 0):
    tokenizer = tokenizer_for(task_cfg, checkpoint_dir=str(tokenizer_dir), model_vocab_size=128)
    return build_task(task_cfg, seed=seed, tokenizer=tokenizer)


def test_dapo_math_reads_its_layout_and_evaluates_aime(tmp_path, tokenizer_dir):
    """conf/task/dapo_math.yaml's keys, unchanged, read DAPO-Math-17k's rows and AIME-2024's."""
    train = write_jsonl(tmp_path / "dapo-math-17k.jsonl", [dapo_row(i) for i in range(6)])
    aime = write_jsonl(
        tmp_path / "aime-2024.jsonl",
        [{"id": i, "problem": f"AIME problem {i}", "solution": "...", "answer": 100 + i} for i in range(3)],
    )
    cfg = task_config(
        ["task=dapo_math", f"task.dataset={train}", f"task.eval.dataset={aime}", "task.max_prompt_length=400"]
    )
    task = build(cfg, tokenizer_dir)
    tok = task.tokenizer
    assert sorted(int(p.answer) for p in task.prompts(0, 6)) == [2 * i for i in range(6)]
    prompt = task.records[1]
    assert tok.decode(prompt.token_ids) == f"<user>{dapo_row(1)['prompt'][0]['content']}<assistant>"
    assert prompt.token_ids[0] == tok._tokenizer.bos_token_id  # from the template
    evals = task.eval_prompts()
    assert [p.answer for p in evals] == ["100", "101", "102"]  # file order
    assert tok.decode(evals[2].token_ids) == "<user>AIME problem 2<assistant>"
    assert task.reward(evals[0], tok.encode("So it is 100.\nAnswer: 100")) == 1.0
    assert task.reward(evals[0], tok.encode("Answer: 101")) == 0.0
    sft = task.supervised_examples(2, random.Random(0))[0]
    assert task.reward(next(p for p in task.records if p.token_ids == sft.prompt_ids), sft.target_ids) == 1.0
    assert task.describe() == f"task dapo_math: 6 prompts from {train}; eval: 3 prompts from {aime}"


def test_overlong_prompts_are_dropped_and_counted(tmp_path, tokenizer_dir):
    rows = [
        {"prompt": "1+1=", "label": "2"},
        {"prompt": "x" * 50, "label": "1"},
        {"prompt": "2+2=", "label": "4"},
    ]
    path = write_jsonl(tmp_path / "mixed.jsonl", rows)
    cfg = task_config(
        ["task=dapo_math", f"task.dataset={path}", "task.label_key=label", "task.max_prompt_length=30"]
    )
    task = build(cfg, tokenizer_dir)
    assert [p.answer for p in task.records] == ["2", "4"] and task.train.dropped == 1
    assert "2 prompts from" in task.describe()
    assert "(1 dropped: longer than task.max_prompt_length=30 tokens)" in task.describe()
    with pytest.raises(
        TaskError, match=r"none of its 3 rows has a prompt of at most task.max_prompt_length=5 tokens"
    ):
        build(replace(cfg, max_prompt_length=5), tokenizer_dir)
    empty = write_jsonl(tmp_path / "empty.jsonl", [])
    with pytest.raises(TaskError, match="empty.jsonl: the file holds no rows"):
        build(replace(cfg, dataset=str(empty)), tokenizer_dir)


def test_without_the_chat_template_prompts_are_their_text(tmp_path, tokenizer_dir):
    path = write_jsonl(tmp_path / "dapo.jsonl", [dapo_row(3)])
    cfg = task_config(
        [
            "task=dapo_math",
            f"task.dataset={path}",
            "task.apply_chat_template=false",
            "task.max_prompt_length=400",
        ]
    )
    task = build(cfg, tokenizer_dir)
    assert task.tokenizer.decode(task.records[0].token_ids) == dapo_row(3)["prompt"][0]["content"]


def test_the_eval_file_needs_its_keys_and_names_them(tmp_path, tokenizer_dir):
    train = write_jsonl(tmp_path / "dapo.jsonl", [dapo_row(1)])
    aime = write_jsonl(tmp_path / "aime.jsonl", [{"question": "q", "answer": "1"}])
    overrides = [
        "task=dapo_math",
        f"task.dataset={train}",
        f"task.eval.dataset={aime}",
        "task.max_prompt_length=400",
    ]
    with pytest.raises(ValueError, match=rf"^{aime}:1: no key 'problem' .*Fix: task.eval.prompt_key="):
        build(task_config(overrides), tokenizer_dir)
    task = build(task_config([*overrides, "task.eval.prompt_key=question"]), tokenizer_dir)
    assert task.eval_prompts()[0].answer == "1"


def test_multimodal_open_r1_reads_lmms_lab_rows_with_their_images(tmp_path, tokenizer_dir):
    """conf/task/multimodal_open_r1.yaml's keys read lmms-lab's layout; the question gets open-r1's format
    instruction, the image goes before it; openr1mm scores the formatted right answer 2."""
    images = [png((40 * i, 0, 0), (3 + i, 4)) for i in range(4)]
    rows = [
        {"image": {"bytes": base64.b64encode(img).decode(), "path": f"{i}.png"}, "problem": f"How many circles? {i}",
         "solution": SOLUTION, "original_question": "...", "original_answer": "3"}
        for i, img in enumerate(images)
    ]  # fmt: skip
    path = write_jsonl(tmp_path / "open_r1.jsonl", rows)
    cfg = task_config(["task=multimodal_open_r1", f"task.dataset={path}", "task.max_prompt_length=200"])
    task = build(cfg, tokenizer_dir, seed=3)
    tok = task.tokenizer
    first = next(p for p in task.records if p.images == (images[0],))
    image_id = tok._tokenizer.convert_tokens_to_ids("<image>")
    assert first.token_ids[:8] == [tok._tokenizer.bos_token_id, *tok.encode("<user>"), image_id]
    assert first.token_ids.count(image_id) == 1
    assert tok.decode(first.token_ids) == f"<user>How many circles? 0{OPEN_R1_QUESTION_SUFFIX}<assistant>"
    assert decode(first.images[0]).size == (3, 4)
    assert sorted(len(p.images) for p in task.prompts(0, 4)) == [1, 1, 1, 1]
    assert task.reward(first, tok.encode("<think>I count 3.</think><answer>3</answer>")) == 2.0
    assert task.reward(first, tok.encode("<think>I count 3.</think><answer>4</answer>")) == 1.0
    assert task.reward(first, tok.encode("3")) == 1.0
    sft = task.supervised_examples(1, random.Random(0))[0]
    assert tok.decode(sft.target_ids) == SOLUTION and sft.target_ids[-1] == tok.eos_token_id
    with pytest.raises(TaskError, match="task.image_key=image with task.apply_chat_template=false"):
        build(replace(cfg, apply_chat_template=False), tokenizer_dir)
