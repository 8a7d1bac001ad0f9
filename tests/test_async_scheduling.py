"""Async scheduling (step N+1 scheduled and launched before step N's tokens are on the host):
the same outputs as one step at a time, on the CPU with the tiny model, with everything that
touches the in-flight token in play -- preemption, prefix-cache hits, chunked prefill, stop
tokens, max_tokens, seeded sampling, penalties and log-probs."""

from __future__ import annotations

import pytest

from pagebatch import LLM, SamplingParams
from pagebatch.scheduler import PLACEHOLDER_TOKEN, Scheduler

from tiny import random_prompts


def _params() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.8, top_k=20, seed=7, max_tokens=17, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[5, 9, 17, 33]),
        SamplingParams(temperature=1.0, seed=3, frequency_penalty=0.5, presence_penalty=0.3,
                       max_tokens=12, logprobs=2, ignore_eos=True),
        SamplingParams(temperature=0.0, min_tokens=3, max_tokens=9, prompt_logprobs=1),
    ]


def _run(folder, async_scheduling: bool, **kw):
    llm = LLM(str(folder), device="cpu", async_scheduling=async_scheduling, **kw)
    assert llm.engine.core.executor.async_decode is async_scheduling
    prompts = random_prompts(20, seed=4, max_len=60)
    shared = prompts[0][:40]
    prompts += [shared + p[:5] for p in prompts[1:6]]  # prefix-cache hits
    ps = _params()
    params = [ps[i % len(ps)] for i in range(len(prompts))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    core = llm.engine.core
    assert not core.has_unfinished_requests
    assert core.kv_cache.usage == 0.0
    return outs, core.stats()


@pytest.mark.parametrize("kw", [
    dict(num_kv_blocks=64, block_size=4, max_num_batched_tokens=48),  # preemption, chunking
    dict(num_kv_blocks=512, block_size=16, max_num_seqs=8),
])
def test_async_scheduling_gives_the_same_outputs(tiny_model_dir, kw):
    ref, _ = _run(tiny_model_dir, False, **kw)
    got, stats = _run(tiny_model_dir, True, **kw)
    for a, b in zip(ref, got):
        ra, rb = a.outputs[0], b.outputs[0]
        assert rb.token_ids == ra.token_ids, a.request_id
        assert rb.finish_reason == ra.finish_reason
        if ra.logprobs is not None:
            assert [list(x) for x in rb.logprobs] == [list(x) for x in ra.logprobs]
            for x, y in zip(ra.logprobs, rb.logprobs):
                for t in x:
                    assert y[t].logprob == pytest.approx(x[t].logprob, abs=1e-4)
        if a.prompt_logprobs is not None:
            assert len(b.prompt_logprobs) == len(a.prompt_logprobs)
    if kw["num_kv_blocks"] == 64:
        assert stats.num_preemptions > 0


def test_placeholder_decode_respects_max_tokens():
    from pagebatch.kv_cache import KVCacheManager
    from pagebatch.request import Request
    from pagebatch.schedulers.fcfs import FCFSPolicy

    kv = KVCacheManager(16, 4, enable_caching=False)
    sched = Scheduler(kv, FCFSPolicy(), 4, 64, async_decode=True)
    req = Request("a", [1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True),
                  max_total_tokens=64)
    sched.add_request(req)
    so1 = sched.schedule()  # the prompt, sampling token 1
    assert so1.scheduled[0].sample and req.num_pending_tokens == 1
    so2 = sched.schedule()  # token 1 still in flight: decode it with a placeholder
    assert so2.scheduled[0].token_ids == [PLACEHOLDER_TOKEN]
    assert so2.scheduled[0].start_pos == 3 and req.num_pending_tokens == 2
    so3 = sched.schedule()  # two tokens pending = max_tokens: nothing more to schedule
    assert so3.is_empty
    sched.update_from_output(so1, {"a": 11})
    assert req.output_token_ids == [11] and req.num_pending_tokens == 1
    sched.update_from_output(so2, {"a": 12})
    assert req.is_finished and req.output_token_ids == [11, 12]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_reused_request_ids_get_fresh_block_tables(tiny_model_dir, async_scheduling):
    """Ids of finished requests taken at once by new requests with other prompts, next to
    requests that take the blocks the old ones freed: the same tokens as under fresh ids (the
    runner drops the old batch slot and block table; a stale table would read and write blocks
    now owned by the others)."""
    llm = LLM(str(tiny_model_dir), device="cpu", async_scheduling=async_scheduling,
              num_kv_blocks=64, block_size=4, enable_prefix_caching=False)
    eng = llm.engine
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = random_prompts(8, seed=9, max_len=30)
    long = random_prompts(4, seed=10, max_len=40)
    long = [(p * 4)[:36] for p in long]  # 10 blocks each with the outputs: 40 in all

    def run(ids, ps):
        for i, p in zip(ids, ps):
            eng.add_request({"prompt_token_ids": p}, sp, request_id=i)
        got = {}
        while eng.has_unfinished_requests:
            for o in eng.step():
                if o.finished:
                    got[o.request_id] = o.outputs[0].token_ids
        return [got[i] for i in ids]

    ids = [f"r{i}" for i in range(4)]
    run(ids, prompts[:4])
    again = run(ids + ["x0", "x1", "x2", "x3"], prompts[4:] + long)
    fresh = run([f"f{i}" for i in range(8)], prompts[4:] + long)
    assert again == fresh
    eng.step()  # the last finished ids reach the runner with the next step
    assert not llm.engine.core.runner.input_batch.slot_of  # every slot given back
