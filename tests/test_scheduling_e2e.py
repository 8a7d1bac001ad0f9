"""Prefix caching, chunked prefill and preemption end to end on the tiny model: greedy outputs
are those of a run without them (DESIGN.md's near-tie rule)."""

from __future__ import annotations

import random

import pytest

from numerics import assert_greedy_match, top2_gaps
from pagebatch import LLM, SamplingParams

BS = 4
SYSTEM = [random.Random(0).randint(3, 255) for _ in range(13)]


def _prompts():
    rng = random.Random(3)
    out = [SYSTEM + [rng.randint(3, 255) for _ in range(rng.randint(1, 9))] for _ in range(6)]
    out.append(list(range(10, 10 + 2 * BS)))  # exactly k * block_size tokens
    out.append(list(range(10, 10 + 2 * BS)))  # ... sent twice
    out.append(SYSTEM[:8])  # a prefix of the others, block aligned
    out.append([rng.randint(3, 255) for _ in range(37)])  # longer than the chunk budget below
    return out


def _run(llm, prompts, max_tokens=10):
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids
            for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp,
                                  use_tqdm=False)]


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """Each prompt alone, no prefix caching, no chunking, plenty of blocks."""
    llm = LLM(str(tiny_model_dir), device="cpu", num_kv_blocks=256, block_size=BS,
              enable_prefix_caching=False, enable_chunked_prefill=False)
    prompts = _prompts()
    toks = [_run(llm, [p])[0] for p in prompts]
    runner = llm.engine.core.runner
    gaps = [top2_gaps(runner.forward_scratch(p + t)[len(p) - 1:-1]) for p, t in zip(prompts, toks)]
    return prompts, toks, gaps


def _check(reference, got):
    prompts, toks, gaps = reference
    for p, t, g, o in zip(prompts, toks, gaps, got):
        assert_greedy_match(t, g, o, what=f"prompt {p}")


@pytest.mark.parametrize("kwargs", [
    dict(enable_prefix_caching=True),
    dict(enable_prefix_caching=True, max_num_batched_tokens=12),  # chunked prefill
    dict(enable_prefix_caching=True, num_kv_blocks=14, max_model_len=56),  # preemption
    dict(enable_prefix_caching=False, max_num_batched_tokens=7, max_num_seqs=3),
    dict(enable_prefix_caching=True, scheduling_policy="lpm"),
    dict(enable_prefix_caching=True, scheduling_policy="priority", num_kv_blocks=14,
         max_model_len=56),
])
def test_batched_outputs_equal_solo_reference(tiny_model_dir, reference, kwargs):
    kwargs = {"num_kv_blocks": 256, **kwargs}
    llm = LLM(str(tiny_model_dir), device="cpu", block_size=BS, **kwargs)
    prompts = reference[0]
    _check(reference, _run(llm, prompts))
    _check(reference, _run(llm, prompts))  # again, now with a warm prefix cache
    core = llm.engine.core
    assert core.kv_cache.num_free_blocks == core.kv_cache.num_blocks
    if kwargs.get("num_kv_blocks") == 14:
        assert core.scheduler.stats.num_preemptions > 0
    if kwargs.get("enable_prefix_caching"):
        assert core.kv_cache.stats.hits > 0


def test_hit_rate_approaches_the_shared_fraction(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), device="cpu", block_size=BS, num_kv_blocks=512)
    rng = random.Random(1)
    system = [rng.randint(3, 255) for _ in range(64)]
    prompts = [system + [rng.randint(3, 255) for _ in range(4)] for _ in range(16)]
    _run(llm, prompts[:1], max_tokens=2)
    stats = llm.engine.core.kv_cache.stats
    q0, h0 = stats.queries, stats.hits
    _run(llm, prompts[1:], max_tokens=2)
    hit_rate = (stats.hits - h0) / (stats.queries - q0)
    assert hit_rate == pytest.approx(64 / 68)


def test_priority_and_cache_salt_through_the_api(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), device="cpu", block_size=BS, num_kv_blocks=128,
              scheduling_policy="priority", max_num_seqs=1)
    sp = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5 + i] * 6} for i in range(3)]
    engine = llm.engine
    ids = [engine.add_request(p, sp, priority=pr) for p, pr in zip(prompts, (5, 0, 2))]
    finished = []
    while engine.has_unfinished_requests:
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished == [ids[1], ids[2], ids[0]]  # one at a time, lowest priority value first
    shared = list(range(20, 40))
    outs = llm.generate([{"prompt_token_ids": shared, "cache_salt": "a"},
                         {"prompt_token_ids": shared, "cache_salt": "b"},
                         {"prompt_token_ids": shared, "cache_salt": "a"}], sp,
                        use_tqdm=False, priority=[0, 1, 2])
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    kv = llm.engine.core.kv_cache
    # only the third request (same salt as the first) was served from the cache
    assert kv.stats.hits == (len(shared) - 1) // BS * BS
    import pytest as _pytest

    from pagebatch.errors import InvalidRequestError
    with _pytest.raises(InvalidRequestError, match="cache_salt"):
        llm.generate({"prompt_token_ids": [5], "cache_salt": 3}, sp, use_tqdm=False)
