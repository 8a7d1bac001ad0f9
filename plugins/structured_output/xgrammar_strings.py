"""A workaround for xgrammar issue #800: JSON-schema strings with ``minLength`` / ``maxLength``.

xgrammar (0.2.x) lowers a length-bounded string to ``"\\"" chars{min, max} "\\""`` where one
``chars`` is the bare class ``[^"\\\\\\r\\n]``: it admits the raw control characters U+0000-U+001F
other than CR/LF (a tab, ``\\x01``: invalid JSON, which ``json.loads`` rejects) and the UTF-8
encodings of UTF-16 surrogates (bytes ``ED A0-BF xx``: not UTF-8, decoded as three U+FFFD each,
so the string is longer than ``maxLength``), and no escape at all. Plain strings and ``pattern``
use a JSON-aware rule and are not affected. (Open fixes upstream: mlc-ai/xgrammar#822, #880.)

`fix_bounded_strings` rewrites, in the grammar xgrammar made from the schema, each rule whose
whole body is that class into another single class: a code point other than ``"``, ``\\``, a
control character (U+0000-U+001F) or a surrogate. The repetition and its bounds stay xgrammar's.
The rule must stay one character class: xgrammar precomputes the token masks of a bounded
repetition of a class, and an alternation in its place (a class *or* a short escape such as
``\\n``, which the first version of this rewrite allowed) fell off that path: filling a token
bitmask then took time growing with the characters already generated, 4.5 ms a token under
``maxLength: 5``, 0.5 s under ``minLength: 256`` and about 1.5 s a token a few dozen tokens into
``minLength: 1024`` (against 0.02-0.1 ms with one class; CPU, SmolLM2's tokenizer,
scripts/bench_grammar_fill.py [--escapes]; on the H200 the
JSON-schema benchmark of scripts/bench_structured.py did not finish its first constrained run in
200 s). So a length-bounded string holds no escape: ``"``, ``\\`` and control characters cannot
appear in it (the output is valid JSON that validates against the schema; a ``pattern`` of
``{0,5000}`` instead takes a minute to compile). A grammar without such a rule (another schema,
or an xgrammar that fixed it) is returned as it is.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import xgrammar as xgr

# the rule body xgrammar 0.2 prints for one character of a length-bounded string
BUGGY_CHARACTER = '(([^\\"\\\\\\r\\n]))'
# one unescaped character of a JSON string (RFC 8259: not ", \, U+0000-U+001F), no surrogate
# code point: one class (the module docstring says why no escape)
JSON_CHARACTER = '(([^\\0-\\x1f\\"\\\\\\ud800-\\udfff]))'


def fix_bounded_strings(grammar: xgr.Grammar) -> xgr.Grammar:
    """``grammar`` (from ``Grammar.from_json_schema``) with each length-bounded string's
    character rule made JSON-correct (see the module docstring), or ``grammar`` itself when it
    has none. Raises what ``Grammar.from_ebnf`` raises if xgrammar cannot read back its own
    printed grammar (not seen with 0.2.x)."""
    import xgrammar

    lines = str(grammar).split("\n")
    fixed = 0
    for i, line in enumerate(lines):
        name, sep, body = line.partition(" ::= ")
        if sep and body == BUGGY_CHARACTER:
            lines[i] = name + sep + JSON_CHARACTER
            fixed += 1
    if not fixed:
        return grammar
    return xgrammar.Grammar.from_ebnf("\n".join(lines))
