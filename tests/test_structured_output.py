"""Structured output (core/structured_output.py, the xgrammar plugin): constraints validated up
front, outputs that parse and match, unconstrained rows of a mixed batch unchanged, an impossible
constraint ending only its own request, and the HTTP fields (response_format, guided_*)."""

from __future__ import annotations

import json
import re
import shutil

import jsonschema
import numpy as np
import pytest
import torch

from pagebatch import LLM, SamplingParams
from pagebatch.errors import SamplingParamsError
from pagebatch.sampler import apply_token_bitmask
from pagebatch.structured_output import StructuredOutputBatch, StructuredOutputsParams as SO

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}


# ---- validation and the bitmask, no model ---------------------------------------------------

@pytest.mark.parametrize("so, field", [
    (SO(), "structured_outputs"),
    (SO(regex="a", choice=["b"]), "structured_outputs"),
    (SO(json="{not json"), "structured_outputs.json"),
    (SO(json=[1]), "structured_outputs.json"),
    (SO(choice=[]), "structured_outputs.choice"),
    (SO(regex=""), "structured_outputs.regex"),
    (SO(json="{bad", origin="guided_json"), "guided_json"),
])
def test_malformed_constraints_name_the_field(so, field):
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(structured_outputs=so).validate()
    assert e.value.param == field and field in str(e.value)


def test_a_dict_is_taken_as_the_fields():
    sp = SamplingParams(structured_outputs={"regex": "[ab]+"})
    sp.validate()
    assert sp.structured_outputs == SO(regex="[ab]+")


def test_bitmask_masks_only_the_constrained_rows():
    logits = torch.randn(3, 70)
    bitmask = np.zeros((1, 3), dtype=np.int32)
    bitmask[0, 0] = 1 << 5
    bitmask[0, 2] = np.int32(-2**31)  # bit 31 of word 2: token 95, past the vocabulary
    bitmask[0, 1] = 1 << 3  # token 35
    out = apply_token_bitmask(logits, StructuredOutputBatch(["b"], bitmask), ["a", "b", "c"])
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])
    allowed = torch.isfinite(out[1]).nonzero().flatten().tolist()
    assert allowed == [5, 35] and torch.equal(out[1, allowed], logits[1, allowed])


@pytest.mark.parametrize("text, ok", [
    (b'{"a": "abcde"}', True), (b'{"a": ""}', True), (b'{"a": "abcdef"}', False),
    (b'{"a": "\xe2\x82\xac\xf0\x9f\x98\x80"}', True),  # a 3-byte and a 4-byte character
    # no escape in a length-bounded string (one character class: xgrammar_strings.py)
    (b'{"a": "\\"\\n"}', False), (b'{"a": "a\\\\"}', False),
    (b'{"a": "a/b"}', True),
    (b'{"a": "a\tb"}', False), (b'{"a": "\x01"}', False),  # raw control characters
    (b'{"a": "\xed\xa0\x80"}', False),  # a UTF-16 surrogate, UTF-8 encoded
])
def test_length_bounded_strings_are_json_strings(text, ok):
    """xgrammar #800: a string with maxLength admitted raw control characters and surrogates
    (and no escapes); plugins/structured_output/xgrammar_strings.py rewrites its rule."""
    import xgrammar as xgr
    from pagebatch.plugins.structured_output.xgrammar_backend import _grammar
    from pagebatch.structured_output import Constraint

    schema = {"type": "object", "required": ["a"], "additionalProperties": False,
              "properties": {"a": {"type": "string", "maxLength": 5}}}
    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo(["a"])).compile_grammar(
        _grammar(Constraint("json", json.dumps(schema))))
    m = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
    assert (m.accept_string(text) and m.is_completed()) is ok


@pytest.mark.parametrize("bounds", [{"maxLength": 5}, {"minLength": 1024},
                                    {"minLength": 2, "maxLength": 300}])
def test_a_bounded_string_stays_one_character_class(bounds):
    """The rewritten rule is a single class, which keeps xgrammar's precomputed masks for the
    bounded repetition: an alternation there made each bitmask fill cost time growing with the
    string's length (1.5 s a token under minLength 1024; xgrammar_strings.py)."""
    import xgrammar as xgr
    from pagebatch.plugins.structured_output import xgrammar_strings as xs

    schema = {"type": "object", "required": ["a"], "additionalProperties": False,
              "properties": {"a": {"type": "string", **bounds}}}
    before = str(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False))
    after = str(xs.fix_bounded_strings(xgr.Grammar.from_json_schema(json.dumps(schema),
                                                                    any_whitespace=False)))
    assert xs.BUGGY_CHARACTER in before and xs.BUGGY_CHARACTER not in after
    bodies = [line.partition(" ::= ")[2] for line in after.split("\n")]
    assert xs.JSON_CHARACTER in bodies
    assert xs.JSON_CHARACTER.count("|") == 0 and xs.JSON_CHARACTER.count("[") == 1


# ---- SmolLM2 ------------------------------------------------------------------------------

def _gen(llm, prompts, params):
    return llm.generate(prompts, params, use_tqdm=False)


def test_json_schema_outputs_parse_and_validate(smollm2_llm):
    prompts = ["Describe a person as JSON:", "A user record:", "Who is Bob?"]
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=40,
                             structured_outputs=SO(json=SCHEMA)) for s in range(3)]
    for out in _gen(smollm2_llm, prompts, params):
        c = out.outputs[0]
        assert c.finish_reason == "stop", c
        jsonschema.validate(json.loads(c.text), SCHEMA)
    # compiled once, whatever the number of requests
    assert smollm2_llm.engine.core.structured.num_compiles >= 1


BOUNDED = {"type": "object", "additionalProperties": False, "required": ["code", "note"],
           "properties": {"code": {"type": "string", "minLength": 1, "maxLength": 2},
                          "note": {"type": "string", "maxLength": 4}}}
# SmolLM2 tokens: a tab, and the bytes ED A0 80 (U+D800 UTF-8 encoded: decoded as 3 U+FFFD)
TAB, SURROGATE = 197, (184, 250, 218)


def test_length_bounded_strings_parse_and_validate_over_seeds(smollm2_llm):
    """xgrammar #800 end to end: greedy with a logit bias towards a tab (or a surrogate's
    bytes) took it wherever the grammar let it; now those outputs, and samples over many seeds,
    all parse and validate."""
    params = [SamplingParams(temperature=0.0, max_tokens=32, logit_bias={t: 20.0 for t in ts},
                             structured_outputs=SO(json=BOUNDED)) for ts in ([TAB], SURROGATE)]
    params += [SamplingParams(temperature=1.2, seed=s, max_tokens=32,
                              structured_outputs=SO(json=BOUNDED)) for s in range(6)]
    for out in _gen(smollm2_llm, ["A short code and a note, as JSON:"] * len(params), params):
        c = out.outputs[0]
        assert c.finish_reason == "stop", c
        jsonschema.validate(json.loads(c.text), BOUNDED)


def test_regex_choice_and_json_object(smollm2_llm):
    outs = _gen(smollm2_llm, ["The code is", "Is the sky blue?", 'Write {"a": 1} as JSON:'], [
        SamplingParams(temperature=0.0, max_tokens=16,
                       structured_outputs=SO(regex=r"[0-9]{3}-[a-z]{2}")),
        SamplingParams(temperature=0.7, seed=1, max_tokens=8,
                       structured_outputs=SO(choice=["yes", "no", "maybe"])),
        SamplingParams(temperature=0.0, max_tokens=48, structured_outputs=SO(json_object=True)),
    ])
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", outs[0].outputs[0].text)
    assert outs[1].outputs[0].text in ("yes", "no", "maybe")
    obj = outs[2].outputs[0]  # greedy SmolLM2 may nest objects past max_tokens
    assert obj.text.startswith("{")
    if obj.finish_reason == "stop":
        assert isinstance(json.loads(obj.text), dict)


def test_unconstrained_rows_of_a_mixed_batch_equal_their_solo_outputs(smollm2_llm):
    plain = [SamplingParams(temperature=0.0, max_tokens=8),
             SamplingParams(temperature=0.9, seed=7, max_tokens=8)]
    prompts = ["The capital of France is", "Once upon a time"]
    solo = [_gen(smollm2_llm, [p], [sp])[0].outputs[0].token_ids
            for p, sp in zip(prompts, plain)]
    constrained = SamplingParams(temperature=0.0, max_tokens=8,
                                 structured_outputs=SO(regex=r"[a-z]+ [0-9]+"))
    mixed = _gen(smollm2_llm, [prompts[0], "Name and number:", prompts[1]],
                 [plain[0], constrained, plain[1]])
    assert [mixed[0].outputs[0].token_ids, mixed[2].outputs[0].token_ids] == solo
    assert re.fullmatch(r"[a-z]+ [0-9]*", mixed[1].outputs[0].text)


def test_impossible_constraint_ends_only_its_request(smollm2_llm):
    """Only EOS may follow "yes", and min_tokens masks EOS out: every token is impossible."""
    plain = SamplingParams(temperature=0.0, max_tokens=6)
    solo = _gen(smollm2_llm, ["Hello there"], [plain])[0].outputs[0].token_ids
    stuck = SamplingParams(temperature=0.0, max_tokens=6, min_tokens=4,
                           structured_outputs=SO(choice=["yes"]))
    outs = _gen(smollm2_llm, ["Hello there", "Say yes:"], [plain, stuck])
    assert outs[0].outputs[0].token_ids == solo and outs[0].error is None
    assert outs[1].outputs[0].finish_reason == "error"
    assert "structured_outputs.choice" in outs[1].error and "cannot be met" in outs[1].error
    assert outs[1].error_param == "structured_outputs.choice" and outs[0].error_param is None
    assert outs[1].outputs[0].text == "yes"


def test_invalid_schema_or_regex_is_an_error_before_queueing(smollm2_llm):
    for so, field in ((SO(regex="(unclosed"), "structured_outputs.regex"),
                      (SO(json={"type": "no-such-type"}), "structured_outputs.json")):
        with pytest.raises(SamplingParamsError) as e:
            smollm2_llm.generate(["x"], SamplingParams(structured_outputs=so), use_tqdm=False)
        assert e.value.param == field
    assert not smollm2_llm.engine.core.has_unfinished_requests


def test_no_token_can_start_the_constraint(tiny_model_dir):
    """The tiny model's word-level vocabulary has no ``{``: the first bitmask is empty."""
    llm = LLM(str(tiny_model_dir), device="cpu", dtype="float32", num_kv_blocks=64,
              block_size=4, max_model_len=64)
    plain = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    solo = _gen(llm, ["w5 w6"], [plain])[0].outputs[0].token_ids
    outs = _gen(llm, ["w5 w6", "w7"], [plain, SamplingParams(
        max_tokens=4, structured_outputs=SO(json_object=True))])
    assert outs[0].outputs[0].token_ids == solo
    assert outs[1].outputs[0].finish_reason == "error"
    assert "no token can continue it" in outs[1].error


def test_async_scheduling_overlaps_constrained_steps_and_gives_the_same_tokens(tiny_model_dir):
    """With async scheduling a constrained step's forward is launched before the step in
    flight is done (`Executor.start_forward`), its bitmask built after that step's tokens are
    accepted: every output equals the one-step-at-a-time run's, constrained or not, greedy or
    seeded, finishing by the constraint or by max_tokens while the others go on."""
    params = [
        SamplingParams(temperature=0.0, max_tokens=12, structured_outputs=SO(
            regex=r"(w[0-9]+){1,6}")),
        SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=3, max_tokens=9, structured_outputs=SO(
            choice=["w3w4", "w5", "w6w7w8"])),
        SamplingParams(temperature=0.8, seed=5, max_tokens=14, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=11, max_tokens=5, structured_outputs=SO(
            regex=r"(w1[0-9]*)+")),
    ]
    prompts = ["w5 w6", "w7 w8 w9", "w2", "w4 w4", "w9 w1 w3"]
    runs = {}
    for async_ in (False, True):
        llm = LLM(str(tiny_model_dir), device="cpu", dtype="float32", num_kv_blocks=128,
                  block_size=4, max_model_len=64, async_scheduling=async_)
        ex = llm.engine.core.executor
        assert ex.supports_deferred_sampling is async_
        calls = []
        if async_:
            start = ex.start_forward
            ex.start_forward = lambda so: calls.append(so) or start(so)
        outs = _gen(llm, prompts, params)
        runs[async_] = [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]
        if async_:
            assert len(calls) >= 5  # deferred steps while constrained requests run
        assert not llm.engine.core.structured.has_requests
    assert runs[True] == runs[False]
    assert {r[1] for r in runs[False]} == {"stop", "length"}


# ---- HTTP ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smol_vocab_server(tmp_path_factory, smollm2_dir):
    """A tiny random model with SmolLM2's tokenizer (a real byte-level vocabulary), served."""
    from conftest import build_tiny_model
    from http_helpers import tiny_server

    folder = build_tiny_model(tmp_path_factory.mktemp("tiny-smolvocab"), vocab_size=49152)
    for f in smollm2_dir.iterdir():
        if f.name.startswith("tokenizer") or f.name == "chat_template.jinja":
            shutil.copy(f, folder / f.name)
    with tiny_server(folder) as url:
        yield url


@pytest.fixture(scope="module")
def smol_client(smol_vocab_server):
    import openai
    from http_helpers import KEY

    return openai.OpenAI(base_url=smol_vocab_server + "/v1", api_key=KEY, max_retries=0,
                         timeout=60)


SMALL = {"type": "object", "additionalProperties": False, "required": ["ok", "color"],
         "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green"]}}}
MSG = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("stream", [False, True])
def test_http_response_format_json_schema(smol_client, stream):
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": SMALL, "strict": True}}
    r = smol_client.chat.completions.create(model="tiny", messages=MSG, max_tokens=40,
                                            seed=3, response_format=rf, stream=stream)
    text = ("".join(c.choices[0].delta.content or "" for c in r if c.choices) if stream
            else r.choices[0].message.content)
    jsonschema.validate(json.loads(text), SMALL)


def test_http_guided_fields(smol_client):
    r = smol_client.completions.create(model="tiny", prompt="pick", max_tokens=8, seed=1,
                                       extra_body={"guided_choice": ["alpha", "beta"]})
    assert r.choices[0].text in ("alpha", "beta")
    r = smol_client.completions.create(model="tiny", prompt="n", max_tokens=8, seed=1,
                                       extra_body={"structured_outputs": {"regex": "[0-9]{4}"}})
    assert re.fullmatch("[0-9]{4}", r.choices[0].text)
    r = smol_client.chat.completions.create(model="tiny", messages=MSG, max_tokens=40,
                                            response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def _json_schema(strict):
    js = {"name": "x", "schema": SMALL}
    return {"type": "json_schema", "json_schema": js if strict is None else {**js,
                                                                            "strict": strict}}


def _is_small(text):
    jsonschema.validate(json.loads(text), SMALL)
    return True


# each request field that constrains the output: the body part, and what its output must be
FIELDS = {
    "response_format.json_schema": ({"response_format": _json_schema(True)}, _is_small),
    "response_format.json_schema.strict=false": ({"response_format": _json_schema(False)},
                                                 _is_small),
    "response_format.json_schema.no_strict": ({"response_format": _json_schema(None)},
                                              _is_small),
    "response_format.json_object": ({"response_format": {"type": "json_object"},
                                     "max_tokens": 6}, lambda t: t.startswith("{")),
    "structured_outputs.json": ({"structured_outputs": {"json": SMALL}}, _is_small),
    "guided_json": ({"guided_json": json.dumps(SMALL)}, _is_small),
    "guided_regex": ({"guided_regex": "[a-z]{2}-[0-9]{3}"},
                     lambda t: re.fullmatch("[a-z]{2}-[0-9]{3}", t)),
    "guided_choice": ({"guided_choice": ["alpha", "beta"]}, lambda t: t in ("alpha", "beta")),
    "guided_grammar": ({"guided_grammar": 'root ::= "x" [0-9] [0-9]'},
                       lambda t: re.fullmatch("x[0-9]{2}", t)),
}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("field", list(FIELDS))
def test_http_every_constraint_field_on_both_endpoints(smol_vocab_server, field, path, stream):
    """Each constraint field (strict or not) in chat and completions, streamed or not: the
    text fits it."""
    import httpx
    from http_helpers import KEY, events

    extra, fits = FIELDS[field]
    prompt = {"messages": MSG} if path.endswith("chat/completions") else {"prompt": "x"}
    r = httpx.post(smol_vocab_server + path, json={
        "model": "tiny", "max_tokens": 40, "seed": 2, "stream": stream, **prompt, **extra},
        headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == 200, r.text
    if stream:
        text = "".join(ch.get("text") or (ch.get("delta") or {}).get("content") or ""
                       for ev in events(r.text) for ch in ev["choices"])
    else:
        ch = r.json()["choices"][0]
        text = ch["text"] if "text" in ch else ch["message"]["content"]
    assert fits(text), text


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"messages": MSG, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format.json_schema.schema"),
    ("/v1/chat/completions", {"messages": MSG, "response_format": {"type": "json_schema"}},
     "response_format.json_schema.schema"),
    ("/v1/chat/completions", {"messages": MSG, "response_format": {"type": "yaml"}},
     "response_format.type"),
    ("/v1/completions", {"prompt": "x", "guided_regex": "(unclosed"}, "guided_regex"),
    ("/v1/completions", {"prompt": "x", "response_format": {"type": "yaml"}},
     "response_format.type"),
    ("/v1/completions", {"prompt": "x", "response_format": {"type": "json_object"},
                         "guided_regex": "a"}, "response_format"),
    ("/v1/completions", {"prompt": "x", "guided_json": "{bad"}, "guided_json"),
    ("/v1/completions", {"prompt": "x", "guided_regex": "a", "guided_choice": ["b"]},
     "guided_choice"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"jsn": {}}},
     "structured_outputs"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_http_bad_constraints_are_400_naming_the_field(smol_vocab_server, path, body, param,
                                                       stream):
    import httpx
    from http_helpers import KEY

    r = httpx.post(smol_vocab_server + path, json={"model": "tiny", **body, "stream": stream},
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "x", "guided_choice": ["alpha"]}, "guided_choice"),
    ("/v1/chat/completions", {"messages": MSG, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"const": "a"}}}},
     "response_format.json_schema.schema"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_http_a_constraint_that_cannot_be_met_is_400_naming_the_field(smol_vocab_server, path,
                                                                      body, param, stream):
    """Only EOS may follow the constraint's text and min_tokens masks EOS out: the request
    ends with a 400 (in a stream: an error event, then [DONE]) whose param names the field,
    not a 500, and a request after it is served."""
    import httpx
    from http_helpers import KEY, events

    def post(extra):
        return httpx.post(smol_vocab_server + path, json={"model": "tiny", **extra},
                          headers={"Authorization": f"Bearer {KEY}"}, timeout=60)

    r = post({**body, "max_tokens": 12, "min_tokens": 10, "stream": stream})
    if stream:
        assert r.status_code == 200
        error = events(r.text)[-1]["error"]
    else:
        assert r.status_code == 400, r.text
        error = r.json()["error"]
    assert error["param"] == param and "cannot be met" in error["message"], error
    assert error["type"] == "invalid_request_error"
    assert post({**body, "max_tokens": 12}).status_code == 200
