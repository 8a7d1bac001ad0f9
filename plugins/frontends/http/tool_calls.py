"""Tool calling in chat completions, the response side: a choice's text -> OpenAI's
``message.tool_calls``, or the ``delta.tool_calls`` fragments of a stream.

Which parser reads the text (`output_parser`): ``auto``, the server's ``tool_call_parser``
plugin; ``required``, `RequiredParser` (the JSON array the constraint forces, tools.py);
a named function, `NamedParser` (the text is the arguments); ``none``, no parser (the text is
content). Finish reason: ``tool_calls`` when calls were found and the model stopped by itself
(``auto``, ``required``), ``stop`` for a named function (OpenAI's and vLLM's rule),
``length`` stays ``length``.

Every answer is read through the parser's reader (core/tool_parser.py) with the request's
tools: a one-body answer by one final read of the whole text, a stream (`ToolCallStream`) by a
read at each step, sending what is new: content, then per call ``{"index", "id", "type":
"function", "function": {"name", "arguments"}}`` once it is certain to be a call (with the
arguments known so far), then ``{"index", "function": {"arguments": frag}}`` as they grow
(OpenAI's chunk shapes). The readers send nothing that a later text could take back, so a
stream reassembles to the one-body answer of the same text: the same calls, content and finish
reason, wherever the steps cut it.
"""

from __future__ import annotations

import uuid
from typing import Any

from pagebatch.tool_parser import (CALL, PENDING, CallDelta, CallScanner, DeltaOut,
                                   ReaderToolParser, ToolCallDelta, ToolCallParse,
                                   ToolCallReader, ToolParser, Tools, collect, skip_ws)

from .tools import ToolRequest


class RequiredParser(ReaderToolParser):
    """``[{"name": ..., "arguments": {...}}, ...]``, what ``tool_choice: required`` forces.
    Text cut short (``max_tokens``) gives the calls that were complete; a call is sent when its
    object is complete. No calls (a text that is not such an array): the text is content."""

    def __init__(self) -> None:
        super().__init__(None)

    def reader(self, tools: Tools | None = None) -> RequiredReader:
        return RequiredReader()


# RequiredReader phases: before '[', before an item, in one, after one, done, not an array
_START, _ITEM, _JSON, _AFTER, _DONE, _CONTENT = range(6)


class RequiredReader(ToolCallReader):
    """One stream of ``required`` text: a cursor over the array, the item being written scanned
    incrementally; content only when the text is no array, or at the end without calls."""

    def __init__(self) -> None:
        self.out = DeltaOut()
        self.phase, self.pos = _START, 0
        self.scan: CallScanner | None = None

    def read(self, text: str, final: bool) -> ToolCallDelta:
        n = len(text)
        while self.phase != _DONE:
            if self.phase == _CONTENT:
                self.out.content(text[self.pos:])
                self.pos = n
                break
            if self.phase == _JSON:
                state = self.scan.advance(text)
                if state == PENDING and not final:
                    break
                if state != CALL:
                    self.phase = _DONE
                    break
                self.out.call(self.scan.name, self.scan.arguments)
                self.pos, self.phase = self.scan.end, _AFTER
                continue
            s = self.pos = skip_ws(text, self.pos)
            if s >= n:
                if final:
                    self.phase = _DONE
                break
            c = text[s]
            if self.phase == _START:
                self.pos, self.phase = (s + 1, _ITEM) if c == "[" else (0, _CONTENT)
            elif self.phase == _AFTER:
                self.pos, self.phase = s + (c == ","), _ITEM
            elif c == "]":
                self.phase = _DONE
            else:
                self.scan, self.phase = CallScanner(s), _JSON
        if final and self.phase == _DONE and not self.out.calls:
            self.out.content(text)  # held back until now: no calls after all
        return self.out.take(final)


class NamedParser(ReaderToolParser):
    """A named ``tool_choice``: the whole text is the arguments of function ``name``, sent as
    it comes (certain from the start)."""

    def __init__(self, name: str) -> None:
        super().__init__(None)
        self.name = name

    def reader(self, tools: Tools | None = None) -> NamedReader:
        return NamedReader(self.name)


class NamedReader(ToolCallReader):
    """One stream of a named choice: the call at the first read, then each read's new text."""

    def __init__(self, name: str) -> None:
        self.name, self.sent = name, -1  # -1: the call not announced yet

    def read(self, text: str, final: bool) -> ToolCallDelta:
        if self.sent < 0:
            self.sent = len(text)
            return ToolCallDelta("", (CallDelta(0, self.name, text),))
        new, self.sent = text[self.sent:], len(text)
        return ToolCallDelta("", (CallDelta(0, None, new),) if new else ())


def output_parser(req: ToolRequest | None, auto: ToolParser | None) -> ToolParser | None:
    """The parser of a request's output text (``auto``: the server's), or None: content."""
    if req is None or req.choice == "none":
        return None
    if req.choice == "required":
        return RequiredParser()
    if req.choice == "function":
        return NamedParser(req.name or "")
    return auto


def call_id() -> str:
    """A tool call id, as OpenAI's: ``call_`` and 24 hex digits."""
    return "call_" + uuid.uuid4().hex[:24]


def finish_reason(req: ToolRequest | None, reason: str | None, called: bool) -> str | None:
    if called and reason == "stop" and req is not None and req.choice != "function":
        return "tool_calls"
    return reason


def read_all(text: str, req: ToolRequest, parser: ToolParser) -> ToolCallParse:
    """The one-body parse of a choice's ``text``: one final read of a new reader."""
    return collect(parser.reader(req.tools).read(text, True))


def chat_message(text: str, reason: str | None, req: ToolRequest | None,
                 parser: ToolParser | None) -> tuple[dict[str, Any], str | None]:
    """A non-streaming choice's ``message`` and finish reason. With calls: ``content`` is
    the text outside them (or null), ``tool_calls`` the calls (``parallel_tool_calls: false``
    keeps the first)."""
    if parser is None or req is None:
        return {"role": "assistant", "content": text}, reason
    parsed = read_all(text, req, parser)
    calls = parsed.calls if req.parallel else parsed.calls[:1]
    if not calls:
        return {"role": "assistant", "content": parsed.content}, reason
    tool_calls = [{"id": call_id(), "type": "function",
                   "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
    return ({"role": "assistant", "content": parsed.content, "tool_calls": tool_calls},
            finish_reason(req, reason, True))


class ToolCallStream:
    """What one streamed choice has sent; `delta` gives the next chunk's delta. Work per
    chunk: the reader's (the new text, for the built-in parsers) and the new calls."""

    def __init__(self, req: ToolRequest, parser: ToolParser) -> None:
        self.req = req
        self.reader = parser.reader(req.tools)
        self.ids: list[str] = []  # per call sent, its id

    @property
    def called(self) -> bool:
        return bool(self.ids)

    def delta(self, text: str, final: bool) -> dict[str, Any]:
        """The delta for the choice's text so far (``final``: all of it): new content and
        ``tool_calls`` fragments, {} when nothing is new."""
        new = self.reader.read(text, final)
        out: dict[str, Any] = {"content": new.content} if new.content else {}
        fragments = []
        for c in new.calls:
            if c.index > 0 and not self.req.parallel:
                continue  # parallel_tool_calls false: the first call only
            if c.index == len(self.ids):
                self.ids.append(call_id())
                fragments.append({"index": c.index, "id": self.ids[-1], "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}})
            elif c.arguments:
                fragments.append({"index": c.index, "function": {"arguments": c.arguments}})
        if fragments:
            out["tool_calls"] = fragments
        return out
