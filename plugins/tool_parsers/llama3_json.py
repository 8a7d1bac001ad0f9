"""The ``llama3_json`` tool-call parser: Llama 3.1/3.2/3.3's JSON tool calls, an output that is
``{"name": ..., "parameters": {...}}`` (``arguments`` is taken too), optionally after
``<|python_tag|>``, several calls separated by ``;`` (Meta's llama-models prompt format for
JSON-based tool calling; vLLM's ``llama3_json`` parser).

An output that does not start (after whitespace) with ``{`` or ``<|python_tag|>`` is content,
whole. Text after the last call that is not one is content too; an output whose first object
is not a call is content, whole.
"""

from __future__ import annotations

from pagebatch.hookspecs import hookimpl
from pagebatch.tool_parser import (ToolCall, ToolCallParse, ToolParser, content_of, scan_call,
                                   skip_ws)

PYTHON_TAG = "<|python_tag|>"
KEYS = ("parameters", "arguments")


class Llama3JsonToolParser(ToolParser):
    def parse(self, text: str, final: bool = True) -> ToolCallParse:
        n = len(text)
        s = skip_ws(text, 0)
        if not final and PYTHON_TAG.startswith(text[s:]):
            return ToolCallParse("")  # nothing yet, or the tag being written
        if text.startswith(PYTHON_TAG, s):
            s = skip_ws(text, s + len(PYTHON_TAG))
        elif not text.startswith("{", s):
            return ToolCallParse(content_of([text], [], final))
        calls: list[ToolCall] = []
        while True:
            if s >= n:
                return ToolCallParse(content_of([], calls, final), tuple(calls))
            scan = scan_call(text, s, KEYS)
            if scan.ok and scan.end is None and not final:
                if scan.call is not None:
                    calls.append(scan.call)
                return ToolCallParse(content_of([], calls, final), tuple(calls))
            if not scan.ok or scan.end is None:
                rest = text if not calls else text[s:]  # no call at all: the whole output
                return ToolCallParse(content_of([rest], calls, final), tuple(calls))
            calls.append(scan.call)
            m = skip_ws(text, scan.end)
            if m < n and text[m] == ";":
                s = skip_ws(text, m + 1)
                continue
            return ToolCallParse(content_of([text[m:]], calls, final), tuple(calls))


@hookimpl
def register_tool_parsers(register):
    register("llama3_json", Llama3JsonToolParser)
