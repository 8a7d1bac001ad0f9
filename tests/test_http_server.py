"""The `http` frontend plugin (`pagebatch serve`): a real uvicorn server on 127.0.0.1 over the
tiny model (engine core in its own process), driven with the `openai` package and httpx."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import time

import httpx
import openai
import pytest
import uvicorn

from pagebatch import AsyncEngine, EngineConfig
from pagebatch.cli import _config_from_args, build_parser
from pagebatch.plugins.frontends.http.server import Settings, build_app
from procs import one_thread_children

KEY = "test-key"
MODEL = "tiny"
ENGINE_KEYS = dict(device="cpu", dtype="float32", num_kv_blocks=96, block_size=4,
                   max_model_len=128, served_model_name=MODEL, api_key=KEY,
                   max_prompts_per_request=8, max_n_per_request=4,
                   max_request_body_bytes=20000)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    config = EngineConfig.from_sources(cli={"model": str(tiny_model_dir), **ENGINE_KEYS})
    with one_thread_children():
        engine = AsyncEngine.from_config(config, multiprocess=True)
    port = _free_port()
    srv = uvicorn.Server(uvicorn.Config(build_app(engine, config), host="127.0.0.1", port=port,
                                       log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert srv.started
    yield f"http://127.0.0.1:{port}", engine
    srv.should_exit = True
    thread.join(10)
    engine.shutdown()


@pytest.fixture(scope="module")
def base(server):
    return server[0]


@pytest.fixture(scope="module")
def http(base):
    with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def client(base):
    return openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=60)


PROMPT = "w5 w6 w7 w8"
GREEDY = dict(temperature=0.0, max_tokens=8, extra_body={"ignore_eos": True})


def _events(text: str) -> list:
    """The data lines of an SSE body; the last must be [DONE]."""
    assert all(part.startswith("data: ") for part in text.split("\n\n") if part)
    datas = [p[len("data: "):] for p in text.split("\n\n") if p]
    assert datas[-1] == "[DONE]"
    return [json.loads(d) for d in datas[:-1]]


def _metric(http, name: str, labels: str = "") -> float:
    text = http.get("/metrics").text
    m = re.search(rf"^{re.escape(name)}\{{[^}}]*{re.escape(labels)}[^}}]*\}} (\S+)$", text, re.M)
    assert m, f"{name} {labels} not in /metrics"
    return float(m.group(1))


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


def test_raw_sse_format(http):
    r = http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "w4"}], "max_tokens": 3,
        "stream": True, "n": 2, "stream_options": {"include_usage": True},
        "some_benchmark_field": 1})  # unknown fields are ignored
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = _events(r.text)
    assert {e["choices"][0]["index"] for e in events[:2]} == {0, 1}
    assert all(e["choices"][0]["delta"]["role"] == "assistant" for e in events[:2])
    assert sum(1 for e in events if e["usage"] is not None) == 1
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] <= 6
    assert all(e["object"] == "chat.completion.chunk" for e in events)


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

@pytest.mark.parametrize("body, param", [
    ({"prompt": PROMPT, "temperature": -1}, None),
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
])
@pytest.mark.parametrize("stream", [False, True])
def test_completion_input_errors_are_400(http, body, param, stream):
    r = http.post("/v1/completions", json={"model": MODEL, **body, "stream": stream})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == "invalid_request_error"
    if param:
        assert err["param"] == param


@pytest.mark.parametrize("body", [
    {"messages": []},
    {"messages": [{"content": "x"}]},
    {"messages": [{"role": "user", "content": "w4"}], "response_format": {"type": "json_object"}},
    {"messages": [{"role": "user", "content": "w4"}], "tool_choice": "auto"},
    {"messages": [{"role": "user", "content": "w4"}], "top_logprobs": 2},
    {"messages": [{"role": "user", "content": "w4"}], "max_tokens": 1000, "stream": True},
])
def test_chat_input_errors_are_400(http, body):
    r = http.post("/v1/chat/completions", json={"model": MODEL, **body})
    assert r.status_code == 400 and r.json()["error"]["message"], r.text


def test_bad_bodies(http):
    r = http.post("/v1/completions", content=b"{not json")
    assert r.status_code == 400
    assert http.post("/v1/completions", json=[1, 2]).status_code == 400
    r = http.post("/v1/completions", json={"prompt": "w5 " * 8000})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_unknown_model_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="nope", prompt=PROMPT, max_tokens=2)
    assert e.value.body["code"] == "model_not_found"


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


# ---- disconnect and metrics ----------------------------------------------------------------------

def test_disconnect_mid_stream_frees_kv(base, http):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 120, "n": 3, "ignore_eos": True,
            "stream": True}
    with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {KEY}"}) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            got = []
            for line in r.iter_lines():
                if line.startswith("data:"):
                    got.append(line)
                if len(got) >= 6:
                    break
            assert _metric(http, "pagebatch:num_requests_running") == 3
            steps = _metric(http, "pagebatch:engine_steps_total")
    deadline = time.monotonic() + 10
    while _metric(http, "pagebatch:kv_cache_usage_perc") > 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _metric(http, "pagebatch:kv_cache_usage_perc") == 0
    assert _metric(http, "pagebatch:num_requests_running") == 0
    assert _metric(http, "pagebatch:num_requests_waiting") == 0
    # far fewer steps than the 120 tokens asked for
    assert _metric(http, "pagebatch:engine_steps_total") - steps < 60


def test_metrics_after_known_traffic(client, http):
    def counts():
        return (_metric(http, "pagebatch:request_success_total", 'finished_reason="length"'),
                _metric(http, "pagebatch:prompt_tokens_total"),
                _metric(http, "pagebatch:generation_tokens_total"),
                _metric(http, "pagebatch:time_to_first_token_seconds_count"),
                _metric(http, "pagebatch:e2e_request_latency_seconds_count"))

    before = counts()
    client.completions.create(model=MODEL, prompt=PROMPT, n=2, **GREEDY)  # 4 + 2 x 8 tokens
    after = counts()
    assert [a - b for a, b in zip(after, before)] == [1, 4, 16, 1, 1]
    text = http.get("/metrics").text
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "num_preemptions_total", "prefix_cache_queries_total",
                 "prefix_cache_hits_total", "inter_token_latency_seconds_bucket",
                 "request_queue_time_seconds_count", "request_prefill_time_seconds_count",
                 "request_decode_time_seconds_count", "request_prompt_tokens_sum",
                 "request_generation_tokens_sum"):
        assert re.search(rf"^pagebatch:{name}\{{.*model_name=\"{MODEL}\"", text, re.M), name
    assert _metric(http, "pagebatch:request_queue_time_seconds_count") >= 1
    assert _metric(http, "pagebatch:kv_cache_usage_perc") == 0  # idle again


# ---- the command line --------------------------------------------------------------------------

def test_serve_options_from_cli_and_file(tmp_path, tiny_model_dir):
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(f"model: {tiny_model_dir}\nport: 9001\nhost: 127.0.0.1\napi-key: k\n")
    args = build_parser().parse_args(["serve", "--config", str(cfg), "--port", "9002"])
    s = Settings.from_config(_config_from_args(args))
    assert (s.port, s.host, s.api_key) == (9002, "127.0.0.1", "k")  # CLI > file > defaults
    assert s.shutdown_timeout == 30.0 and s.allowed_origins == []


# ---- examples/: the Grafana dashboard and the Kubernetes HPA -----------------------------------

ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]
_METRIC_RE = re.compile(r"pagebatch:[A-Za-z_][A-Za-z0-9_]*")


def _dashboard_exprs(node) -> list[str]:
    """Every PromQL text in a Grafana dashboard: targets' exprs and template queries."""
    out = []
    if isinstance(node, dict):
        for k, v in node.items():
            if k in ("expr", "definition") and isinstance(v, str):
                out.append(v)
            elif k == "query" and isinstance(v, str):
                out.append(v)
            else:
                out += _dashboard_exprs(v)
    elif isinstance(node, list):
        for v in node:
            out += _dashboard_exprs(v)
    return out


def test_example_metric_names_are_served(client, http):
    """Every pagebatch: series the Grafana dashboard and the HPA query is served at /metrics,
    exactly as named there (histograms as _bucket/_sum/_count, counters as _total)."""
    import yaml

    dash = json.loads((ROOT / "examples/grafana/pagebatch-dashboard.json").read_text())
    exprs = _dashboard_exprs(dash)
    used = {m for e in exprs for m in _METRIC_RE.findall(e)}
    hpa_text = (ROOT / "examples/kubernetes/hpa.yaml").read_text()
    hpa = yaml.safe_load(hpa_text)
    assert hpa["apiVersion"] == "autoscaling/v2" and hpa["kind"] == "HorizontalPodAutoscaler"
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    assert metric["pods"]["metric"]["name"] == "pagebatch:num_requests_waiting"
    assert 40 <= float(metric["pods"]["target"]["averageValue"]) <= 60
    hpa_used = set(_METRIC_RE.findall(hpa_text))
    assert hpa_used == {"pagebatch:num_requests_waiting"}
    used |= hpa_used
    # the panels the issue asks for are there
    for family in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                   "generation_tokens_total", "time_to_first_token_seconds_bucket",
                   "inter_token_latency_seconds_bucket", "e2e_request_latency_seconds_bucket",
                   "num_preemptions_total", "prefix_cache_hits_total",
                   "prefix_cache_queries_total"):
        assert "pagebatch:" + family in used, family

    # labelled counters (request_success) appear once a request has finished
    client.completions.create(model=MODEL, prompt=PROMPT, **GREEDY)
    served = {line.split("{")[0].split(" ")[0]
              for line in http.get("/metrics").text.splitlines()
              if line.startswith("pagebatch:")}
    missing = sorted(used - served)
    assert not missing, f"used in examples/ but not served at /metrics: {missing}"


# ---- SIGTERM -----------------------------------------------------------------------------------

def test_sigterm_drains_and_exits_cleanly(tiny_model_dir):
    """`pagebatch serve` as a process: on SIGTERM a running stream completes (inside
    --shutdown-timeout), new requests are turned away, and the process exits with status 0
    leaving no child (the engine core) behind. Turned away means one of two things, by
    phase: until uvicorn's main loop sees the signal (<= 0.1 s) the app is draining and
    answers 503 `shutting_down`; after that the listening socket is closed (connection
    refused). Never a 200."""
    import os
    import signal
    import subprocess
    import sys

    psutil = pytest.importorskip("psutil")  # optional (tests/procs.py)
    from procs import wait_gone

    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "pagebatch.cli", "--log-level", "WARNING", "serve",
         str(tiny_model_dir), "--device", "cpu", "--dtype", "float32", "--port", str(port),
         "--max-model-len", "256", "--num-kv-blocks", "512", "--block-size", "4",
         "--shutdown-timeout", "15"],
        env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    children: list = []
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, "pagebatch serve exited early"
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.1)
        children = psutil.Process(proc.pid).children(recursive=True)
        assert children  # the engine core process

        events: list = []
        started = threading.Event()

        def stream() -> None:
            body = {"prompt": "w5 w6", "max_tokens": 250, "n": 4, "ignore_eos": True,
                    "stream": True}
            with httpx.stream("POST", base + "/v1/completions", json=body, timeout=30) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[len("data: "):])
                        started.set()

        t = threading.Thread(target=stream, daemon=True)
        t.start()
        assert started.wait(30)
        proc.send_signal(signal.SIGTERM)

        refused, answers = False, []
        deadline = time.monotonic() + 5
        while not refused and time.monotonic() < deadline:
            try:
                r = httpx.post(base + "/v1/completions", timeout=5,
                               json={"prompt": "w5", "max_tokens": 2})
                answers.append((r.status_code, r.json()["error"]["code"]))
            except httpx.ConnectError:
                refused = True
            time.sleep(0.01)
        assert refused, answers
        assert all(a == (503, "shutting_down") for a in answers), answers

        t.join(20)
        assert not t.is_alive()
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        reasons, texts = {}, {i: "" for i in range(4)}
        for c in chunks:
            for ch in c["choices"]:
                texts[ch["index"]] += ch["text"]
                if ch["finish_reason"] is not None:
                    reasons[ch["index"]] = ch["finish_reason"]
        assert reasons == {i: "length" for i in range(4)}
        assert all(len(x.split()) > 200 for x in texts.values())  # 250 tokens, some special

        assert proc.wait(15) == 0
        for child in children:
            assert wait_gone(child.pid, 10), f"child {child.pid} left running"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        for child in children:
            try:
                child.kill()
            except psutil.NoSuchProcess:
                pass


# ---- pagebatch bench serve ---------------------------------------------------------------------

@pytest.mark.parametrize("extra", [
    ["--request-rate", "40", "--max-concurrency", "3"],
    ["--prompt-kind", "text"],  # request rate inf: all at once
])
def test_bench_serve(base, tmp_path, capsys, extra):
    from pagebatch.cli import main

    out = tmp_path / "serve.json"
    rc = main(["bench", "serve", "--base-url", base, "--api-key", KEY, "--num-prompts", "6",
               "--input-len", "8", "--output-len", "6", "--vocab-size", "256",
               "--output", str(out), *extra])
    assert rc == 0
    assert "TTFT" in capsys.readouterr().out
    r = json.loads(out.read_text())
    assert (r["completed"], r["failed"], r["errors"]) == (6, 0, [])
    assert r["model"] == MODEL and r["total_output_tokens"] == 36  # ignore_eos
    if "text" not in extra:
        assert r["total_input_tokens"] == 48
    assert r["duration_s"] > 0
    assert r["request_throughput"] == pytest.approx(6 / r["duration_s"])
    assert r["output_token_throughput"] == pytest.approx(36 / r["duration_s"])
    assert r["total_token_throughput"] > r["output_token_throughput"]
    for name in ("ttft", "tpot", "itl", "e2el"):
        s = r[name]
        assert 0 < s["median_ms"] <= s["p99_ms"] and 0 < s["mean_ms"] <= s["p99_ms"], name
    assert r["ttft"]["p99_ms"] <= r["e2el"]["p99_ms"]
    assert r["e2el"]["p99_ms"] <= r["duration_s"] * 1e3


def test_health_503_once_engine_core_is_killed(tiny_model_dir):
    """A server of its own (the module's engine must live on): kill its engine core process
    and /health turns 503, and so do new requests."""
    psutil = pytest.importorskip("psutil")  # optional (tests/procs.py)
    from procs import engine_core_children, wait_gone

    config = EngineConfig.from_sources(cli={"model": str(tiny_model_dir), **ENGINE_KEYS})
    before = engine_core_children()
    with one_thread_children():
        engine = AsyncEngine.from_config(config, multiprocess=True)
    (core_pid,) = engine_core_children() - before
    port = _free_port()
    srv = uvicorn.Server(uvicorn.Config(build_app(engine, config), host="127.0.0.1", port=port,
                                       log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not srv.started and time.monotonic() < deadline:
            time.sleep(0.05)
        base = f"http://127.0.0.1:{port}"
        assert httpx.get(base + "/health").status_code == 200
        psutil.Process(core_pid).kill()
        assert wait_gone(core_pid, 10)
        deadline = time.monotonic() + 10
        while httpx.get(base + "/health").status_code != 503 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert httpx.get(base + "/health").status_code == 503
        r = httpx.post(base + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                       json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2}, timeout=10)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead", r.text
    finally:
        srv.should_exit = True
        thread.join(10)
        engine.shutdown()
