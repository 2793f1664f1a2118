"""Incremental detokenization: token ids arrive one by one, text deltas go out.

Decoding token by token breaks multi-byte characters (one emoji can span several byte-level
tokens) and loses leading spaces in some tokenizers. So each step decodes a small window of
recent tokens twice: up to the last emitted token (`prefix_text`) and including the new one
(`new_text`); the delta is the difference, held back while it ends in an incomplete character
("\\ufffd"). The window starts with a few prompt tokens so the first output token decodes in
context. The concatenation of all deltas is the text.
"""

from __future__ import annotations

# How many prompt tokens seed the window (enough context for any tokenizer's space rules).
INITIAL_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids = list(prompt_token_ids[-INITIAL_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)

    def add_token(self, token_id: int) -> str:
        """Append one token; return the newly complete text (often "", never partial)."""
        self.token_ids.append(token_id)
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.token_ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        return new_text[len(prefix_text) :]

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(
            token_ids,
            skip_special_tokens=self.skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )
