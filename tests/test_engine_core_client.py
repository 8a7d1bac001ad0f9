"""The engine-core boundary on the tiny model: the same core in this process, behind the
in-process client and in its own process gives the same tokens; aborts cross the process;
startup errors come back typed; the core process follows its parent out."""

from __future__ import annotations

import random
from functools import partial
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from pagebatch import EngineConfig, LLMEngine, SamplingParams
from pagebatch.core_client import InprocClient, MPClient
from pagebatch.engine_core import EngineCore, EngineCoreRequest
from pagebatch.errors import ModelNotFoundError
from procs import engine_core_children, one_thread_children, wait_gone
from tiny import engine_config

ENGINE_KEYS = dict(device="cpu", dtype="float32", num_kv_blocks=64, block_size=4,
                   max_model_len=128)


tiny_config = partial(engine_config, keys=ENGINE_KEYS)


@pytest.fixture(scope="module")
def core(tiny_model_dir):
    return EngineCore.from_config(tiny_config(tiny_model_dir))


@pytest.fixture(scope="module")
def mp_client(tiny_model_dir):
    with one_thread_children():
        client = MPClient(tiny_config(tiny_model_dir))
    yield client
    client.shutdown()
    assert wait_gone(client.pid, 10)


def _requests(n: int, seed: int = 0) -> list[EngineCoreRequest]:
    """Greedy requests and seeded sampling ones, all running to max_tokens."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randint(3, 255) for _ in range(rng.randint(1, 30))]
        sp = (SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True) if i % 3 else
              SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, ignore_eos=True))
        out.append(EngineCoreRequest(f"r{i}", prompt, sp, frozenset({2}), seed=1000 + i))
    return out


def _run(core_like, requests: list[EngineCoreRequest]) -> dict[str, list[int]]:
    """Add the requests, step until all finish; new token ids per request."""
    for r in requests:
        core_like.add_request(r)
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    done: set[str] = set()
    deadline = time.monotonic() + 60
    while len(done) < len(requests):
        assert time.monotonic() < deadline, "requests did not finish"
        for o in core_like.step():
            tokens[o.request_id] += o.new_token_ids
            if o.finish_reason is not None:
                assert o.finish_reason == "length", o
                done.add(o.request_id)
    return tokens


def test_clients_give_the_in_process_tokens(core, mp_client):
    reqs = _requests(6)
    direct = _run(core, reqs)
    assert all(len(t) == 12 for t in direct.values())
    assert _run(mp_client, _requests(6)) == direct
    assert _run(InprocClient(core), _requests(6)) == direct
    assert not mp_client.has_unfinished_requests
    assert core.kv_cache.num_free_blocks == core.kv_cache.num_blocks


def test_abort_crosses_the_process(mp_client):
    long = EngineCoreRequest("long", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=100,
                                                               ignore_eos=True), frozenset(), 0)
    short = EngineCoreRequest("short", [8, 9], SamplingParams(temperature=0.0, max_tokens=20,
                                                              ignore_eos=True), frozenset(), 0)
    mp_client.add_request(long)
    mp_client.add_request(short)
    got: dict[str, list[int]] = {"long": [], "short": []}
    reasons: dict[str, str] = {}
    aborted = False
    while mp_client.has_unfinished_requests:
        for o in mp_client.step(timeout=10):
            got[o.request_id] += o.new_token_ids
            if o.finish_reason is not None:
                reasons[o.request_id] = o.finish_reason
        if not aborted and len(got["long"]) >= 2:
            assert mp_client.abort_requests(["long"]) == []  # the answer comes through step
            aborted = True
    assert reasons == {"long": "abort", "short": "length"}
    assert 2 <= len(got["long"]) < 100 and len(got["short"]) == 20


def test_llm_engine_over_the_process_client(tiny_model_dir, core, mp_client):
    """The front half is the same over either core: text, tokens and finish reasons agree."""
    config = tiny_config(tiny_model_dir)
    here = LLMEngine(config, core=lambda *args: core)
    there = LLMEngine(config, core=lambda *args: mp_client)
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    finals = []
    for engine in (here, there):
        rid = engine.add_request("w5 w9 w12", sp)
        outs = []
        while engine.has_unfinished_requests:
            outs += engine.step()
        assert [o.request_id for o in outs] == [rid] * 8  # one output per step, streamed
        finals.append(outs[-1])
    a, b = (f.outputs[0] for f in finals)
    assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
    assert a.text and len(a.token_ids) == 8


def test_startup_error_comes_back_typed(tiny_model_dir):
    """An error raised while the child builds its core reaches the parent as the same type with
    the same message and the child's traceback as its cause. (MPClient resolves nothing here;
    AsyncEngine.from_config resolves the model first, so there CacheTooSmallError is the child's:
    see tests/test_async_engine.py.)"""
    before = engine_core_children()
    with pytest.raises(ModelNotFoundError, match="not found") as info:
        MPClient(EngineConfig(model=str(tiny_model_dir / "nope")))
    assert "Traceback" in str(info.value.__cause__)
    assert engine_core_children() <= before  # nothing left behind


def test_core_process_exits_when_its_parent_dies(tiny_model_dir):
    script = textwrap.dedent(f"""
        import time
        from pagebatch import EngineConfig
        from pagebatch.core_client import MPClient
        config = EngineConfig.from_sources(cli={{"model": {str(tiny_model_dir)!r},
                                                 **{ENGINE_KEYS!r}}})
        client = MPClient(config)
        print(client.pid, flush=True)
        time.sleep(120)
    """)
    with one_thread_children():
        parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                                  text=True)
    try:
        line = parent.stdout.readline()
        assert line.strip().isdigit(), f"parent printed {line!r}"
        core_pid = int(line)
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        assert wait_gone(core_pid, 10), "the engine core outlived its parent"
    finally:
        parent.kill()
        parent.wait()
