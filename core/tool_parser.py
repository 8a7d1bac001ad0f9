"""Tool-call parsers: a model's text -> OpenAI tool calls (vLLM's ``ToolParser``, its
``--tool-call-parser``).

The interface plugins implement is `ToolParser` (registered through the
``register_tool_parsers`` hook; the built-ins are ``hermes``, ``<tool_call>{json}</tool_call>``
as Qwen2/Qwen3/Hermes templates ask for, and ``llama3_json``, Llama 3.1's JSON calls; both in
plugins/tool_parsers/). The HTTP frontend picks one with ``tool_call_parser: NAME`` and runs it
on the text of requests whose ``tool_choice`` is ``auto``.

Two ways in. ``parse(text, final=True)`` reads a whole text; ``parse(text, final=False)`` a
prefix of it. ``reader(tools)`` gives a `ToolCallReader` for one choice of one request, which
is read again at each step of a stream (``read(text, final)``, the text so far) and returns what
is new (`ToolCallDelta`); the server reads every answer through one, streamed or not (the
non-streamed answer is one final read of the whole text), with the request's ``tools``. The
default reader calls ``parse`` on the whole text at each read, so a parser that implements
only ``parse`` works, at a cost per step that grows with the text; the built-ins keep a cursor
(`ReaderToolParser`) and do work in proportion to the new text.

**The streaming rule: nothing is sent that the final answer could take back.** A stream must
reassemble to what one final read of the same text gives, whatever the points where it was cut
into steps, and whether the text ends well or is cut short (``max_tokens``). So a read with
``final=False`` reports only what no later text can change:

- content as soon as it is certain to be content (not a marker being written, such as a trailing
  ``<tool_c``, and not trailing whitespace, which is dropped at the end of an answer with calls);
- a call once it is certain to be one, with all of its arguments: for ``hermes`` when its
  ``</tool_call>`` has come (or, at the end of the text, once it is final); for ``llama3_json``
  when its JSON object is complete (and names one of the tools). A call's arguments may stream
  in fragments only where the call is certain before they end (a named ``tool_choice``: the whole
  text is its arguments).

Text that turns out not to be a call (malformed JSON, text after the JSON inside a block, a
block cut off by the end of the text) is content, sent once that is certain. So while a call is
being written nothing of it is sent; it comes in one delta when it is whole. ``parse(text,
final=False)`` follows the same rule (a prefix's result is what a stream has sent so far).

The JSON helpers (core/json_scan.py, re-exported here) find the extent of JSON values in text
that may end mid-value, so that a parser reports a call's arguments as raw text, the same
characters streamed and final.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .json_scan import (CALL, NOT_A_CALL, PENDING, CallScanner, ObjectScan, ObjectScanner,
                        ValueScanner, call_parts, json_value_end, scan_object, skip_ws)
from .request import SamplingParams

__all__ = [  # the interface, and core/json_scan.py's scanners re-exported for parsers
    "CALL", "NOT_A_CALL", "PENDING", "CallDelta", "CallScan", "CallScanner", "DeltaOut",
    "ObjectScan", "ObjectScanner", "ReaderToolParser", "ReparseReader", "ToolCall",
    "ToolCallDelta", "ToolCallParse", "ToolCallReader", "ToolParser", "Tools", "ValueScanner",
    "call_parts", "collect", "content_of", "held_back", "json_value_end", "scan_call",
    "scan_object", "skip_ws", "tool_names",
]

Tools = Sequence[Mapping[str, Any]]  # a request's ``tools``: OpenAI function tool objects


@dataclass(frozen=True)
class ToolCall:
    """One call in model text. ``name``: the function's name. ``arguments``: the JSON text of
    the arguments object, exactly as the model wrote it (while streaming, the part certain so
    far; '' until it starts)."""

    name: str
    arguments: str


@dataclass(frozen=True)
class ToolCallParse:
    """What a parser found: ``content``, the text outside the calls (None when there are
    calls and nothing else but whitespace), and ``calls`` in order."""

    content: str | None
    calls: tuple[ToolCall, ...] = ()


@dataclass(frozen=True)
class CallDelta:
    """New text of call ``index`` (0, 1, ... in order): ``name`` on its first delta (None
    after), ``arguments`` the fragment of its arguments that follows what was sent."""

    index: int
    name: str | None
    arguments: str


@dataclass(frozen=True)
class ToolCallDelta:
    """What one read adds: ``content`` to append, and ``calls``' deltas in order."""

    content: str = ""
    calls: tuple[CallDelta, ...] = ()


class ToolCallReader(ABC):
    """One choice's text, read as it grows (state for one stream: make a new one per choice).

    ``read(text, final)`` is called with the text so far, each time a text that starts with the
    previous one, the last time with ``final`` (the whole output); it returns what is new since
    the previous read, under the module docstring's streaming rule. Never raises for malformed
    text: it is content."""

    @abstractmethod
    def read(self, text: str, final: bool) -> ToolCallDelta:
        """See the class docstring."""


class ToolParser(ABC):
    """Turns model text into tool calls; one instance per server, shared by its requests (keep
    no per-request state: ``parse`` gets the whole text each time, a reader holds one choice's).

    ``__init__(tokenizer)``: the model's Hugging Face tokenizer (None for dummy weights), for
    parsers whose markers are special tokens.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def adjust_request(self, params: SamplingParams) -> None:
        """Change a request's sampling params before it is queued (e.g. keep special tokens
        that mark calls in the text: ``params.skip_special_tokens = False``). Default: none."""

    @abstractmethod
    def parse(self, text: str, final: bool = True) -> ToolCallParse:
        """The calls and content of ``text``, the model's output (all of it when ``final``,
        else a prefix, see the module docstring). Raises nothing for malformed text: it is
        content."""

    def reader(self, tools: Tools | None = None) -> ToolCallReader:
        """A reader of one choice's text, for a request with ``tools`` (None: not known; a
        parser may then take any name). Default: `ReparseReader`, ``parse`` on the whole text
        at each read, its results' differences sent."""
        return ReparseReader(self)


class ReparseReader(ToolCallReader):
    """The reader of a parser that implements only ``parse``: each read parses the whole text
    and returns what is new against the previous result (which must be prefix-stable: content
    that extends, calls that keep their place and name and whose arguments only grow)."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.content = ""  # content sent
        self.sent: list[int] = []  # per call sent: the length of its arguments sent

    def read(self, text: str, final: bool) -> ToolCallDelta:
        parsed = self.parser.parse(text, final=final)
        content, new = parsed.content or "", ""
        if len(content) > len(self.content) and content.startswith(self.content):
            new, self.content = content[len(self.content):], content
        calls = []
        for i, call in enumerate(parsed.calls):
            if i == len(self.sent):
                calls.append(CallDelta(i, call.name, call.arguments))
                self.sent.append(len(call.arguments))
            elif len(call.arguments) > self.sent[i]:
                calls.append(CallDelta(i, None, call.arguments[self.sent[i]:]))
                self.sent[i] = len(call.arguments)
        return ToolCallDelta(new, tuple(calls))


def collect(delta: ToolCallDelta, final: bool = True) -> ToolCallParse:
    """The `ToolCallParse` of a reader's first (so far only) read: its content (None for a
    final answer with calls and no other text) and its calls, fragments joined."""
    names: list[str] = []
    arguments: list[list[str]] = []
    for c in delta.calls:
        if c.index == len(names):
            names.append(c.name or "")
            arguments.append([])
        arguments[c.index].append(c.arguments)
    calls = tuple(ToolCall(n, "".join(a)) for n, a in zip(names, arguments))
    return ToolCallParse((delta.content or None) if final and calls else delta.content, calls)


class ReaderToolParser(ToolParser):
    """A parser whose work is its reader: ``parse`` is one read of a new reader (no tools
    known), so the streamed and the one-body answers are the same code."""

    def parse(self, text: str, final: bool = True) -> ToolCallParse:
        return collect(self.reader(None).read(text, final), final)

    @abstractmethod
    def reader(self, tools: Tools | None = None) -> ToolCallReader:
        """See `ToolParser.reader`."""


# ---- helpers for parsers ----------------------------------------------------------------------

def tool_names(tools: Tools | None) -> frozenset[str] | None:
    """The function names of a request's ``tools`` (None for None)."""
    if tools is None:
        return None
    return frozenset(t["function"]["name"] for t in tools if isinstance(t.get("function"), dict))


def held_back(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that is a proper prefix of ``marker``: the
    characters that may still become the marker once more text comes."""
    tail = text[-(len(marker) - 1):] if len(marker) > 1 else ""
    for k in range(len(tail), 0, -1):
        if marker.startswith(tail[-k:]):
            return k
    return 0


class DeltaOut:
    """What a reader has decided, collected into its next `ToolCallDelta`: ``content(s)``
    appends text that is certainly content, ``call(name, arguments)`` a whole call; ``take``
    gives the delta and starts the next. Content's trailing whitespace is held back (it may end
    the answer, where an answer with calls drops it, as `content_of`); ``take(final=True)``
    sends it when there were no calls."""

    def __init__(self) -> None:
        self.calls = 0  # calls so far
        self._text: list[str] = []
        self._ws: list[str] = []  # whitespace held back
        self._deltas: list[CallDelta] = []

    def content(self, s: str) -> None:
        body = s.rstrip()
        if body:
            self._text += self._ws
            self._text.append(body)
            self._ws = []
        if len(body) < len(s):
            self._ws.append(s[len(body):])

    def call(self, name: str, arguments: str) -> None:
        self._deltas.append(CallDelta(self.calls, name, arguments))
        self.calls += 1

    def take(self, final: bool) -> ToolCallDelta:
        if final and not self.calls:
            self._text += self._ws
            self._ws = []
        out = ToolCallDelta("".join(self._text), tuple(self._deltas))
        self._text, self._deltas = [], []
        return out


@dataclass
class CallScan:
    """`scan_call`'s result: ``call`` (None until its name is complete), ``end`` just past the
    object (None while incomplete), ``ok`` False for a malformed call."""

    call: ToolCall | None
    end: int | None
    ok: bool


def scan_call(text: str, i: int, arguments_keys: tuple[str, ...] = ("arguments",)) -> CallScan:
    """A ``{"name": str, "arguments": {...}}`` object at ``text[i]``, possibly cut off (one
    shot; `CallScanner` is the incremental form). The arguments are the first of
    ``arguments_keys`` present (e.g. Llama's ``parameters``), as raw text; a complete call
    without them has ``{}``. A complete call must have a string name and an object of
    arguments, else it is not ok. An incomplete one has the name and arguments so far."""
    scan = ObjectScanner(i).advance(text)
    if not scan.ok or i >= len(text):
        return CallScan(None, None, False)
    if scan.end is not None:
        parts = call_parts(text, scan.fields, arguments_keys)
        if parts is None:
            return CallScan(None, None, False)
        return CallScan(ToolCall(*parts), scan.end, True)
    name = None
    if "name" in scan.fields and scan.fields["name"][1] is not None:
        parts = call_parts(text, {"name": scan.fields["name"]}, ())
        if parts is None:
            return CallScan(None, None, False)
        name = parts[0]
    key = next((k for k in arguments_keys if k in scan.fields), None)
    arguments = ""
    if key is not None:
        s, e = scan.fields[key]
        if text[s] != "{":
            return CallScan(None, None, False)
        arguments = text[s:e] if e is not None else text[s:]
    return CallScan(ToolCall(name, arguments) if name is not None else None, None, True)


def content_of(parts: list[str], calls: list[ToolCall], final: bool) -> str | None:
    """The content of a parse from the text outside the calls: while streaming its end
    whitespace is held back; a final one with calls is None when it is only whitespace."""
    text = "".join(parts)
    if not final:
        return text.rstrip()
    if not calls:
        return text
    return text.rstrip() or None
