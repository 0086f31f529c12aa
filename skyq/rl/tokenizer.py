"""The built-in character tokenizer of the embedded arithmetic task.

One token per character, plus pad / bos / eos. Small enough for the tiny model's 32-token vocabulary;
ids the model can emit beyond the tokenizer's vocabulary decode to U+FFFD so a reward never crashes
on them (and never matches an answer).
"""

from __future__ import annotations

from collections.abc import Sequence

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
