"""Tokenizers of the RL tasks: arith's built-in character tokenizer, and a model's own (dataset tasks).

`ArithTokenizer`: one token per character, plus pad / bos / eos. Small enough for the tiny model's
32-token vocabulary. `HFTokenizer`: the transformers tokenizer saved beside a checkpoint's weights.
With both, ids the model can emit beyond the tokenizer's vocabulary decode to U+FFFD so a reward
never crashes on them (and never matches an answer).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
CHARACTERS = "0123456789+-*/%=(). "
UNKNOWN_CHARACTER = "\ufffd"


class TokenizerError(ValueError):
    """Text the tokenizer cannot encode, or a vocabulary that does not fit the model."""


class ArithTokenizer:
    """Character-level tokenizer: ids 0..2 are pad, bos, eos; then one id per character."""

    def __init__(self) -> None:
        self.vocab: list[str] = [PAD, BOS, EOS, *CHARACTERS]
        self._char_to_id = {c: i for i, c in enumerate(self.vocab) if len(c) == 1}
        self.pad_token_id = PAD_ID
        self.bos_token_id = BOS_ID
        self.eos_token_id = EOS_ID

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def check_fits(self, model_vocab_size: int) -> None:
        """Refuse a model whose vocabulary cannot hold every token id."""
        if self.vocab_size > model_vocab_size:
            raise TokenizerError(
                f"ArithTokenizer has {self.vocab_size} tokens but model.vocab_size={model_vocab_size}; "
                f"set model.vocab_size >= {self.vocab_size}"
            )

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """Token ids of `text`, one per character; refuses characters outside the vocabulary."""
        ids = [self.bos_token_id] if add_bos else []
        for position, char in enumerate(text):
            if char not in self._char_to_id:
                raise TokenizerError(
                    f"character {char!r} at position {position} of {text!r} is not in the arith "
                    f"vocabulary {CHARACTERS!r}"
                )
            ids.append(self._char_to_id[char])
        if add_eos:
            ids.append(self.eos_token_id)
        return ids

    def decode(self, ids: Sequence[int], *, stop_at_eos: bool = True) -> str:
        """Text of `ids`, skipping pad and bos; stops at the first eos unless `stop_at_eos` is False."""
        chars = []
        for token_id in ids:
            token_id = int(token_id)
            if token_id == self.eos_token_id and stop_at_eos:
                break
            if token_id in (self.pad_token_id, self.bos_token_id, self.eos_token_id):
                continue
            chars.append(self.vocab[token_id] if 0 <= token_id < self.vocab_size else UNKNOWN_CHARACTER)
        return "".join(chars)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
"""Files of which at least one marks a directory as holding a transformers tokenizer."""


class HFTokenizer:
    """A model's own tokenizer (transformers, read from its checkpoint directory) as a task sees it.

    `encode` adds no special tokens: a prompt's bos / role markers come from the chat template
    (`task.apply_chat_template`), and answer targets must not carry any. Ids beyond the tokenizer's
    vocabulary (the model's may be larger) decode to U+FFFD, as ArithTokenizer's do, rather than
    being dropped: a dropped id could turn a wrong answer into a right one.
    """

    def __init__(self, tokenizer: Any, *, source: str) -> None:
        if tokenizer.eos_token_id is None:
            raise TokenizerError(f"{source}: the tokenizer has no eos token; RL responses end at eos")
        self._tokenizer = tokenizer
        self.source = source
        self.eos_token_id: int = int(tokenizer.eos_token_id)

    @property
    def vocab_size(self) -> int:
        """Every id the tokenizer can produce, added tokens included."""
        return len(self._tokenizer)

    @property
    def has_chat_template(self) -> bool:
        return bool(self._tokenizer.chat_template)

    def check_fits(self, model_vocab_size: int) -> None:
        """Refuse a model whose vocabulary cannot hold every token id."""
        if self.vocab_size > model_vocab_size:
            raise TokenizerError(
                f"the tokenizer in {self.source} has {self.vocab_size} tokens but model.vocab_size="
                f"{model_vocab_size}; the model cannot embed its ids. Fix: a model config whose vocab_size "
                f">= {self.vocab_size} (the checkpoint's own)"
            )

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        pieces, known = [], []
        for token_id in ids:
            token_id = int(token_id)
            if 0 <= token_id < self.vocab_size:
                known.append(token_id)
                continue
            pieces += [self._tokenizer.decode(known, skip_special_tokens=True), UNKNOWN_CHARACTER]
            known = []
        pieces.append(self._tokenizer.decode(known, skip_special_tokens=True))
        return "".join(pieces)

    def chat_prompt(self, messages: list[dict[str, Any]]) -> str:
        """`messages` rendered by the tokenizer's chat template, ready for the assistant's turn."""
        if not self.has_chat_template:
            raise TokenizerError(
                f"task.apply_chat_template=true but the tokenizer in {self.source} has no chat template. "
                "Fix: task.apply_chat_template=false (prompts as plain text), or a tokenizer with one"
            )
        return self._tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def load_tokenizer(directory: str | Path) -> HFTokenizer:
    """The tokenizer saved in `directory` (a model checkpoint), from local files only: no download,
    no remote code."""
    path = Path(directory).expanduser()
    if not path.is_dir() or not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise TokenizerError(
            f"{path} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}): a dataset task reads the "
            "model's tokenizer from checkpoint.hf_checkpoint. Fix: save the tokenizer there "
            "(tokenizer.save_pretrained(dir))"
        )
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError) as exc:
        raise TokenizerError(f"{path}: cannot load its tokenizer: {exc}") from None
    return HFTokenizer(tokenizer, source=str(path))
