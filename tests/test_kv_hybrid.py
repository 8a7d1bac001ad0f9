"""The hybrid KV cache manager (core/kv_hybrid.py): full-attention and sliding-window layers in
one model, a block table per layer group over one block pool.

No model first: the layer grouping rule; the scheduler over a fake runner that keeps one fake
cache tensor per layer slot (a group's s-th layer writes and reads tensor s through its own
table, so two groups holding the same block at once, or a table that lost a block still inside
a window, change the tokens); the block bound of a request 20 windows long; prefix hits that
every group can use, also when a windowed group's blocks were evicted. Then tiny Qwen2 models
with full and windowed layers (transformers' ``layer_types``) give transformers' greedy tokens
with prefix caching on and off, chunked prefill and preemption.
"""

from __future__ import annotations

import random

import pytest
import torch

from helpers_sched import (BlockTables, default_next_token, make_request, reference_outputs,
                           slot_of, step)
from pagebatch.kv_hybrid import HybridKVCacheManager, deinterleave, kv_cache_groups
from pagebatch.kv_window import max_blocks_held, num_skipped_blocks
from pagebatch.scheduler import Scheduler
from pagebatch.schedulers.fcfs import FCFSPolicy

W, BS = 32, 8
BOUND = W // BS + 2  # blocks a decoding request holds at most per windowed group


# ---- the grouping rule ---------------------------------------------------------------------------


@pytest.mark.parametrize("windows, num_groups, num_slots", [
    ([None] * 4, 1, 4),
    ([W] * 3, 1, 3),
    ([None, W], 2, 1),
    ([None, None, W, W], 2, 2),
    ([None] * 4 + [W] * 24, 7, 4),  # 4 full layers: 1 full group, 6 windowed ones
    ([None] * 16 + [W] * 12, 7, 4),  # gcd 4: 4 full groups, 3 windowed, none padded
    ([None] * 21 + [W] * 7, 4, 7),
    ([W, None, W, None, W, W, W, None], 8, 1),  # 3 full, 5 windowed: groups of one layer
    ([None, 16, W, None], 4, 1),  # two windows: each its own type; full split in two
])
def test_layers_group_by_type_in_equal_groups(windows, num_groups, num_slots):
    g = kv_cache_groups(windows)
    assert (g.num_groups, g.num_slots) == (num_groups, num_slots)
    sizes = [g.layer_group.count(k) for k in range(g.num_groups)]
    assert sizes == [g.num_slots] * g.num_groups, "a padded group"
    pairs = list(zip(g.layer_group, g.layer_slot))
    assert len(set(pairs)) == len(windows), "two layers share a group's tensor slot"
    assert all(0 <= s < g.num_slots for s in g.layer_slot)
    assert [g.windows[k] for k in g.layer_group] == list(windows)
    for k in range(g.num_groups):  # a group's layers fill its slots from 0
        slots = sorted(s for grp, s in pairs if grp == k)
        assert slots == list(range(len(slots)))


def test_too_many_groups_keep_whole_tables(tmp_path):
    assert kv_cache_groups([None] * 15 + [W] * 13) is None  # gcd 1: 28 groups
    from conftest import build_tiny_model
    from pagebatch import LLM
    from pagebatch.kv_cache import KVCacheManager

    folder = build_tiny_model(tmp_path, seed=3, model_type="qwen2", sliding_window=W,
                              use_sliding_window=True, max_window_layers=5, num_hidden_layers=9)
    llm = LLM(str(folder), device="cpu", dtype="float32", block_size=BS, num_kv_blocks=64,
              max_model_len=256)
    try:  # 5 full + 4 windowed: 9 groups of one layer
        assert llm.engine.core.setup.kv_groups is None
        assert type(llm.engine.core.kv_cache) is KVCacheManager
    finally:
        llm.engine.shutdown()


def test_bad_layer_windows_are_refused():
    with pytest.raises(ValueError, match="no layers"):
        kv_cache_groups([])
    with pytest.raises(ValueError, match=">= 1"):
        kv_cache_groups([None, 0])


# ---- the scheduler over a fake hybrid runner ---------------------------------------------------


class HybridFakeRunner:
    """A fake runner of a hybrid model: group k has ``layers[k]`` layers; its s-th layer writes
    each token to fake tensor s through group k's table and reads back (the whole context in a
    full group, the last ``window`` tokens in a windowed one), checking each slot holds what
    this request wrote there. The next token is a function of the full group's reading."""

    def __init__(self, windows, layers, next_token=default_next_token, shared_reads=False):
        self.windows, self.layers, self.next_token = list(windows), list(layers), next_token
        self.shared_reads = shared_reads
        self.tensors: list[dict[int, tuple[str, int, int]]] = [{} for _ in range(max(layers))]
        self.tables = BlockTables()

    def execute(self, so):
        g = len(self.windows)
        tables = {rid: deinterleave(t, g) for rid, t in self.tables.apply(so).items()}
        for sr in so.scheduled:
            for k, table in enumerate(tables[sr.request_id]):
                assert len(table) * BS >= sr.start_pos + len(sr.token_ids), (k, sr)
                for i, tok in enumerate(sr.token_ids):
                    pos = sr.start_pos + i
                    assert table[pos // BS] != 0, "a token written to the null block"
                    for s in range(self.layers[k]):
                        self.tensors[s][slot_of(table, pos, BS)] = (sr.request_id, pos, tok)
        out = {}
        for sr in so.scheduled:
            if not sr.sample:
                continue
            end = sr.start_pos + len(sr.token_ids)
            seq = None
            for k, table in enumerate(tables[sr.request_id]):
                w = self.windows[k]
                read = []
                for pos in range(0 if w is None else max(0, end - w), end):
                    for s in range(self.layers[k]):
                        owner, p, tok = self.tensors[s][slot_of(table, pos, BS)]
                        if self.shared_reads:
                            owner = sr.request_id
                        assert (owner, p) == (sr.request_id, pos), (
                            f"{sr.request_id} group {k} layer {s} pos {pos} reads a slot "
                            f"written by {owner} pos {p}")
                    read.append(tok)
                if w is None:
                    seq = read
            out[sr.request_id] = self.next_token(sr.request_id, seq)
        return out


GROUPINGS = {  # windows per group, layers per group
    "1+1": ((None, W), (1, 1)),
    "2+2x2": ((None, W, W), (2, 2, 2)),
    "1+3 windows": ((None, W, W, W), (1, 1, 1, 1)),
}


def make_sched(windows, num_blocks, budget=1024, caching=False, chunked=True, seqs=8):
    kv = HybridKVCacheManager(num_blocks, BS, caching, windows)
    return Scheduler(kv, FCFSPolicy(None), seqs, budget, clock=lambda: 0.0,
                     enable_chunked_prefill=chunked)


def check_hybrid_invariants(kv: HybridKVCacheManager) -> None:
    """Every block is free, held, or the null block, exactly once across the groups; ref
    counts equal users; a windowed group's table holds the null block only behind the window."""
    pool, null = kv.pool, kv.null_block
    users: dict[int, int] = {}
    owner: dict[int, int] = {}
    for k, grp in enumerate(kv.groups):
        for rid, t in grp.block_tables.items():
            assert all(b is null for b in t.blocks[:t.num_skipped]), (k, rid)
            assert null not in t.blocks[t.num_skipped:], (k, rid)
            assert t.block_ids == [b.block_id for b in t.blocks]
            for b in t.blocks[t.num_skipped:]:
                users[b.block_id] = users.get(b.block_id, 0) + 1
                assert owner.setdefault(b.block_id, k) == k, f"block {b.block_id} in two groups"
    free_ids = pool.free_queue.block_ids()
    assert not set(free_ids) & set(users)
    assert sorted(free_ids + list(users) + [null.block_id]) == list(range(pool.num_blocks))
    for b in pool.blocks:
        assert b.ref_cnt == users.get(b.block_id, 0), b
    lengths = {rid: {len(g.block_tables[rid].blocks) for g in kv.groups}
               for rid in kv.groups[0].block_tables}
    assert all(len(v) == 1 for v in lengths.values()), f"groups' logical lengths differ: {lengths}"


def run(sched, runner, max_steps=20_000):
    """Steps until done; returns the blocks each windowed group of the busiest request held."""
    kv, peaks = sched.kv_cache, []
    for _ in range(max_steps):
        if not sched.has_unfinished_requests:
            return peaks
        step(sched, runner)
        check_hybrid_invariants(kv)
        peaks.append(max((len(t.blocks) - t.num_skipped for g in kv.groups
                          if g.sliding_window is not None for t in g.block_tables.values()),
                         default=0))
        held = sum(len(t.blocks) - t.num_skipped for g in kv.groups
                   for t in g.block_tables.values())
        assert kv.usage == pytest.approx(held / kv.num_blocks) or kv.enable_caching
    raise AssertionError("not finished")


@pytest.mark.parametrize("grouping", sorted(GROUPINGS))
@pytest.mark.parametrize("prompt_len, budget", [(16, 1024), (20 * W - 40, BS), (200, 64)])
def test_a_request_of_20_windows_holds_window_blocks_per_windowed_group(grouping, prompt_len,
                                                                        budget):
    windows, layers = GROUPINGS[grouping]
    full_blocks = 20 * W // BS
    sched = make_sched(windows, num_blocks=full_blocks + 40 * len(windows), budget=budget)
    req = make_request("long", prompt_len, max_tokens=20 * W - prompt_len, ignore_eos=True)
    sched.add_request(req)
    peaks = run(sched, HybridFakeRunner(windows, layers))
    bound = max_blocks_held(20 * W, W, BS, budget if prompt_len > 16 else 1)
    assert max(peaks[len(peaks) // 2:]) <= BOUND
    assert max(peaks) <= max(bound, BOUND)
    assert req.output_token_ids == reference_outputs(req)[0]
    assert sched.kv_cache.usage == 0.0 and sched.stats.num_preemptions == 0


def test_usage_gauge_counts_the_full_table_and_the_windows():
    windows, layers = GROUPINGS["2+2x2"]
    sched = make_sched(windows, num_blocks=201)
    sched.add_request(make_request("a", 16, max_tokens=20 * W, ignore_eos=True))
    runner = HybridFakeRunner(windows, layers)
    for _ in range(20 * W - 100):
        step(sched, runner)
    kv = sched.kv_cache
    full = len(kv.groups[0].block_tables["a"].blocks)
    wins = [len(t.blocks) - t.num_skipped for g in kv.groups[1:]
            for t in [g.block_tables["a"]]]
    assert full == -(-(16 + 20 * W - 100) // BS) and all(w <= BOUND for w in wins)
    assert kv.usage == pytest.approx((full + sum(wins)) / 200)  # block 0 is the null block
    ids = kv.block_ids("a")
    assert deinterleave(ids, 3)[0] == kv.groups[0].block_ids("a")
    assert deinterleave(ids, 3)[1][0] == 0  # the window group's first entry: released


@pytest.mark.parametrize("grouping", sorted(GROUPINGS))
@pytest.mark.parametrize("caching", [False, True])
@pytest.mark.parametrize("pool", ["tight", "roomy"])
@pytest.mark.parametrize("seed", range(3))
def test_random_batches_give_the_reference_tokens(grouping, caching, pool, seed):
    """Mixed prompts (some sharing prefixes), chunked prefill; a tight pool preempts, a roomy
    one keeps prefixes cached for the requests admitted later."""
    windows, layers = GROUPINGS[grouping]
    rng = random.Random(seed)
    base = [rng.randint(3, 90) for _ in range(120)]
    num_blocks = (20 + 10 * len(windows)) if pool == "tight" else (60 + 8 * len(windows))
    sched = make_sched(windows, num_blocks=num_blocks, budget=rng.choice([8, 24]),
                       caching=caching, seqs=4 if pool == "tight" else 3)
    reqs = []
    for i in range(8):
        prompt = (base[:rng.randint(10, 120)] if i % 2 else []) + [
            rng.randint(3, 90) for _ in range(rng.randint(1, 60))]
        reqs.append(make_request(f"r{i}", 0, max_tokens=rng.randint(1, 80), prompt=prompt,
                                 ignore_eos=True))
        sched.add_request(reqs[-1])
    run(sched, HybridFakeRunner(windows, layers, shared_reads=caching))
    assert not sched.rejected
    for r in reqs:
        assert r.output_token_ids == reference_outputs(r)[0], r.request_id
    if pool == "tight":
        assert sched.stats.num_preemptions > 0
    elif caching:
        assert sched.kv_cache.stats.hits > 0
    assert sched.kv_cache.usage == 0.0


def test_a_hit_is_what_every_group_can_use():
    """A finished 200-token prompt is cached in both groups; after the window group's blocks
    near the prompt's end are evicted, a hit stops where that group can still serve it, and the
    tokens stay right; a prompt whose full-group prefix is evicted gets no hit."""
    windows, layers = GROUPINGS["1+1"]
    sched = make_sched(windows, num_blocks=80, caching=True)
    prompt = [random.Random(5).randint(3, 90) for _ in range(200)]
    runner = HybridFakeRunner(windows, layers, shared_reads=True)
    a = make_request("a", 0, max_tokens=4, prompt=prompt, ignore_eos=True)
    sched.add_request(a)
    run(sched, runner)
    kv = sched.kv_cache
    full, win = kv.groups
    n = (len(prompt) - 1) // BS
    assert len(kv.get_computed_blocks(a.block_hashes, len(prompt))) == n
    # evict the window group's blocks 20..23 (only ones still cached there near the end)
    victims = [win.pool.lookup(h, 1) for h in a.block_hashes[20:24]]
    assert all(b is not None and b.ref_cnt == 0 for b in victims)
    for b in victims:
        kv.pool.free_queue.remove(b)
        kv.pool._evict(b)
        kv.pool.free_queue.append(b)
    hits = kv.get_computed_blocks(a.block_hashes, len(prompt))
    # the longest hit whose window (blocks (8n - 31) // 8 .. n - 1) avoids 20..23: n = 20
    assert len(hits) == 20 and num_skipped_blocks(20 * BS, W, BS) == 16
    assert all(t[1] is kv.null_block or t[1].block_hash is not None for t in hits)
    b = make_request("b", 0, max_tokens=6, prompt=prompt, ignore_eos=True)
    sched.add_request(b)
    run(sched, runner)
    assert b.num_cached_tokens == len(hits) * BS
    assert b.output_token_ids == reference_outputs(b)[0]
    # the full group's first block gone: no hit at all
    first = full.pool.lookup(a.block_hashes[0], 0)
    kv.pool.free_queue.remove(first)
    kv.pool._evict(first)
    kv.pool.free_queue.append(first)
    assert kv.get_computed_blocks(a.block_hashes, len(prompt)) == []


def test_allocation_is_all_or_nothing():
    kv = HybridKVCacheManager(1 + 10, BS, False, (None, W))
    assert kv.allocate_slots("a", 5 * BS) is not None  # 5 + 5
    before = kv.num_free_blocks
    assert kv.allocate_slots("b", 1 * BS) is None  # needs 2, 0 free
    assert kv.num_free_blocks == before == 0 and "b" not in kv.groups[0].block_tables
    kv.free("a")
    assert kv.num_free_blocks == 10


# ---- tiny Qwen2 models against transformers ------------------------------------------------

PROMPTS = [[random.Random(s).randint(3, 255) for _ in range(n)]
           for s, n in [(1, 150), (2, 97), (3, 131)]]
SETTINGS = {
    "plain": dict(num_kv_blocks=200),
    "prefix-cache": dict(num_kv_blocks=200, enable_prefix_caching=True),
    "chunked": dict(num_kv_blocks=200, enable_chunked_prefill=True, max_num_batched_tokens=24),
    # a request of max_model_len needs 32 + 6 blocks a window group (+ the null block); three
    # at once need more than 53
    "preempt": dict(num_kv_blocks=53,
                    enable_chunked_prefill=True, max_num_batched_tokens=BS,
                    enable_prefix_caching=True),
}
MODELS = {  # layers, max_window_layers: layers from it on are windowed
    "1 full + 1 windowed": (2, 1),
    "2 full + 2 windowed (shared tensors)": (4, 2),
    "1 full + 2 windowed (two window groups)": (3, 1),
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def qwen2_hybrid(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from conftest import build_tiny_model

    layers, first = MODELS[request.param]
    folder = build_tiny_model(tmp_path_factory.mktemp("qwen2-hybrid"), seed=12 + layers,
                              model_type="qwen2", sliding_window=W, use_sliding_window=True,
                              max_window_layers=first, num_hidden_layers=layers, norm_std=0.1)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert hf.config.layer_types == (["full_attention"] * first
                                     + ["sliding_attention"] * (layers - first))
    return folder, hf, layers, first


def check_greedy(qwen2_hybrid, setting, **engine):
    from numerics import assert_greedy_match, hf_greedy
    from pagebatch import LLM, SamplingParams

    folder, hf, layers, first = qwen2_hybrid
    llm = LLM(str(folder), dtype="float32", block_size=BS, max_num_seqs=3,
              max_model_len=256, **SETTINGS[setting], **engine)
    try:
        core = llm.engine.core
        kv, groups = core.kv_cache, core.setup.kv_groups
        assert isinstance(kv, HybridKVCacheManager)
        assert groups.num_slots == min(first, layers - first)
        assert len({id(t) for t in core.runner.kv_caches}) == groups.num_slots
        sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        prompts = PROMPTS + [PROMPTS[0][:120] + PROMPTS[1][:20]]  # shares prompt 0's prefix
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        for p, out in zip(prompts, outs):
            ref, gaps = hf_greedy(hf, p, 24)
            assert_greedy_match(ref, gaps, out.outputs[0].token_ids, what=setting)
        if setting == "preempt":
            assert core.scheduler.stats.num_preemptions > 0
        if "prefix" in setting:
            assert kv.stats.hits > 0
        assert kv.usage == 0.0
    finally:
        llm.engine.shutdown()  # (a tensor-parallel engine's process group, in this process)


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_hybrid_qwen2_greedy_matches_transformers(qwen2_hybrid, setting):
    check_greedy(qwen2_hybrid, setting, device="cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_hybrid_triton_greedy_matches_transformers_on_gpu(qwen2_hybrid, setting):
    """The triton backend with the groups' block tables, decodes in CUDA graphs."""
    check_greedy(qwen2_hybrid, setting, device="cuda", attention_backend="triton")


def test_hybrid_can_be_turned_off(tmp_path):
    from conftest import build_tiny_model
    from pagebatch import LLM
    from pagebatch.kv_cache import KVCacheManager

    folder = build_tiny_model(tmp_path, seed=12, model_type="qwen2", sliding_window=W,
                              use_sliding_window=True, max_window_layers=1)
    llm = LLM(str(folder), device="cpu", dtype="float32", block_size=BS, num_kv_blocks=64,
              max_model_len=256, disable_hybrid_kv_cache_manager=True)
    core = llm.engine.core
    assert type(core.kv_cache) is KVCacheManager and core.kv_cache.sliding_window is None
    assert core.setup.kv_groups is None and len({id(t) for t in core.runner.kv_caches}) == 2


def test_hybrid_tensor_parallel_matches_transformers(tmp_path):
    """TP=2 over gloo: every rank splits the interleaved block ids into the same group tables."""
    from transformers import AutoModelForCausalLM

    from conftest import build_tiny_model
    from procs import one_thread_children

    folder = build_tiny_model(tmp_path, seed=16, model_type="qwen2", sliding_window=W,
                              use_sliding_window=True, max_window_layers=2, num_hidden_layers=4,
                              norm_std=0.1)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with one_thread_children():
            check_greedy((folder, hf, 4, 2), "preempt", device="cpu", tensor_parallel_size=2)
    finally:
        torch.set_num_threads(threads)
