"""Where JSON values end in a text that grows: the scanners a tool-call reader keeps for one
stream (core/tool_parser.py), so that each read looks only at the characters that came since the
last one. A model's output arrives a few characters at a time; scanning it all again at each
step costs the square of its length.

`ValueScanner` finds the end of one JSON value, `ObjectScanner` the top-level members of an
object, `CallScanner` a ``{"name": ..., "arguments": {...}}`` call. Their ``advance(text)`` takes
the whole text so far, which must start with the text of the previous call (each scanner is for
one stream); the work of a call is proportional to the characters added since the previous one.
The extents come from brackets and quotes; values are not checked (``json.loads`` does that, once,
on a complete call). `json_value_end` and `scan_object` are the one-shot forms.

This module imports nothing of the project: tool_parser.py builds on it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

_WS = " \t\n\r"
_SCALAR_END = ",}] \t\n\r"


def skip_ws(text: str, i: int) -> int:
    """The index of the first non-whitespace character of ``text`` from ``i`` (len at end)."""
    n = len(text)
    while i < n and text[i] in _WS:
        i += 1
    return i


class ValueScanner:
    """The end of the JSON value that starts at ``text[start]``: a string, an object or array by
    its brackets and quotes, else a number or literal up to the next delimiter. ``advance(text)``
    returns the index just past it, or None while the text ends inside it (a number at the end
    may go on). State between calls: position, nesting depth, inside a string, after a
    backslash, and the next quote already found."""

    __slots__ = ("pos", "kind", "depth", "in_str", "esc", "quote", "quote_from", "end")

    def __init__(self, start: int) -> None:
        self.pos = start
        self.kind = ""  # '"' a string, '{' an object or array, 's' a scalar; '' until seen
        self.depth = 0
        self.in_str = False
        self.esc = False  # the next character is escaped
        self.quote = -1  # a '"' found ahead inside the current string (-1: none)
        self.quote_from = 0  # where the search for it goes on
        self.end: int | None = None

    def advance(self, text: str) -> int | None:
        if self.end is not None:
            return self.end
        n, j = len(text), self.pos
        if j >= n:
            return None
        if not self.kind:
            c = text[j]
            if c == '"':
                self.kind, self.in_str, j = '"', True, j + 1
            elif c in "{[":
                self.kind, self.depth, j = "{", 1, j + 1
            else:
                self.kind = "s"
        if self.kind == "s":
            while j < n and text[j] not in _SCALAR_END:
                j += 1
            self.pos = j
            if j < n:
                self.end = j
            return self.end
        while j < n:
            if self.in_str:
                j = self._string(text, j, n)
                if self.in_str:
                    break
                if self.kind == '"':
                    self.end = j
                    break
                continue
            c = text[j]
            j += 1
            if c == '"':
                self.in_str = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.end = j
                    break
        self.pos = j
        return self.end

    def _string(self, text: str, j: int, n: int) -> int:
        """Moves through a string from ``j``: returns the index past its closing quote (and
        clears ``in_str``), else ``n``. Each character is searched at most once for a quote and
        once for a backslash (str.find), whatever the escapes."""
        if self.esc:
            if j >= n:
                return j
            j += 1
            self.esc = False
        while True:
            if self.quote < j:
                q = text.find('"', max(j, self.quote_from))
                self.quote, self.quote_from = q, (q + 1 if q >= 0 else n)
            b = text.find("\\", j, self.quote if self.quote >= 0 else n)
            if b >= 0:
                if b + 1 >= n:
                    self.esc = True
                    return n
                j = b + 2
                continue
            if self.quote >= 0:
                self.in_str = False
                return self.quote + 1
            return n


def json_value_end(text: str, i: int) -> int | None:
    """The index just past the JSON value that starts at ``text[i]`` (see `ValueScanner`), or
    None when ``text`` ends inside it."""
    return ValueScanner(i).advance(text)


# ObjectScanner states: after '{', in a key, before ':', before a value, in a value, after a
# value, after ','
_FIRST, _KEY, _COLON, _VALUE_AT, _VALUE, _AFTER, _NEXT = range(7)


class ObjectScanner:
    """The top-level members of the JSON object that starts at ``text[start]`` (``{``), as the
    text grows. After ``advance(text)``: ``fields`` key -> (value start, value end or None while
    incomplete), ``end`` just past the ``}`` (None while incomplete), ``ok`` False once the text
    cannot be an object (a later text cannot make it one)."""

    def __init__(self, start: int) -> None:
        self.start = self.pos = start
        self.state = -1  # before the '{'
        self.fields: dict[str, tuple[int, int | None]] = {}
        self.end: int | None = None
        self.ok = True
        self._key = ""
        self._at = 0  # where the key or value being scanned starts
        self._sub: ValueScanner | None = None

    def advance(self, text: str) -> ObjectScanner:
        n = len(text)
        if self.state < 0:
            if self.start >= n:
                return self
            if text[self.start] != "{":
                self.ok = False
                return self
            self.pos, self.state = self.start + 1, _FIRST
        while self.ok and self.end is None:
            if self.state in (_KEY, _VALUE):
                e = self._sub.advance(text)
                if e is None:
                    if self.state == _VALUE:
                        self.fields[self._key] = (self._at, None)
                    break
                if self.state == _KEY:
                    try:
                        self._key = json.loads(text[self._at:e])
                    except ValueError:
                        self.ok = False
                        break
                    self.state = _COLON
                else:
                    self.fields[self._key] = (self._at, e)
                    self.state = _AFTER
                self.pos = e
                continue
            j = self.pos = skip_ws(text, self.pos)
            if j >= n:
                break
            c = text[j]
            if self.state == _VALUE_AT:
                self._at, self._sub, self.state = j, ValueScanner(j), _VALUE
            elif self.state in (_FIRST, _NEXT) and c == '"':
                self._at, self._sub, self.state = j, ValueScanner(j), _KEY
            elif self.state in (_FIRST, _AFTER) and c == "}":
                self.end = j + 1
            elif self.state == _COLON and c == ":":
                self.pos, self.state = j + 1, _VALUE_AT
            elif self.state == _AFTER and c == ",":
                self.pos, self.state = j + 1, _NEXT
            else:
                self.ok = False
        return self


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
    anywhere by the end of ``text`` (not ok when ``i`` is at the end: no object there)."""
    s = ObjectScanner(i).advance(text)
    return ObjectScan(s.fields, s.end, s.ok and i < len(text))


def call_parts(text: str, fields: dict[str, tuple[int, int | None]],
               arguments_keys: tuple[str, ...]) -> tuple[str, str] | None:
    """(name, arguments text) of a complete object's ``fields`` when it is a call: a string
    ``name`` and, under the first of ``arguments_keys`` present, an object (``{}`` when none
    is); else None."""
    if "name" not in fields:
        return None
    s, e = fields["name"]
    try:
        name = json.loads(text[s:e])
    except ValueError:
        return None
    if not isinstance(name, str):
        return None
    key = next((k for k in arguments_keys if k in fields), None)
    if key is None:
        return name, "{}"
    s, e = fields[key]
    if text[s] != "{":
        return None
    arguments = text[s:e]
    try:
        return (name, arguments) if isinstance(json.loads(arguments), dict) else None
    except ValueError:
        return None


PENDING, CALL, NOT_A_CALL = "pending", "call", "not a call"


class CallScanner:
    """A ``{"name": str, "arguments": {...}}`` object at ``text[start]`` as the text grows
    (`call_parts` says what is a call). ``advance(text)`` returns PENDING while it may still be
    one and is incomplete, then for good CALL (``name``, ``arguments``, ``end`` just past the
    object) or NOT_A_CALL (broken JSON, as soon as the text shows it; a complete object that
    is no call)."""

    def __init__(self, start: int, arguments_keys: tuple[str, ...] = ("arguments",)) -> None:
        self.object = ObjectScanner(start)
        self.keys = arguments_keys
        self.state = PENDING
        self.name = self.arguments = ""
        self.end = 0

    def advance(self, text: str) -> str:
        if self.state != PENDING:
            return self.state
        obj = self.object.advance(text)
        if not obj.ok:
            self.state = NOT_A_CALL
        elif obj.end is not None:
            parts = call_parts(text, obj.fields, self.keys)
            if parts is None:
                self.state = NOT_A_CALL
            else:
                self.state, (self.name, self.arguments), self.end = CALL, parts, obj.end
        return self.state
