"""The block manager (core/kv_cache.py) as data: exact block ids, free-queue order, ref counts."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers_sched import check_block_invariants
from pagebatch.kv_cache import BlockPool, FreeBlockQueue, KVCacheBlock, KVCacheManager


def ids(blocks):
    return [b.block_id for b in blocks]


# ---- FreeBlockQueue -----------------------------------------------------------------------------

def test_free_queue_pops_front_appends_back_removes_middle():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert q.block_ids() == [0, 1, 2, 3, 4] and q.num_free == 5
    assert q.popleft() is blocks[0]
    q.remove(blocks[3])  # O(1) removal from the middle
    assert q.block_ids() == [1, 2, 4] and q.num_free == 3
    q.append(blocks[0])
    q.append(blocks[3])
    assert q.block_ids() == [1, 2, 4, 0, 3] and q.num_free == 5
    q.remove(blocks[1])  # the front
    q.remove(blocks[3])  # the back
    assert q.block_ids() == [2, 4, 0] and q.num_free == 3
    assert [q.popleft().block_id for _ in range(3)] == [2, 4, 0]
    assert q.block_ids() == [] and q.num_free == 0
    with pytest.raises(IndexError):
        q.popleft()


def test_free_queue_remove_of_a_block_not_in_it_raises():
    blocks = [KVCacheBlock(i) for i in range(2)]
    q = FreeBlockQueue(blocks)
    b = q.popleft()
    with pytest.raises(ValueError, match="not in the free queue"):
        q.remove(b)
    assert q.block_ids() == [1] and q.num_free == 1


# ---- BlockPool ----------------------------------------------------------------------------------

def test_pool_hands_out_lowest_ids_first_with_ref_count_one():
    pool = BlockPool(6)
    assert pool.num_free_blocks == 6 and pool.usage == 0.0
    got = pool.get_new_blocks(3)
    assert ids(got) == [0, 1, 2]
    assert [b.ref_cnt for b in got] == [1, 1, 1]
    assert pool.free_queue.block_ids() == [3, 4, 5]
    assert pool.num_free_blocks == 3 and pool.usage == pytest.approx(0.5)
    assert ids(pool.get_new_blocks(0)) == [] and pool.num_free_blocks == 3


def test_pool_free_appends_in_given_order_and_reuses_lru():
    pool = BlockPool(5)
    a = pool.get_new_blocks(2)  # 0, 1
    b = pool.get_new_blocks(2)  # 2, 3
    pool.free_blocks(reversed(a))  # tail first
    assert pool.free_queue.block_ids() == [4, 1, 0]
    pool.free_blocks([b[1], b[0]])
    assert pool.free_queue.block_ids() == [4, 1, 0, 3, 2]
    # the least recently freed blocks go out first
    assert ids(pool.get_new_blocks(3)) == [4, 1, 0]


def test_pool_ref_counts_shared_block():
    pool = BlockPool(3)
    (blk,) = pool.get_new_blocks(1)
    blk.ref_cnt += 1  # a second user (as a prefix-cache hit would add)
    pool.free_blocks([blk])
    assert blk.ref_cnt == 1 and pool.num_free_blocks == 2
    assert 0 not in pool.free_queue.block_ids()
    pool.free_blocks([blk])
    assert blk.ref_cnt == 0 and pool.free_queue.block_ids() == [1, 2, 0]


def test_pool_double_free_raises_and_leaves_queue_alone():
    pool = BlockPool(3)
    got = pool.get_new_blocks(2)
    pool.free_blocks(got)
    before = pool.free_queue.block_ids()
    with pytest.raises(ValueError, match="double free"):
        pool.free_blocks([got[0]])
    assert pool.free_queue.block_ids() == before and pool.num_free_blocks == 3
    with pytest.raises(ValueError, match="double free"):
        pool.free_blocks([pool.blocks[2]])  # never handed out


def test_pool_refuses_more_blocks_than_free_and_takes_none():
    pool = BlockPool(4)
    pool.get_new_blocks(3)
    with pytest.raises(ValueError, match="asked for 2 blocks, 1 free"):
        pool.get_new_blocks(2)
    assert pool.free_queue.block_ids() == [3] and pool.blocks[3].ref_cnt == 0


def test_pool_rejects_empty_size():
    with pytest.raises(ValueError):
        BlockPool(0)


def test_pool_usage_fraction():
    pool = BlockPool(8)
    got = pool.get_new_blocks(2)
    assert pool.usage == pytest.approx(0.25)
    pool.get_new_blocks(6)
    assert pool.usage == pytest.approx(1.0)
    pool.free_blocks(got)
    assert pool.usage == pytest.approx(0.75)


# ---- KVCacheManager -----------------------------------------------------------------------------

def test_manager_allocates_block_table_and_grows_it():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    assert kv.blocks_needed("a", 5) == 2
    assert kv.allocate_slots("a", 5) == [0, 1]
    assert kv.allocate_slots("b", 4) == [2]
    # 'a' grows within its last block: nothing new
    assert kv.allocate_slots("a", 8) == []
    assert kv.allocate_slots("a", 9) == [3]
    assert kv.block_ids("a") == [0, 1, 3] and kv.block_ids("b") == [2]
    # asking for fewer tokens than covered takes nothing
    assert kv.allocate_slots("a", 1) == [] and kv.block_ids("a") == [0, 1, 3]
    assert kv.num_free_blocks == 4 and kv.usage == pytest.approx(0.5)
    assert [kv.pool.blocks[i].ref_cnt for i in range(8)] == [1, 1, 1, 1, 0, 0, 0, 0]
    check_block_invariants(kv)


def test_manager_free_returns_blocks_tail_first():
    kv = KVCacheManager(num_blocks=6, block_size=2)
    kv.allocate_slots("a", 3)  # 0, 1
    kv.allocate_slots("b", 2)  # 2
    kv.allocate_slots("a", 6)  # 3
    assert kv.block_ids("a") == [0, 1, 3]
    kv.free("a")
    assert kv.pool.free_queue.block_ids() == [4, 5, 3, 1, 0]
    assert kv.block_ids("a") == [] and "a" not in kv.block_tables
    assert [b.ref_cnt for b in kv.pool.blocks] == [0, 0, 1, 0, 0, 0]
    # the next request gets the least recently freed first: the untouched ones, then a's tail
    assert kv.allocate_slots("c", 6) == [4, 5, 3]
    check_block_invariants(kv)


def test_manager_allocate_returns_none_and_takes_nothing_when_short():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    assert kv.allocate_slots("a", 9) == [0, 1, 2]
    free_before = kv.pool.free_queue.block_ids()
    assert not kv.can_allocate("b", 5)
    assert kv.allocate_slots("b", 5) is None
    assert kv.pool.free_queue.block_ids() == free_before == [3]
    assert kv.block_ids("b") == [] and "b" not in kv.block_tables
    assert kv.allocate_slots("a", 17) is None  # a growing request too
    assert kv.block_ids("a") == [0, 1, 2] and kv.num_free_blocks == 1
    assert kv.can_allocate("b", 4) and kv.allocate_slots("b", 4) == [3]
    check_block_invariants(kv)


def test_manager_free_unknown_is_noop_and_double_free_is_harmless():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    kv.free("nobody")
    kv.allocate_slots("a", 4)
    kv.free("a")
    kv.free("a")
    assert kv.num_free_blocks == 3 and kv.pool.free_queue.block_ids() == [1, 2, 0]
    check_block_invariants(kv)


def test_manager_rejects_bad_block_size():
    with pytest.raises(ValueError):
        KVCacheManager(num_blocks=4, block_size=0)


# ---- property: random allocate / grow / free on several requests --------------------------------

REQS = ["r0", "r1", "r2", "r3"]
ops = st.lists(
    st.tuples(st.sampled_from(["alloc", "free"]), st.sampled_from(REQS), st.integers(0, 24)),
    max_size=40,
)


@settings(deadline=None, max_examples=60, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(num_blocks=st.integers(1, 8), block_size=st.integers(1, 4), ops=ops)
def test_property_no_leak_no_double_free(num_blocks, block_size, ops):
    kv = KVCacheManager(num_blocks, block_size)
    covered = {r: 0 for r in REQS}  # tokens each request's table covers (a model of the manager)
    for op, rid, n in ops:
        if op == "alloc":
            need = max(0, -(-n // block_size) - len(kv.block_ids(rid)))
            free_before = kv.pool.free_queue.block_ids()
            table_before = list(kv.block_ids(rid))  # the manager's own list: copy
            got = kv.allocate_slots(rid, n)
            if need > len(free_before):
                assert got is None
                assert kv.pool.free_queue.block_ids() == free_before
                assert kv.block_ids(rid) == table_before
            else:
                assert got == free_before[:need]  # front of the free queue, in order
                assert kv.block_ids(rid) == table_before + got
                covered[rid] = max(covered[rid], n)
                assert len(kv.block_ids(rid)) * block_size >= covered[rid]
        else:
            table = kv.block_ids(rid)
            free_before = kv.pool.free_queue.block_ids()
            kv.free(rid)
            covered[rid] = 0
            assert kv.pool.free_queue.block_ids() == free_before + table[::-1]
        check_block_invariants(kv)
    for rid in REQS:
        kv.free(rid)
    assert kv.num_free_blocks == num_blocks and kv.usage == 0.0
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)
