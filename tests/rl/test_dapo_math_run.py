"""task=dapo_math end to end: the model's tokenizer read from its checkpoint directory, prompts from a
local JSONL file through the tokenizer's chat template, rewards from the math-answer reward, and an eval over a
local file in AIME-2024's layout logged as eval/*.

The checkpoint is the tiny MoE (random init) plus a character-level tokenizer built here with `tokenizers` and saved
with `save_pretrained` (no hub): the model's 32-token vocabulary holds its 24 tokens.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from skyq.config.enums import RewardName, TaskName
from skyq.config.schema import TaskConfig
from skyq.config.store import compose, to_object
from skyq.launch.loop import run_rl
from skyq.quant.layouts import get_layout
from skyq.rl import rewards
from skyq.rl.rewards import exact_match, math_answer_reward
from skyq.rl.tasks import TaskError, build_task, tokenizer_for
from skyq.rl.tokenizer import TokenizerError
from skyq.trainer.native.model import build_model, write_hf_checkpoint
from tests.rl.test_datasets import write_jsonl

SPECIALS = ["<pad>", "<bos>", "<eos>"]  # ids 0, 1, 2: the embedded engine stops at EOS_ID
CHARACTERS = "0123456789+=\\boxed{} "
CHAT_TEMPLATE = "<bos>{% for m in messages %}{{ m['content'] }}{% endfor %}"
PROBLEMS = [(a, b) for a in range(4) for b in range(4)]
RUN_GROUPS = (
    "model",
    "precision",
    "algorithm",
    "task",
    "rollout",
    "trainer",
    "topology",
    "logger",
    "checkpoint",
)


def save_char_tokenizer(
    directory: Path, *, specials: list[str] = SPECIALS, template: str | None = CHAT_TEMPLATE
):
    """A one-token-per-character tokenizer saved as transformers files under `directory`."""
    vocab = {token: i for i, token in enumerate([*specials, *CHARACTERS])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>"
    )
    tokenizer.chat_template = template
    tokenizer.save_pretrained(directory)


def write_problems(path: Path) -> Path:
    path.write_text(
        "".join(json.dumps({"prompt": f"{a}+{b}=", "label": str(a + b)}) + "\n" for a, b in PROBLEMS)
    )
    return path


@pytest.fixture(scope="module")
def math_checkpoint(tmp_path_factory) -> tuple[Path, Path]:
    """(checkpoint dir, dataset): the tiny MoE's seeded random init, beside its tokenizer."""
    root = tmp_path_factory.mktemp("dapo_math")
    ckpt, data = root / "ckpt", write_problems(root / "problems.jsonl")
    save_char_tokenizer(ckpt)
    model_cfg = to_object(compose([])).model
    state = {
        name: p.detach().to(torch.bfloat16) for name, p in build_model(model_cfg, seed=0).named_parameters()
    }
    write_hf_checkpoint(ckpt, get_layout(model_cfg.family).split_experts(state, model_cfg), model_cfg)
    return ckpt, data


def test_dapo_math_runs_grpo_scoring_every_response_with_the_math_reward(
    math_checkpoint, tmp_path, monkeypatch
):
    """The embedded run of `task=dapo_math` (2 steps, in process) reads the tokenizer from
    checkpoint.hf_checkpoint and the problems from the JSONL file; every response of every step is
    scored by the math reward, and each step's logged reward is the mean of those scores."""
    ckpt, data = math_checkpoint
    scored: list[tuple[str, str, float]] = []

    def recording_math_reward(response: str, label: str) -> float:
        scored.append((response, label, math_answer_reward(response, label)))
        return scored[-1][2]

    monkeypatch.setitem(rewards._REWARDS, RewardName.math, recording_math_reward)
    cfg = compose(
        [
            "task=dapo_math",
            f"task.dataset={data}",
            "task.label_key=label",  # the file's layout is {prompt, label} (slime's), not the parquet's
            f"checkpoint.hf_checkpoint={ckpt}",
            "task.max_prompt_length=8",
            "task.max_response_length=10",
            "algorithm.num_steps=2",
            "algorithm.global_batch_size=16",
            "algorithm.group_size=4",
            "trainer.micro_batch_size=16",
            "rollout.weight_sync.transport=in_process",
            "checkpoint.save_interval=0",
            "logger.progress_bar=false",
            "logger.plot=false",
        ]  # fmt: skip
    )
    obj = to_object(cfg)
    result = run_rl(
        **{k: getattr(obj, k) for k in RUN_GROUPS},
        seed=obj.seed,
        config_container=OmegaConf.to_container(cfg, resolve=True, enum_to_str=True),
        run_dir=tmp_path / "run",
    )
    rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1] and result.weight_version == 2
    assert len(scored) == 2 * 16
    assert {label for _, label, _ in scored} <= {str(a + b) for a, b in PROBLEMS}
    for step, row in enumerate(rows):
        step_rewards = [r for _, _, r in scored[16 * step : 16 * (step + 1)]]
        assert row["reward"] == pytest.approx(sum(step_rewards) / 16)


def test_prompts_use_the_chat_template_and_rewards_read_boxed_answers(math_checkpoint):
    ckpt, data = math_checkpoint
    cfg = TaskConfig(
        name=TaskName.dapo_math, reward=RewardName.math, dataset=str(data), apply_chat_template=True
    )
    task = build_task(
        cfg, seed=0, tokenizer=tokenizer_for(cfg, checkpoint_dir=str(ckpt), model_vocab_size=32)
    )
    tok = task.tokenizer
    prompt = task.prompts(0, 1)[0]
    assert prompt.token_ids[0] == 1 and tok.decode(prompt.token_ids).endswith("=")  # <bos> from the template
    boxed = [*tok.encode(f"\\boxed{{{prompt.answer}}}"), tok.eos_token_id, *tok.encode("9")]
    assert task.reward(prompt, boxed) == 1.0 and exact_match(tok.decode(boxed[:-2]), prompt.answer) == 0.0
    wrong = str(int(prompt.answer) + 1)
    assert task.reward(prompt, tok.encode(f"\\boxed{{{wrong}}}")) == 0.0
    # An id the model has but the tokenizer lacks is U+FFFD, not dropped (dropping would turn
    # "1<id 31>2" into the answer "12").
    assert tok.decode([*tok.encode("1"), 31, *tok.encode("2")]) == "1\ufffd2"


def test_a_dataset_task_refuses_a_missing_or_unfit_tokenizer(math_checkpoint, tmp_path):
    ckpt, data = math_checkpoint
    cfg = TaskConfig(
        name=TaskName.dapo_math, reward=RewardName.math, dataset=str(data), apply_chat_template=True
    )
    with pytest.raises(TaskError, match="checkpoint.hf_checkpoint, which is not set"):
        tokenizer_for(cfg, checkpoint_dir=None, model_vocab_size=32)
    with pytest.raises(TokenizerError, match=f"{tmp_path} holds no tokenizer"):
        tokenizer_for(cfg, checkpoint_dir=str(tmp_path), model_vocab_size=32)
    with pytest.raises(TokenizerError, match="24 tokens but model.vocab_size=16"):
        tokenizer_for(cfg, checkpoint_dir=str(ckpt), model_vocab_size=16)
    other_eos = tmp_path / "other_eos"
    save_char_tokenizer(other_eos, specials=["<pad>", "<eos>", "<bos>"])
    # Any eos id: the engines are told the tokenizer's (PairSpec.eos_token_id).
    assert tokenizer_for(cfg, checkpoint_dir=str(other_eos), model_vocab_size=32).eos_token_id == 1
    no_template = tmp_path / "no_template"
    save_char_tokenizer(no_template, template=None)
    tokenizer = tokenizer_for(cfg, checkpoint_dir=str(no_template), model_vocab_size=32)
    with pytest.raises(TokenizerError, match="task.apply_chat_template=true but the tokenizer"):
        build_task(cfg, seed=0, tokenizer=tokenizer)
    plain = build_task(replace(cfg, apply_chat_template=False), seed=0, tokenizer=tokenizer)
    assert tokenizer.decode(plain.prompts(0, 1)[0].token_ids).endswith("=")


def test_a_dapo_math_run_evaluates_its_aime_file(math_checkpoint, tmp_path, capsys):
    """`task=dapo_math` with the conf's keys, run in process: the training file in DAPO-Math-17k's layout,
    the eval file in AIME-2024's; eval/* rows at steps 0 and 2 over the 4 eval prompts, the start line
    saying where the prompts come from."""
    ckpt, _ = math_checkpoint
    problems = [(a, b) for a in range(4) for b in range(4)]
    train = write_jsonl(
        tmp_path / "dapo-math-17k.jsonl",
        [{"prompt": [{"role": "user", "content": f"{a}+{b}="}], "reward_model": {"ground_truth": str(a + b)}}
         for a, b in problems],
    )  # fmt: skip
    aime = write_jsonl(
        tmp_path / "aime-2024.jsonl", [{"problem": f"{a}+{a}=", "answer": 2 * a} for a in range(4)]
    )
    cfg = compose(
        [
            "task=dapo_math", f"task.dataset={train}", f"task.eval.dataset={aime}", f"checkpoint.hf_checkpoint={ckpt}",
            "task.eval.interval=2", "task.eval.num_samples=2", "task.max_prompt_length=8",
            "task.max_response_length=6", "algorithm.num_steps=3", "algorithm.global_batch_size=8",
            "algorithm.group_size=4", "trainer.micro_batch_size=8", "rollout.weight_sync.transport=in_process",
            "checkpoint.save_interval=0", "logger.progress_bar=false", "logger.plot=false",
        ]
    )  # fmt: skip
    obj = to_object(cfg)
    result = run_rl(
        **{k: getattr(obj, k) for k in RUN_GROUPS},
        seed=obj.seed,
        config_container=OmegaConf.to_container(cfg, resolve=True, enum_to_str=True),
        run_dir=tmp_path / "run",
    )
    rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert [r["step"] for r in rows if "eval/reward" in r] == [0, 2]
    for row in (rows[0], rows[2]):
        assert row["eval/prompts"] == 4.0 and 0.0 <= row["eval/reward"] <= row["eval/best_of_n"] <= 1.0
    assert f"task dapo_math: 16 prompts from {train}; eval: 4 prompts from {aime}" in capsys.readouterr().out
