"""The ``hermes`` tool-call parser: calls written as ``<tool_call>{"name": ..., "arguments":
{...}}</tool_call>``, one block per call (NousResearch's Hermes 2 Pro format, which the chat
templates of Qwen2, Qwen2.5, Qwen3 and SmolLM2 ask for; vLLM's ``hermes`` parser).

The text outside the blocks is the content. A block whose JSON is not a call (no string
``name``, arguments that are not an object, broken JSON, text after the JSON) stays content, up
to its ``</tool_call>``. The last block may lack its ``</tool_call>`` when the model stopped
right after the JSON. Whitespace around the JSON is allowed.

Streaming (core/tool_parser.py's rule): a block is sent as a call once its ``</tool_call>``
follows the JSON, or when the text is final and ends after the JSON; until then nothing of the
block is sent, since text after the JSON or a cut-off turns it into content. Content before a
block is sent as it comes (a trailing ``<tool_c`` held back until it is clear).

`HermesReader` reads a stream with a cursor: the text before the block being read is settled,
and the block's JSON is scanned incrementally (core/json_scan.py), so a read costs the new text.
"""

from __future__ import annotations

from pagebatch.hookspecs import hookimpl
from pagebatch.request import SamplingParams
from pagebatch.tool_parser import (CALL, PENDING, CallScanner, DeltaOut,
                                   ReaderToolParser, ToolCallDelta, ToolCallReader, Tools,
                                   held_back, skip_ws)

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesToolParser(ReaderToolParser):
    def adjust_request(self, params: SamplingParams) -> None:
        """Where ``<tool_call>`` is a special token of the tokenizer, keep special tokens in the
        text (else the detokenizer drops the markers)."""
        special = getattr(self.tokenizer, "all_special_tokens", None) or ()
        if OPEN in special:
            params.skip_special_tokens = False

    def reader(self, tools: Tools | None = None) -> HermesReader:
        return HermesReader()


class HermesReader(ToolCallReader):
    """One stream of ``hermes`` text. ``pos``: where the unsettled text starts (content up to
    there is sent or held as trailing whitespace); ``block``: the start of the ``<tool_call>``
    being read, else None. In a block: ``at`` where the next scan resumes (the whitespace
    before or after the JSON, or the search for ``</tool_call>`` once it is not a call)."""

    def __init__(self) -> None:
        self.out = DeltaOut()
        self.pos = 0
        self.block: int | None = None
        self.at = 0
        self.scan: CallScanner | None = None
        self.bad = False  # the block is not a call: content up to its </tool_call>

    def read(self, text: str, final: bool) -> ToolCallDelta:
        n = len(text)
        while self.pos < n or (final and self.block is not None):
            if self.block is None:
                j = text.find(OPEN, self.pos)
                if j < 0:
                    end = n if final else n - held_back(text, OPEN)
                    self.out.content(text[self.pos:max(end, self.pos)])
                    self.pos = max(end, self.pos)
                    break
                self.out.content(text[self.pos:j])
                self.pos = self.block = j
                self.at, self.scan, self.bad = j + len(OPEN), None, False
            elif not self._block(text, n, final):
                break
        return self.out.take(final)

    def _block(self, text: str, n: int, final: bool) -> bool:
        """Reads on in the block: True when it is settled (a call sent, or content), False
        while it waits for more text."""
        if not self.bad and self.scan is None:
            self.at = skip_ws(text, self.at)
            if self.at >= n and not final:
                return False
            self.scan = CallScanner(self.at)
        if not self.bad:
            state = self.scan.advance(text)
            if state == PENDING and not final:
                return False
            if state == CALL:
                after = self.at = skip_ws(text, max(self.at, self.scan.end))
                if after >= n and not final:
                    return False
                if after >= n or text.startswith(CLOSE, after):
                    self.out.call(self.scan.name, self.scan.arguments)
                    return self._settle(min(n, after + len(CLOSE)))
                if not final and n - after < len(CLOSE) and CLOSE.startswith(text[after:]):
                    return False  # its </tool_call> being written
            self.bad, self.at = True, self.block  # not a call, or cut off by the end
        close = text.find(CLOSE, self.at)
        if close < 0:
            if final:
                self.out.content(text[self.block:])
                return self._settle(n)
            self.at = max(self.block, n - len(CLOSE) + 1)
            return False  # held back until it closes (or the text ends)
        self.out.content(text[self.block:close + len(CLOSE)])
        return self._settle(close + len(CLOSE))

    def _settle(self, pos: int) -> bool:
        self.pos, self.block = pos, None
        return True


@hookimpl
def register_tool_parsers(register):
    register("hermes", HermesToolParser)
