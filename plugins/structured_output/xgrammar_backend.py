"""The built-in structured output backend: xgrammar (Dong et al., "XGrammar: Flexible and
Efficient Structured Generation Engine for Large Language Models", 2024), as vLLM's default.

Constraints compile with xgrammar's `GrammarCompiler` (its own cache too) against a
`TokenizerInfo` of the model's Hugging Face tokenizer; each request gets a `GrammarMatcher`.
JSON is compiled with ``any_whitespace=False`` (vLLM's ``disable_any_whitespace``): compact
JSON, so a small model cannot loop on whitespace; strings with minLength / maxLength get a
JSON-correct character rule (xgrammar issue #800, xgrammar_strings.py). A choice list is the regex
of its alternatives, each escaped. xgrammar is imported on first use, so loading this plugin (every
start does) costs nothing where no request asks for structured output, and a machine without
xgrammar starts quietly.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pagebatch.errors import SamplingParamsError
from pagebatch.hookspecs import hookimpl
from pagebatch.structured_output import Constraint, StructuredOutputBackend

from .xgrammar_strings import fix_bounded_strings

if TYPE_CHECKING:
    import xgrammar as xgr


def _xgr():
    import xgrammar

    return xgrammar


def _choice_regex(spec: str) -> str:
    return "(" + "|".join(re.escape(s) for s in json.loads(spec)) + ")"


def _grammar(c: Constraint) -> xgr.Grammar:
    """The constraint as an uncompiled xgrammar Grammar (no tokenizer needed)."""
    if c.kind == "json":  # length-bounded strings fixed (xgrammar #800: xgrammar_strings.py)
        return fix_bounded_strings(_xgr().Grammar.from_json_schema(c.spec, any_whitespace=False))
    if c.kind == "json_object":
        return _xgr().Grammar.from_json_schema('{"type": "object"}', any_whitespace=False)
    if c.kind == "regex":
        return _xgr().Grammar.from_regex(c.spec)
    if c.kind == "choice":
        return _xgr().Grammar.from_regex(_choice_regex(c.spec))
    return _xgr().Grammar.from_ebnf(c.spec)


class _Matcher:
    """xgrammar's GrammarMatcher over the core's numpy bitmask rows (xgrammar writes the whole
    row). The torch view of the core's buffer, which is the same array every step, is kept."""

    def __init__(self, m: xgr.GrammarMatcher) -> None:
        self._m = m
        self._array: np.ndarray | None = None
        self._tensor: torch.Tensor | None = None

    def accept_token(self, token_id: int) -> bool:
        return self._m.accept_token(token_id)

    def fill_next_token_bitmask(self, bitmask: np.ndarray, index: int) -> None:
        if bitmask is not self._array:
            self._array, self._tensor = bitmask, torch.from_numpy(bitmask)
        self._m.fill_next_token_bitmask(self._tensor, index)

    def is_terminated(self) -> bool:
        return self._m.is_terminated()


class XGrammarBackend(StructuredOutputBackend):
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        self.stop_token_ids = list(stop_token_ids)
        info = _xgr().TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=self.stop_token_ids or None)
        self.compiler = _xgr().GrammarCompiler(info, max_threads=2)

    @classmethod
    def validate(cls, constraint: Constraint) -> None:
        try:
            _grammar(constraint)
        except Exception as e:  # xgrammar raises RuntimeError / ValueError / its own errors
            raise SamplingParamsError(f"{constraint.field} cannot be compiled: "
                                      f"{str(e).strip()[:500]}", constraint.field) from None

    def compile(self, constraint: Constraint) -> xgr.CompiledGrammar:
        try:
            return self.compiler.compile_grammar(_grammar(constraint))
        except Exception as e:
            raise SamplingParamsError(f"{constraint.field} cannot be compiled: "
                                      f"{str(e).strip()[:500]}", constraint.field) from None

    def matcher(self, compiled: xgr.CompiledGrammar) -> _Matcher:
        return _Matcher(_xgr().GrammarMatcher(compiled))


@hookimpl
def register_structured_output_backends(register):
    register("xgrammar", XGrammarBackend)
