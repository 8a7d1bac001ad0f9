"""The `http` frontend when requests end early: a client that disconnects (streaming or not,
while tokens flow or while nothing is written), SIGTERM (drain, then abort), and a dead engine
core (an error event mid-stream, then 503s, then the server exits with status 1).

"Within two engine steps" is checked by the step counter at /metrics. The engine cores here
sleep before every step (tests/http_helpers.py `slow_core`), so a step outlasts the round trips
of a busy 2-core machine and the counter read before the disconnect is the step in progress.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import threading
import time

import httpx
import pytest

from pagebatch.plugins.frontends.http.streams import EventStreamResponse
from http_helpers import ENGINE_KEYS, KEY, MODEL, cli_args, events, metric, serve_process, \
    tiny_server

STEP_S = 0.2  # the slow core's sleep before each step
SLOW_KEYS = dict(ENGINE_KEYS, max_num_batched_tokens=16)  # a 110-token prompt: 7 prefill steps


@pytest.fixture(scope="module")
def slow_server(tiny_model_dir):
    with tiny_server(tiny_model_dir, SLOW_KEYS, step_s=STEP_S) as base:
        yield base


@pytest.fixture
def http(slow_server):
    with httpx.Client(base_url=slow_server, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=30) as c:
        yield c


def _steps(http) -> float:
    return metric(http, "pagebatch:engine_steps_total")


def _wait_for(cond, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def _idle(http) -> bool:
    return (metric(http, "pagebatch:num_requests_running") == 0
            and metric(http, "pagebatch:num_requests_waiting") == 0
            and metric(http, "pagebatch:kv_cache_usage_perc") == 0)


def _check_aborted_within_two_steps(http, s0: float, aborts0: float) -> float:
    """After the client left at step ``s0``: idle again (KV usage 0) by step s0 + 2, and one
    aborted request counted (whatever n). Returns the steps taken."""
    _wait_for(lambda: _idle(http))
    taken = _steps(http) - s0
    assert 0 <= taken <= 2, f"the abort took {taken} engine steps"
    assert metric(http, "pagebatch:request_success_total", 'finished_reason="abort"',
                  default=0) == aborts0 + 1
    return taken


def test_disconnect_mid_stream_aborts_all_n_within_two_steps(slow_server, http):
    aborts0 = metric(http, "pagebatch:request_success_total", 'finished_reason="abort"',
                     default=0)
    body = {"model": MODEL, "prompt": "w5 w6 w7 w8", "max_tokens": 100, "n": 3,
            "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=slow_server, headers={"Authorization": f"Bearer {KEY}"}) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            got = 0
            for line in r.iter_lines():
                got += line.startswith("data: ")
                if got == 6:  # two steps of 3 samples
                    break
            assert metric(http, "pagebatch:num_requests_running") == 3
            assert metric(http, "pagebatch:kv_cache_usage_perc") > 0
            s0 = _steps(http)
    _check_aborted_within_two_steps(http, s0, aborts0)


def test_disconnect_while_nothing_is_written(slow_server, http):
    """During a 7-step chunked prefill no byte of the stream is written; the disconnect is
    still seen at once (the response watches for it) and the request aborted before its
    first token."""
    aborts0 = metric(http, "pagebatch:request_success_total", 'finished_reason="abort"',
                     default=0)
    start = _steps(http)
    body = {"model": MODEL, "prompt": [5 + i % 200 for i in range(110)], "max_tokens": 5,
            "stream": True}
    with httpx.Client(base_url=slow_server, headers={"Authorization": f"Bearer {KEY}"}) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200  # headers only: the body has no event yet
            _wait_for(lambda: _steps(http) >= start + 2)
            assert metric(http, "pagebatch:num_requests_running") == 1
            s0 = _steps(http)
    _check_aborted_within_two_steps(http, s0, aborts0)
    assert _steps(http) - start < 7  # aborted mid-prefill


def test_disconnect_non_streaming_within_two_steps(slow_server, http):
    aborts0 = metric(http, "pagebatch:request_success_total", 'finished_reason="abort"',
                     default=0)
    body = json.dumps({"model": MODEL, "prompt": "w5 w6", "max_tokens": 100, "n": 2,
                       "ignore_eos": True}).encode()
    host, port = slow_server.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Authorization: Bearer " + KEY.encode() + b"\r\n"
                     b"Content-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        _wait_for(lambda: metric(http, "pagebatch:num_requests_running") == 2)
        s0 = _steps(http)
    _check_aborted_within_two_steps(http, s0, aborts0)


def test_event_stream_sees_disconnect_without_writing():
    """`EventStreamResponse` ends its body (whose finally aborts the requests) when the client
    disconnects, even while the body yields nothing, under ASGI spec 2.4 too (where
    starlette's StreamingResponse only notices on a failed write)."""

    async def main() -> bool:
        closed = asyncio.Event()

        async def body():
            try:
                await asyncio.sleep(60)
                yield "data: never\n\n"
            finally:
                closed.set()

        messages = [{"type": "http.request", "body": b"", "more_body": False}]

        async def receive():
            if messages:
                return messages.pop()
            await asyncio.sleep(0.05)
            return {"type": "http.disconnect"}

        sent = []

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}}
        await asyncio.wait_for(EventStreamResponse(body())(scope, receive, send), 5)
        assert sent[0]["type"] == "http.response.start"
        return closed.is_set()

    assert asyncio.run(main())


# ---- SIGTERM ----------------------------------------------------------------------------------

def _stream(base: str, body: dict, log: list) -> None:
    """Stream ``body`` and append (seconds since epoch, event data) pairs to ``log``."""
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                log.append((time.monotonic(), line[len("data: "):]))


def _choices(log: list) -> tuple[dict, dict]:
    """(index -> finish reason, index -> text) of a completions stream's events."""
    assert log and log[-1][1] == "[DONE]"
    reasons, texts = {}, {}
    for _, data in log[:-1]:
        for ch in json.loads(data)["choices"]:
            texts[ch["index"]] = texts.get(ch["index"], "") + ch["text"]
            if ch["finish_reason"] is not None:
                reasons[ch["index"]] = ch["finish_reason"]
    return reasons, texts


def test_sigterm_drains_then_aborts_and_exits_cleanly(tiny_model_dir, tmp_path):
    """`pagebatch serve` as a process, engine steps of 0.1 s, --shutdown-timeout 3. On SIGTERM
    new requests are turned away: 503 `shutting_down` until uvicorn's main loop sees the
    signal (<= 0.1 s), connection refused after (the listening socket is closed); never a 200.
    (a) A stream that finishes within the timeout runs to its end ("length"). (b) A stream and
    a one-body request still running at the timeout are aborted then: the stream ends with
    finish_reason "abort" and [DONE], the other gets a 200 saying "abort". The process exits
    with status 0 right after, leaving no engine core process behind."""
    psutil = pytest.importorskip("psutil")  # optional (tests/procs.py)
    from procs import wait_gone

    timeout_s = 3.0
    args = [str(tiny_model_dir), "--device", "cpu", "--dtype", "float32", "--max-model-len",
            "256", "--num-kv-blocks", "512", "--block-size", "4", "--shutdown-timeout",
            str(timeout_s)]
    with serve_process(args, tmp_path / "serve.log", step_s=0.1) as (proc, base):
        children = psutil.Process(proc.pid).children(recursive=True)
        assert children  # the engine core process

        short, long, whole = [], [], {}
        common = {"prompt": "w5 w6", "n": 2, "ignore_eos": True}

        def one_body() -> None:
            r = httpx.post(base + "/v1/completions", timeout=60,
                           json={**common, "n": 1, "max_tokens": 200})
            whole.update(status=r.status_code, body=r.json())

        threads = [threading.Thread(target=_stream, daemon=True, args=(base, {
                       **common, "max_tokens": 200, "stream": True}, long)),
                   threading.Thread(target=one_body, daemon=True),
                   threading.Thread(target=_stream, daemon=True, args=(base, {
                       **common, "max_tokens": 8, "stream": True}, short))]
        with httpx.Client(base_url=base, timeout=5) as plain:
            threads[0].start()
            threads[1].start()
            _wait_for(lambda: long and metric(plain, "pagebatch:num_requests_running") == 3)
        threads[2].start()  # 8 steps of 0.1 s: done well within the timeout
        _wait_for(lambda: short)
        t0 = time.monotonic()
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

        for t in threads:
            t.join(timeout_s + 10)
            assert not t.is_alive()
        # (a) finished within the timeout
        reasons, texts = _choices(short)
        assert reasons == {0: "length", 1: "length"}
        assert all(len(x.split()) == 8 for x in texts.values())
        # (b) aborted at the timeout, not before
        reasons, _ = _choices(long)
        assert reasons == {0: "abort", 1: "abort"}
        aborted_at = next(t for t, data in long if '"abort"' in data) - t0
        assert timeout_s - 0.5 <= aborted_at <= timeout_s + 3, aborted_at
        assert whole["status"] == 200
        assert whole["body"]["choices"][0]["finish_reason"] == "abort"
        assert whole["body"]["usage"]["completion_tokens"] < 200

        assert proc.wait(10) == 0
        assert time.monotonic() - t0 < timeout_s + 10
        for child in children:
            assert wait_gone(child.pid, 10), f"child {child.pid} left running"


def test_sigterm_to_the_process_group_drains_and_exits_cleanly(tiny_model_dir, tmp_path):
    """systemd and `kill -- -PGID` send SIGTERM to the server and its engine core at once: the
    core ignores it, the server drains (a stream in flight runs to its end) and exits 0, and
    nothing says the engine core died (it used to, racing the server's own handler)."""
    psutil = pytest.importorskip("psutil")
    from procs import wait_gone

    args = [str(tiny_model_dir), "--device", "cpu", "--dtype", "float32", "--max-model-len",
            "256", "--num-kv-blocks", "512", "--block-size", "4", "--shutdown-timeout", "20"]
    log_path = tmp_path / "serve.log"
    with serve_process(args, log_path, step_s=0.05) as (proc, base):
        children = psutil.Process(proc.pid).children(recursive=True)
        events: list = []
        t = threading.Thread(target=_stream, daemon=True, args=(base, {
            "prompt": "w5 w6", "max_tokens": 20, "ignore_eos": True, "stream": True}, events))
        t.start()
        _wait_for(lambda: events)
        os.killpg(proc.pid, signal.SIGTERM)
        t.join(30)
        assert not t.is_alive()
        reasons, texts = _choices(events)
        assert reasons == {0: "length"} and len(texts[0].split()) == 20
        assert proc.wait(30) == 0, log_path.read_text()[-3000:]
        for child in children:
            assert wait_gone(child.pid, 10), f"child {child.pid} left running"
    assert "engine core died" not in log_path.read_text()


# ---- a dead engine core ------------------------------------------------------------------------

def test_engine_core_killed_mid_stream(tiny_model_dir, tmp_path):
    """`pagebatch serve` as a process, engine steps of 0.1 s: kill its engine core process while
    a stream runs. The stream ends with an error event (503 engine_dead) then [DONE]; /health
    and new requests turn 503; then the server shuts itself down and exits with status 1
    within 30 s of the kill, its log naming the cause."""
    psutil = pytest.importorskip("psutil")  # optional (tests/procs.py)
    from procs import engine_core_children, wait_gone

    log = tmp_path / "serve.log"
    with serve_process([str(tiny_model_dir), *cli_args(ENGINE_KEYS)], log,
                       step_s=0.1) as (proc, base):
        (core,) = map(psutil.Process, engine_core_children(proc.pid))
        auth = {"Authorization": f"Bearer {KEY}"}
        body = {"model": MODEL, "prompt": "w5", "max_tokens": 100, "ignore_eos": True,
                "stream": True}
        lines = []
        with httpx.stream("POST", base + "/v1/completions", json=body, headers=auth,
                          timeout=30) as r:
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                if len(lines) == 1:
                    core.kill()
                    killed_at = time.monotonic()
        chunks = events("".join(line + "\n\n" for line in lines))
        assert "choices" in chunks[0]
        assert chunks[-1]["error"]["code"] == "engine_dead"
        assert chunks[-1]["error"]["type"] == "service_unavailable"
        assert wait_gone(core.pid, 10)
        assert httpx.get(base + "/health").status_code == 503
        r = httpx.post(base + "/v1/completions", headers=auth, timeout=10,
                       json={"model": MODEL, "prompt": "w5", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead", r.text
        assert proc.wait(max(0.0, 30 - (time.monotonic() - killed_at))) == 1, log.read_text()
    text = log.read_text()
    assert "the engine core died" in text and "killed by SIGKILL" in text, text[-3000:]
    assert "pagebatch serve exits with status 1" in text, text[-3000:]


def test_serve_runs_uvicorn_on_uvloop_and_httptools_where_installed(monkeypatch):
    """`serve` names uvicorn's loop and parser itself (they go into its start-up log line):
    uvloop and httptools when importable (the package depends on both), asyncio and h11
    when one is missing."""
    import importlib.util

    from pagebatch.plugins.frontends.http.server import uvicorn_implementations

    real = importlib.util.find_spec
    assert uvicorn_implementations() == (
        "uvloop" if real("uvloop") else "asyncio", "httptools" if real("httptools") else "h11")
    for missing, want in (("uvloop", ("asyncio", "httptools")),
                          ("httptools", ("uvloop", "h11"))):
        monkeypatch.setattr(importlib.util, "find_spec",
                            lambda name, m=missing: None if name == m else object())
        assert uvicorn_implementations() == want
