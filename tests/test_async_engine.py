"""AsyncEngine on the tiny model, with the core in its own process and in this one: concurrent
streams, aborts, bad requests, a failing request, a killed core process, startup errors."""

from __future__ import annotations

import asyncio
from functools import partial
import os
import signal
import time

import pytest

from pagebatch import AsyncEngine, SamplingParams
from pagebatch.core_client import InprocClient
from pagebatch.errors import (CacheTooSmallError, ContextLengthError, EngineDeadError,
                              InvalidRequestError, InvalidTokenError, SamplingParamsError)
from procs import engine_core_children, one_thread_children, wait_gone
from tiny import engine_config, random_prompts

ENGINE_KEYS = dict(device="cpu", dtype="float32", num_kv_blocks=96, block_size=4,
                   max_model_len=128)


tiny_config = partial(engine_config, keys=ENGINE_KEYS)


@pytest.fixture(scope="module")
def mp_engine(tiny_model_dir):
    with one_thread_children():
        engine = AsyncEngine.from_config(tiny_config(tiny_model_dir), multiprocess=True)
    yield engine
    engine.shutdown()
    assert wait_gone(engine.engine.core.pid, 10)


@pytest.fixture(scope="module")
def inproc_engine(tiny_model_dir):
    engine = AsyncEngine.from_config(tiny_config(tiny_model_dir), multiprocess=False)
    yield engine
    engine.shutdown()


@pytest.fixture(params=["multiprocess", "inproc"])
def engine(request):
    return request.getfixturevalue("mp_engine" if request.param == "multiprocess"
                                   else "inproc_engine")


def _prompts(n: int, seed: int = 3) -> list[dict]:
    return [{"prompt_token_ids": p} for p in random_prompts(n, seed, max_len=30)]


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


async def _collect(stream) -> list:
    return [out async for out in stream]


def _kv(engine: AsyncEngine):
    return engine.engine.core.core.kv_cache  # InprocClient -> EngineCore


def test_concurrent_requests_match_solo(engine):
    prompts = _prompts(8)

    async def main():
        streams = [await engine.add_request(p, _greedy(12)) for p in prompts]
        together = await asyncio.gather(*[_collect(s) for s in streams])
        alone = [await _collect(await engine.add_request(p, _greedy(12))) for p in prompts]
        return together, alone

    together, alone = asyncio.run(main())
    for outs, solo in zip(together, alone):
        final = outs[-1]
        assert final.finished and not any(o.finished for o in outs[:-1])
        # streamed: one output per step, or the newest of several when this reader fell
        # behind (AsyncEngine._iterate), so the token counts only grow, up to 12
        lens = [len(o.outputs[0].token_ids) for o in outs]
        assert lens == sorted(set(lens)) and lens[-1] == 12 and lens[0] >= 1
        assert final.outputs[0].finish_reason == "length"
        assert final.outputs[0].token_ids == solo[-1].outputs[0].token_ids
        assert final.outputs[0].text == solo[-1].outputs[0].text != ""


def test_abort_mid_stream_frees_blocks_while_others_continue(engine):
    inproc = isinstance(engine.engine.core, InprocClient)  # its blocks can be looked at

    async def main():
        victim = await engine.add_request({"prompt_token_ids": [5, 6, 7, 8, 9]}, _greedy(100),
                                          request_id="victim")
        others = [await engine.add_request(p, _greedy(30)) for p in _prompts(3, seed=8)]
        seen = []
        async for out in victim:
            seen.append(out)
            if len(seen) == 3:
                await engine.abort("victim")
        if inproc:  # freed at once, while the others still run
            core = engine.engine.core.core
            assert "victim" not in core.scheduler.requests
            assert core.kv_cache.block_ids("victim") == []
        results = await asyncio.gather(*[_collect(s) for s in others])
        return seen, results

    seen, results = asyncio.run(main())
    last = seen[-1].outputs[0]
    assert seen[-1].finished and last.finish_reason == "abort"
    assert 3 <= len(last.token_ids) < 100
    for outs in results:  # the others ran on to their max_tokens
        assert outs[-1].outputs[0].finish_reason == "length"
        assert len(outs[-1].outputs[0].token_ids) == 30
    if inproc:
        kv = _kv(engine)
        assert kv.num_free_blocks == kv.num_blocks


def test_bad_requests_raise_typed_errors_while_others_finish(engine):
    bad = [
        ({"prompt_token_ids": [5] * 120}, _greedy(20), ContextLengthError,
         "exceeds max_model_len"),
        ({"prompt_token_ids": [5]}, SamplingParams(temperature=-1.0), SamplingParamsError,
         "temperature"),
        ({"prompt_token_ids": [5, 999]}, _greedy(4), InvalidTokenError, "999"),
        ({"prompt_token_ids": [5]}, _greedy(4), InvalidRequestError, "already in use"),
    ]

    async def main():
        good = [await engine.add_request(p, _greedy(12), request_id=f"good{i}")
                for i, p in enumerate(_prompts(3, seed=5))]
        for prompt, params, exc, needle in bad:
            rid = "good0" if needle == "already in use" else None
            with pytest.raises(exc, match=needle):
                await engine.add_request(prompt, params, request_id=rid)
        return await asyncio.gather(*[_collect(s) for s in good])

    for outs in asyncio.run(main()):
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 12


def test_failing_request_ends_only_its_own_stream(inproc_engine, monkeypatch):
    """Output processing that raises for one request finishes it with an error (and aborts it
    in the core); the other streams go on."""
    front = inproc_engine.engine
    process = front._process

    def flaky(o):
        if o.request_id == "flaky":
            raise RuntimeError("boom")
        return process(o)

    monkeypatch.setattr(front, "_process", flaky)

    async def main():
        f = await inproc_engine.add_request({"prompt_token_ids": [4, 5]}, _greedy(50),
                                            request_id="flaky")
        ok = [await inproc_engine.add_request(p, _greedy(10)) for p in _prompts(2, seed=6)]
        return await _collect(f), await asyncio.gather(*[_collect(s) for s in ok])

    failed, others = asyncio.run(main())
    assert len(failed) == 1 and failed[0].finished
    assert failed[0].outputs[0].finish_reason == "error" and "boom" in failed[0].error
    assert all(len(o[-1].outputs[0].token_ids) == 10 for o in others)
    kv = _kv(inproc_engine)
    deadline = time.monotonic() + 5  # the core's abort lands on the output thread
    while kv.num_free_blocks != kv.num_blocks and time.monotonic() < deadline:
        time.sleep(0.01)
    assert kv.num_free_blocks == kv.num_blocks


def test_leaving_a_stream_early_aborts_the_request(inproc_engine):
    core = inproc_engine.engine.core.core

    async def main():
        stream = await inproc_engine.add_request({"prompt_token_ids": [7, 7]}, _greedy(100),
                                                 request_id="left")
        async for _ in stream:
            break
        await stream.aclose()

    asyncio.run(main())
    deadline = time.monotonic() + 5
    while "left" in core.scheduler.requests and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "left" not in core.scheduler.requests


def test_killed_core_process_fails_every_waiting_caller(tiny_model_dir):
    with one_thread_children():
        engine = AsyncEngine.from_config(tiny_config(tiny_model_dir, max_model_len=256),
                                         multiprocess=True)
    proc = engine.engine.core.proc
    try:
        async def main():
            first = asyncio.Event()

            async def consume(stream):
                async for _ in stream:
                    first.set()

            streams = [await engine.add_request(p, _greedy(200)) for p in _prompts(3, seed=9)]
            tasks = [asyncio.create_task(consume(s)) for s in streams]
            await asyncio.wait_for(first.wait(), 30)
            t0 = time.monotonic()
            os.kill(proc.pid, signal.SIGKILL)
            results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 10)
            waited = time.monotonic() - t0
            with pytest.raises(EngineDeadError):
                await engine.add_request(_prompts(1)[0], _greedy(4))
            return results, waited

        results, waited = asyncio.run(main())
        assert all(isinstance(r, EngineDeadError) for r in results), results
        assert "SIGKILL" in str(results[0])
        assert waited < 10
        assert proc.exitcode == -signal.SIGKILL  # reaped, not a zombie
        assert proc.pid not in engine_core_children()
        with pytest.raises(EngineDeadError):
            engine.check_health()
    finally:
        engine.shutdown()
    assert wait_gone(proc.pid, 5)


def test_startup_error_in_the_core_process_comes_back_typed(tiny_model_dir):
    before = engine_core_children()
    with pytest.raises(CacheTooSmallError, match="holds 3 blocks"):
        AsyncEngine.from_config(tiny_config(tiny_model_dir, num_kv_blocks=3), multiprocess=True)
    assert engine_core_children() <= before


class _Out:
    """A stand-in RequestOutput for the stream logic: its step number and ``finished``."""

    def __init__(self, step: int, finished: bool = False):
        self.step, self.finished = step, finished


def _drain(engine: AsyncEngine, items: list) -> tuple[list[int], BaseException | None]:
    """What a reader that comes only after ``items`` are all queued gets from them."""
    async def main():
        queue: asyncio.Queue = asyncio.Queue()
        for item in items:
            queue.put_nowait(item)
        got = []
        try:
            async for out in engine._iterate("never-added", queue):
                got.append(out.step)
        except RuntimeError as e:
            return got, e
        return got, None

    return asyncio.run(main())


def test_a_reader_behind_gets_the_newest_output(inproc_engine):
    """Outputs are cumulative, so a reader several outputs behind gets the newest only (as
    vLLM's output collector merges), an error after them still reaches it after the newest
    output, and one that keeps up gets every step."""
    assert _drain(inproc_engine, [_Out(1), _Out(2), _Out(3, finished=True)]) == ([3], None)
    got, err = _drain(inproc_engine, [_Out(1), _Out(2), RuntimeError("core died")])
    assert got == [2] and str(err) == "core died"
    assert _drain(inproc_engine, [RuntimeError("at once")])[0] == []

    async def keeps_up():
        queue: asyncio.Queue = asyncio.Queue()
        stream, got = inproc_engine._iterate("never-added", queue), []
        for step in (1, 2, 3):
            queue.put_nowait(_Out(step, finished=step == 3))
            got.append((await anext(stream)).step)
        return got

    assert asyncio.run(keeps_up()) == [1, 2, 3]
