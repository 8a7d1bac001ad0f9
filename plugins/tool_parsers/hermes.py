"""The ``hermes`` tool-call parser: calls written as ``<tool_call>{"name": ..., "arguments":
{...}}</tool_call>``, one block per call (NousResearch's Hermes 2 Pro format, which the chat
templates of Qwen2, Qwen2.5, Qwen3 and SmolLM2 ask for; vLLM's ``hermes`` parser).

The text outside the blocks is the content. A block whose JSON is not a call (no string
``name``, arguments that are not an object, broken JSON) stays content, up to its
``</tool_call>``. The last block may lack its ``</tool_call>`` when the model stopped right after
the JSON. Whitespace around the JSON is allowed.
"""

from __future__ import annotations

from pagebatch.hookspecs import hookimpl
from pagebatch.request import SamplingParams
from pagebatch.tool_parser import (ToolCall, ToolCallParse, ToolParser, content_of, held_back,
                                   scan_call, skip_ws)

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    def adjust_request(self, params: SamplingParams) -> None:
        """Where ``<tool_call>`` is a special token of the tokenizer, keep special tokens in the
        text (else the detokenizer drops the markers)."""
        special = getattr(self.tokenizer, "all_special_tokens", None) or ()
        if OPEN in special:
            params.skip_special_tokens = False

    def parse(self, text: str, final: bool = True) -> ToolCallParse:
        parts: list[str] = []
        calls: list[ToolCall] = []
        i, n = 0, len(text)
        while i <= n:
            j = text.find(OPEN, i)
            if j < 0:
                rest = text[i:]
                parts.append(rest if final else rest[:len(rest) - held_back(rest, OPEN)])
                break
            parts.append(text[i:j])
            k = skip_ws(text, j + len(OPEN))
            scan = scan_call(text, k)
            after = None if scan.end is None else skip_ws(text, scan.end)
            if scan.ok and after is not None and text.startswith(CLOSE, after):
                calls.append(scan.call)  # a whole block
                i = after + len(CLOSE)
                continue
            if scan.ok and after is not None and (after == n or (
                    not final and CLOSE.startswith(text[after:]))):
                calls.append(scan.call)  # the end of the text, or its </tool_call> coming
                break
            if scan.ok and scan.end is None and not final:
                if scan.call is not None:  # still being written
                    calls.append(scan.call)
                break
            close = text.find(CLOSE, j)  # not a call: content, up to its </tool_call>
            if close < 0:
                if final:
                    parts.append(text[j:])
                break  # streaming: held back until it closes (or the text ends)
            parts.append(text[j:close + len(CLOSE)])
            i = close + len(CLOSE)
        return ToolCallParse(content_of(parts, calls, final), tuple(calls))


@hookimpl
def register_tool_parsers(register):
    register("hermes", HermesToolParser)
