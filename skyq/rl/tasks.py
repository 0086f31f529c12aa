"""RL tasks: prompts with reference answers, a reward, and supervised examples for a warm-up.

`Task.prompts(step, n)` is a pure function of (seed, step), so a resumed run sees the same data
order as the run it continues, with no sampler state to checkpoint.
"""

from __future__ import annotations

import hashlib
import random
from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

from skyq.config.enums import ArithOp, RewardName, TaskName
from skyq.config.schema import TaskConfig
from skyq.rl.datasets import Messages, local_file, read_records
from skyq.rl.rewards import RewardFn, get_reward_fn, reference_response
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
    images: tuple[bytes, ...] = ()
    """Encoded images of a multimodal prompt, in the order of its image tokens (`skyq.rl.images.decode`)."""


OPEN_R1_QUESTION_SUFFIX = (
    "  Output the thinking process in <think> </think> and final answer (number) in <answer> </answer> tags."
)
"""The instruction open-r1-multimodal appends to each question (src/open_r1/grpo.py, its question template):
multimodal_open_r1 appends it to a prompt given as a plain question, asking for the format openr1mm rewards."""


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

    @abstractmethod
    def describe(self) -> str:
        """One line saying where the prompts come from (printed when a run starts)."""

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

    def describe(self) -> str:
        return f"task arith: generated {self.op.value} problems on digits 0-9"

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


class DatasetTask(Task):
    """Prompts from the user's dataset file (`task.dataset`), evaluated on `task.eval.dataset`.

    dapo_math and multimodal_open_r1 are this task with their own reward and keys (conf/task/). A prompt is
    rendered by the model's chat template when `task.apply_chat_template` is set (else its text joined),
    then tokenized by the model's tokenizer. A prompt longer than `task.max_prompt_length` tokens is
    dropped, not truncated, as DAPO's overlong filter does (a cut problem has no right answer); the drops
    are counted (`describe`). Each epoch visits the prompts in a seed-determined order.
    """

    def __init__(
        self,
        *,
        task_cfg: TaskConfig,
        tokenizer: TextTokenizer,
        reward_fn: RewardFn,
        seed: int,
        question_suffix: str | None = None,
    ) -> None:
        super().__init__(tokenizer=tokenizer, reward_fn=reward_fn, seed=seed)
        if task_cfg.image_key is not None and not task_cfg.apply_chat_template:
            raise TaskError(
                f"task.image_key={task_cfg.image_key} with task.apply_chat_template=false: the chat template "
                "places a prompt's images. Fix: task.apply_chat_template=true"
            )
        self.name = TaskName(task_cfg.name)
        self.reward_name = RewardName(task_cfg.reward)
        self.train = load_split(
            task_cfg,
            tokenizer,
            file_key="task.dataset",
            prompt_key=task_cfg.prompt_key,
            label_key=task_cfg.label_key,
            question_suffix=question_suffix,
        )
        ev = task_cfg.eval
        self.eval_split = (
            None
            if ev.dataset is None
            else load_split(
                replace(task_cfg, dataset=ev.dataset),
                tokenizer,
                file_key="task.eval.dataset",
                prompt_key=ev.prompt_key or task_cfg.prompt_key,
                label_key=ev.label_key or task_cfg.label_key,
                question_suffix=question_suffix,
            )
        )
        self.records = self.train.prompts

    def describe(self) -> str:
        lines = [f"task {self.name.value}: {self.train.describe()}"]
        if self.eval_split is not None:
            lines.append(f"eval: {self.eval_split.describe()}")
        return "; ".join(lines)

    def eval_prompts(self) -> list[Prompt]:
        """The prompts of `task.eval.dataset`, read as the training file, in file order."""
        if self.eval_split is None:
            raise TaskError(f"task {self.name.value} evaluates task.eval.dataset=<a local file>; none is set")
        return self.eval_split.prompts

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
                prompt_ids=p.token_ids,
                target_ids=[*self.tokenizer.encode(reference_response(self.reward_name, p.answer)), eos],
            )
            for p in chosen
        ]


@dataclass(frozen=True, slots=True)
class DatasetSplit:
    """The prompts of one dataset file, and what reading it kept and dropped."""

    path: Path
    prompts: list[Prompt]
    dropped: int
    """Rows whose prompt is longer than `task.max_prompt_length` tokens."""
    max_prompt_length: int

    def describe(self) -> str:
        kept = f"{len(self.prompts)} prompts from {self.path}"
        if not self.dropped:
            return kept
        return (
            f"{kept} ({self.dropped} dropped: longer than task.max_prompt_length={self.max_prompt_length} "
            "tokens)"
        )


def load_split(
    task_cfg: TaskConfig,
    tokenizer: TextTokenizer,
    *,
    file_key: str,
    prompt_key: str,
    label_key: str,
    question_suffix: str | None = None,
) -> DatasetSplit:
    """Read the local file `task_cfg.dataset` (named `file_key` in errors) into tokenized prompts; no
    downloads. `question_suffix` is appended to prompts given as a plain question string."""
    path = local_file(task_cfg.dataset, key=file_key)
    prompts, dropped = [], 0
    records = read_records(
        path,
        prompt_key=prompt_key,
        label_key=label_key,
        image_key=task_cfg.image_key,
        config_prefix="task.eval" if file_key == "task.eval.dataset" else "task",
        question_suffix=question_suffix,
    )
    for record in records:
        ids = _prompt_ids(tokenizer, record.messages, task_cfg.apply_chat_template)
        if len(ids) > task_cfg.max_prompt_length:
            dropped += 1
            continue
        prompts.append(Prompt(token_ids=ids, answer=record.answer, images=record.images))
    if not prompts:
        raise TaskError(
            f"{path}: none of its {dropped} rows has a prompt of at most task.max_prompt_length="
            f"{task_cfg.max_prompt_length} tokens"
            if dropped
            else f"{path}: the file holds no rows"
        )
    return DatasetSplit(
        path=path, prompts=prompts, dropped=dropped, max_prompt_length=task_cfg.max_prompt_length
    )


def _text(messages: Messages) -> str:
    """The messages' text, joined by newlines (prompts without a chat template)."""
    pieces = []
    for m in messages:
        content = m["content"]
        if isinstance(content, str):
            pieces.append(content)
        else:
            pieces.extend(str(p["text"]) for p in content if p.get("type") == "text")
    return "\n".join(pieces)


def _prompt_ids(tokenizer: TextTokenizer, messages: Messages, chat_template: bool) -> list[int]:
    """The prompt's tokens: rendered by the tokenizer's chat template (`task.apply_chat_template`), or
    the message texts joined by newlines."""
    if not chat_template:
        return tokenizer.encode(_text(messages))
    if not isinstance(tokenizer, HFTokenizer):
        raise TaskError(
            f"task.apply_chat_template=true needs a model tokenizer with a chat template, not "
            f"{type(tokenizer).__name__}. Fix: task.apply_chat_template=false"
        )
    return tokenizer.encode(tokenizer.chat_prompt(messages))


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
    if tokenizer is None:
        raise TaskError(f"task {name.value} needs the model's tokenizer: build_task(..., tokenizer=...)")
    return DatasetTask(
        task_cfg=task_cfg,
        tokenizer=tokenizer,
        reward_fn=reward_fn,
        seed=seed,
        question_suffix=OPEN_R1_QUESTION_SUFFIX if name is TaskName.multimodal_open_r1 else None,
    )
