"""The `http` frontend plugin (`pagebatch serve`), its API: a real uvicorn server on 127.0.0.1
over the tiny model (engine core in its own process), driven with the `openai` package (sync and
async, streaming and not) and httpx for raw checks: endpoints, response and chunk shapes, usage,
finish reasons, logprobs, echo, and the status code of each kind of bad input.
Metrics: test_http_metrics.py; disconnects, SIGTERM, a dead core: test_http_lifecycle.py."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from http_helpers import GREEDY, KEY, MODEL, PROMPT, events


# ---- endpoints ---------------------------------------------------------------------------------

def test_models_health_version(http, base):
    models = http.get("/v1/models").json()
    assert models["data"][0]["id"] == MODEL and models["data"][0]["max_model_len"] == 128
    assert httpx.get(base + "/health").status_code == 200  # no key needed outside /v1
    assert "version" in httpx.get(base + "/version").json()


def test_tokenize_detokenize(http):
    toks = http.post("/tokenize", json={"prompt": PROMPT}).json()
    assert toks["tokens"] == [5, 6, 7, 8] and toks["count"] == 4
    assert http.post("/detokenize", json={"tokens": [5, 6]}).json()["prompt"] == "w5 w6"
    r = http.post("/detokenize", json={"tokens": [5, 10**6]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"


def test_completion_openai_sync(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, **GREEDY)
    assert r.object == "text_completion" and len(r.choices) == 1
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == 4 and r.usage.completion_tokens == 8
    assert r.usage.total_tokens == 12
    assert len(r.choices[0].text.split()) == 8


def test_completion_prompt_forms_and_n(client):
    """A list of prompts (strings or token ids) gives n choices per prompt, in order."""
    one = client.completions.create(model=MODEL, prompt=PROMPT, **GREEDY).choices[0].text
    r = client.completions.create(model=MODEL, prompt=[PROMPT, [5, 6, 7, 8]], n=2, **GREEDY)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert all(c.text == one for c in r.choices)  # greedy: every sample the same
    r = client.completions.create(model=MODEL, prompt=[[5, 6, 7, 8]], **GREEDY)
    assert r.choices[0].text == one


def test_completion_stop_and_finish_reason(client):
    full = client.completions.create(model=MODEL, prompt=PROMPT, **GREEDY).choices[0].text
    word = full.split()[2]
    r = client.completions.create(model=MODEL, prompt=PROMPT, stop=[word], **GREEDY)
    assert r.choices[0].finish_reason == "stop" and word not in r.choices[0].text
    assert full.startswith(r.choices[0].text)


def test_completion_logprobs_and_echo(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, logprobs=2, echo=True,
                                  **GREEDY)
    c = r.choices[0]
    assert c.text.startswith(PROMPT)
    lp = c.logprobs
    assert len(lp.tokens) == 4 + 8 and lp.token_logprobs[0] is None  # prompt's first token
    assert all(x <= 0 for x in lp.token_logprobs[1:])
    assert all(1 <= len(t) <= 3 for t in lp.top_logprobs[1:])  # top 2 (+ the actual token)
    assert lp.text_offset == sorted(lp.text_offset)
    # max_tokens 0 with echo scores the prompt only
    s = client.completions.create(model=MODEL, prompt=PROMPT, logprobs=0, echo=True,
                                  max_tokens=0)
    assert s.choices[0].text == PROMPT and len(s.choices[0].logprobs.tokens) == 4
    assert s.usage.completion_tokens == 0
    assert s.choices[0].logprobs.token_logprobs[1:] == lp.token_logprobs[1:4]


def test_chat_openai_sync_and_logprobs(client):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "w9 w10"}], temperature=0,
        max_completion_tokens=5, logprobs=True, top_logprobs=3,
        extra_body={"ignore_eos": True})
    c = r.choices[0]
    assert r.object == "chat.completion" and c.message.role == "assistant"
    assert c.finish_reason == "length" and r.usage.completion_tokens == 5
    assert len(c.logprobs.content) == 5
    assert all(len(t.top_logprobs) == 3 for t in c.logprobs.content)
    assert all(t.top_logprobs[0].logprob >= t.logprob for t in c.logprobs.content)


def test_streams_match_nonstreaming(client):
    want = client.completions.create(model=MODEL, prompt=PROMPT, **GREEDY).choices[0].text
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert [c.usage is None for c in chunks] == [True] * (len(chunks) - 1) + [False]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert chunks[-2].choices[0].finish_reason == "length"

    msgs = [{"role": "user", "content": "w9 w10"}]
    want = client.chat.completions.create(model=MODEL, messages=msgs, **GREEDY)
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, stream=True,
                                                 **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == \
        want.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


CHUNK_KEYS = {"id", "object", "created", "model", "choices", "usage"}


def _post_stream(http, path: str, body: dict) -> list:
    r = http.post(path, json={"model": MODEL, "stream": True, **body})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    assert r.text.endswith("data: [DONE]\n\n")
    return events(r.text)


def _per_choice(chunks: list, field: str) -> dict:
    """Completions chunks: choice index -> its `field` values, in order."""
    out: dict = {}
    for c in chunks:
        for ch in c["choices"]:
            out.setdefault(ch["index"], []).append(ch[field])
    return out


def test_raw_completion_chunks(http):
    """Chunk shape: the same id/created/model everywhere, one choice per chunk, one
    finish_reason per choice (its last chunk), usage null and no usage chunk unless asked."""
    body = {"prompt": [PROMPT, [9, 10]], "n": 2, "max_tokens": 5, "temperature": 0,
            "ignore_eos": True, "some_benchmark_field": 1}  # unknown fields are ignored
    chunks = _post_stream(http, "/v1/completions", body)
    assert all(set(c) == CHUNK_KEYS and c["usage"] is None for c in chunks)
    assert len({(c["id"], c["created"], c["model"], c["object"]) for c in chunks}) == 1
    assert chunks[0]["id"].startswith("cmpl-") and chunks[0]["model"] == MODEL
    assert chunks[0]["object"] == "text_completion"
    assert all(len(c["choices"]) == 1 for c in chunks)
    assert all(set(c["choices"][0]) == {"index", "text", "logprobs", "finish_reason",
                                        "stop_reason"} for c in chunks)
    reasons = _per_choice(chunks, "finish_reason")
    assert sorted(reasons) == [0, 1, 2, 3]  # prompt i, sample j -> index i * n + j
    assert all(r[-1] == "length" and set(r[:-1]) <= {None} for r in reasons.values())
    whole = http.post("/v1/completions", json={"model": MODEL, **body}).json()
    texts = {i: "".join(t) for i, t in _per_choice(chunks, "text").items()}
    assert texts == {c["index"]: c["text"] for c in whole["choices"]}


def test_raw_chat_chunks_and_usage(http):
    chunks = _post_stream(http, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "w4"}], "max_tokens": 3, "n": 2,
        "ignore_eos": True, "stream_options": {"include_usage": True}})
    assert all(set(c) == CHUNK_KEYS and c["object"] == "chat.completion.chunk"
               for c in chunks)
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("chatcmpl-")
    assert {c["choices"][0]["index"] for c in chunks[:2]} == {0, 1}
    assert all(c["choices"][0]["delta"] == {"role": "assistant", "content": ""}
               for c in chunks[:2])
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[2:-1])
    # exactly one usage chunk, the last, with no choices; every other chunk has usage null
    assert [c["usage"] is None for c in chunks] == [True] * (len(chunks) - 1) + [False]
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 6,
                                   "total_tokens": 9}  # "user w4 w3": 3 tokens
    finals = [c["choices"][0] for c in chunks[:-1] if c["choices"][0]["finish_reason"]]
    assert sorted(f["index"] for f in finals) == [0, 1]
    assert all(f["finish_reason"] == "length" for f in finals)


def _greedy_tokens(client, n: int = 4) -> list[int]:
    r = client.completions.create(model=MODEL, prompt=PROMPT, logprobs=0,
                                  **{**GREEDY, "max_tokens": n})
    return [int(t[1:]) for t in r.choices[0].logprobs.tokens]  # "wN" -> N


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("case", ["length", "eos", "stop_token_ids", "stop"])
def test_finish_and_stop_reasons(http, client, case, stream):
    """finish_reason "length" at max_tokens; "stop" on EOS (stop_reason null), on a
    stop_token_id (stop_reason the id) and on a stop string (stop_reason the string, not in
    the text); the same streaming or not."""
    toks = _greedy_tokens(client)
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0}
    want_reason, want_stop, n_tokens = "stop", None, None
    if case == "length":
        body["ignore_eos"], want_reason, n_tokens = True, "length", 6
    elif case == "eos":
        body["logit_bias"], n_tokens = {"2": 100}, 1  # EOS (id 2) first
    elif case == "stop_token_ids":
        body["stop_token_ids"], want_stop, n_tokens = [toks[2]], toks[2], 3
        body["ignore_eos"] = True
    else:
        body["stop"], want_stop = [f"w{toks[2]}"], f"w{toks[2]}"
        body["ignore_eos"] = True
    if stream:
        chunks = _post_stream(http, "/v1/completions", body)
        last = chunks[-1]["choices"][0]
        text = "".join(c["choices"][0]["text"] for c in chunks)
    else:
        r = http.post("/v1/completions", json={"model": MODEL, **body}).json()
        last = r["choices"][0]
        text = last["text"]
        if n_tokens is not None:
            assert r["usage"]["completion_tokens"] == n_tokens
    assert (last["finish_reason"], last["stop_reason"]) == (want_reason, want_stop)
    if case == "stop":
        assert text.split() == [f"w{t}" for t in toks[:2]]


def test_chat_finish_reasons(client):
    msgs = [{"role": "user", "content": "w9 w10"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, temperature=0,
                                       max_tokens=4, extra_body={"logit_bias": {"2": 100}})
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 1
    r = client.chat.completions.create(model=MODEL, messages=msgs, **GREEDY)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 8


def test_completion_stream_logprobs_and_echo_match_nonstreaming(http):
    """A stream's logprobs, chunk after chunk, add up to the one-body answer's: the same
    tokens, log-probs, top-N dicts and text offsets (which run on across chunks); with echo
    the first chunk starts with the prompt and its log-probs (the first one null)."""
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "logprobs": 2, "echo": True}
    whole = http.post("/v1/completions", json={"model": MODEL, **body}).json()["choices"][0]
    chunks = _post_stream(http, "/v1/completions", body)
    first = chunks[0]["choices"][0]
    assert first["text"].startswith(PROMPT)
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["text"]
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        joined = [x for c in chunks for x in c["choices"][0]["logprobs"][key]]
        assert joined == whole["logprobs"][key], key
    lp = whole["logprobs"]
    assert len(lp["tokens"]) == 4 + 6 and len(lp["top_logprobs"]) == 4 + 6
    assert all(2 <= len(t) <= 3 for t in lp["top_logprobs"][1:])  # top 2 (+ the sampled)
    # the prompt's first token has its text and null log-probs (as OpenAI and vLLM)
    assert (lp["tokens"][0], lp["token_logprobs"][0], lp["top_logprobs"][0]) == ("w5", None,
                                                                                 None)
    # offsets add up the tokens' texts (a token decoded alone: "w6", no space)
    assert lp["text_offset"] == [sum(map(len, lp["tokens"][:k])) for k in range(10)]


def test_chat_stream_logprobs_match_nonstreaming(http):
    body = {"messages": [{"role": "user", "content": "w9 w10"}], "max_tokens": 5,
            "temperature": 0, "ignore_eos": True, "logprobs": True, "top_logprobs": 2}
    whole = http.post("/v1/chat/completions", json={"model": MODEL, **body}).json()
    content = whole["choices"][0]["logprobs"]["content"]
    assert len(content) == 5
    for entry in content:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert entry["bytes"] == list(entry["token"].encode())
        assert len(entry["top_logprobs"]) == 2
        assert all(set(t) == {"token", "logprob", "bytes"} for t in entry["top_logprobs"])
    chunks = _post_stream(http, "/v1/chat/completions", body)
    streamed = [e for c in chunks for ch in c["choices"] if ch["logprobs"]
                for e in ch["logprobs"]["content"]]
    assert streamed == content
    assert chunks[0]["choices"][0]["logprobs"] is None  # the role chunk


def test_concurrent_streams_match_solo(base):
    """32 concurrent greedy streams (async openai client) give the texts of one-by-one runs
    (exactly: the tiny model's fp32 logits have no near-ties on these prompts)."""
    prompts = [" ".join(f"w{(7 * i + j) % 250 + 3}" for j in range(1 + i % 9))
               for i in range(32)]

    async def main():
        ac = openai.AsyncOpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0)

        async def one(p, stream):
            if not stream:
                r = await ac.completions.create(model=MODEL, prompt=p, **GREEDY)
                return r.choices[0].text
            s = await ac.completions.create(model=MODEL, prompt=p, stream=True, **GREEDY)
            return "".join([c.choices[0].text async for c in s])

        solo = [await one(p, False) for p in prompts]
        together = await asyncio.gather(*[one(p, True) for p in prompts])
        await ac.close()
        return solo, together

    solo, together = asyncio.run(main())
    assert together == solo


# ---- errors ------------------------------------------------------------------------------------

def _post(http, path, body):
    """POST ``body`` as JSON with non-ASCII escaped (httpx's encoder refuses lone surrogates)."""
    return http.post(path, content=json.dumps(body).encode(),
                     headers={"content-type": "application/json"})


@pytest.mark.parametrize("body, param", [
    ({"prompt": PROMPT, "temperature": -1}, "temperature"),
    ({"prompt": PROMPT, "max_tokens": 500}, None),  # context length
    ({"prompt": "", "max_tokens": 2}, None),
    ({"prompt": [], "max_tokens": 2}, "prompt"),
    ({"prompt": [5, 10**6], "max_tokens": 2}, None),
    ({"prompt": PROMPT, "n": 5}, "n"),  # above max_n_per_request
    ({"prompt": [PROMPT] * 9}, "prompt"),  # above max_prompts_per_request
    ({"prompt": PROMPT, "logit_bias": {"x": 1}}, "logit_bias"),
    ({"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
    ({"prompt": PROMPT, "tools": [{"type": "function"}]}, "tools"),
    ({"prompt": PROMPT, "suffix": "x"}, "suffix"),
    ({"prompt": PROMPT, "priority": "high"}, "priority"),
    ({"prompt": PROMPT, "logprobs": True}, "logprobs"),
    ({"prompt": PROMPT, "best_of": 3}, "best_of"),
    ({"prompt": PROMPT, "cache_salt": ""}, "cache_salt"),
    ({"prompt": PROMPT, "stream_options": "yes"}, "stream_options"),
    ({"prompt": PROMPT, "top_p": 0}, "top_p"),
    ({"prompt": PROMPT, "presence_penalty": 5}, "presence_penalty"),
    ({"prompt": PROMPT, "min_tokens": 9, "max_tokens": 2}, None),
    ({"prompt": PROMPT, "stop_token_ids": [999]}, None),  # outside the vocabulary
    ({"prompt": PROMPT, "logprobs": 1000}, None),
    ({"prompt": PROMPT, "n": 0}, None),
    ({"prompt": PROMPT, "seed": "x"}, "seed"),
    ({"prompt": PROMPT, "stop": [""]}, None),
    ({"prompt": PROMPT, "guided_json": "{not json"}, "guided_json"),
    # booleans are true or false (bool("false") is True), text is valid Unicode
    ({"prompt": PROMPT, "echo": "false"}, "echo"),
    ({"prompt": PROMPT, "ignore_eos": "no"}, "ignore_eos"),
    ({"prompt": PROMPT, "skip_special_tokens": 1}, "skip_special_tokens"),
    ({"prompt": PROMPT, "include_stop_str_in_output": "no"}, "include_stop_str_in_output"),
    ({"prompt": "\ud800 w5", "max_tokens": 2}, "prompt"),  # a lone surrogate
    ({"prompt": ["w5", "w6 \udfff"], "max_tokens": 2}, "prompt[1]"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_completion_input_errors_are_400(http, body, param, stream):
    r = _post(http, "/v1/completions", {"model": MODEL, **body, "stream": stream})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == "invalid_request_error"
    if param:
        assert err["param"] == param


@pytest.mark.parametrize("body", [
    {"messages": []},
    {"messages": [{"content": "x"}]},
    {"messages": [{"role": "user", "content": "w4"}], "response_format": {"type": "json_schema"}},
    {"messages": [{"role": "user", "content": "w4"}], "tool_choice": "auto"},
    {"messages": [{"role": "user", "content": "w4"}], "top_logprobs": 2},
    {"messages": [{"role": "user", "content": "w4"}], "max_tokens": 1000},  # context length
    {"messages": [{"role": "user", "content": "w4"}], "max_completion_tokens": 1000},
    {"messages": [{"role": "user", "content": "w4"}], "logprobs": 3},
    {"messages": [{"role": "user", "content": "w4"}], "n": 5},
    {"messages": [{"role": "user", "content": "w4"}], "echo": True},
    {"messages": [{"role": "user", "content": "w4"}], "temperature": "hot"},
    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
    {"messages": [{"role": "user", "content": 5}]},
    {"messages": "w4"},
    {"messages": [{"role": "user", "content": "w4 \ud800"}]},
    {"messages": [{"role": "user", "content": "w4"}], "logprobs": True, "top_logprobs": 100},
    {"messages": [{"role": "user", "content": "w4"}], "max_completion_tokens": -1},
    {"messages": [{"role": "user", "content": "w4"}], "echo": "false"},
    {"messages": [{"role": "user", "content": "w4"}], "logprobs": "true"},
])
@pytest.mark.parametrize("stream", [False, True])
def test_chat_input_errors_are_400(http, body, stream):
    r = _post(http, "/v1/chat/completions", {"model": MODEL, **body, "stream": stream})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == "invalid_request_error"


def test_chat_null_logprobs_is_the_default(http):
    r = http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "w4"}], "max_tokens": 2,
        "logprobs": None, "top_logprobs": None})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["logprobs"] is None


def test_stream_options_without_stream_is_400(http):
    for path, body in (("/v1/completions", {"prompt": PROMPT}),
                       ("/v1/chat/completions", {"messages": [{"role": "user",
                                                               "content": "w4"}]})):
        r = http.post(path, json={"model": MODEL, **body,
                                  "stream_options": {"include_usage": True}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options"


def test_chat_errors_name_the_chat_fields(http):
    msgs = [{"role": "user", "content": "w4"}]
    r = _post(http, "/v1/chat/completions", {"model": MODEL, "messages": msgs,
                                             "logprobs": True, "top_logprobs": 100})
    assert r.json()["error"]["param"] == "top_logprobs"
    assert "top_logprobs=100" in r.json()["error"]["message"]
    r = _post(http, "/v1/chat/completions", {"model": MODEL, "messages": msgs,
                                             "max_completion_tokens": -1})
    assert r.json()["error"]["param"] == "max_completion_tokens"


def test_stream_flags_are_booleans(http):
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "stream": "false"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream"
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "stream": True,
                                           "stream_options": {"include_usage": "x"}})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "stream_options.include_usage"


def test_bad_bodies(http):
    r = http.post("/v1/completions", content=b"{not json")
    assert r.status_code == 400
    deep = b'{"prompt": ' + b"[" * 6000 + b"]" * 6000 + b"}"  # RecursionError in json.loads
    r = http.post("/v1/completions", content=deep)
    assert r.status_code == 400 and "nested too deeply" in r.json()["error"]["message"]
    r = _post(http, "/tokenize", {"model": MODEL, "prompt": "\ud800"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert http.post("/v1/completions", json=[1, 2]).status_code == 400
    r = http.post("/v1/completions", json={"prompt": "w5 " * 8000})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_unknown_path_and_method_answer_in_the_error_shape(http):
    r = http.get("/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    assert "/v1/nothing" in r.json()["error"]["message"]
    r = http.get("/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    assert "POST" in r.headers["allow"]


def test_unknown_model_404(client, http, tiny_model_dir):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="nope", prompt=PROMPT, max_tokens=2)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user",
                                                                "content": "w4"}])
    r = http.post("/v1/completions", json={"model": "nope", "prompt": PROMPT, "stream": True})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"  # before the stream
    # with --served-model-name the model's path is not a name of it (vLLM alike)
    r = http.post("/v1/completions", json={"model": str(tiny_model_dir), "prompt": PROMPT})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_model_and_user_must_be_strings(http, path):
    body = {"prompt": PROMPT} if "chat" not in path else {
        "messages": [{"role": "user", "content": "w4"}]}
    for field in ("model", "user"):
        r = http.post(path, json={**body, "max_tokens": 2, field: 5})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    r = http.post(path, json={**body, "max_tokens": 2, "user": "someone"})
    assert r.status_code == 200


def test_api_key_401(base):
    assert httpx.get(base + "/v1/models").status_code == 401
    r = httpx.get(base + "/v1/models", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    # a forged Host header or an absolute URL does not change the scope's path
    r = httpx.get(base + "/v1/models", headers={"Host": "localhost:1"})
    assert r.status_code == 401
    bad = openai.OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w4"}],
                                    stream=True)
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/", "/v1"):
        r = httpx.post(base + path, json={"model": MODEL, "prompt": PROMPT},
                       headers={"Authorization": f"Bearer {KEY}x"})
        assert r.status_code == 401, path
    # /tokenize and /detokenize compute on user input: keyed too (tests/test_http_auth.py)
    assert httpx.post(base + "/tokenize", json={"prompt": PROMPT}).status_code == 401
    # /health, /version and (by default) /metrics need no key
    assert httpx.get(base + "/metrics").status_code == 200
    r = httpx.post(base + "/tokenize", json={"prompt": PROMPT},
                   headers={"Authorization": f"bearer {KEY}"})  # RFC 7235: any case
    assert r.status_code == 200


def test_a_model_without_tokenizer_streams_a_chunk_per_step(tiny_model_dir, tmp_path):
    """Token-id prompts on a folder with no tokenizer (every text empty): a stream still gets a
    chunk for each step that generated tokens (vLLM's rule), so a client's TTFT is the first
    token's, not the last's (`pagebatch bench serve` against dummy-weight model folders). A
    stream that falls behind the steps gets the newest of several outputs in one chunk
    (AsyncEngine._iterate), so the count is at least 2 of 32 (withheld text would be 1)."""
    import shutil

    from http_helpers import tiny_server

    bare = tmp_path / "bare"
    bare.mkdir()
    for f in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(tiny_model_dir / f, bare / f)
    from http_helpers import ENGINE_KEYS

    with tiny_server(bare, {**ENGINE_KEYS, "load_format": "dummy"}) as base:
        with httpx.Client(base_url=base, timeout=60,
                          headers={"Authorization": f"Bearer {KEY}"}) as h:
            body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 32,
                    "temperature": 0, "ignore_eos": True, "stream": True}
            r = h.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            chunks = events(r.text)
    choice_chunks = [c for c in chunks if c.get("choices")]
    assert len(choice_chunks) >= 2, chunks  # the first token's chunk comes before the end
    assert choice_chunks[-1]["choices"][0]["finish_reason"] == "length"
