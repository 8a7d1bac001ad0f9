"""Prefix caching and chunked prefill in the block manager and the scheduler, with no model.

A fake runner writes every scheduled token into a fake paged cache through the block table it is
given and reads each sequence back through it; the next token is a function of what it read. A
wrong cache hit (a block whose content is not the request's prefix) therefore changes a
request's tokens, and every test compares against the request run alone.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from helpers_sched import FakeRunner, check_block_invariants, make_request, reference_outputs
from pagebatch.block_hash import extend_block_hashes, hash_block
from pagebatch.kv_cache import KVCacheManager
from pagebatch.scheduler import Scheduler
from pagebatch.schedulers.fcfs import FCFSPolicy


def SharedCacheRunner(block_size: int) -> FakeRunner:
    """A FakeRunner where a request may read slots another request wrote (a cache hit), as
    long as the slot holds the same position."""
    return FakeRunner(block_size, shared_reads=True)


def make_sched(num_blocks, block_size, *, caching=True, chunked=False, budget=1024,
               max_num_seqs=16, policy=None, clock=lambda: 0.0):
    kv = KVCacheManager(num_blocks, block_size, enable_caching=caching)
    return Scheduler(kv, policy or FCFSPolicy(None), max_num_seqs, budget, clock=clock,
                     enable_chunked_prefill=chunked)


def run(sched, runner, max_steps=1000):
    outs = []
    for _ in range(max_steps):
        if not sched.has_unfinished_requests:
            return outs
        so = sched.schedule()
        outs.append(so)
        sched.update_from_output(so, runner.execute(so))
        check_block_invariants(sched.kv_cache)
    raise AssertionError("did not finish")


def finished_tokens(reqs):
    return {r.request_id: r.output_token_ids for r in reqs}


# ---- hashing ------------------------------------------------------------------------------------

def test_block_hashes_chain_and_salt():
    a, b = [], []
    extend_block_hashes(a, list(range(10)), 4)
    assert len(a) == 2  # only full blocks
    assert a[0] == hash_block(None, [0, 1, 2, 3]) and a[1] == hash_block(a[0], [4, 5, 6, 7])
    extend_block_hashes(b, [9, 1, 2, 3, 4, 5, 6, 7], 4)
    assert b[1] != a[1]  # same tokens, different parent: different hash
    salted = []
    extend_block_hashes(salted, list(range(8)), 4, cache_salt="tenant-a")
    assert salted[0] != a[0] and salted[1] != a[1]  # the salt changes the whole chain
    before = list(a)
    extend_block_hashes(a, list(range(12)), 4)
    assert a[:2] == before and len(a) == 3  # earlier blocks are never rehashed


# ---- block manager --------------------------------------------------------------------------

def test_hit_shares_blocks_and_ref_counts():
    kv = KVCacheManager(8, 4, enable_caching=True)
    h = []
    extend_block_hashes(h, list(range(10)), 4)
    assert kv.allocate_slots("a", 10, (), h) == [0, 1, 2]
    hits = kv.get_computed_blocks(h, 10)
    assert [b.block_id for b in hits] == [0, 1]
    assert kv.allocate_slots("b", 10, hits, h) == [3]
    assert kv.block_ids("b") == [0, 1, 3]
    assert [kv.pool.blocks[i].ref_cnt for i in range(4)] == [2, 2, 1, 1]
    kv.free("a")
    assert [kv.pool.blocks[i].ref_cnt for i in range(4)] == [1, 1, 0, 1]
    kv.free("b")
    # a freed its unshared tail (2); b frees tail first (3, 1, 0); hashes stay on free blocks
    assert kv.pool.free_queue.block_ids() == [4, 5, 6, 7, 2, 3, 1, 0]
    assert kv.pool.blocks[0].block_hash == h[0] and kv.pool.blocks[1].block_hash == h[1]


def test_a_forced_digest_collision_is_a_miss(monkeypatch):
    """Every digest the same (a forced SHA-256 collision): a cached block is still a hit only
    for the same token ids after the same parent, so no request reads another's KV."""
    from pagebatch import block_hash

    monkeypatch.setattr(block_hash, "_digest", lambda parent, token_ids, extra: b"\0" * 32)
    kv = KVCacheManager(16, 4, enable_caching=True)
    a = []
    extend_block_hashes(a, list(range(12)), 4)
    assert kv.allocate_slots("a", 12, (), a) == [0, 1, 2]
    assert len({h.digest for h in a}) == 1  # the collision is real
    other = []
    extend_block_hashes(other, [9, 9, 9, 9, 4, 5, 6, 7, 8, 9, 10, 11], 4)
    assert kv.get_computed_blocks(other, 12) == []  # block 0 differs: no hit at all
    half = []
    extend_block_hashes(half, [0, 1, 2, 3, 7, 7, 7, 7, 8, 9, 10, 11], 4)
    assert [b.block_id for b in kv.get_computed_blocks(half, 12)] == [0]  # then a miss
    assert kv.num_cached_prefix_blocks(half) == 1
    same = []
    extend_block_hashes(same, list(range(12)), 4)
    assert [b.block_id for b in kv.get_computed_blocks(same, 12)] == [0, 1]


def test_last_token_is_always_computed():
    kv = KVCacheManager(8, 4, enable_caching=True)
    h = []
    extend_block_hashes(h, list(range(8)), 4)  # exactly 2 full blocks
    kv.allocate_slots("a", 8, (), h)
    hits = kv.get_computed_blocks(h, 8)
    assert len(hits) == 1  # the second block holds the last prompt token: recompute it


def test_lazy_eviction_lru_and_revival():
    kv = KVCacheManager(4, 2, enable_caching=True)
    ha, hb = [], []
    extend_block_hashes(ha, [1, 2, 3, 4, 5], 2)
    extend_block_hashes(hb, [7, 8, 9, 9, 5], 2)
    kv.allocate_slots("a", 5, (), ha)  # blocks 0, 1, 2
    kv.free("a")  # queue: 3, 2, 1, 0 (tail first)
    assert kv.pool.free_queue.block_ids() == [3, 2, 1, 0]
    assert kv.pool.num_evictions == 0
    kv.allocate_slots("b", 5, (), hb)  # takes 3, 2, 1: block 1 (a's 2nd) is evicted
    assert kv.block_ids("b") == [3, 2, 1]
    assert kv.pool.num_evictions == 1
    hits = kv.get_computed_blocks(ha, 5)
    assert [b.block_id for b in hits] == [0]  # a's first block survived and is revived
    kv.free("b")
    assert kv.allocate_slots("c", 5, hits, ha) is not None
    assert kv.block_ids("c")[0] == 0 and kv.pool.blocks[0].ref_cnt == 1


def test_allocation_counts_revived_blocks_against_the_free_pool():
    kv = KVCacheManager(3, 2, enable_caching=True)
    h = []
    extend_block_hashes(h, [1, 2, 3, 4, 5], 2)
    kv.allocate_slots("a", 5, (), h)
    kv.free("a")
    hits = kv.get_computed_blocks(h, 5)
    assert len(hits) == 2
    kv.allocate_slots("x", 2)  # takes the LRU front: a's last, unhashed block
    # 2 free blocks left, both are the hits: reviving them leaves none for the new block
    assert kv.allocate_slots("b", 5, hits, h) is None
    assert [b.ref_cnt for b in kv.pool.blocks] == [0, 0, 1]  # nothing taken


# ---- scheduler ------------------------------------------------------------------------------

def test_second_identical_prompt_hits_and_matches_cold_run():
    sched = make_sched(32, 4)
    runner = SharedCacheRunner(4)
    prompt = list(range(3, 21))  # 18 tokens: 4 full blocks
    a = make_request("a", 0, 6, prompt=prompt)
    sched.add_request(a)
    run(sched, runner)
    b = make_request("b", 0, 6, prompt=prompt)
    sched.add_request(b)
    so = sched.schedule()
    (sr,) = so.scheduled
    assert sr.start_pos == 16 and sr.token_ids == prompt[16:]
    assert b.num_cached_tokens == 16
    sched.update_from_output(so, runner.execute(so))
    run(sched, runner)
    assert b.output_token_ids == a.output_token_ids == reference_outputs(a)[0]
    st = sched.kv_cache.stats
    assert (st.queries, st.hits) == (36, 16)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_prompt_of_exactly_k_blocks(k):
    sched = make_sched(32, 4)
    runner = SharedCacheRunner(4)
    prompt = list(range(5, 5 + 4 * k))
    first = make_request("a", 0, 5, prompt=prompt)
    sched.add_request(first)
    run(sched, runner)
    again = make_request("b", 0, 5, prompt=prompt)
    sched.add_request(again)
    run(sched, runner)
    assert again.num_cached_tokens == 4 * (k - 1)
    assert again.output_token_ids == first.output_token_ids == reference_outputs(first)[0]


def test_cache_salt_isolates_tenants():
    sched = make_sched(32, 4)
    runner = SharedCacheRunner(4)
    prompt = list(range(3, 23))
    a = make_request("a", 0, 3, prompt=prompt)
    a.cache_salt = "tenant-1"
    sched.add_request(a)
    run(sched, runner)
    b = make_request("b", 0, 3, prompt=prompt)
    b.cache_salt = "tenant-2"
    c = make_request("c", 0, 3, prompt=prompt)
    c.cache_salt = "tenant-1"
    sched.add_request(b)
    sched.add_request(c)
    run(sched, runner)
    assert b.num_cached_tokens == 0 and c.num_cached_tokens == 16


def test_skip_prefix_cache_computes_every_prompt_position():
    sched = make_sched(32, 4)
    runner = SharedCacheRunner(4)
    prompt = list(range(3, 23))
    sched.add_request(make_request("a", 0, 3, prompt=prompt))
    run(sched, runner)
    b = make_request("b", 0, 3, prompt=prompt)
    b.skip_prefix_cache = True
    sched.add_request(b)
    so = sched.schedule()
    assert so.scheduled[0].start_pos == 0 and len(so.scheduled[0].token_ids) == 20


def test_preemption_recompute_is_not_a_hit():
    sched = make_sched(8, 2, budget=64)
    runner = SharedCacheRunner(2)
    reqs = [make_request(f"r{i}", 5, 8) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    run(sched, runner)
    assert sched.stats.num_preemptions > 0
    assert sched.kv_cache.stats.queries == 15  # each prompt counted once
    for r in reqs:
        assert r.output_token_ids == reference_outputs(r)[0]


def test_chunked_prefill_chunk_sizes_and_decodes_first():
    sched = make_sched(64, 4, caching=False, chunked=True, budget=8)
    runner = SharedCacheRunner(4)
    short = make_request("short", 3, 6)
    sched.add_request(short)
    so = sched.schedule()
    sched.update_from_output(so, runner.execute(so))
    long = make_request("long", 21, 3)
    sched.add_request(long)
    chunks = []
    while sched.has_unfinished_requests:
        so = sched.schedule()
        chunks.append([(s.request_id, len(s.token_ids), s.sample) for s in so.scheduled])
        sched.update_from_output(so, runner.execute(so))
    # the decode of "short" always goes first; "long" gets the rest of the budget of 8
    assert chunks[:4] == [
        [("short", 1, True), ("long", 7, False)],
        [("short", 1, True), ("long", 7, False)],
        [("short", 1, True), ("long", 7, True)],
        [("short", 1, True), ("long", 1, True)],
    ]
    assert long.output_token_ids == reference_outputs(long)[0]
    assert short.output_token_ids == reference_outputs(short)[0]


def test_without_chunking_a_long_prompt_waits_for_a_full_budget():
    sched = make_sched(64, 4, caching=False, chunked=False, budget=8)
    long = make_request("long", 9, 2)
    sched.add_request(long)
    so = sched.schedule()
    assert so.is_empty  # 9 tokens never fit a budget of 8 (the engine rejects such configs)


def test_request_larger_than_the_cache_is_rejected_and_does_not_block():
    sched = make_sched(4, 4)
    runner = SharedCacheRunner(4)
    huge = make_request("huge", 20, 2)
    small = make_request("small", 3, 2)
    sched.add_request(huge)
    sched.add_request(small)
    so = sched.schedule()
    assert [s.request_id for s in so.scheduled] == ["small"]
    assert [r.request_id for r in sched.rejected] == ["huge"]
    assert huge.finish_reason.value == "error"
    sched.update_from_output(so, runner.execute(so))
    run(sched, runner)
    assert sched.kv_cache.num_free_blocks == 4


def test_a_step_can_be_scheduled_before_the_previous_one_returns():
    sched = make_sched(32, 4)
    runner = SharedCacheRunner(4)
    a = make_request("a", 6, 4)
    sched.add_request(a)
    so1 = sched.schedule()
    so2 = sched.schedule()  # step 1 is still in flight: nothing to compute for "a"
    assert so2.is_empty and a.num_computed_tokens == 6
    b = make_request("b", 5, 2)
    sched.add_request(b)
    so3 = sched.schedule()  # a newcomer can still be admitted
    assert [s.request_id for s in so3.scheduled] == ["b"]
    sched.update_from_output(so1, runner.execute(so1))
    sched.update_from_output(so3, runner.execute(so3))
    run(sched, runner)
    assert a.output_token_ids == reference_outputs(a)[0]
    assert b.output_token_ids == reference_outputs(b)[0]


@settings(deadline=None, max_examples=60, derandomize=True)
@given(st.lists(st.tuples(st.sampled_from("abc"), st.integers(1, 14), st.integers(1, 6),
                          st.booleans()), min_size=1, max_size=12),
       st.integers(6, 20), st.booleans())
def test_property_shared_prefixes_never_change_outputs(specs, num_blocks, chunked):
    """Random requests over three shared prefixes, a small pool, random aborts: no leak, ref
    counts equal users, cached hashes match their content, and each finished request's tokens
    equal its solo run."""
    bs = 2
    sched = make_sched(num_blocks, bs, chunked=chunked, budget=16 if chunked else 32)
    runner = SharedCacheRunner(bs)
    bases = {"a": [3, 4, 5, 6, 7, 8, 9, 10], "b": [3, 4, 5, 6, 11, 12, 13, 14],
             "c": [20, 21, 22, 23, 24, 25, 26, 27]}
    reqs = []
    for i, (base, extra, max_tokens, abort) in enumerate(specs):
        prompt = (bases[base] + list(range(30 + i, 30 + i + extra)))[:16]
        r = make_request(f"q{i}", 0, max_tokens, prompt=prompt)
        reqs.append((r, abort))
        sched.add_request(r)
    steps = 0
    while sched.has_unfinished_requests:
        steps += 1
        assert steps < 2000
        so = sched.schedule()
        sched.update_from_output(so, runner.execute(so))
        if steps == 3:
            sched.abort_requests([r.request_id for r, abort in reqs if abort])
        check_block_invariants(sched.kv_cache)
        for b in sched.kv_cache.pool.blocks:
            if b.block_hash is not None:
                assert sched.kv_cache.pool.cached[b.block_hash] is b
    assert sched.kv_cache.num_free_blocks == num_blocks
    for r, _ in reqs:
        if r.finish_reason.value in ("length", "stop"):
            assert r.output_token_ids == reference_outputs(r)[0], r.request_id


def test_a_forced_collision_before_the_window_is_a_miss(monkeypatch):
    """A sliding-window lookup reads only the blocks inside the window; the blocks before them
    are compared through the keys' links, so a prompt that differs there (every digest the
    same) gets no hit, and one that does not gets its hit."""
    from pagebatch import block_hash

    monkeypatch.setattr(block_hash, "_digest", lambda parent, token_ids, extra: b"\0" * 32)
    kv = KVCacheManager(64, 4, enable_caching=True, sliding_window=4)
    toks = list(range(32))
    a = []
    extend_block_hashes(a, toks, 4)
    kv.allocate_slots("a", 32, (), a)
    other = []
    extend_block_hashes(other, [99] * 16 + toks[16:], 4)
    assert kv.get_computed_blocks(other, 32) == []
    same = []
    extend_block_hashes(same, toks, 4)
    hit = kv.get_computed_blocks(same, 32)
    assert len(hit) == 7 and hit[-1].block_id == kv.block_ids("a")[6]
