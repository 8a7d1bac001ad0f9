"""Refuse text that cannot fit ``max_model_len`` before tokenizing all of it.

A multi-megabyte prompt would otherwise be tokenized whole (seconds of work) only to be refused.
`tokenize_within` tokenizes growing prefixes of the text, each cut where a run of non-whitespace
meets whitespace, and stops as soon as a prefix alone has more tokens than the limit. The cut is
sound for tokenizers that never merge across such a boundary: those that pre-tokenize at
whitespace (byte-level BPE with GPT-2/Llama-3/Qwen regexes, SentencePiece's metaspace split,
word-level): there the prefix's tokens are the first tokens of the whole text, so the whole has
at least as many. Work is at most about twice that of tokenizing a prefix of ``limit`` tokens,
or the whole text when it fits.
"""

from __future__ import annotations

import re
from typing import Any

from .errors import ContextLengthError

_FIRST_CUT_CHARS = 4096  # the first prefix tried: at least this many characters
_CHARS_PER_TOKEN_GUESS = 4  # ... or limit times this; doubled after each prefix that fits
_BOUNDARY = re.compile(r"(?<=\S)\s")  # a cut: non-whitespace, then whitespace


def _cut(text: str, at: int) -> int:
    """The first boundary at or after ``at`` (a position where non-whitespace meets
    whitespace), or len(text) when there is none."""
    m = _BOUNDARY.search(text, max(at, 1))
    return len(text) if m is None else m.start()


def tokenize_within(tokenizer: Any, text: str, max_model_len: int, max_tokens: int | None,
                    add_special_tokens: bool = True, what: str = "prompt") -> list[int]:
    """``text``'s token ids, or ContextLengthError as soon as a prefix of it alone has more
    tokens than ``max_model_len`` leaves for a prompt (room for ``max_tokens`` output tokens,
    at least 1), without tokenizing the rest; the message names the count, the characters
    read and the limit. Text that is tokenized whole is returned whatever its length (the
    caller's exact check words that case). Thread-safe as far as the tokenizer's encode is:
    call it on a worker thread, the work scales with the text (up to about twice that of
    tokenizing ``max_model_len`` tokens, or all of a text that fits)."""
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
        max_tokens = None  # a wrong type is SamplingParams.validate's to word
    room = max_model_len - max(max_tokens or 1, 1)
    at = max(_FIRST_CUT_CHARS, max_model_len * _CHARS_PER_TOKEN_GUESS)
    while True:
        end = _cut(text, at) if at < len(text) else len(text)
        ids = tokenizer(text[:end], add_special_tokens=add_special_tokens)["input_ids"]
        if end == len(text):
            return ids
        if len(ids) > room:
            raise ContextLengthError(
                f"{what} has at least {len(ids)} tokens (in its first {end} of {len(text)} "
                f"characters); max_model_len={max_model_len} leaves room for "
                f"{room} prompt tokens with max_tokens={max_tokens}")
        at = 2 * end
