"""The ``llama3_json`` tool-call parser: Llama 3.1/3.2/3.3's JSON tool calls, an output that is
``{"name": ..., "parameters": {...}}`` (``arguments`` is taken too), optionally after
``<|python_tag|>``, several calls separated by ``;`` (Meta's llama-models prompt format for
JSON-based tool calling; vLLM's ``llama3_json`` parser).

An output that does not start (after whitespace) with ``{`` or ``<|python_tag|>`` is content,
whole. An object is a call when it has a string ``name`` that is one of the request's tools
(any name when the tools are not known: ``parse`` without a request) and ``parameters`` that
are an object (``{}`` when absent); so a JSON answer that happens to have a ``name`` key stays
content. Text after the last call that is not one is content too; an output whose first object
is not a call is content, whole, and so is an output without calls.

Streaming (core/tool_parser.py's rule): a call is sent when its object is complete; content
once it is certain (the whole output as it comes when it does not start like a call).
"""

from __future__ import annotations

from pagebatch.hookspecs import hookimpl
from pagebatch.tool_parser import (CALL, PENDING, CallScanner, DeltaOut, ReaderToolParser,
                                   ToolCallDelta, ToolCallReader, Tools, skip_ws, tool_names)

PYTHON_TAG = "<|python_tag|>"
KEYS = ("parameters", "arguments")

# reader phases: before the first object (or the tag), before an object, in one, after one,
# in content to the end
_START, _OBJECT, _JSON, _AFTER, _CONTENT = range(5)


class Llama3JsonToolParser(ReaderToolParser):
    def reader(self, tools: Tools | None = None) -> Llama3JsonReader:
        return Llama3JsonReader(tool_names(tools))


class Llama3JsonReader(ToolCallReader):
    """One stream of ``llama3_json`` text, read with a cursor ``pos`` (calls before it are
    sent) and an incremental scan of the object being written. ``names``: the request's tool
    names (None: any)."""

    def __init__(self, names: frozenset[str] | None) -> None:
        self.names = names
        self.out = DeltaOut()
        self.phase, self.pos = _START, 0
        self.scan: CallScanner | None = None

    def read(self, text: str, final: bool) -> ToolCallDelta:
        n = len(text)
        while True:
            if self.phase == _CONTENT:
                self.out.content(text[self.pos:])
                self.pos = n
                break
            if self.phase == _JSON:
                state = self.scan.advance(text)
                if state == PENDING and not final:
                    break
                name = self.scan.name
                if state != CALL or self.names is not None and name not in self.names:
                    self._content(self.scan.object.start)  # not a call
                    continue
                self.out.call(name, self.scan.arguments)
                self.pos, self.phase = self.scan.end, _AFTER
                continue
            s = self.pos = skip_ws(text, self.pos)
            if s >= n:
                if final and not self.out.calls:
                    self._content(0)
                    continue
                break
            if self.phase == _START:
                if not final and n - s < len(PYTHON_TAG) and PYTHON_TAG.startswith(text[s:]):
                    break  # the tag being written
                if text.startswith(PYTHON_TAG, s):
                    self.pos, self.phase = s + len(PYTHON_TAG), _OBJECT
                elif text[s] == "{":
                    self.phase = _OBJECT
                else:
                    self._content(0)
            elif self.phase == _OBJECT:
                self.scan, self.phase = CallScanner(s, KEYS), _JSON
            elif text[s] == ";":  # _AFTER
                self.pos, self.phase = s + 1, _OBJECT
            else:
                self._content(s)
        return self.out.take(final)

    def _content(self, start: int) -> None:
        """The rest of the text from ``start`` is content (from 0, the whole output, when
        there is no call before it)."""
        self.pos, self.phase = (start if self.out.calls else 0), _CONTENT


@hookimpl
def register_tool_parsers(register):
    register("llama3_json", Llama3JsonToolParser)
