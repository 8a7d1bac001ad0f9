"""Incremental detokenization that never emits half a UTF-8 character.

Each new token is decoded together with a few tokens before it (``prefix_offset``) and only
text past what those already produced is emitted; while the tail decodes to U+FFFD (a multi-byte
character split across tokens) nothing is emitted. The approach of Hugging Face
text-generation-inference and vLLM.
"""

from __future__ import annotations

from typing import Any

_CONTEXT = 5  # prompt tokens used as left context (keeps leading spaces right)


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int],
                 skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.tokens: list[int] = list(prompt_token_ids[-_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_tokens(self, new_token_ids: list[int], final: bool = False) -> str:
        """Append tokens; return the newly complete text (possibly empty). ``final`` flushes
        whatever is left, a trailing U+FFFD included."""
        self.tokens.extend(new_token_ids)
        prefix = self._decode(self.tokens[self.prefix_offset:self.read_offset])
        full = self._decode(self.tokens[self.prefix_offset:])
        if len(full) > len(prefix) and (final or not full.endswith("\ufffd")):
            delta = full[len(prefix):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.tokens)
            self.text += delta
            return delta
        return ""
