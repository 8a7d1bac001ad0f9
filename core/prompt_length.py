"""Refuse text that cannot fit ``max_model_len`` before tokenizing all of it.

A multi-megabyte prompt would otherwise be tokenized whole (seconds of work) only to be refused.
`tokenize_within` tokenizes growing prefixes of the text, each cut where a run of non-whitespace
meets whitespace, and stops as soon as a prefix alone has more tokens than the limit. The cut is
sound for tokenizers that never merge across such a boundary: those that pre-tokenize at
whitespace (byte-level BPE with GPT-2/Llama-3/Qwen regexes, SentencePiece's metaspace split,
word-level): there the prefix's tokens are the first tokens of the whole text, so the whole has
at least as many. The rest after a cut has at least its length over the longest token's
(the vocabulary's longest token text) tokens more: that bound refuses a text without whitespace
to cut at (3 MB of one "word", which byte-level BPE takes seconds over) before tokenizing it,
and keeps the work of any text to about that of tokenizing ``limit`` tokens' worth of the
longest tokens (the bound holds for tokenizers whose normalizer does not shorten the text).
"""

from __future__ import annotations

import re
from typing import Any

from .errors import ContextLengthError

_FIRST_CUT_CHARS = 4096  # the first prefix tried: at least this many characters
_CHARS_PER_TOKEN_GUESS = 4  # ... or limit times this; doubled after each prefix that fits
_BOUNDARY = re.compile(r"(?<=\S)\s")  # a cut: non-whitespace, then whitespace


def _cut(text: str, at: int, after: int) -> int:
    """A boundary (a position where non-whitespace meets whitespace) past ``after``: the first
    in [at, 2 * at), else the last before ``at``, else the first after; len(text) when there is
    none."""
    m = _BOUNDARY.search(text, max(at, 1), 2 * at)
    if m is not None:
        return m.start()
    head = text[:at]
    last_ws = max(head.rfind(c) for c in " \n\t\r")
    if last_ws > 0:
        back = len(head[:last_ws + 1].rstrip())
        if back > after:
            return back
    m = _BOUNDARY.search(text, 2 * at)
    return len(text) if m is None else m.start()


def _longest_token_chars(tokenizer: Any) -> int:
    """The length of the vocabulary's longest token text (its raw form: byte-level BPE's has a
    character per byte, so it is at least the characters the token stands for), cached on the
    tokenizer."""
    n = getattr(tokenizer, "_pagebatch_longest_token", None)
    if n is None:
        n = max((len(t) for t in tokenizer.get_vocab()), default=1) or 1
        try:
            tokenizer._pagebatch_longest_token = n
        except AttributeError:
            pass
    return n


def tokenize_within(tokenizer: Any, text: str, max_model_len: int, max_tokens: int | None,
                    add_special_tokens: bool = True, what: str = "prompt") -> list[int]:
    """``text``'s token ids, or ContextLengthError as soon as a prefix of it and a bound on the
    rest (its characters over the longest token's) have more tokens than ``max_model_len``
    leaves for a prompt (room for ``max_tokens`` output tokens, at least 1), without
    tokenizing the rest; the message names the count, the characters read and the limit. Text
    that is tokenized whole is returned whatever its length (the caller's exact check words
    that case). Thread-safe as far as the tokenizer's encode is: call it on a worker thread,
    the work is bounded by max_model_len (up to about that of tokenizing ``max_model_len``
    tokens of the longest tokens), not by the text."""
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
        max_tokens = None  # a wrong type is SamplingParams.validate's to word
    room = max_model_len - max(max_tokens or 1, 1)
    per_token = _longest_token_chars(tokenizer)
    at = max(_FIRST_CUT_CHARS, max_model_len * _CHARS_PER_TOKEN_GUESS)
    end, ids = 0, []
    while True:
        rest = -(-(len(text) - end) // per_token)  # at least this many tokens after `end`
        if len(ids) + rest > room:
            raise ContextLengthError(
                f"{what} has at least {len(ids) + rest} tokens ({len(ids)} in its first {end} "
                f"of {len(text)} characters, at least 1 per {per_token} characters after); "
                f"max_model_len={max_model_len} leaves room for {room} prompt tokens with "
                f"max_tokens={max_tokens}")
        end = _cut(text, at, end) if at < len(text) else len(text)
        ids = tokenizer(text[:end], add_special_tokens=add_special_tokens)["input_ids"]
        if end == len(text):
            return ids
        at = 2 * end
