"""Tool-call parsers: a model's text -> OpenAI tool calls (vLLM's ``ToolParser``, its
``--tool-call-parser``).

The interface plugins implement is `ToolParser` (registered through the
``register_tool_parsers`` hook; the built-ins are ``hermes``, ``<tool_call>{json}</tool_call>``
as Qwen2/Qwen3/Hermes templates ask for, and ``llama3_json``, Llama 3.1's JSON calls; both in
plugins/tool_parsers/). The HTTP frontend picks one with ``tool_call_parser: NAME`` and runs it
on the text of requests whose ``tool_choice`` is ``auto``.

One method does both answers: ``parse(text, final=True)`` for a finished text, and
``parse(text, final=False)`` on each longer prefix of it while streaming. The streaming results
must be *prefix-stable*: each later result's content starts with an earlier one's, a call once
reported keeps its place and name, and its arguments only grow (text that may still turn into a
call, such as a trailing ``<tool_c``, is held back). The frontend sends the differences as
OpenAI's ``delta.content`` and ``delta.tool_calls`` fragments, so a stream reassembles to what
``final=True`` gives for well-formed calls. A call whose text turns out malformed stays content.

The helpers below find the extent of JSON values in text that may end mid-value, so that a
parser can report a call's arguments as raw text, the same characters streamed and final.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from .request import SamplingParams


@dataclass(frozen=True)
class ToolCall:
    """One call in model text. ``name``: the function's name (while streaming, a call is
    reported once its name is complete). ``arguments``: the JSON text of the arguments object,
    exactly as the model wrote it (while streaming, the part written so far; '' until it
    starts)."""

    name: str
    arguments: str


@dataclass(frozen=True)
class ToolCallParse:
    """What a parser found: ``content``, the text outside the calls (None when there are
    calls and nothing else but whitespace), and ``calls`` in order."""

    content: str | None
    calls: tuple[ToolCall, ...] = ()


class ToolParser(ABC):
    """Turns model text into tool calls; one instance per server, shared by its requests (keep
    no per-request state: ``parse`` gets the whole text each time).

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


# ---- helpers for parsers ----------------------------------------------------------------------

_WS = " \t\n\r"


def skip_ws(text: str, i: int) -> int:
    """The index of the first non-whitespace character of ``text`` from ``i`` (len at end)."""
    n = len(text)
    while i < n and text[i] in _WS:
        i += 1
    return i


def held_back(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that is a proper prefix of ``marker``: the
    characters that may still become the marker once more text comes."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


def json_value_end(text: str, i: int) -> int | None:
    """The index just past the JSON value that starts at ``text[i]`` (a string, an object or
    array by its brackets and quotes, else a number or literal up to the next delimiter), or
    None when ``text`` ends inside it. The value is not checked (json.loads does that)."""
    n = len(text)
    if i >= n:
        return None
    c = text[i]
    if c == '"':
        j = i + 1
        while j < n:
            if text[j] == "\\":
                j += 2
                continue
            if text[j] == '"':
                return j + 1
            j += 1
        return None
    if c in "{[":
        depth, j, in_str = 0, i, False
        while j < n:
            ch = text[j]
            if in_str:
                if ch == "\\":
                    j += 1
                elif ch == '"':
                    in_str = False
            elif ch == '"':
                in_str = True
            elif ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i
    while j < n and text[j] not in ",}] \t\n\r":
        j += 1
    return j if j < n else None  # a number at the end may go on


@dataclass
class ObjectScan:
    """A JSON object's top-level members as found by `scan_object`: ``fields`` key -> (value
    start, value end or None while incomplete); ``end`` just past its ``}`` (None while
    incomplete); ``ok`` False when it is not an object (or not one's prefix)."""

    fields: dict[str, tuple[int, int | None]] = field(default_factory=dict)
    end: int | None = None
    ok: bool = True


def scan_object(text: str, i: int) -> ObjectScan:
    """The members of the JSON object that starts at ``text[i]`` (``{``), which may be cut off
    anywhere by the end of ``text``."""
    out = ObjectScan()
    n = len(text)
    if i >= n or text[i] != "{":
        out.ok = False
        return out
    j = skip_ws(text, i + 1)
    if j < n and text[j] == "}":
        out.end = j + 1
        return out
    while j < n:
        if text[j] != '"':
            out.ok = False
            return out
        kend = json_value_end(text, j)
        if kend is None:
            return out
        try:
            key = json.loads(text[j:kend])
        except ValueError:
            out.ok = False
            return out
        j = skip_ws(text, kend)
        if j >= n:
            return out
        if text[j] != ":":
            out.ok = False
            return out
        j = skip_ws(text, j + 1)
        if j >= n:
            return out
        vend = json_value_end(text, j)
        out.fields[key] = (j, vend)
        if vend is None:
            return out
        j = skip_ws(text, vend)
        if j >= n:
            return out
        if text[j] == "}":
            out.end = j + 1
            return out
        if text[j] != ",":
            out.ok = False
            return out
        j = skip_ws(text, j + 1)
    return out


@dataclass
class CallScan:
    """`scan_call`'s result: ``call`` (None until its name is complete), ``end`` just past the
    object (None while incomplete), ``ok`` False for a malformed call."""

    call: ToolCall | None
    end: int | None
    ok: bool


def scan_call(text: str, i: int, arguments_keys: tuple[str, ...] = ("arguments",)) -> CallScan:
    """A ``{"name": str, "arguments": {...}}`` object at ``text[i]``, possibly cut off. The
    arguments are the first of ``arguments_keys`` present (e.g. Llama's ``parameters``), as
    raw text; a complete call without them has ``{}``. A complete call must have a string name
    and an object of arguments, else it is not ok."""
    scan = scan_object(text, i)
    if not scan.ok:
        return CallScan(None, None, False)
    name = None
    if "name" in scan.fields:
        s, e = scan.fields["name"]
        if e is not None:
            try:
                name = json.loads(text[s:e])
            except ValueError:
                return CallScan(None, None, False)
            if not isinstance(name, str):
                return CallScan(None, None, False)
    key = next((k for k in arguments_keys if k in scan.fields), None)
    arguments = ""
    if key is not None:
        s, e = scan.fields[key]
        if text[s] != "{":
            return CallScan(None, None, False)
        arguments = text[s:e] if e is not None else text[s:]
    if scan.end is None:
        return CallScan(ToolCall(name, arguments) if name is not None else None, None, True)
    if name is None:
        return CallScan(None, None, False)
    if key is None:
        arguments = "{}"
    try:
        ok = isinstance(json.loads(arguments), dict)
    except ValueError:
        ok = False
    return CallScan(ToolCall(name, arguments), scan.end, True) if ok else CallScan(
        None, None, False)


def content_of(parts: list[str], calls: list[ToolCall], final: bool) -> str | None:
    """The content of a parse from the text outside the calls: while streaming its end
    whitespace is held back; a final one with calls is None when it is only whitespace."""
    text = "".join(parts)
    if not final:
        return text.rstrip()
    if not calls:
        return text
    return text.rstrip() or None
