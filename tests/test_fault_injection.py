"""Fault injection in the style of vLLM's tests/v1/shutdown (issue 25, item 5), for what the
other tests do not cover already (output processing that raises: test_async_engine.py; a killed
engine core under the server: test_http_lifecycle.py; a killed parallel worker:
test_parallel_failures.py; a typed start-up error and the parent's death:
test_engine_core_client.py).

- an exception in one request's own processing (its detokenizer, its stop-string checker) fails
  that request alone with an error naming the cause; the others finish;
- an exception in a model step marks the engine dead (as vLLM's: the device state the step was
  changing cannot be trusted; core/engine_core.py `_step_failed`): in process every open stream
  gets EngineDeadError naming the cause and health fails; served, the same, and the core exits;
- an exception in the engine core's loop outside a step (the scheduler) kills the core: every
  open stream gets EngineDeadError, the process exits with status 1, nothing is left running;
- `pagebatch serve` with a start-up error exits non-zero, naming the cause.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from functools import partial
from typing import Any

import pytest

from pagebatch import AsyncEngine, SamplingParams
from pagebatch.errors import EngineDeadError
from procs import engine_core_children, one_thread_children, wait_gone
from tiny import engine_config

KEYS = dict(device="cpu", dtype="float32", num_kv_blocks=64, block_size=4, max_model_len=128)
POISON = 9  # a prompt holding this token id is the one whose processing fails


def _params(**kw: Any) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": 6, "ignore_eos": True, **kw})


async def _run(engine: AsyncEngine, prompts: list[list[int]], params: list[SamplingParams]):
    async def one(i: int):
        last = None
        async for out in await engine.add_request({"prompt_token_ids": prompts[i]},
                                                  params[i], f"r{i}"):
            last = out
        return last

    return await asyncio.gather(*(one(i) for i in range(len(prompts))))


@pytest.fixture
def inproc(tiny_model_dir):
    engine = AsyncEngine.from_config(engine_config(tiny_model_dir, KEYS), multiprocess=False)
    yield engine
    engine.shutdown()


def _assert_only_poisoned_failed(finals, poisoned: set[int], needle: str) -> None:
    for i, out in enumerate(finals):
        if i in poisoned:
            assert out.outputs[0].finish_reason == "error" and needle in out.error, out
        else:
            assert out.error is None and out.outputs[0].finish_reason == "length"
            assert len(out.outputs[0].token_ids) == 6


def test_detokenizer_fault_fails_its_request_alone(inproc, monkeypatch):
    from pagebatch.detokenizer import IncrementalDetokenizer

    add = IncrementalDetokenizer.add_tokens

    def flaky(self, ids, final=False):
        if POISON in self.tokens:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected detokenizer fault")
        return add(self, ids, final)

    monkeypatch.setattr(IncrementalDetokenizer, "add_tokens", flaky)
    prompts = [[5, 6, 7], [5, POISON, 7], [8, 6], [POISON]]
    finals = asyncio.run(_run(inproc, prompts, [_params()] * 4))
    _assert_only_poisoned_failed(finals, {1, 3}, "injected detokenizer fault")
    assert not inproc.engine._states and not inproc.engine.core.core.scheduler.requests


def test_stop_checker_fault_fails_its_request_alone(inproc, monkeypatch):
    from pagebatch.output import StopStrings

    def broken(self, *args, **kwargs):
        raise RuntimeError("injected stop-checker fault")

    monkeypatch.setattr(StopStrings, "check", broken)
    prompts = [[5, 6, 7], [5, 6, 7], [8, 6]]
    params = [_params(), _params(stop=["w999"]), _params()]  # only r1 has a stop checker
    finals = asyncio.run(_run(inproc, prompts, params))
    _assert_only_poisoned_failed(finals, {1}, "injected stop-checker fault")


def test_model_step_fault_marks_the_engine_dead(inproc, monkeypatch):
    runner = inproc.engine.core.core.runner
    execute = runner.execute
    calls = {"n": 0}

    def faulty(so):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected model-step fault")
        return execute(so)

    monkeypatch.setattr(runner, "execute", faulty)

    async def go():
        async def one(i):
            try:
                async for _ in await inproc.add_request({"prompt_token_ids": [5 + i, 6]},
                                                        _params(max_tokens=20), f"m{i}"):
                    pass
                return "finished"
            except EngineDeadError as e:
                return str(e)
        return await asyncio.gather(one(0), one(1))

    results = asyncio.run(go())
    assert all("injected model-step fault" in r for r in results), results
    with pytest.raises(EngineDeadError, match="injected model-step fault"):
        inproc.check_health()
    with pytest.raises(EngineDeadError):  # nothing new is taken
        asyncio.run(_run(inproc, [[5, 6]], [_params()]))


def faulty_core_main(after_steps: int, where: str, *args: Any, **kwargs: Any) -> None:
    """`run_engine_core` whose scheduler (``where="scheduler"``, outside the step's own error
    handling) or model runner (``"model"``) raises on its ``after_steps``-th call."""
    from pagebatch.core_proc import run_engine_core
    from pagebatch.model_runner import ModelRunner
    from pagebatch.scheduler import Scheduler

    owner, name = (Scheduler, "schedule") if where == "scheduler" else (ModelRunner, "execute")
    inner, calls = getattr(owner, name), [0]

    def faulty(self, *a, **k):
        calls[0] += 1
        if calls[0] == after_steps:
            raise RuntimeError(f"injected {where} fault")
        return inner(self, *a, **k)

    setattr(owner, name, faulty)
    run_engine_core(*args, **kwargs)


@pytest.mark.parametrize("where", ["scheduler", "model"])
def test_core_fault_marks_the_served_engine_dead(tiny_model_dir, monkeypatch, where):
    import test_fault_injection as me  # pickled by reference into the "spawn" child
    from pagebatch import core_client

    monkeypatch.setattr(core_client, "run_engine_core", partial(me.faulty_core_main, 4, where))
    before = engine_core_children()
    with one_thread_children():
        engine = AsyncEngine.from_config(engine_config(tiny_model_dir, KEYS), multiprocess=True)
    try:
        proc = engine.engine.core.proc

        async def go():
            results = []
            for i in range(3):
                try:
                    async for _ in await engine.add_request(
                            {"prompt_token_ids": [5, 6]}, _params(max_tokens=50), f"d{i}"):
                        pass
                    results.append("finished")
                except EngineDeadError as e:
                    results.append(str(e))
            return results

        results = asyncio.run(go())
        assert results and all(r != "finished" for r in results), results
        assert f"injected {where} fault" in results[0], results[0]
        with pytest.raises(EngineDeadError):
            engine.check_health()
        proc.join(10)
        assert proc.exitcode == 1, proc.exitcode
    finally:
        engine.shutdown()
    assert all(wait_gone(pid, 10) for pid in engine_core_children() - before)


def test_serve_startup_error_exits_nonzero_with_the_cause(tmp_path):
    missing = tmp_path / "no-such-model"
    r = subprocess.run([sys.executable, "-m", "pagebatch.cli", "serve", str(missing),
                        "--device", "cpu"], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert str(missing) in r.stderr and "not found" in r.stderr.lower(), r.stderr[-2000:]
    assert "Traceback" not in r.stderr, r.stderr[-2000:]  # a message, not a crash


@pytest.mark.parametrize("where", ["fill_next_token_bitmask", "accept_token"])
def test_structured_output_fault_fails_its_request_alone(inproc, monkeypatch, where):
    """A structured output backend (the plugin that masks the logits) that raises for one
    request's matcher fails that request with an error naming the field; the others finish."""
    from pagebatch.plugins.structured_output.xgrammar_backend import _Matcher

    def broken(self, *args, **kwargs):
        raise RuntimeError("injected matcher fault")

    monkeypatch.setattr(_Matcher, where, broken)
    prompts = [[5, 6, 7], [5, 6, 7], [8, 6]]
    params = [_params(), _params(structured_outputs={"regex": "(w[0-9]+ ?)+"}), _params()]
    finals = asyncio.run(_run(inproc, prompts, params))
    _assert_only_poisoned_failed(finals, {1}, "injected matcher fault")
    assert "structured_outputs.regex" in finals[1].error
    inproc.check_health()
    assert not inproc.engine._states and not inproc.engine.core.core.scheduler.requests
