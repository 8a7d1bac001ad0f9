"""core/stall_log.py: PAGEBATCH_SLOW_STEP_MS parsing, the turn clock's phases, the engine core's
slow-turn log on the tiny model (what its steps held), the event loop watch, and the log of a
Triton kernel compiled after start-up (its hooks called as Triton calls them on a cache miss)."""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from functools import partial

import pytest
import torch

from pagebatch import SamplingParams
from pagebatch.core_client import InprocClient
from pagebatch.engine_core import EngineCore, EngineCoreRequest
from pagebatch.scheduler import ScheduledRequest, SchedulerOutput
from pagebatch.stall_log import (SLOW_STEP_ENV, NullClock, TurnClock, cuda_allocator_counters,
                                 describe_step,
                                 slow_step_threshold_s, stop_watching_triton_compiles,
                                 turn_clock, watch_event_loop, watch_triton_compiles)
from tiny import engine_config

tiny_config = partial(engine_config, keys=dict(device="cpu", dtype="float32", num_kv_blocks=64,
                                               block_size=4, max_model_len=128))


@pytest.mark.parametrize("raw, expected", [("", None), ("0", None), ("50", 0.05),
                                           (" 2.5 ", 0.0025)])
def test_threshold_parsed(raw, expected):
    assert slow_step_threshold_s({SLOW_STEP_ENV: raw}) == expected
    assert slow_step_threshold_s({}) is None


@pytest.mark.parametrize("raw", ["fast", "-1", "nan"])
def test_bad_threshold_names_the_variable_and_value(raw):
    with pytest.raises(ValueError, match=rf"{SLOW_STEP_ENV}='{raw}'"):
        slow_step_threshold_s({SLOW_STEP_ENV: raw})


def test_turn_clock_adds_up_phases(monkeypatch):
    ticks = iter([10.0, 10.002, 10.005, 10.0052, 10.1])
    monkeypatch.setattr(time, "perf_counter", lambda: next(ticks))
    clock = TurnClock(0.05, watch_gc=False)  # a collection would take a tick
    clock.start()
    clock.mark("schedule")   # 2 ms
    clock.mark("wait")       # 3 ms
    clock.mark("schedule")   # +0.2 ms
    assert not clock.slow and clock.elapsed == pytest.approx(0.0052)
    clock.mark("send")       # 94.8 ms
    clock.note("scheduled 3 rows")
    assert clock.slow
    assert clock.phases == pytest.approx({"schedule": 0.0022, "wait": 0.003, "send": 0.0948})
    assert clock.describe() == ("100.0 ms (schedule 2.2, wait 3.0, send 94.8 ms); "
                                "scheduled 3 rows")


def test_a_slow_turn_names_the_collectors_time_in_it():
    clock = TurnClock(0.0)
    try:
        clock.start()
        clock.mark("schedule")
        assert "gc " not in clock.describe()  # no collection in this turn
        clock.start()
        gc.collect()
        clock.mark("launch")
        text = clock.describe()
        assert "gc " in text and "(generation 2)" in text, text
        assert 0.0 < clock.gc_s <= clock.elapsed
        clock.start()  # the next turn starts from nothing
        assert clock.gc_s == 0.0 and clock.gc_generation == -1
    finally:
        clock.close()
    assert clock._on_gc not in gc.callbacks


def test_a_slow_turn_names_the_counters_that_moved():
    counts = {"num_device_alloc": 3, "num_alloc_retries": 0, "num_device_free": 1}
    clock = TurnClock(0.0, watch_gc=False)
    clock.counters = lambda: dict(counts)
    clock.start()
    clock.mark("launch")
    assert "allocator" not in clock.describe()
    counts["num_device_alloc"] += 2
    counts["num_alloc_retries"] += 1
    text = clock.describe()
    assert text.endswith("allocator num_device_alloc +2, num_alloc_retries +1"), text


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_allocator_counters_count_a_cudamalloc():
    read = cuda_allocator_counters()
    torch.cuda.empty_cache()
    before = read()
    x = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")  # no cached block fits
    after = read()
    del x
    assert after["num_device_alloc"] == before["num_device_alloc"] + 1
    assert after["num_alloc_retries"] == before["num_alloc_retries"]


def test_turn_clock_from_the_environment(monkeypatch):
    monkeypatch.delenv(SLOW_STEP_ENV, raising=False)
    assert isinstance(turn_clock(), NullClock) and not turn_clock().slow
    monkeypatch.setenv(SLOW_STEP_ENV, "20")
    clock = turn_clock()
    assert isinstance(clock, TurnClock) and clock.threshold_s == pytest.approx(0.02)


def test_describe_step_counts_decodes_and_prefill_tokens():
    rows = [ScheduledRequest("a", [5], 9, [], True),           # a running request's decode
            ScheduledRequest("b", [1, 2, 3], 0, [0], True, new=object()),   # a new prompt
            ScheduledRequest("c", [7], 0, [1], True, new=object()),   # a new 1-token prompt
            ScheduledRequest("d", [4] * 8, 16, [], False)]     # a later chunk of a prompt
    so = SchedulerOutput(rows, 13)
    assert describe_step(so) == "4 rows, 13 tokens: 1 decodes, 3 prefill chunks of 12 tokens"


def test_slow_engine_core_turns_are_logged_with_what_they_ran(tiny_model_dir, monkeypatch,
                                                              caplog):
    monkeypatch.setenv(SLOW_STEP_ENV, "0.000001")  # every turn is slow
    client = InprocClient(EngineCore.from_config(tiny_config(tiny_model_dir)))
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
        client.add_request(EngineCoreRequest("r0", list(range(3, 13)), sp, frozenset({2}), seed=0))
        with caplog.at_level(logging.WARNING, logger="pagebatch"):
            done = False
            for _ in range(20):
                done = any(o.finish_reason for o in client.step(timeout=0.0)) or done
                if done:
                    break
        assert done
    finally:
        client.shutdown()
    turns = [r.getMessage() for r in caplog.records if "slow engine core turn" in r.message]
    assert turns, caplog.text
    first = turns[0]
    for phase in ("messages", "schedule", "launch", "wait", "update"):
        assert f"{phase} " in first, first
    assert "scheduled 1 rows, 10 tokens: 0 decodes, 1 prefill chunks of 10 tokens" in first
    assert any("scheduled 1 rows, 1 tokens: 1 decodes" in t for t in turns), turns


def test_engine_core_without_the_variable_logs_nothing(tiny_model_dir, monkeypatch, caplog):
    monkeypatch.delenv(SLOW_STEP_ENV, raising=False)
    core = EngineCore.from_config(tiny_config(tiny_model_dir))
    assert isinstance(core.clock, NullClock)
    client = InprocClient(core)
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
        client.add_request(EngineCoreRequest("r0", [3, 4, 5], sp, frozenset({2}), seed=0))
        with caplog.at_level(logging.WARNING, logger="pagebatch"):
            for _ in range(10):
                if any(o.finish_reason for o in client.step(timeout=0.0)):
                    break
    finally:
        client.shutdown()
    assert "slow engine core turn" not in caplog.text


def test_event_loop_watch_reports_a_held_loop():
    lines: list[str] = []

    async def main() -> None:
        task = watch_event_loop(0.02, interval_s=0.002, log=lambda fmt, *a: lines.append(fmt % a))
        await asyncio.sleep(0.02)  # quiet: nothing above 20 ms
        quiet = len(lines)
        time.sleep(0.08)  # a callback that holds the loop 80 ms
        await asyncio.sleep(0.02)
        task.cancel()
        return quiet

    quiet = asyncio.run(main())
    assert quiet == 0
    assert len(lines) == 1 and "held" in lines[0]
    assert float(lines[0].split("held ")[1].split(" ms")[0]) >= 60


def test_triton_compiles_after_start_up_are_logged(caplog):
    knobs = pytest.importorskip("triton").knobs
    if not hasattr(knobs.runtime, "jit_post_compile_hook"):
        pytest.skip("this Triton has no JIT hooks")
    seen = []
    knobs.runtime.jit_cache_hook = lambda **kw: seen.append(("miss", kw["key"]))
    knobs.runtime.jit_post_compile_hook = lambda **kw: seen.append(("done", kw["key"]))
    try:
        assert watch_triton_compiles("engine core")
        assert watch_triton_compiles("engine core")  # a second call changes nothing

        class Fn:
            name = "_paged_attention_kernel"

        kw = dict(compile={}, is_manual_warmup=False, already_compiled=False)
        with caplog.at_level(logging.WARNING, logger="pagebatch"):
            # as Triton's JITFunction._do_compile calls them: before, then after compiling
            knobs.runtime.jit_cache_hook(key="k1", repr="_paged_attention_kernel[num_warps=4]",
                                         fn=Fn(), **kw)
            time.sleep(0.01)
            knobs.runtime.jit_post_compile_hook(key="k1", fn=Fn(),
                                                repr="_paged_attention_kernel[num_warps=4]", **kw)
        assert seen == [("miss", "k1"), ("done", "k1")]  # the hooks found are still called
        msg = caplog.records[-1].getMessage()
        assert msg.startswith("engine core: Triton compiled or loaded _paged_attention_kernel "
                              "after start-up in ")
        assert int(msg.split(" in ")[1].split(" ms")[0]) >= 10
    finally:
        stop_watching_triton_compiles()
        assert len(seen) == 2
        knobs.runtime.jit_cache_hook = knobs.runtime.jit_post_compile_hook = None
