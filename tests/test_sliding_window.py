"""Sliding-window attention end to end: the block manager returns the blocks behind the window
(no model: the scheduler over a fake runner that attends over the window only), and a tiny
Mistral-style model with a 32-token window gives transformers' greedy tokens on prompts several
windows long, with prefix caching on and off, chunked prefill and preemption (torch_ref; the
triton kernels' windows are checked in tests/test_triton_swa.py, and on the GPU by
scripts/gpu_swa.sh). Models that mix full and windowed layers: tests/test_kv_hybrid.py."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings, strategies as st

from helpers_sched import (FakeRunner, check_scheduler_invariants, default_next_token,
                           make_request, reference_outputs, step)
from pagebatch.block_hash import extend_block_hashes
from pagebatch.kv_cache import KVCacheManager
from pagebatch.kv_window import (max_blocks_held, num_skipped_blocks, window_hit,
                                 window_hit_length)
from pagebatch.scheduler import Scheduler
from pagebatch.schedulers.fcfs import FCFSPolicy

W, BS = 32, 8
BOUND = W // BS + 2  # blocks a decoding request holds at most (docs/tuning.md)


def windowed(rid: str, seq: list[int]) -> int:
    """A windowed 'model': the next token is a function of the last W tokens only."""
    return default_next_token(rid, seq[-W:])


def make_sched(num_blocks: int, budget: int = 1024, caching: bool = False,
               chunked: bool = True) -> Scheduler:
    kv = KVCacheManager(num_blocks, BS, enable_caching=caching, sliding_window=W)
    return Scheduler(kv, FCFSPolicy(None), 8, budget, clock=lambda: 0.0,
                     enable_chunked_prefill=chunked)


def run(sched: Scheduler, runner: FakeRunner, max_steps: int = 20_000) -> list[int]:
    """Steps until done; returns the blocks each step's busiest request held (null left out)."""
    kv, peaks = sched.kv_cache, []
    for _ in range(max_steps):
        if not sched.has_unfinished_requests:
            return peaks
        step(sched, runner)
        check_scheduler_invariants(sched)
        held = [len(t.blocks) - t.num_skipped for t in kv.block_tables.values()]
        peaks.append(max(held, default=0))
        assert kv.usage == pytest.approx(
            (kv.num_blocks - kv.num_free_blocks) / kv.num_blocks)
    raise AssertionError("not finished")


def test_the_window_rule():
    assert num_skipped_blocks(W + BS - 2, W, BS) == 0  # key W + BS - 2 - W + 1 = 7 still read
    assert num_skipped_blocks(W + BS - 1, W, BS) == 1
    assert max_blocks_held(20 * W, W, BS, 1) == W // BS + 1 <= BOUND  # W a multiple of BS
    assert max_blocks_held(20 * W, W + 3, BS, 1) == W // BS + 2
    assert max_blocks_held(20 * W, None, BS, 1) == 20 * W // BS
    assert max_blocks_held(16, W, BS, 16) == 2  # never more than the whole request
    # a hit of n blocks needs only the last cdiv(W - 1, BS) = 4 of them cached
    assert window_hit_length([False, False, True, True, True, True], W, BS) == 6
    assert window_hit_length([False, False, True, True, True, False], W, BS) == 0
    assert window_hit_length([True, True, False, True], W, BS) == 2  # from 0: all must be there


def _hit_by_every_length(cached: list[bool], window: int, bs: int) -> int:
    """The rule stated directly: the longest n whose blocks from num_skipped_blocks(n * bs) on
    are all cached."""
    return max([n for n in range(1, len(cached) + 1)
                if all(cached[num_skipped_blocks(n * bs, window, bs):n])], default=0)


@settings(max_examples=400, deadline=None)
@given(st.lists(st.booleans(), max_size=40), st.integers(1, 70), st.sampled_from([1, 4, 8]))
def test_window_hit_is_the_longest_usable_hit_and_looks_up_only_what_it_can_use(
        cached, window, bs):
    looked: list[int] = []
    n, found = window_hit(lambda i: looked.append(i) or (i if cached[i] else None),
                          len(cached), window, bs)
    assert n == _hit_by_every_length(cached, window, bs) == window_hit_length(cached, window, bs)
    skip = num_skipped_blocks(n * bs, window, bs) if n else 0
    assert found == list(range(skip, n))  # the blocks the first token to compute reads
    assert len(looked) == len(set(looked))  # each block at most once
    # below the hit's end exactly the blocks its first token reads, none behind its window
    assert sorted(i for i in looked if i < n) == list(range(skip, n))


def test_a_windowed_hit_looks_up_only_the_window_of_a_long_prompt():
    """A 100-block cached prompt: the hit's lookups are the blocks its first token reads (the
    last cdiv(W - 1, BS) + 1 before the hit's end), not the 95 released behind them."""
    kv = KVCacheManager(128, BS, enable_caching=True, sliding_window=W)
    req = make_request("a", 100 * BS + 1, max_tokens=1)
    extend_block_hashes(req.block_hashes, req.all_token_ids, BS, None)
    assert kv.allocate_slots("a", req.num_tokens, block_hashes=req.block_hashes) is not None
    kv.free("a")
    looked = []
    lookup = kv.pool.lookup
    kv.pool.lookup = lambda h, group=0: looked.append(h) or lookup(h, group)
    hits = kv.get_computed_blocks(req.block_hashes, req.num_tokens)
    skip = num_skipped_blocks(100 * BS, W, BS)
    assert len(hits) == 100 and hits[:skip] == [kv.null_block] * skip
    assert [b.block_hash for b in hits[skip:]] == req.block_hashes[skip:100]
    assert len(looked) == 100 - skip == 4  # blocks 96..99 of W=32, BS=8


@pytest.mark.parametrize("prompt_len, budget", [(16, 1024), (20 * W - 40, BS), (200, 64)])
def test_a_request_of_20_windows_holds_window_blocks(prompt_len, budget):
    """Decodes hold at most W/BS + 2 blocks, chunks of c tokens cdiv(W - 1 + c, BS) + 1; the
    usage gauge counts only those; the tokens are the windowed reference's."""
    sched = make_sched(num_blocks=40, budget=budget)
    req = make_request("long", prompt_len, max_tokens=20 * W - prompt_len, ignore_eos=True)
    sched.add_request(req)
    peaks = run(sched, FakeRunner(BS, windowed, window=W))
    bound = max_blocks_held(20 * W, W, BS, budget if prompt_len > 16 else 1)
    assert max(peaks[len(peaks) // 2:]) <= BOUND  # decoding
    assert max(peaks) <= max(bound, BOUND)
    assert req.output_token_ids == reference_outputs(req, windowed)[0]
    assert sched.kv_cache.usage == 0.0 and sched.stats.num_preemptions == 0


def test_usage_gauge_reflects_the_reclaimed_blocks():
    sched = make_sched(num_blocks=41)
    sched.add_request(make_request("a", 16, max_tokens=20 * W, ignore_eos=True))
    runner = FakeRunner(BS, windowed, window=W)
    for _ in range(20 * W - 100):
        step(sched, runner)
    held = len(sched.kv_cache.block_tables["a"].blocks) - sched.kv_cache.block_tables[
        "a"].num_skipped
    assert held <= BOUND
    assert sched.kv_cache.usage == pytest.approx(held / 40)  # 40 usable: block 0 is null
    assert sched.kv_cache.block_ids("a")[0] == 0  # the null block heads the table


def test_more_requests_than_full_attention_could_hold():
    """6 requests of 20 windows (480 blocks with full attention) in 40 blocks, no preemption."""
    sched = make_sched(num_blocks=40)
    reqs = [make_request(f"r{i}", 20 + i, max_tokens=20 * W - 20 - i, ignore_eos=True)
            for i in range(6)]
    for r in reqs:
        sched.add_request(r)
    run(sched, FakeRunner(BS, windowed, window=W))
    assert sched.stats.num_preemptions == 0
    for r in reqs:
        assert r.output_token_ids == reference_outputs(r, windowed)[0]


def test_preemption_recomputes_right():
    sched = make_sched(num_blocks=13, budget=16)
    reqs = [make_request(f"p{i}", 50 + 7 * i, max_tokens=120, ignore_eos=True)
            for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    run(sched, FakeRunner(BS, windowed, window=W))
    assert sched.stats.num_preemptions > 0
    for r in reqs:
        assert r.output_token_ids == reference_outputs(r, windowed)[0]


def test_prefix_hits_need_only_the_window():
    """B shares A's 200-token prompt after A finished: the hit covers blocks whose leading
    ones were released behind the window (and may be evicted), needing only the window's."""
    sched = make_sched(num_blocks=40, caching=True)
    prompt = [random.Random(3).randint(3, 90) for _ in range(200)]
    a = make_request("a", 0, max_tokens=5, prompt=prompt, ignore_eos=True)
    sched.add_request(a)
    runner = FakeRunner(BS, windowed, shared_reads=True, window=W)
    run(sched, runner)
    kv = sched.kv_cache
    blocks_a = [kv.pool.lookup(h) for h in a.block_hashes[:24]]
    assert all(b is not None for b in blocks_a)  # released, hashed, content still there
    # evict the prompt's first 10 blocks (released first: nearest the free queue's front)
    order = kv.pool.free_queue.block_ids()
    take = order.index(blocks_a[9].block_id) + 1
    assert kv.allocate_slots("f", take * BS) is not None
    kv.free("f")
    assert kv.pool.lookup(a.block_hashes[0]) is None
    assert kv.pool.lookup(a.block_hashes[20]) is not None
    b = make_request("b", 0, max_tokens=8, prompt=prompt, ignore_eos=True)
    sched.add_request(b)
    so, _ = step(sched, runner)
    n_hit = b.num_cached_tokens // BS
    assert b.num_cached_tokens > 0, "a window-aware hit needs only the last blocks"
    table = kv.block_tables["b"]
    assert table.num_skipped == num_skipped_blocks(n_hit * BS, W, BS) > 0
    assert table.block_ids[:table.num_skipped] == [0] * table.num_skipped
    run(sched, runner)
    assert not sched.rejected
    assert b.output_token_ids == reference_outputs(b, windowed)[0]


def test_a_released_and_overwritten_block_is_no_hit():
    """A block released behind the window and handed out again loses its hash: a later request
    with the same prefix computes it again (its tokens show it read the right KV)."""
    sched = make_sched(num_blocks=12, budget=16, caching=True)
    rng = random.Random(4)
    prompt = [rng.randint(3, 90) for _ in range(160)]
    runner = FakeRunner(BS, windowed, shared_reads=True, window=W)
    sched.add_request(make_request("a", 0, max_tokens=3, prompt=prompt, ignore_eos=True))
    run(sched, runner)
    other = [rng.randint(3, 90) for _ in range(160)]
    sched.add_request(make_request("c", 0, max_tokens=3, prompt=other, ignore_eos=True))
    run(sched, runner)  # c's blocks evicted a's
    b = make_request("b", 0, max_tokens=6, prompt=prompt, ignore_eos=True)
    sched.add_request(b)
    run(sched, runner)
    assert not sched.rejected
    assert b.output_token_ids == reference_outputs(b, windowed)[0]


# ---- a tiny Mistral-style model against transformers --------------------------------------------


@pytest.fixture(scope="module")
def mistral_swa(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from conftest import build_tiny_model

    folder = build_tiny_model(tmp_path_factory.mktemp("mistral-swa"), seed=11,
                              model_type="mistral", sliding_window=W, norm_std=0.1)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return folder, hf


PROMPTS = [[random.Random(s).randint(3, 255) for _ in range(n)]
           for s, n in [(1, 150), (2, 97), (3, 131)]]
SETTINGS = {
    "plain": dict(num_kv_blocks=64),
    "prefix-cache": dict(num_kv_blocks=64, enable_prefix_caching=True),
    "chunked": dict(num_kv_blocks=64, enable_chunked_prefill=True, max_num_batched_tokens=24),
    "preempt": dict(num_kv_blocks=2 * (W // BS + 3), enable_chunked_prefill=True,
                    max_num_batched_tokens=BS, enable_prefix_caching=True),
}


def check_greedy(mistral_swa, setting, **engine):
    from numerics import assert_greedy_match, hf_greedy
    from pagebatch import LLM, SamplingParams

    folder, hf = mistral_swa
    llm = LLM(str(folder), dtype="float32", block_size=BS, max_num_seqs=3, max_model_len=256,
              **SETTINGS[setting], **engine)
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = PROMPTS + [PROMPTS[0][:120] + PROMPTS[1][:20]]  # a prefix shared with prompt 0
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    for p, out in zip(prompts, outs):
        ref, gaps = hf_greedy(hf, p, 24)
        assert_greedy_match(ref, gaps, out.outputs[0].token_ids, what=setting)
    core = llm.engine.core
    if setting == "preempt":
        assert core.scheduler.stats.num_preemptions > 0
    assert core.kv_cache.usage == 0.0


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_greedy_matches_transformers_past_the_window(mistral_swa, setting):
    check_greedy(mistral_swa, setting, device="cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (scripts/gpu_swa.sh)")
@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_triton_greedy_matches_transformers_on_gpu(mistral_swa, setting):
    """The triton backend's windowed kernels in the engine (CUDA graphs for decodes)."""
    check_greedy(mistral_swa, setting, device="cuda", attention_backend="triton")
