"""A bounded soak (issue 25, item 6): a few hundred mixed requests at concurrency against a real
uvicorn server over the tiny model (n > 1, streams the client closes mid-way, max_tokens 1,
multi-prompt, chat), then every KV block is free and every per-request table is empty, in the
engine core (its requests, the scheduler's queues, the block tables, the runner's input batch
rows) and in the front half (detokenizer states, streams, the server's running set); every
request the client did not abort got its whole answer. The core runs on the engine's thread
here (multiprocess=False) so that the test can read its tables."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time

import httpx

from http_helpers import ENGINE_KEYS, KEY, MODEL, events, uvicorn_server

N_REQUESTS = 300
CONCURRENCY = 24


@contextlib.contextmanager
def inproc_server(model_dir):
    from pagebatch import AsyncEngine, EngineConfig
    from pagebatch.plugins.frontends.http.server import build_app

    config = EngineConfig.from_sources(cli={"model": str(model_dir), **ENGINE_KEYS,
                                            "enable_prefix_caching": True})
    engine = AsyncEngine.from_config(config, multiprocess=False)
    try:
        app = build_app(engine, config)
        with uvicorn_server(app) as base:
            yield base, engine, app.state.server
    finally:
        engine.shutdown()


def _body(kind: str, rng: random.Random) -> tuple[str, dict]:
    words = " ".join(f"w{rng.randrange(3, 256)}" for _ in range(rng.randrange(1, 12)))
    if kind == "chat":
        return "/v1/chat/completions", {"model": MODEL, "max_tokens": rng.randrange(1, 6),
                                        "messages": [{"role": "user", "content": words}],
                                        "n": rng.choice([1, 2]), "ignore_eos": True}
    body = {"model": MODEL, "prompt": words, "ignore_eos": True,
            "max_tokens": 1 if kind == "one" else rng.randrange(1, 8),
            "n": rng.choice([1, 2, 3]) if kind == "n" else 1, "temperature": 0.8}
    if kind == "multi":
        body["prompt"] = [words, [5, 6, 7]]
    return "/v1/completions", body


async def _one(http: httpx.AsyncClient, i: int, rng: random.Random, sent: dict) -> str:
    kind = rng.choice(["one", "n", "multi", "chat", "stream", "stream_cut", "stream_cut"])
    path, body = _body("n" if kind.startswith("stream") else kind, rng)
    if not kind.startswith("stream"):
        r = await http.post(path, json=body)
        assert r.status_code == 200, r.text
        choices = r.json()["choices"]
        n_prompts = len(body["prompt"]) if isinstance(body.get("prompt"), list) and \
            isinstance(body["prompt"][0], (str, list)) and kind == "multi" else 1
        assert len(choices) == body["n"] * n_prompts
        assert all(c["finish_reason"] == "length" for c in choices), choices
        return "answered"
    body = {**body, "stream": True, "max_tokens": 30 if kind == "stream_cut" else 4}
    async with http.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        text = ""
        async for chunk in r.aiter_text():
            text += chunk
            if kind == "stream_cut" and text.count("data: ") >= 2:
                return "aborted"  # leaving the block closes the connection mid-stream
    chunks = events(text)
    reasons = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert reasons.count("length") == body["n"], chunks[-3:]
    return "answered"


async def _soak(base: str) -> dict[str, int]:
    rng = random.Random(0)
    sem = asyncio.Semaphore(CONCURRENCY)
    counts = {"answered": 0, "aborted": 0}
    limits = httpx.Limits(max_connections=CONCURRENCY * 2)
    async with httpx.AsyncClient(base_url=base, timeout=60, limits=limits,
                                 headers={"Authorization": f"Bearer {KEY}"}) as http:
        async def run(i: int) -> None:
            async with sem:
                counts[await _one(http, i, random.Random(rng.random()), counts)] += 1

        await asyncio.gather(*(run(i) for i in range(N_REQUESTS)))
    return counts


def test_soak_leaves_nothing_behind(tiny_model_dir):
    with inproc_server(tiny_model_dir) as (base, engine, server):
        t0 = time.monotonic()
        counts = asyncio.run(_soak(base))
        assert counts["answered"] + counts["aborted"] == N_REQUESTS
        assert counts["aborted"] > 20 and counts["answered"] > 150, counts
        core = engine.engine.core.core  # the InprocClient's EngineCore
        deadline = time.monotonic() + 10  # the last aborts land within a step or two
        while time.monotonic() < deadline and (core.scheduler.requests or server.active
                                               or engine.engine._states):
            time.sleep(0.05)
        sched, kv, batch = core.scheduler, core.kv_cache, core.runner.input_batch
        assert not sched.requests and not sched.waiting and not sched.running
        assert not kv.block_tables
        assert kv.num_free_blocks == kv.num_blocks, (kv.num_free_blocks, kv.num_blocks)
        assert not batch.requests and all(r is None for r in batch.row_req)
        assert not engine.engine._states and not engine.engine._core_ids
        assert not engine._streams and not server.active
        assert time.monotonic() - t0 < 60
