"""Nothing on the event loop scales with the input (issue 25, item 1): a multi-megabyte prompt
is parsed, templated and tokenized on worker threads and refused as soon as a prefix of it
cannot fit max_model_len, while /health and a small completion answer within a second."""

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
    with tiny_server(tiny_model_dir, {**ENGINE_KEYS, "max_request_body_bytes": LIMIT}) as url:
        yield url


def test_prefix_refusal_reads_only_a_prefix(tiny_model_dir):
    from pagebatch.errors import ContextLengthError
    from pagebatch.prompt_length import tokenize_within
    from pagebatch.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny_model_dir)
    with pytest.raises(ContextLengthError, match=r"at least \d+ tokens \(in its first \d+ of "
                       r"3600000 characters\); max_model_len=128 leaves room for 120"):
        tokenize_within(tok, HUGE, 128, 8)
    assert tokenize_within(tok, "w5 w6", 128, 8) == tok("w5 w6")["input_ids"]
    text = "w9 " * 3000  # cut points fall between words: the prefix's ids are the whole's first
    whole = tok(text)["input_ids"]
    assert tokenize_within(tok, text, 10**6, None) == whole


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"model": MODEL, "prompt": HUGE, "max_tokens": 4}),
    ("/v1/chat/completions", {"model": MODEL, "max_tokens": 4,
                              "messages": [{"role": "user", "content": HUGE}]}),
    ("/tokenize", {"model": MODEL, "prompt": HUGE}),
])
def test_huge_prompt_does_not_stall_others(big_base, path, body):
    results: list[httpx.Response] = []

    def huge() -> None:
        results.append(httpx.post(big_base + path, json=body, headers=AUTH, timeout=120))

    threads = [threading.Thread(target=huge) for _ in range(3)]
    for t in threads:
        t.start()
    time.sleep(0.3)  # the bodies are on their way / being parsed
    worst = 0.0
    while any(t.is_alive() for t in threads):
        t0 = time.monotonic()
        assert httpx.get(big_base + "/health", timeout=5).status_code == 200
        r = httpx.post(big_base + "/v1/completions", headers=AUTH, timeout=5,
                       json={"model": MODEL, "prompt": "w5 w6", "max_tokens": 1})
        assert r.status_code == 200, r.text
        worst = max(worst, time.monotonic() - t0)
        if len(results) == 3:
            break
    for t in threads:
        t.join(60)
    assert worst < 1.0, f"a small request took {worst:.2f}s while huge ones were refused"
    assert [r.status_code for r in results] == [400] * 3, results[0].text
    msg = results[0].json()["error"]["message"]
    assert "max_model_len=128" in msg and "at least" in msg, msg
