"""Nothing on the event loop scales with the input (issue 25, item 1): a multi-megabyte prompt
is parsed, templated and tokenized on worker threads and refused as soon as a prefix of it
cannot fit max_model_len, and a JSON schema that takes long to compile is compiled off the
engine core's step loop and refused when it outlasts the compile timeout, while /health and a
small completion answer within a second."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from http_helpers import ENGINE_KEYS, KEY, MODEL, tiny_server

AUTH = {"Authorization": f"Bearer {KEY}"}
HUGE = "w5 w6 w7 " * 400_000  # 3.6 MB of text, 1.2 M tokens
LIMIT = 8 * 2**20


@pytest.fixture(scope="module")
def big_base(tiny_model_dir):
    with tiny_server(tiny_model_dir, {**ENGINE_KEYS, "max_request_body_bytes": LIMIT,
                                      "structured_outputs_compile_timeout": 1.0}) as url:
        yield url


def test_prefix_refusal_reads_only_a_prefix(tiny_model_dir):
    from pagebatch.errors import ContextLengthError
    from pagebatch.prompt_length import tokenize_within
    from pagebatch.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny_model_dir)
    with pytest.raises(ContextLengthError, match=r"at least \d+ tokens \(\d+ in its first \d+ "
                       r"of 3600000 characters.*\); max_model_len=128 leaves room for 120"):
        tokenize_within(tok, HUGE, 128, 8)
    assert tokenize_within(tok, "w5 w6", 128, 8) == tok("w5 w6")["input_ids"]
    text = "w9 " * 3000  # cut points fall between words: the prefix's ids are the whole's first
    whole = tok(text)["input_ids"]
    assert tokenize_within(tok, text, 10**6, None) == whole


class _Counting:
    """A tokenizer that records the length of each text it is given."""

    def __init__(self, tok):
        self.tok, self.lengths = tok, []

    def get_vocab(self):
        return self.tok.get_vocab()

    def __call__(self, text, **kw):
        self.lengths.append(len(text))
        return self.tok(text, **kw)


@pytest.mark.parametrize("text", [
    "w5" * 1_800_000,  # no whitespace to cut at: 3.6 MB of one "word"
    "w5 w6 " * 20 + "w7" * 1_800_000,  # a short head, then one long run
    "w5 " * 200 + "\n" * 3_000_000,  # whitespace only after the head
])
def test_text_without_cuts_is_refused_unread(tiny_model_dir, text):
    from pagebatch.errors import ContextLengthError
    from pagebatch.prompt_length import tokenize_within
    from pagebatch.tokenizer import load_tokenizer

    tok = _Counting(load_tokenizer(tiny_model_dir))
    with pytest.raises(ContextLengthError, match="max_model_len=128"):
        tokenize_within(tok, text, 128, 8)
    assert sum(tok.lengths) < 20_000, tok.lengths  # never the whole text


def _probe_while(base: str, path: str, body: dict, n: int = 3) -> tuple[float, list]:
    """Send ``body`` to ``path`` n times at once; meanwhile /health and a small completion,
    again and again. Returns the slowest probe's seconds and the n responses."""
    results: list[httpx.Response] = []

    def huge() -> None:
        results.append(httpx.post(base + path, json=body, headers=AUTH, timeout=120))

    threads = [threading.Thread(target=huge) for _ in range(n)]
    for t in threads:
        t.start()
    time.sleep(0.3)  # the bodies are on their way / being parsed
    worst = 0.0
    while any(t.is_alive() for t in threads):
        t0 = time.monotonic()
        assert httpx.get(base + "/health", timeout=5).status_code == 200
        r = httpx.post(base + "/v1/completions", headers=AUTH, timeout=5,
                       json={"model": MODEL, "prompt": "w5 w6", "max_tokens": 1})
        assert r.status_code == 200, r.text
        worst = max(worst, time.monotonic() - t0)
        if len(results) == n:
            break
    for t in threads:
        t.join(60)
    return worst, results


# 100k messages (a body of 3 MB): checked by pydantic in pieces, each of which holds the GIL
MANY = [{"role": "user", "content": "w5"}] * 100_000 + [{"role": "nobody", "content": "w5"}]


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {"model": MODEL, "messages": MANY}, "messages[100000].role"),
    ("/tokenize", {"model": MODEL, "messages": MANY}, "messages[100000].role"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "w5"}] * 100_000 + [{"type": "text", "text": 5}]}]},
     "messages[0].content[100000].text"),
    ("/v1/chat/completions", {"model": MODEL, "messages": MANY[:1], "tools": [
        {"type": "function", "function": {"name": "f"}}] * 100_000 + [{"type": "function"}]},
     "tools[100000].function"),
    ("/detokenize", {"model": MODEL, "tokens": [5] * 1_000_000}, "tokens"),
])
def test_large_body_checks_do_not_stall_others(big_base, path, body, param):
    worst, results = _probe_while(big_base, path, body, n=1)
    assert worst < 1.0, f"a small request took {worst:.2f}s while a large body was checked"
    assert results[0].status_code == 400, results[0].text
    assert results[0].json()["error"]["param"] == param, results[0].text


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"model": MODEL, "prompt": HUGE, "max_tokens": 4}),
    ("/v1/chat/completions", {"model": MODEL, "max_tokens": 4,
                              "messages": [{"role": "user", "content": HUGE}]}),
    ("/tokenize", {"model": MODEL, "prompt": HUGE}),
])
def test_huge_prompt_does_not_stall_others(big_base, path, body):
    worst, results = _probe_while(big_base, path, body)
    assert worst < 1.0, f"a small request took {worst:.2f}s while huge ones were refused"
    assert [r.status_code for r in results] == [400] * 3, results[0].text
    msg = results[0].json()["error"]["message"]
    assert "max_model_len=128" in msg and "at least" in msg, msg


def _wide_schema(n: int) -> dict:
    return {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(n)},
            "required": ["p0"]}


@pytest.mark.parametrize("path,body", [
    # xgrammar compiles 1,500 properties in a few seconds on 2 cores (time grows ~n^3)
    ("/v1/chat/completions", {"model": MODEL, "max_tokens": 4,
                              "messages": [{"role": "user", "content": "w5"}],
                              "response_format": {"type": "json_schema", "json_schema": {
                                  "name": "wide", "schema": _wide_schema(1500)}}}),
    # 40,000 properties: built (not compiled) in the front half off the loop, ~1 MB
    ("/v1/completions", {"model": MODEL, "max_tokens": 4, "prompt": "w5",
                         "structured_outputs": {"json": _wide_schema(40_000)}}),
])
def test_a_slow_constraint_compile_does_not_stall_others(big_base, path, body):
    worst, results = _probe_while(big_base, path, body)
    assert worst < 1.0, f"a small request took {worst:.2f}s while a schema compiled"
    assert [r.status_code for r in results] == [400] * 3, results[0].text
    err = results[0].json()["error"]
    assert "structured_outputs_compile_timeout=1 s" in err["message"], err
    assert err["param"] in ("response_format.json_schema.schema", "structured_outputs.json")
