"""Tool calling (issue 24): the tool-call parser plugins (hermes, llama3_json) and their
streaming deltas, the request side (tool_choice, the constraint of required / named), and a
served tiny model with SmolLM2's vocabulary and a Hermes chat template driven by raw HTTP, the
openai SDK and LangChain.

The tiny model is random, so its free text is garbage: ``required`` and named choices must
still give calls whose arguments validate (the structured output backend forces them), and the
``auto`` path is driven end to end by a regex constraint that makes the model write a Hermes
block. Schemas use enums and bounded integers, so that every constrained output ends well
before ``max_tokens``."""

from __future__ import annotations

import json
import random
import re
from typing import Literal

import jsonschema
import pytest

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from http_helpers import KEY, events, keyed_http, keyed_openai
from pagebatch.errors import SamplingParamsError
from pagebatch.plugins.frontends.http.tool_calls import (NamedParser, RequiredParser,
                                                         ToolCallStream, chat_message,
                                                         finish_reason)
from pagebatch.plugins.frontends.http.tools import (ToolRequest, required_schema,
                                                    template_messages, tool_request)
from pagebatch.registry import registry
from pagebatch.tool_parser import (ReparseReader, ToolCall, ToolCallParse, ValueScanner,
                                   json_value_end, scan_object)
from tool_helpers import characters_read

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
           "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The forecast",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["utc"],
        "properties": {"utc": {"type": "boolean"}}}}},
]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]


def parser(name):
    return registry().tool_parser(name)(None)


# ---- parsers, no model ---------------------------------------------------------------------

def test_the_builtins_are_registered_by_entry_point():
    reg = registry()
    assert {"hermes", "llama3_json"} <= set(reg.names("tool_parser"))
    assert reg.provider("tool_parser", "hermes") == "hermes"
    assert reg.provider("tool_parser", "llama3_json") == "llama3_json"


def test_hermes_calls_and_content():
    text = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
            '"days": 2}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": '
            '{"utc": true}}\n</tool_call>')
    assert parser("hermes").parse(text) == ToolCallParse("Let me look.", (
        ToolCall("get_weather", '{"city": "Paris", "days": 2}'),
        ToolCall("get_time", '{"utc": true}')))
    # no content: null; the last block may lack </tool_call>; nested braces in strings
    assert parser("hermes").parse('<tool_call>{"name": "f", "arguments": {"s": "}{"}}') == \
        ToolCallParse(None, (ToolCall("f", '{"s": "}{"}'),))


@pytest.mark.parametrize("text", [
    "just words, no call",
    '<tool_call>{"name": 3, "arguments": {}}</tool_call>',  # name not a string
    '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',  # arguments not an object
    '<tool_call>{"name": "f", "arguments": {"a": 1}</tool_call>',  # unbalanced
    '<tool_call>not json</tool_call>',
    '<tool_call>{"name": "f", "arguments": {"a": 1}} trailing</tool_call>',
    '<tool_call>{"name": "f", "argum',  # cut off
])
def test_hermes_malformed_text_stays_content(text):
    assert parser("hermes").parse(text) == ToolCallParse(text)


def test_hermes_a_malformed_block_between_good_ones():
    text = ('<tool_call>{"name": "a", "arguments": {}}</tool_call> <tool_call>oops</tool_call>'
            '<tool_call>{"name": "b", "arguments": {"x": 1}}</tool_call>')
    out = parser("hermes").parse(text)
    assert [c.name for c in out.calls] == ["a", "b"]
    assert out.content == " <tool_call>oops</tool_call>"


def test_llama3_json_calls_and_content():
    p = parser("llama3_json")
    assert p.parse('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome", '
                   '"days": 1}}; {"name": "get_time", "arguments": {"utc": false}}') == \
        ToolCallParse(None, (ToolCall("get_weather", '{"city": "Rome", "days": 1}'),
                             ToolCall("get_time", '{"utc": false}')))
    assert p.parse('  {"name": "f"}') == ToolCallParse(None, (ToolCall("f", "{}"),))
    for text in ("Hello, no calls here", '{"not_a_call": 1}', '{"name": "f", "parameters": 3}',
                 '{"name": "f", "parameters": {'):
        assert p.parse(text) == ToolCallParse(text), text


def test_json_extents():
    text = '{"a": "x}\\"y", "b": [1, {"c": 2}], "n": 12}'
    assert json_value_end(text, 0) == len(text)
    assert json_value_end('{"a": [1, 2', 0) is None and json_value_end("12", 0) is None
    scan = scan_object(text, 0)
    assert scan.ok and scan.end == len(text)
    assert {k: text[s:e] for k, (s, e) in scan.fields.items()} == {
        "a": '"x}\\"y"', "b": '[1, {"c": 2}]', "n": "12"}
    assert not scan_object('{"a" 1}', 0).ok and not scan_object('[1]', 0).ok


def _stream_answer(p, text, cuts, req=None):
    """``text`` fed to a ToolCallStream in the pieces ``cuts`` gives (the last one final); the
    deltas joined back: (content, [(name, arguments)], finish reason for a model that stopped),
    checking each call's first delta has its id and name."""
    req = req or ToolRequest(TOOLS, "auto", None, True, TOOLS)
    st = ToolCallStream(req, p)
    content, calls = "", []
    for k, end in enumerate(cuts):
        d = st.delta(text[:end], final=k == len(cuts) - 1)
        content += d.get("content", "")
        for frag in d.get("tool_calls", []):
            if frag["index"] == len(calls):
                assert frag["id"].startswith("call_") and frag["type"] == "function"
                calls.append([frag["function"]["name"], ""])
            assert "name" not in frag["function"] or frag["index"] == len(calls) - 1
            calls[frag["index"]][1] += frag["function"].get("arguments", "")
    return content, [tuple(c) for c in calls], finish_reason(req, "stop", st.called)


def _stream(p, text, cuts, req=None):
    return _stream_answer(p, text, cuts, req)[:2]


def _one_body(p, text, req=None):
    """The non-streamed answer of ``text`` in _stream_answer's form."""
    req = req or ToolRequest(TOOLS, "auto", None, True, TOOLS)
    message, reason = chat_message(text, "stop", req, p)
    return (message["content"] or "", [(c["function"]["name"], c["function"]["arguments"])
                                       for c in message.get("tool_calls", [])], reason)


STREAM_CASES = [
    ("hermes", 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", '
               '"days": 7}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": '
               '{"utc": true}}\n</tool_call>'),
    ("hermes", "plain text with a < and <tool and a ' at the end  "),
    ("hermes", '<tool_call>{"arguments": {"a": [1, "]"]}, "name": "f"}</tool_call> after'),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", '
                    '"days": 3}}; {"name": "get_time", "parameters": {"utc": false}}'),
    ("llama3_json", "No calls, {just} text."),
]


@pytest.mark.parametrize("name, text", STREAM_CASES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_streamed_deltas_reassemble_to_the_final_parse(name, text, seed):
    p = parser(name)
    rng = random.Random(seed)
    cuts = sorted(set(rng.sample(range(1, len(text)), min(12, len(text) - 1)))) + [len(text)]
    if seed == 0:
        cuts = list(range(1, len(text) + 1))  # one character at a time
    final = p.parse(text)
    content, calls = _stream(p, text, cuts)
    assert calls == [(c.name, c.arguments) for c in final.calls]
    assert (content or None) == (final.content or None)


def test_required_and_named_parsers_stream_the_forced_text():
    text = ('[{"name": "get_weather", "arguments": {"city": "Rome", "days": 4}}, '
            '{"name": "get_time", "arguments": {"utc": true}}]')
    assert RequiredParser().parse(text).calls == (
        ToolCall("get_weather", '{"city": "Rome", "days": 4}'),
        ToolCall("get_time", '{"utc": true}'))
    assert _stream(RequiredParser(), text, range(1, len(text) + 1))[1] == [
        ("get_weather", '{"city": "Rome", "days": 4}'), ("get_time", '{"utc": true}')]
    assert _stream(NamedParser("f"), '{"a": 1}', range(0, 9))[1] == [("f", '{"a": 1}')]


def test_parallel_tool_calls_false_keeps_the_first_call():
    req = ToolRequest(TOOLS, "auto", None, False, TOOLS)
    text = ('<tool_call>{"name": "a", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "b", "arguments": {}}</tool_call>')
    message, reason = chat_message(text, "stop", req, parser("hermes"))
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["a"]
    assert reason == "tool_calls" and message["content"] is None


def test_a_streamed_call_is_never_taken_back():
    """Review: hermes sent a call as soon as its JSON ended at the end of the text; text other
    than </tool_call> after it (or a max_tokens cut) made the final parse content, so the stream
    sent the call and then the raw block as content, with finish reason tool_calls. A call is
    now held back until it is certain: closed, or the end of the final text."""
    p = parser("hermes")
    block = '<tool_call>{"name": "get_time", "arguments": {"utc": true}}'
    for text in (block + " oops</tool_call>", block + "</tool_c", block[:-1], block + " x"):
        cuts = range(1, len(text) + 1)
        assert _stream_answer(p, text, cuts) == (text, [], "stop") == _one_body(p, text), text
        assert p.parse(text[:len(block)], final=False) == ToolCallParse("")  # not yet certain
    for text in (block, block + "\n", block + " </tool_call> after"):  # calls, at the end too
        got = _stream_answer(p, text, range(1, len(text) + 1))
        assert got == _one_body(p, text) and got[1] == [("get_time", '{"utc": true}')], text
    # the whole call comes in one delta, once closed
    st = ToolCallStream(ToolRequest(TOOLS, "auto", None, True, TOOLS), p)
    assert st.delta(block + "</tool_call", False) == {}
    (frag,) = st.delta(block + "</tool_call>", False)["tool_calls"]
    assert frag["function"] == {"name": "get_time", "arguments": '{"utc": true}'}


def test_llama3_json_a_call_must_name_one_of_the_tools():
    """Review: any JSON output with a string "name" became a call with {} arguments. A name
    that is not among the request's tools leaves the output content (vLLM's llama3_json asks
    for name and parameters keys; its parser engine drops calls of undeclared names)."""
    p = parser("llama3_json")
    for text in ('{"name": "Bob", "age": 3}', '{"name": "nope", "parameters": {}}'):
        assert _one_body(p, text) == (text, [], "stop") == _stream_answer(
            p, text, range(1, len(text) + 1))
    text = '{"name": "get_time", "parameters": {"utc": true}}; {"name": "nope"}'
    want = ('{"name": "nope"}', [("get_time", '{"utc": true}')], "tool_calls")
    assert _one_body(p, text) == want == _stream_answer(p, text, range(1, len(text) + 1))
    assert p.parse('{"name": "Bob"}').calls == (ToolCall("Bob", "{}"),)  # no tools known


# ---- the stream is the one-body answer, chunked anyhow (property test) ----------------------

_JSON_TEXT = st.text(alphabet='ab "\\{}[]<>/:,;\n', max_size=6)
_ARGS = st.dictionaries(st.sampled_from(["city", "days", "s"]), st.one_of(
    st.integers(-5, 99), _JSON_TEXT, st.booleans(), st.lists(st.integers(0, 3), max_size=2)),
    max_size=3).map(json.dumps)
_NAMES = st.sampled_from(["get_weather", "get_time", "nope"])  # nope: not among TOOLS
_WS = st.sampled_from(["", " ", "\n", "\n\n"])
_CONTENT = st.one_of(st.text(alphabet="ab <>/{}[]\";:,\n\t_tolcapyhn|", max_size=10),
                     st.sampled_from(["<tool_c", "</tool_call>", "<tool_call>", "<|python_tag|>",
                                      "<tool_call>not json</tool_call>", "\u2003"]))


@st.composite
def _call_json(draw, key="arguments"):
    """A call object, well-formed or, a third of the time, not a call."""
    name, args = json.dumps(draw(_NAMES)), draw(_ARGS)
    return draw(st.sampled_from([
        f'{{"name": {name}, "{key}": {args}}}', f'{{"{key}": {args}, "name": {name}}}',
        f'{{"name": {name}, "{key}": {args}}}', f'{{"name": {name}, "{key}": {args}}}',
        f'{{"name": 3, "{key}": {args}}}', f'{{"name": {name}, "{key}": [1]}}',
        f'{{"name": {name}, "{key}": {args}', f'{{"name": {name}, "{key}": {args}}}}}',
        f'{{"name": {name}}}', '{"not_a_call": 1}']))


@st.composite
def _hermes_text(draw):
    def block():
        return (f"<tool_call>{draw(_WS)}{draw(_call_json())}{draw(_WS)}"
                + draw(st.sampled_from(["</tool_call>"] * 3 + [" x</tool_call>", ""])))
    return "".join(draw(_CONTENT) if draw(st.booleans()) else block()
                   for _ in range(draw(st.integers(0, 4))))


@st.composite
def _llama3_text(draw):
    if draw(st.integers(0, 4)) == 0:
        return draw(_CONTENT)
    calls = [draw(_call_json(draw(st.sampled_from(["parameters", "arguments"]))))
             for _ in range(draw(st.integers(1, 3)))]
    return (draw(_WS) + draw(st.sampled_from(["", "<|python_tag|>"])) + draw(_WS)
            + draw(st.sampled_from(["; ", ";", " ; "])).join(calls)
            + draw(st.sampled_from(["", "", ";", " and words", " {x"])))


@st.composite
def _required_text(draw):
    if draw(st.integers(0, 5)) == 0:
        return draw(_CONTENT)
    calls = [draw(_call_json()) for _ in range(draw(st.integers(0, 3)))]
    return "[" + draw(_WS) + ", ".join(calls) + draw(st.sampled_from(["]", "", ",]", "] x"]))


_PARSERS = {"hermes": (lambda: parser("hermes"), _hermes_text()),
            "llama3_json": (lambda: parser("llama3_json"), _llama3_text()),
            "required": (RequiredParser, _required_text())}


@pytest.mark.parametrize("name", list(_PARSERS))
@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_the_stream_is_the_one_body_answer(name, data):
    """Texts of content, well-formed calls, malformed calls (to the tools or not), cut off
    anywhere (max_tokens), streamed in pieces cut anywhere: the deltas join to the one-body
    answer of the same text (calls, content, finish reason), with parallel calls or not."""
    make, texts = _PARSERS[name]
    text = data.draw(texts)
    text = text[:data.draw(st.integers(0, len(text)))]  # cut short, or not
    cuts = sorted(set(data.draw(st.lists(st.integers(1, max(1, len(text))), max_size=12))))
    cuts = [c for c in cuts if c < len(text)] + [len(text)]
    req = ToolRequest(TOOLS, "auto", None, data.draw(st.booleans()), TOOLS)
    p = make()
    assert _stream_answer(p, text, cuts, req) == _one_body(p, text, req)
    # parse on a prefix reports only what the whole text's parse has
    final = p.parse(text)
    for k in cuts[:-1]:
        part = p.parse(text[:k], final=False)
        assert final.calls[:len(part.calls)] == part.calls
        assert (final.content or "").startswith(part.content)


@settings(max_examples=500, deadline=None)
@given(text=st.text(alphabet='{}[]"\\ab1,:', max_size=16), data=st.data())
def test_the_value_scanner_ends_where_one_scan_does(text, data):
    """ValueScanner fed a text in pieces finds the end one scan of the whole text finds."""
    scanner = ValueScanner(0)
    for k in sorted(set(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))):
        end = scanner.advance(text[:k])
        assert end is None or end == json_value_end(text, 0)
    assert scanner.advance(text) == json_value_end(text, 0)


# ---- streaming work grows with the output, not its square ---------------------------------

CODE = "def f(x):\n    return x * 2  # a line of code\n" * 300
BIG_CALL = ('<tool_call>{"name": "get_time", "arguments": '  # the review's 14 KB write_file call
            + json.dumps({"path": "a.py", "content": CODE}) + "}</tool_call>")


@pytest.mark.parametrize("name, text", [
    ("hermes", BIG_CALL),
    ("hermes", 'ok <tool_call>{"name": "get_time", "arguments": {"a": [1, "x"]}}</tool_call>\n'
               * 200),
    ("hermes", "plain words < and <tool and { } " * 400),
    ("hermes", '<tool_call>{"name": "f", "arguments": {}} oops ' + "x" * 10_000 + "</tool_call>"),
    ("llama3_json", "<|python_tag|>" + "; ".join(
        ['{"name": "get_time", "parameters": {"a": "' + "y" * 50 + '"}}'] * 200)),
    ("required", "[" + ", ".join(['{"name": "get_time", "arguments": {"content": '
                                  + json.dumps(CODE[:2000]) + "}}"] * 7) + "]"),
])
@pytest.mark.parametrize("step", [1, 4])
def test_a_stream_reads_each_character_a_bounded_number_of_times(name, text, step):
    """Review: each chunk re-parsed the whole text so far (a 14 KB call: 3,547 chunks, 3.9 s of
    event-loop time). A reader keeps its place: over a stream it looks at a few characters
    per character of output plus a few per read (counted with a test double, not timed);
    re-parsing the whole text each time, as before, looks at thousands."""
    p = RequiredParser() if name == "required" else parser(name)
    seen, reads = characters_read(p.reader(TOOLS), text, step)
    assert seen <= 4 * len(text) + 16 * reads, (seen, len(text), reads)


def test_the_work_count_sees_a_whole_reparse():
    """The test double above catches the old cost: re-parsing the text so far at each step
    (`ReparseReader`, the default for parsers that only implement ``parse``) looks at every
    character about a thousand times over the review's call."""
    p = parser("hermes")
    before, _ = characters_read(ReparseReader(p), BIG_CALL)
    after, _ = characters_read(p.reader(TOOLS), BIG_CALL)
    assert before > 1000 * len(BIG_CALL) > 250 * after


# ---- the request side, no model -------------------------------------------------------------

def _bad(body, auto=True):
    with pytest.raises(SamplingParamsError) as e:
        tool_request(body, auto)
    return e.value.param


def test_tool_request_errors_name_the_field():
    named = {"type": "function", "function": {"name": "nope"}}
    assert _bad({"tools": TOOLS, "tool_choice": named}) == "tool_choice.function.name"
    assert _bad({"tool_choice": "required"}) == "tool_choice"
    assert _bad({"tools": TOOLS + TOOLS[:1]}) == "tools[2].function.name"
    assert _bad({"tools": TOOLS}, auto=False) == "tool_choice"  # auto, the default
    assert tool_request({"tool_choice": "none"}, False) is None
    assert tool_request({"tools": TOOLS, "tool_choice": "required"}, False).choice == "required"


def test_required_and_named_constraints():
    req = tool_request({"tools": TOOLS, "tool_choice": "required",
                        "parallel_tool_calls": False}, False)
    c = req.constraint()
    assert c.origin == "tools" and c.json == required_schema(TOOLS, False)
    assert c.json["maxItems"] == 1 and len(c.json["items"]["anyOf"]) == 2
    ok = [{"name": "get_time", "arguments": {"utc": True}}]
    jsonschema.validate(ok, c.json)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_time", "arguments": {"city": "Paris"}}], c.json)
    named = tool_request({"tools": TOOLS, "tool_choice": {
        "type": "function", "function": {"name": "get_time"}}}, False)
    c = named.constraint()
    assert c.json == PARAMS["get_time"] and c.origin == "tools[1].function.parameters"
    assert tool_request({"tools": TOOLS, "tool_choice": "auto"}, True).constraint() is None
    none = tool_request({"tools": TOOLS, "tool_choice": "none"}, False, True)
    assert none.render is None and none.constraint() is None


def test_template_messages_turn_arguments_into_objects():
    msgs = [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "f", "arguments": '{"a": 1}'}}]}]
    out = template_messages(msgs)
    assert out[0]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    assert msgs[0]["tool_calls"][0]["function"]["arguments"] == '{"a": 1}'  # not modified


# ---- a served tiny model with a Hermes template --------------------------------------------

@pytest.fixture(scope="module")
def tool_base(tmp_path_factory, smollm2_dir):
    from tool_helpers import hermes_model, hermes_server

    with hermes_server(hermes_model(tmp_path_factory.mktemp("tiny-hermes"), smollm2_dir)) as url:
        yield url


@pytest.fixture(scope="module")
def tool_http(tool_base):
    with keyed_http(tool_base, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def tool_client(tool_base):
    return keyed_openai(tool_base, timeout=120)


def _chat(http, **body):
    r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": MSGS,
                                                "tools": TOOLS, "max_tokens": 300, **body})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def _chat_stream(http, **body):
    """A streamed choice: its calls joined from their fragments, its content, its finish
    reasons, and per call the arguments its first fragment carried."""
    r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": MSGS,
                                                "tools": TOOLS, "max_tokens": 300,
                                                "stream": True, **body})
    assert r.status_code == 200, r.text
    calls, content, reasons, announced = [], "", [], []
    for ev in events(r.text):
        for ch in ev["choices"]:
            d = ch["delta"]
            content += d.get("content") or ""
            for frag in d.get("tool_calls") or []:
                if frag["index"] == len(calls):
                    assert frag["id"] and frag["type"] == "function"
                    calls.append({"name": frag["function"]["name"], "arguments": ""})
                    announced.append(frag["function"]["arguments"])
                calls[frag["index"]]["arguments"] += frag["function"].get("arguments", "")
            if ch["finish_reason"] is not None:
                reasons.append(ch["finish_reason"])
    return calls, content, reasons, announced


def _validated(calls):
    for c in calls:
        jsonschema.validate(json.loads(c["arguments"]), PARAMS[c["name"]])
    return [(c["name"], c["arguments"]) for c in calls]


@pytest.mark.parametrize("parallel", [False, True])
def test_required_always_gives_valid_calls(tool_http, parallel):
    """With parallel calls a random model may go on adding calls up to max_tokens (finish
    reason length): the calls it completed still come, valid."""
    reasons_seen = set()
    for seed in range(4):
        choice = _chat(tool_http, tool_choice="required", seed=seed,
                       parallel_tool_calls=parallel)
        msg, reason = choice["message"], choice["finish_reason"]
        reasons_seen.add(reason)
        assert reason == "tool_calls" or (parallel and reason == "length"), choice
        assert msg["content"] is None
        calls = _validated([c["function"] for c in msg["tool_calls"]])
        assert len(calls) >= 1 and (parallel or len(calls) == 1)
        assert len({c["id"] for c in msg["tool_calls"]}) == len(calls)
        # the same seed streamed: the same calls (a call cut off by max_tokens is sent by
        # neither)
        s_calls, s_content, reasons, announced = _chat_stream(
            tool_http, tool_choice="required", seed=seed, parallel_tool_calls=parallel)
        assert s_calls == [{"name": n, "arguments": a} for n, a in calls]
        assert announced == [a for _, a in calls]  # each call whole, in one fragment
        assert reasons == [reason] and not s_content
    assert "tool_calls" in reasons_seen


def test_named_function_always_gives_its_valid_arguments(tool_http):
    named = {"type": "function", "function": {"name": "get_weather"}}
    for seed in range(4):
        choice = _chat(tool_http, tool_choice=named, seed=seed)
        assert choice["finish_reason"] == "stop"  # OpenAI's (and vLLM's) for a forced call
        (call,) = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "get_weather"
        calls = _validated([call["function"]])
        s_calls, _, reasons, (first,) = _chat_stream(tool_http, tool_choice=named, seed=seed)
        assert _validated(s_calls) == calls and reasons == ["stop"]
        assert len(first) < len(s_calls[0]["arguments"])  # certain: streamed as it comes


HERMES_BLOCK = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", '
                '"days": 3}}\n</tool_call>')


def test_auto_parses_the_model_text(tool_http):
    """The model is made to write a Hermes block (a regex constraint): auto finds the call."""
    forced = {"structured_outputs": {"regex": "Checking\\. " + re.escape(HERMES_BLOCK)}}
    choice = _chat(tool_http, **forced)  # tool_choice auto: the default with tools
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Checking."
    (call,) = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Rome", "days": 3}'}
    calls, content, reasons, _ = _chat_stream(tool_http, tool_choice="auto", **forced)
    assert calls == [call["function"]] and content == "Checking." and reasons == ["tool_calls"]


def test_auto_without_a_call_and_none_give_content(tool_http):
    for choice in ("auto", "none"):
        c = _chat(tool_http, tool_choice=choice, max_tokens=8, seed=1)
        assert c["finish_reason"] == "length" and "tool_calls" not in c["message"]
        assert isinstance(c["message"]["content"], str)
    # none still renders the tools (vLLM's default): the same prompt as required
    usage = [tool_http.post("/v1/chat/completions", json={
        "model": "tiny", "messages": MSGS, "max_tokens": 1, **extra}).json()["usage"]
        for extra in ({"tools": TOOLS, "tool_choice": "none"}, {"tools": TOOLS}, {})]
    assert usage[0]["prompt_tokens"] == usage[1]["prompt_tokens"] > usage[2]["prompt_tokens"]


@pytest.mark.parametrize("body, param", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [], "tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools[2].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]},
     "tools[0].function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "no-such-type"}}}], "tool_choice": "required"}, "tools"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_time"}},
      "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_bad_tool_fields_are_400_naming_the_field(tool_http, body, param, stream):
    r = tool_http.post("/v1/chat/completions", json={
        "model": "tiny", "messages": MSGS, "tools": TOOLS, "max_tokens": 4, **body,
        "stream": stream})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_tools_on_completions_are_400(tool_http):
    r = tool_http.post("/v1/completions", json={"model": "tiny", "prompt": "x", "tools": TOOLS})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"


def test_tool_round_trip_through_the_template(tool_http, smollm2_dir):
    """An assistant turn with tool_calls (arguments as JSON text, as OpenAI clients send them)
    and the tool's result render as the Hermes template writes them."""
    msgs = MSGS + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"forecast": "sunny"}'},
    ]
    r = tool_http.post("/tokenize", json={"model": "tiny", "messages": msgs, "tools": TOOLS})
    assert r.status_code == 200, r.text
    text = tool_http.post("/detokenize", json={"model": "tiny",
                                               "tokens": r.json()["tokens"]}).json()["prompt"]
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris", "days": 1}}\n</tool_call><|im_end|>') in text
    assert ('<|im_start|>user\n<tool_response>\n{"forecast": "sunny"}\n</tool_response>'
            '<|im_end|>\n<|im_start|>assistant\n') in text
    c = _chat(tool_http, messages=msgs, tool_choice="none", max_tokens=4)
    assert c["finish_reason"] == "length"


# ---- clients: the openai SDK and LangChain ------------------------------------------------

def test_openai_sdk_parse(tool_client):
    """The SDK's ``parse`` (pydantic in, pydantic out): a response_format model and a strict
    function tool."""
    import openai
    from pydantic import BaseModel, Field

    class Weather(BaseModel):
        city: Literal["Paris", "Rome"]
        days: int = Field(ge=1, le=7)

    completions = getattr(tool_client.chat.completions, "parse", None) or \
        tool_client.beta.chat.completions.parse
    r = completions(model="tiny", messages=MSGS, response_format=Weather, max_tokens=200,
                    seed=0)
    assert isinstance(r.choices[0].message.parsed, Weather)
    r = completions(model="tiny", messages=MSGS, tools=[openai.pydantic_function_tool(Weather)],
                    tool_choice="required", parallel_tool_calls=False, max_tokens=200,
                    seed=0)
    (call,) = r.choices[0].message.tool_calls[:1]
    assert call.function.name == "Weather" and isinstance(call.function.parsed_arguments,
                                                          Weather)


@pytest.fixture(scope="module")
def chat_model(tool_base):
    pytest.importorskip("langchain_openai")
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model="tiny", base_url=tool_base + "/v1", api_key=KEY, max_retries=0,
                      timeout=120, max_tokens=200, seed=0)


def get_weather(city: Literal["Paris", "Rome"], days: int) -> str:
    """The forecast of a city for some days."""
    return json.dumps({"city": city, "days": days, "forecast": "sunny"})


def _weather_tool():
    from langchain_core.tools import tool

    return tool(get_weather)


def test_langchain_bind_tools_required(chat_model):
    get_weather = _weather_tool()
    msg = chat_model.bind_tools([get_weather], tool_choice="required",
                                  parallel_tool_calls=False).invoke(
        "What is the weather in Paris?")
    assert msg.tool_calls and msg.tool_calls[0]["name"] == "get_weather"
    args = msg.tool_calls[0]["args"]
    assert args["city"] in ("Paris", "Rome") and isinstance(args["days"], int)
    assert not msg.invalid_tool_calls


@pytest.mark.parametrize("method", ["json_schema", "function_calling", "json_mode"])
def test_langchain_with_structured_output(chat_model, method):
    from pydantic import BaseModel, Field

    if method == "json_mode":
        # json_mode only asks for some JSON object (the prompt should say which): a model
        # whose fields all have defaults takes any object, so a random model's passes
        class Answer(BaseModel):
            """An answer."""
            ok: bool = True
            note: str = ""
    else:
        class Answer(BaseModel):
            """An answer."""
            ok: bool
            mood: Literal["good", "bad"]
            score: int = Field(ge=0, le=10)

    out = chat_model.with_structured_output(Answer, method=method).invoke(
        "Answer as JSON with ok, mood and score.")
    assert isinstance(out, Answer)


def test_langchain_two_turn_tool_round_trip(chat_model):
    from langchain_core.messages import HumanMessage, ToolMessage

    get_weather = _weather_tool()
    history = [HumanMessage("What is the weather in Paris?")]
    first = chat_model.bind_tools([get_weather], tool_choice="required",
                                  parallel_tool_calls=False).invoke(history)
    call = first.tool_calls[0]
    result = get_weather.invoke(call["args"])
    history += [first, ToolMessage(result, tool_call_id=call["id"])]
    second = chat_model.bind(max_tokens=8).invoke(history)
    assert isinstance(second.content, str) and second.content
    assert second.response_metadata["finish_reason"] == "length"


def test_smollm2_required_calls_validate_over_seeds(smollm2_llm):
    """A real model under the ``required`` constraint, batched over seeds: every output is a
    list of calls whose arguments validate."""
    from pagebatch import SamplingParams
    from pagebatch.structured_output import StructuredOutputsParams

    schema = required_schema(TOOLS, parallel=False)
    prompt = smollm2_llm.engine.chat_prompt(MSGS, tools=TOOLS)
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=60,
                             structured_outputs=StructuredOutputsParams(json=schema))
              for s in range(3)]
    for out in smollm2_llm.generate([prompt] * len(params), params, use_tqdm=False):
        c = out.outputs[0]
        assert c.finish_reason == "stop", c.text
        assert c.text.startswith('[{"name": "')  # the schema's property order, name first
        jsonschema.validate(json.loads(c.text), schema)
        calls = RequiredParser().parse(c.text).calls
        assert calls and _validated([{"name": k.name, "arguments": k.arguments}
                                     for k in calls])


def test_openai_sdk_two_turn_round_trip(tool_client):
    """docs/serving.md's example: the SDK's own message object sent back with the result."""
    r = tool_client.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS,
                                            tool_choice="required", parallel_tool_calls=False,
                                            max_tokens=200, seed=1)
    msg = r.choices[0].message
    call = msg.tool_calls[0]
    messages = MSGS + [msg, {"role": "tool", "tool_call_id": call.id,
                             "content": '{"forecast": "sunny"}'}]
    r = tool_client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS,
                                            max_tokens=4)  # auto: the server has a parser
    assert r.choices[0].finish_reason == "length"


def test_the_worked_example_parser_in_plugins_md():
    """docs/plugins.md's ToolParser example, registered as a plugin, parses and streams."""
    import types
    from pathlib import Path

    from pagebatch.registry import Registry

    doc = (Path(__file__).resolve().parents[1] / "docs" / "plugins.md").read_text()
    code = doc.split("A worked example: calls written as", 1)[1].split("```python\n", 1)[1]
    mod = types.ModuleType("xml_calls")
    exec(code.split("```", 1)[0], mod.__dict__)
    reg = Registry()
    assert reg.register_plugin(mod, "xml_calls").provides == {"tool_parser": ["xml_calls"]}
    p = reg.tool_parser("xml_calls")(None)
    text = 'Sure. <call name="get_weather">{"city": "Paris"}</call> <call name="f">{}</call>'
    assert p.parse(text) == ToolCallParse("Sure.", (
        ToolCall("get_weather", '{"city": "Paris"}'), ToolCall("f", "{}")))
    assert _stream(p, text, range(1, len(text) + 1)) == (
        "Sure.", [("get_weather", '{"city": "Paris"}'), ("f", "{}")])
    assert p.parse('hi <call name="x">oops</call>').calls == ()


def test_server_keys_are_checked_at_start(tiny_model_dir):
    from pagebatch import EngineConfig
    from pagebatch.errors import ConfigError, PluginError
    from pagebatch.plugins.frontends.http.server import Settings

    def settings(**keys):
        return Settings.from_config(EngineConfig.from_sources(
            cli={"model": str(tiny_model_dir), **keys}))

    with pytest.raises(PluginError, match="no tool parser named 'nope'.*hermes"):
        settings(tool_call_parser="nope")
    with pytest.raises(ConfigError, match="enable_auto_tool_choice needs tool_call_parser"):
        settings(enable_auto_tool_choice=True)
    s = settings(tool_call_parser="llama3_json", enable_auto_tool_choice=True)
    assert (s.tool_call_parser, s.enable_auto_tool_choice) == ("llama3_json", True)
