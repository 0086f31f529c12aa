"""RL tasks: prompts with reference answers, a reward, and supervised examples for a warm-up.

`Task.prompts(step, n)` is a pure function of (seed, step), so a resumed run sees the same data
order as the run it continues, with no sampler state to checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import random
from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

from skyq.config.enums import ArithOp, RewardName, TaskName
from skyq.config.schema import TaskConfig
from skyq.rl.rewards import RewardFn, get_reward_fn
from skyq.rl.tokenizer import ArithTokenizer, HFTokenizer, load_tokenizer


class TaskError(ValueError):
    """A task that cannot be built from its config (missing dataset, prompts too long, ...)."""


class TextTokenizer(Protocol):
    eos_token_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


@dataclass(frozen=True, slots=True)
class Prompt:
    token_ids: list[int]
    """Prompt tokens, bos included."""
    answer: str
    """Reference answer the reward compares against."""


@dataclass(frozen=True, slots=True)
class SupervisedExample:
    prompt_ids: list[int]
    target_ids: list[int]
    """Response tokens to imitate, eos included."""


def step_rng(seed: int, step: int) -> random.Random:
    """A generator that depends only on (seed, step): same data for the same step of any run."""
    digest = hashlib.sha256(f"skyq-task:{seed}:{step}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "little"))


class Task(ABC):
    """Prompts and a reward over responses; subclasses say where prompts come from."""

    def __init__(self, *, tokenizer: TextTokenizer, reward_fn: RewardFn, seed: int) -> None:
        self.tokenizer = tokenizer
        self.reward_fn = reward_fn
        self.seed = seed

    @abstractmethod
    def prompts(self, step: int, n: int) -> list[Prompt]:
        """The `n` prompts of training step `step` (deterministic in seed and step)."""

    @abstractmethod
    def supervised_examples(self, n: int, rng: random.Random) -> list[SupervisedExample]:
        """`n` (prompt, correct response) pairs for a supervised warm-up."""

    def eval_prompts(self) -> list[Prompt]:
        """The fixed prompts evaluation scores (`task.eval.*`), the same at every eval of a run."""
        raise TaskError(f"task {type(self).__name__} has no eval set: set task.eval.interval=0")

    def response_text(self, response_ids: list[int]) -> str:
        """The response as text, cut at the first eos."""
        eos = self.tokenizer.eos_token_id
        ids = list(response_ids)
        if eos in ids:
            ids = ids[: ids.index(eos)]
        return self.tokenizer.decode(ids)

    def reward(self, prompt: Prompt, response_ids: list[int]) -> float:
        """Reward of one response to `prompt`."""
        return self.reward_fn(self.response_text(response_ids), prompt.answer)


class ArithTask(Task):
    """`<bos>a+b=` -> `(a+b) mod 10` (add_mod10) or `<bos>a=` -> `a` (copy), digits 0-9."""

    def __init__(
        self,
        *,
        op: ArithOp,
        tokenizer: ArithTokenizer,
        reward_fn: RewardFn,
        seed: int,
        max_prompt_length: int,
        max_response_length: int,
    ) -> None:
        super().__init__(tokenizer=tokenizer, reward_fn=reward_fn, seed=seed)
        self.op = ArithOp(op)
        prompt_len = len(self._make(random.Random(0))[0].token_ids)
        if prompt_len > max_prompt_length:
            raise TaskError(
                f"arith op {self.op.value} needs prompts of {prompt_len} tokens but "
                f"task.max_prompt_length={max_prompt_length}; raise it to >= {prompt_len}"
            )
        if max_response_length < 2:
            raise TaskError(
                f"arith answers need 2 tokens (digit + eos) but task.max_response_length="
                f"{max_response_length}; raise it to >= 2"
            )

    def _make(self, rng: random.Random) -> tuple[Prompt, list[int]]:
        a, b = rng.randrange(10), rng.randrange(10)
        return self._problem(a, b)

    def _problem(self, a: int, b: int) -> tuple[Prompt, list[int]]:
        """(prompt, target tokens) of the problem on digits a and b (b unused by copy)."""
        if self.op is ArithOp.copy:
            text, answer = f"{a}=", str(a)
        else:
            text, answer = f"{a}+{b}=", str((a + b) % 10)
        prompt = Prompt(token_ids=self.tokenizer.encode(text, add_bos=True), answer=answer)
        return prompt, self.tokenizer.encode(answer, add_eos=True)

    def prompts(self, step: int, n: int) -> list[Prompt]:
        rng = step_rng(self.seed, step)
        return [self._make(rng)[0] for _ in range(n)]

    def eval_prompts(self) -> list[Prompt]:
        """Every distinct problem of the op once (100 for add_mod10, 10 for copy), in digit order: the
        whole problem space, so an eval's reward is the policy's accuracy, not a sample of it."""
        pairs = (
            [(a, 0) for a in range(10)]
            if self.op is ArithOp.copy
            else [(a, b) for a in range(10) for b in range(10)]
        )
        return [self._problem(a, b)[0] for a, b in pairs]

    def supervised_examples(self, n: int, rng: random.Random) -> list[SupervisedExample]:
        examples = []
        for _ in range(n):
            prompt, target = self._make(rng)
            examples.append(SupervisedExample(prompt_ids=prompt.token_ids, target_ids=target))
        return examples


class DapoMathTask(Task):
    """{prompt, label} records from a local JSONL file, graded by the math-answer reward.

    A prompt is a string or a chat message list, rendered by the tokenizer's chat template when
    `task.apply_chat_template` is set (else its message contents joined). Records whose prompt
    exceeds `task.max_prompt_length` tokens are skipped, as DAPO's overlong filter does.
    Each epoch visits the records in a seed-determined order.
    """

    def __init__(
        self, *, task_cfg: TaskConfig, tokenizer: TextTokenizer, reward_fn: RewardFn, seed: int
    ) -> None:
        super().__init__(tokenizer=tokenizer, reward_fn=reward_fn, seed=seed)
        self.records = load_prompt_records(task_cfg, tokenizer)
        eval_file = task_cfg.eval.dataset
        self.eval_records = (
            None
            if eval_file is None
            else load_prompt_records(replace(task_cfg, dataset=eval_file), tokenizer)
        )

    def eval_prompts(self) -> list[Prompt]:
        """The records of `task.eval.dataset` (a local JSONL file, read as the training one), in file order."""
        if self.eval_records is None:
            raise TaskError("task dapo_math evaluates task.eval.dataset=<a local .jsonl file>; none is set")
        return self.eval_records

    def _order(self, epoch: int) -> list[int]:
        order = list(range(len(self.records)))
        step_rng(self.seed, -1 - epoch).shuffle(order)
        return order

    def prompts(self, step: int, n: int) -> list[Prompt]:
        size = len(self.records)
        out = []
        for position in range(step * n, step * n + n):
            epoch, index = divmod(position, size)
            out.append(self.records[self._order(epoch)[index]])
        return out

    def supervised_examples(self, n: int, rng: random.Random) -> list[SupervisedExample]:
        eos = self.tokenizer.eos_token_id
        chosen = [self.records[rng.randrange(len(self.records))] for _ in range(n)]
        return [
            SupervisedExample(
                prompt_ids=p.token_ids, target_ids=[*self.tokenizer.encode(f"\\boxed{{{p.answer}}}"), eos]
            )
            for p in chosen
        ]


def _messages(value: object, path: Path, line: int) -> list[dict[str, object]]:
    """A record's prompt as chat messages (a plain string is one user message)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if isinstance(value, list) and all(isinstance(m, dict) and "content" in m for m in value):
        return value
    raise TaskError(
        f"{path}:{line}: prompt must be a string or a list of chat messages, got {type(value).__name__}"
    )


def _prompt_ids(
    tokenizer: TextTokenizer, messages: list[dict[str, object]], chat_template: bool
) -> list[int]:
    """The prompt's tokens: rendered by the tokenizer's chat template (`task.apply_chat_template`), or
    the message contents joined by newlines."""
    if not chat_template:
        return tokenizer.encode("\n".join(str(m["content"]) for m in messages))
    if not isinstance(tokenizer, HFTokenizer):
        raise TaskError(
            f"task.apply_chat_template=true needs a model tokenizer with a chat template, not "
            f"{type(tokenizer).__name__}. Fix: task.apply_chat_template=false"
        )
    return tokenizer.encode(tokenizer.chat_prompt(messages))


def load_prompt_records(task_cfg: TaskConfig, tokenizer: TextTokenizer) -> list[Prompt]:
    """Read `task.dataset` (a local JSONL file) into prompts; no downloads."""
    if task_cfg.dataset is None:
        raise TaskError(f"task {task_cfg.name.value} needs task.dataset=<path to a local .jsonl file>")
    path = Path(task_cfg.dataset).expanduser()
    if not path.is_file():
        raise TaskError(
            f"task.dataset={task_cfg.dataset!r} is not a local file; skyq never downloads data at run "
            "time: point task.dataset at a JSONL file of {prompt, label} records"
        )
    records = []
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            row = json.loads(line)
            for key in (task_cfg.prompt_key, task_cfg.label_key):
                if key not in row:
                    raise TaskError(f"{path}:{line_no}: record has no key {key!r} (keys: {sorted(row)})")
            messages = _messages(row[task_cfg.prompt_key], path, line_no)
            ids = _prompt_ids(tokenizer, messages, task_cfg.apply_chat_template)
            if len(ids) <= task_cfg.max_prompt_length:
                records.append(Prompt(token_ids=ids, answer=str(row[task_cfg.label_key])))
    if not records:
        raise TaskError(f"{path}: no record fits task.max_prompt_length={task_cfg.max_prompt_length} tokens")
    return records


def tokenizer_for(
    task_cfg: TaskConfig, *, checkpoint_dir: str | None, model_vocab_size: int
) -> ArithTokenizer | HFTokenizer:
    """The tokenizer `build_task` needs for `task_cfg`, checked against the model: arith's own, or for a
    dataset task the model's, read from its checkpoint directory (`checkpoint.hf_checkpoint`).

    The engines stop a response at this tokenizer's eos id (`PairSpec.eos_token_id`).
    """
    if TaskName(task_cfg.name) is TaskName.arith:
        tokenizer: ArithTokenizer | HFTokenizer = ArithTokenizer()
    elif checkpoint_dir is None:
        raise TaskError(
            f"task {task_cfg.name.value} tokenizes with the model's own tokenizer, read from "
            "checkpoint.hf_checkpoint, which is not set (skyq's self-built tiny checkpoints have none). "
            "Fix: checkpoint.hf_checkpoint=<dir with the model's weights and tokenizer files>"
        )
    else:
        tokenizer = load_tokenizer(checkpoint_dir)
    tokenizer.check_fits(model_vocab_size)
    return tokenizer


def build_task(task_cfg: TaskConfig, *, seed: int, tokenizer: TextTokenizer | None = None) -> Task:
    """The task of `task_cfg`. arith brings its own tokenizer; dataset tasks need the model's."""
    name = TaskName(task_cfg.name)
    reward_fn = get_reward_fn(RewardName(task_cfg.reward))
    if name is TaskName.arith:
        return ArithTask(
            op=task_cfg.arith_op,
            tokenizer=tokenizer or ArithTokenizer(),
            reward_fn=reward_fn,
            seed=seed,
            max_prompt_length=task_cfg.max_prompt_length,
            max_response_length=task_cfg.max_response_length,
        )
    if name is TaskName.dapo_math:
        if tokenizer is None:
            raise TaskError("task dapo_math needs the model's tokenizer: build_task(..., tokenizer=...)")
        return DapoMathTask(task_cfg=task_cfg, tokenizer=tokenizer, reward_fn=reward_fn, seed=seed)
    raise TaskError(
        f"task.name={name.value} is not implemented by skyq.rl.tasks (available: arith, dapo_math)"
    )
