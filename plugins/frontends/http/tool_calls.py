"""Tool calling in chat completions, the response side: a choice's text -> OpenAI's
``message.tool_calls``, or the ``delta.tool_calls`` fragments of a stream.

Which parser reads the text (`output_parser`): ``auto``, the server's ``tool_call_parser``
plugin; ``required``, `RequiredParser` (the JSON array the constraint forces, tools.py);
a named function, `NamedParser` (the text is the arguments); ``none``, no parser (the text is
content). Finish reason: ``tool_calls`` when calls were found and the model stopped by itself
(``auto``, ``required``), ``stop`` for a named function (OpenAI's and vLLM's rule),
``length`` stays ``length``.

A stream (`ToolCallStream`) parses the choice's text so far at each step and sends what is
new: content, then per call ``{"index", "id", "type": "function", "function": {"name",
"arguments": ""}}`` once its name is known, then ``{"index", "function": {"arguments": frag}}``
as its arguments grow (OpenAI's chunk shapes). The parsers are prefix-stable
(core/tool_parser.py), so the fragments of a call join to the arguments of the one-body
answer.
"""

from __future__ import annotations

import uuid
from typing import Any

from pagebatch.tool_parser import (ToolCall, ToolCallParse, ToolParser, content_of, scan_call,
                                   skip_ws)

from .tools import ToolRequest


class RequiredParser(ToolParser):
    """``[{"name": ..., "arguments": {...}}, ...]``, what ``tool_choice: required`` forces.
    Text cut short (``max_tokens``) gives the calls that were complete."""

    def __init__(self) -> None:
        super().__init__(None)

    def parse(self, text: str, final: bool = True) -> ToolCallParse:
        calls: list[ToolCall] = []
        s = skip_ws(text, 0)
        if s < len(text) and text[s] != "[":
            return ToolCallParse(content_of([text], [], final))
        s = skip_ws(text, s + 1)
        while s < len(text) and text[s] != "]":
            scan = scan_call(text, s)
            if not scan.ok or scan.end is None:
                if scan.ok and not final and scan.call is not None:
                    calls.append(scan.call)
                break
            calls.append(scan.call)
            s = skip_ws(text, scan.end)
            if s < len(text) and text[s] == ",":
                s = skip_ws(text, s + 1)
        return ToolCallParse(None if calls or final else "", tuple(calls))


class NamedParser(ToolParser):
    """A named ``tool_choice``: the whole text is the arguments of function ``name``."""

    def __init__(self, name: str) -> None:
        super().__init__(None)
        self.name = name

    def parse(self, text: str, final: bool = True) -> ToolCallParse:
        return ToolCallParse(None, (ToolCall(self.name, text),))


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


def _limited(req: ToolRequest, parsed: ToolCallParse) -> tuple[ToolCall, ...]:
    return parsed.calls if req.parallel else parsed.calls[:1]


def chat_message(text: str, reason: str | None, req: ToolRequest | None,
                 parser: ToolParser | None) -> tuple[dict[str, Any], str | None]:
    """A non-streaming choice's ``message`` and finish reason. With calls: ``content`` is
    the text outside them (or null), ``tool_calls`` the calls (``parallel_tool_calls: false``
    keeps the first)."""
    if parser is None or req is None:
        return {"role": "assistant", "content": text}, reason
    parsed = parser.parse(text, final=True)
    calls = _limited(req, parsed)
    if not calls:
        return {"role": "assistant", "content": text}, reason
    tool_calls = [{"id": call_id(), "type": "function",
                   "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
    return ({"role": "assistant", "content": parsed.content, "tool_calls": tool_calls},
            finish_reason(req, reason, True))


class ToolCallStream:
    """What one streamed choice has sent; `delta` gives the next chunk's delta."""

    def __init__(self, req: ToolRequest, parser: ToolParser) -> None:
        self.req, self.parser = req, parser
        self.content = ""  # content sent
        self.calls: list[tuple[str, int]] = []  # per call sent: its id, arguments sent

    @property
    def called(self) -> bool:
        return bool(self.calls)

    def delta(self, text: str, final: bool) -> dict[str, Any]:
        """The delta for the choice's text so far (``final``: all of it): new content and
        ``tool_calls`` fragments, {} when nothing is new."""
        parsed = self.parser.parse(text, final=final)
        out: dict[str, Any] = {}
        content = parsed.content or ""
        if len(content) > len(self.content) and content.startswith(self.content):
            out["content"] = content[len(self.content):]
            self.content = content
        fragments = []
        for i, call in enumerate(_limited(self.req, parsed)):
            entry: dict[str, Any] | None = None
            if i == len(self.calls):
                cid = call_id()
                entry = {"index": i, "id": cid, "type": "function",
                         "function": {"name": call.name, "arguments": ""}}
                self.calls.append((cid, 0))
            cid, sent = self.calls[i]
            if len(call.arguments) > sent:
                if entry is None:
                    entry = {"index": i, "function": {}}
                entry["function"]["arguments"] = call.arguments[sent:]
                self.calls[i] = (cid, len(call.arguments))
            if entry is not None:
                fragments.append(entry)
        if fragments:
            out["tool_calls"] = fragments
        return out
