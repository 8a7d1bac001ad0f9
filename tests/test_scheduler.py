"""The scheduler (core/scheduler.py) with the fcfs policy and a fake runner: no model, no GPU.

Each test states a step's batch as data: (request id, token ids, start_pos, block ids, sample).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers_sched import (FakeRunner, check_scheduler_invariants, default_next_token,
                           make_request, make_scheduler, reference_outputs, run_until_done,
                           scripted, step)
from pagebatch.kv_cache import KVCacheManager
from pagebatch.request import FinishReason, RequestStatus
from pagebatch.scheduler import ScheduledRequest, Scheduler
from pagebatch.schedulers.fcfs import FCFSPolicy


def batch(so, runner):
    """A step's batch as comparable data, with each row's whole block table as the runner
    keeps it from the scheduler output."""
    t = runner.tables.apply(so)
    return [(s.request_id, s.token_ids, s.start_pos, t[s.request_id], s.sample)
            for s in so.scheduled]


def shape(so):
    """A step's batch as (request id, number of tokens, start_pos)."""
    return [(s.request_id, len(s.token_ids), s.start_pos) for s in so.scheduled]


# ---- one request: prefill, decode, block growth, finish -----------------------------------------

def test_single_request_exact_steps_and_blocks():
    sched = make_scheduler(num_blocks=8, block_size=4)
    runner = FakeRunner(4)
    a = make_request("a", 6, max_tokens=4)
    prompt = list(a.prompt_token_ids)
    sched.add_request(a)

    so = sched.schedule()
    assert batch(so, runner) == [("a", prompt, 0, [0, 1], True)]
    assert so.num_scheduled_tokens == 6 and so.preempted_request_ids == []
    assert a.num_computed_tokens == 6  # advanced when scheduled
    sampled = runner.execute(so)
    t1 = sampled["a"]
    new = sched.update_from_output(so, sampled)
    assert new == [(a, [t1])] and a.output_token_ids == [t1]
    assert a.status == RequestStatus.RUNNING

    so, s2 = step(sched, runner)
    assert batch(so, runner) == [("a", [t1], 6, [0, 1], True)]  # decode: one token
    so, s3 = step(sched, runner)
    t2, t3 = s2["a"], s3["a"]
    assert batch(so, runner) == [("a", [t2], 7, [0, 1], True)]
    so, s4 = step(sched, runner)
    assert batch(so, runner) == [("a", [t3], 8, [0, 1, 2], True)]  # position 8 opens block 2
    assert a.is_finished and a.finish_reason == FinishReason.LENGTH
    assert a.output_token_ids == [t1, t2, t3, s4["a"]]
    assert a.output_token_ids == reference_outputs(a)[0]
    # blocks back at the end of the free queue, tail first
    assert sched.kv_cache.pool.free_queue.block_ids() == [3, 4, 5, 6, 7, 2, 1, 0]
    assert not sched.has_unfinished_requests

    so = sched.schedule()
    assert so.is_empty and so.finished_request_ids == ["a"]
    assert sched.schedule().finished_request_ids == []  # reported once


def test_prompt_filling_whole_blocks():
    sched = make_scheduler(num_blocks=4, block_size=4)
    runner = FakeRunner(4)
    sched.add_request(make_request("a", 8, max_tokens=2))
    so, sampled = step(sched, runner)
    assert batch(so, runner)[0][2:] == (0, [0, 1], True)
    so, _ = step(sched, runner)
    assert batch(so, runner) == [("a", [sampled["a"]], 8, [0, 1, 2], True)]


def test_add_request_twice_raises():
    sched = make_scheduler(num_blocks=4, block_size=4)
    sched.add_request(make_request("a", 2))
    with pytest.raises(ValueError, match="already"):
        sched.add_request(make_request("a", 2))


# ---- continuous batching ------------------------------------------------------------------------

def test_request_joins_in_the_step_after_another_finishes():
    sched = make_scheduler(num_blocks=16, block_size=4, max_num_seqs=2)
    runner = FakeRunner(4)
    for rid, mt in (("a", 2), ("b", 4), ("c", 2)):
        sched.add_request(make_request(rid, 3, max_tokens=mt))
    first, _ = step(sched, runner)
    st_ = sched.stats
    assert (len(sched.running), len(sched.waiting), st_.num_steps) == (2, 1, 1)
    assert sched.kv_cache.usage == 2 / 16  # a and b hold one block each
    shapes = [shape(first)] + [shape(so) for so in run_until_done(sched, runner)]
    assert shapes == [
        [("a", 3, 0), ("b", 3, 0)],  # c waits: max_num_seqs=2
        [("a", 1, 3), ("b", 1, 3)],  # a finishes (2 tokens)
        [("b", 1, 4), ("c", 3, 0)],  # c joins next step, decode and prefill mixed
        [("b", 1, 5), ("c", 1, 3)],  # b finishes (4 tokens), c finishes (2 tokens)
    ]
    assert (len(sched.running), len(sched.waiting), sched.kv_cache.usage,
            st_.num_steps) == (0, 0, 0, 4)
    assert sched.kv_cache.num_free_blocks == 16


def test_requests_leave_the_batch_at_their_own_max_tokens():
    sched = make_scheduler(num_blocks=16, block_size=2)
    runner = FakeRunner(2)
    reqs = [make_request(r, 2, max_tokens=m) for r, m in (("a", 3), ("b", 1), ("c", 2))]
    for r in reqs:
        sched.add_request(r)
    outs = run_until_done(sched, runner)
    assert [[s.request_id for s in so.scheduled] for so in outs] == [
        ["a", "b", "c"], ["a", "c"], ["a"]]
    assert outs[1].finished_request_ids == ["b"] and outs[2].finished_request_ids == ["c"]
    for r in reqs:
        assert r.finish_reason == FinishReason.LENGTH
        assert r.output_token_ids == reference_outputs(r)[0]
    assert sched.kv_cache.num_free_blocks == 16


def test_max_tokens_is_capped_by_max_total_tokens():
    sched = make_scheduler(num_blocks=8, block_size=4)
    r = make_request("a", 5, max_tokens=100, max_total_tokens=8)
    sched.add_request(r)
    run_until_done(sched, FakeRunner(4))
    assert len(r.output_token_ids) == 3 and r.finish_reason == FinishReason.LENGTH


# ---- stop conditions ----------------------------------------------------------------------------

EOS = 2
STOP = 1


def run_scripted(script, **kw):
    sched = make_scheduler(num_blocks=8, block_size=4)
    r = make_request("a", 3, **kw)
    sched.add_request(r)
    runner = FakeRunner(4, scripted({"a": script}, {"a": 3}))
    outs = run_until_done(sched, runner)
    assert sched.kv_cache.num_free_blocks == 8
    return r, len(outs)


def test_eos_finishes_with_stop():
    r, steps = run_scripted([5, EOS, 7, 8], max_tokens=4, eos=[EOS])
    assert r.output_token_ids == [5, EOS] and r.finish_reason == FinishReason.STOP
    assert steps == 2


def test_eos_is_ignored_with_ignore_eos():
    r, _ = run_scripted([5, EOS, EOS, 8], max_tokens=4, eos=[EOS], ignore_eos=True)
    assert r.output_token_ids == [5, EOS, EOS, 8] and r.finish_reason == FinishReason.LENGTH


def test_stop_token_id_finishes_even_with_ignore_eos():
    r, _ = run_scripted([5, 6, STOP, 8], max_tokens=4, eos=[EOS], stop_token_ids=[STOP],
                        ignore_eos=True)
    assert r.output_token_ids == [5, 6, STOP] and r.finish_reason == FinishReason.STOP


def test_min_tokens_defers_eos_and_stop_ids():
    r, _ = run_scripted([EOS, STOP, EOS, 9], max_tokens=4, min_tokens=3, eos=[EOS],
                        stop_token_ids=[STOP])
    assert r.output_token_ids == [EOS, STOP, EOS] and r.finish_reason == FinishReason.STOP
    r, _ = run_scripted([STOP, STOP, 6, STOP, 9], max_tokens=5, min_tokens=3,
                        stop_token_ids=[STOP])
    assert r.output_token_ids == [STOP, STOP, 6, STOP] and r.finish_reason == FinishReason.STOP


def test_eos_of_one_request_leaves_the_others_running():
    sched = make_scheduler(num_blocks=8, block_size=4)
    a = make_request("a", 2, max_tokens=5, eos=[EOS])
    b = make_request("b", 2, max_tokens=3, eos=[EOS])
    sched.add_request(a)
    sched.add_request(b)
    runner = FakeRunner(4, scripted({"a": [4, EOS, 4, 4, 4]}, {"a": 2}))
    outs = run_until_done(sched, runner)
    assert [[s.request_id for s in so.scheduled] for so in outs] == [
        ["a", "b"], ["a", "b"], ["b"]]
    assert a.output_token_ids == [4, EOS] and a.finish_reason == FinishReason.STOP
    assert b.output_token_ids == reference_outputs(b)[0]
    assert len(b.output_token_ids) == 3


# ---- budget and limits --------------------------------------------------------------------------

def test_token_budget_limits_admission_fcfs_without_skipping():
    sched = make_scheduler(num_blocks=32, block_size=4, max_num_batched_tokens=10)
    runner = FakeRunner(4)
    for rid, n in (("a", 6), ("b", 8), ("c", 2)):
        sched.add_request(make_request(rid, n, max_tokens=3))
    outs = run_until_done(sched, runner)
    # c (2 tokens) would fit next to a, but FCFS does not let it pass b
    assert shape(outs[0]) == [("a", 6, 0)]
    assert shape(outs[1]) == [("a", 1, 6), ("b", 8, 0)]
    assert shape(outs[2]) == [("a", 1, 7), ("b", 1, 8), ("c", 2, 0)]  # a finishes
    assert shape(outs[3]) == [("b", 1, 9), ("c", 1, 2)]  # b finishes
    assert shape(outs[4]) == [("c", 1, 3)]
    assert [so.num_scheduled_tokens for so in outs] == [6, 9, 4, 2, 1]


def test_max_num_seqs_limits_the_batch():
    sched = make_scheduler(num_blocks=32, block_size=4, max_num_seqs=3)
    runner = FakeRunner(4)
    for i in range(7):
        sched.add_request(make_request(f"r{i}", 2, max_tokens=2))
    outs = run_until_done(sched, runner)
    assert [[s.request_id for s in so.scheduled] for so in outs] == [
        ["r0", "r1", "r2"], ["r0", "r1", "r2"],
        ["r3", "r4", "r5"], ["r3", "r4", "r5"],
        ["r6"], ["r6"],
    ]
    assert max(len(so.scheduled) for so in outs) == 3


def test_admission_is_in_arrival_order():
    sched = make_scheduler(num_blocks=32, block_size=4, max_num_seqs=1)
    runner = FakeRunner(4)
    order = ["z", "m", "a", "q"]
    for rid in order:
        sched.add_request(make_request(rid, 1 + len(sched.requests), max_tokens=1))
    outs = run_until_done(sched, runner)
    assert [so.scheduled[0].request_id for so in outs] == order


# ---- preemption by recompute --------------------------------------------------------------------

def test_preemption_victim_is_last_admitted_and_recomputes():
    # 2 blocks of 4: a (4 tokens) and b (3 tokens) take one each; a's decode at position 4 needs a
    # second block, so b (admitted last) is preempted and a takes b's block.
    sched = make_scheduler(num_blocks=2, block_size=4)
    runner = FakeRunner(4)
    a = make_request("a", 4, max_tokens=4)
    b = make_request("b", 3, max_tokens=3)
    c = make_request("c", 1, max_tokens=1)  # arrives after b
    sched.add_request(a)
    sched.add_request(b)
    so, s1 = step(sched, runner)
    assert batch(so, runner) == [("a", a.prompt_token_ids, 0, [0], True),
                         ("b", b.prompt_token_ids, 0, [1], True)]
    sched.add_request(c)
    b_out = list(b.output_token_ids)
    assert b_out == [s1["b"]]

    so = sched.schedule()
    assert so.preempted_request_ids == ["b"]
    # c is not admitted in this step
    assert batch(so, runner) == [("a", [s1["a"]], 4, [0, 1], True)]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.num_preemptions == 1 and sched.stats.num_preemptions == 1
    assert sched.kv_cache.block_ids("b") == [] and sched.kv_cache.num_free_blocks == 0
    assert [r.request_id for r in sched.waiting] == ["b", "c"]  # ahead of the later arrival
    assert [r.request_id for r in sched.running] == ["a"]
    sched.update_from_output(so, runner.execute(so))
    assert b.output_token_ids == b_out  # kept for the recompute

    so, _ = step(sched, runner)
    assert shape(so) == [("a", 1, 5)]  # b cannot fit back yet
    so, _ = step(sched, runner)  # a's fourth token: a finishes
    assert shape(so) == [("a", 1, 6)] and a.is_finished
    so, _ = step(sched, runner)
    # b recomputes prompt + its output so far, samples its second token; then c fits too
    # a's blocks went back tail first ([1, 0]), so b gets 1 and c gets 0
    assert batch(so, runner) == [("b", b.prompt_token_ids + b_out, 0, [1], True),
                         ("c", c.prompt_token_ids, 0, [0], True)]
    run_until_done(sched, runner)
    assert a.output_token_ids == reference_outputs(a)[0]
    assert b.output_token_ids == reference_outputs(b)[0]
    assert b.finish_reason == FinishReason.LENGTH and len(b.output_token_ids) == 3
    assert sched.kv_cache.num_free_blocks == 2


def test_preemption_picks_last_admitted_not_the_one_growing():
    sched = make_scheduler(num_blocks=3, block_size=2)
    runner = FakeRunner(2)
    reqs = [make_request(r, 2, max_tokens=4) for r in ("a", "b", "c")]
    for r in reqs:
        sched.add_request(r)
    step(sched, runner)
    assert [sched.kv_cache.block_ids(r) for r in "abc"] == [[0], [1], [2]]
    so, _ = step(sched, runner)
    # a needs a block for position 2: c goes, a takes its block; b then needs one: b itself goes
    assert so.preempted_request_ids == ["c", "b"]
    assert batch(so, runner)[0][0] == "a" and batch(so, runner)[0][3] == [0, 2]
    assert len(so.scheduled) == 1
    assert [r.request_id for r in sched.waiting] == ["b", "c"]
    run_until_done(sched, runner)
    for r in reqs:
        assert r.output_token_ids == reference_outputs(r)[0]
        assert r.num_preemptions >= 1 or r.request_id == "a"
    assert sched.kv_cache.num_free_blocks == 3


class OldestVictimPolicy(FCFSPolicy):
    def select_victim(self, candidates):
        return candidates[0]


def test_victim_is_never_a_request_already_scheduled_in_the_step():
    sched = Scheduler(KVCacheManager(3, 2), OldestVictimPolicy(None), 16, 64, clock=lambda: 0.0)
    runner = FakeRunner(2)
    reqs = [make_request("a", 1, 4), make_request("b", 2, 4), make_request("c", 2, 4)]
    for r in reqs:
        sched.add_request(r)
    step(sched, runner)
    so, _ = step(sched, runner)
    # a fits in its block and is scheduled first; b needs a block: the policy is offered [b, c]
    # only, picks b (the oldest of those), and c takes b's block
    assert so.preempted_request_ids == ["b"]
    t = runner.tables.apply(so)
    assert [(s.request_id, s.start_pos, t[s.request_id]) for s in so.scheduled] == [
        ("a", 1, [0]), ("c", 2, [2, 1])]
    run_until_done(sched, runner)
    for r in reqs:
        assert r.output_token_ids == reference_outputs(r)[0]


def test_preempted_tokens_equal_unpreempted_run():
    """Same requests, one cache far too small and one large: same tokens for every request."""
    def run(num_blocks):
        sched = make_scheduler(num_blocks=num_blocks, block_size=2)
        reqs = [make_request(f"r{i}", 3 + i, max_tokens=6 + i) for i in range(4)]
        for r in reqs:
            sched.add_request(r)
        run_until_done(sched, FakeRunner(2))
        assert sched.kv_cache.num_free_blocks == num_blocks
        return reqs, sched.stats.num_preemptions

    small, n_pre = run(8)
    big, n_pre_big = run(64)
    assert n_pre > 0 and n_pre_big == 0
    assert [r.output_token_ids for r in small] == [r.output_token_ids for r in big]
    assert [r.output_token_ids for r in big] == [reference_outputs(r)[0] for r in big]


# ---- abort --------------------------------------------------------------------------------------

def test_abort_running_frees_blocks_at_once():
    sched = make_scheduler(num_blocks=4, block_size=4)
    runner = FakeRunner(4)
    a = make_request("a", 5, max_tokens=10)
    b = make_request("b", 3, max_tokens=10)
    sched.add_request(a)
    sched.add_request(b)
    step(sched, runner)
    assert sched.kv_cache.block_ids("a") == [0, 1] and sched.kv_cache.num_free_blocks == 1
    assert sched.abort_requests(["a", "nope"]) == [a]
    assert sched.kv_cache.num_free_blocks == 3  # same step, before the next schedule
    assert sched.kv_cache.pool.free_queue.block_ids() == [3, 1, 0]
    assert a.finish_reason == FinishReason.ABORT and a.is_finished
    check_scheduler_invariants(sched)
    so, _ = step(sched, runner)
    assert so.finished_request_ids == ["a"] and shape(so) == [("b", 1, 3)]


def test_abort_waiting_request():
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_seqs=1)
    runner = FakeRunner(4)
    sched.add_request(make_request("a", 2, max_tokens=2))
    sched.add_request(make_request("b", 2, max_tokens=2))
    step(sched, runner)
    sched.abort_requests(["b"])
    assert [r.request_id for r in sched.waiting] == []
    outs = run_until_done(sched, runner)
    assert all(s.request_id == "a" for so in outs for s in so.scheduled)
    assert sched.kv_cache.num_free_blocks == 4


def test_abort_between_schedule_and_update_drops_the_token():
    sched = make_scheduler(num_blocks=4, block_size=4)
    runner = FakeRunner(4)
    a = make_request("a", 2, max_tokens=4)
    sched.add_request(a)
    so = sched.schedule()
    sampled = runner.execute(so)
    sched.abort_requests(["a"])
    assert sched.update_from_output(so, sampled) == []
    assert a.output_token_ids == [] and sched.kv_cache.num_free_blocks == 4


def test_scheduled_request_fields():
    sr = ScheduledRequest("x", [1, 2], 3, [0], False)
    assert (sr.request_id, sr.token_ids, sr.start_pos, sr.new_block_ids, sr.sample) == (
        "x", [1, 2], 3, [0], False) and sr.new is None


# ---- property: random add / step / abort --------------------------------------------------------

add = st.tuples(st.just("add"), st.integers(1, 6), st.integers(1, 12))
step_ = st.tuples(st.just("step"), st.just(0), st.just(0))
op = st.one_of(add, step_, add, step_, st.tuples(st.just("abort"), st.integers(0, 30), st.just(0)))


@settings(deadline=None, max_examples=100, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(num_blocks=st.integers(2, 8), block_size=st.integers(1, 3), max_num_seqs=st.integers(2, 4),
       ops=st.lists(op, min_size=10, max_size=40))
def test_property_random_add_step_abort(num_blocks, block_size, max_num_seqs, ops):
    capacity = num_blocks * block_size  # max_model_len: one request always fits alone
    sched = make_scheduler(num_blocks, block_size, max_num_seqs, max_num_batched_tokens=capacity)
    runner = FakeRunner(block_size)
    reqs, aborted = [], set()

    def one_step():
        before = {r.request_id for r in sched.waiting}
        so, _ = step(sched, runner)
        check_scheduler_invariants(sched)
        assert so.num_scheduled_tokens <= capacity
        assert len(so.scheduled) <= max_num_seqs
        tables = runner.tables.apply(so)
        for s in so.scheduled:
            # every scheduled request, newly admitted or not, got the blocks for its tokens
            assert len(tables[s.request_id]) * block_size >= s.start_pos + len(s.token_ids)
            assert len(set(tables[s.request_id])) == len(tables[s.request_id])
            # (re-)admitted rows bring their whole table, running ones only what they gained
            assert (s.new is not None) == (s.request_id in before)
            if s.request_id in before:
                assert s.start_pos == 0  # admission (or re-admission) computes from the start
        assert not {s.request_id for s in so.scheduled} & set(so.preempted_request_ids)
        held = [b for s in so.scheduled for b in tables[s.request_id]]
        assert len(held) == len(set(held)), "two requests of one step share a block"
        return so

    for kind, a, b in ops:
        if kind == "add":
            prompt_len = min(a, capacity - 1)
            max_tokens = min(b, capacity - prompt_len)
            r = make_request(f"r{len(reqs)}", prompt_len, max_tokens, max_total_tokens=capacity)
            reqs.append(r)
            sched.add_request(r)
        elif kind == "step":
            one_step()
        elif reqs:
            r = reqs[a % len(reqs)]
            if not r.is_finished:
                aborted.add(r.request_id)
            sched.abort_requests([r.request_id])
            check_scheduler_invariants(sched)
    for _ in range(2000):
        if not sched.has_unfinished_requests:
            break
        one_step()
    assert not sched.has_unfinished_requests, "scheduler stopped making progress"
    assert sched.kv_cache.num_free_blocks == num_blocks
    assert all(b.ref_cnt == 0 for b in sched.kv_cache.pool.blocks)
    for r in reqs:
        assert r.is_finished
        if r.request_id in aborted:
            assert r.finish_reason == FinishReason.ABORT
        else:
            assert (r.output_token_ids, r.finish_reason) == reference_outputs(r, default_next_token)


def test_pipeline_micro_batches_split_the_running_requests_evenly():
    """num_micro_batches=2 (two pipeline stages, two steps in flight): each step holds half of
    the requests, and the step scheduled while the first is in flight holds the other half, so
    the stages can work on both at once. One micro-batch holds them all."""
    def run(k, n=7):
        sched = Scheduler(KVCacheManager(64, 4), FCFSPolicy(None), 16, 1024,
                          clock=lambda: 0.0, num_micro_batches=k)
        for i in range(n):
            sched.add_request(make_request(f"r{i}", 3, max_tokens=5, ignore_eos=True))
        in_flight, sizes, groups = [], [], []
        while sched.has_unfinished_requests:
            while len(in_flight) < k:  # the engine core keeps k steps in flight
                so = sched.schedule()
                if so.is_empty:
                    break
                in_flight.append(so)
                sizes.append(len(so.scheduled))
                groups.append({sr.request_id for sr in so.scheduled})
            so = in_flight.pop(0)
            sched.update_from_output(so, {sr.request_id: 5 for sr in so.scheduled if sr.sample})
        return sizes, groups

    sizes, groups = run(2)
    assert sizes == [4, 3] * 5  # ceil(7 / 2), then the rest; 5 tokens each
    assert groups[0].isdisjoint(groups[1]) and groups[0] | groups[1] == {f"r{i}" for i in range(7)}
    assert groups[2] == groups[0] and groups[3] == groups[1]
    assert run(1)[0] == [7] * 5
    with pytest.raises(ValueError, match="num_micro_batches"):
        Scheduler(KVCacheManager(4, 4), FCFSPolicy(None), 4, 64, num_micro_batches=0)


def test_long_prefill_token_threshold_caps_each_requests_tokens_per_step():
    """long_prefill_token_threshold = 4: no request computes more than 4 tokens in a step (its
    prompt spread over steps, several prompts in one step within the budget), and every
    request's outputs equal the unbatched reference."""
    sched = Scheduler(KVCacheManager(64, 4), FCFSPolicy(None), 16, 64, clock=lambda: 0.0,
                      enable_chunked_prefill=True, long_prefill_token_threshold=4)
    reqs = [make_request(f"r{i}", n, max_tokens=3, ignore_eos=True)
            for i, n in enumerate((10, 3, 9))]
    for r in reqs:
        sched.add_request(r)
    outs = run_until_done(sched, FakeRunner(4))
    assert max(len(sr.token_ids) for so in outs for sr in so.scheduled) == 4
    first = outs[0].scheduled
    assert [len(sr.token_ids) for sr in first] == [4, 3, 4]  # one step holds all three
    for r in reqs:
        assert r.is_finished
        assert (r.output_token_ids, r.finish_reason) == reference_outputs(r, default_next_token)


def test_max_mixed_prefill_tokens_caps_prompt_tokens_only_beside_decodes():
    """max_mixed_prefill_tokens = 6: a step of prompts alone takes the whole budget; once a
    request decodes, every step that carries a decode holds at most 6 prompt tokens in all
    (across requests), and outputs equal the unbatched reference."""
    sched = Scheduler(KVCacheManager(64, 4), FCFSPolicy(None), 16, 64, clock=lambda: 0.0,
                      enable_chunked_prefill=True, max_mixed_prefill_tokens=6)
    runner = FakeRunner(4)
    reqs = [make_request("r0", 9, max_tokens=8, ignore_eos=True)]
    sched.add_request(reqs[0])
    step(sched, runner)
    reqs += [make_request(f"r{i}", n, max_tokens=3, ignore_eos=True)
             for i, n in ((1, 10), (2, 9))]
    for r in reqs[1:]:
        sched.add_request(r)
    run_until_done(sched, runner)
    steps = [[(sr.request_id, len(sr.token_ids)) for sr in so.scheduled] for so in runner.steps]
    assert steps[0] == [("r0", 9)]  # no decodes: no cap
    assert steps[1] == [("r0", 1), ("r1", 6)]
    assert steps[2] == [("r0", 1), ("r1", 4), ("r2", 2)]
    for rows in steps[1:]:
        assert sum(n for _, n in rows if n > 1) <= 6, rows
    for r in reqs:
        assert r.is_finished
        assert (r.output_token_ids, r.finish_reason) == reference_outputs(r, default_next_token)


@pytest.mark.parametrize("key", ["long_prefill_token_threshold", "max_mixed_prefill_tokens"])
def test_prefill_caps_refuse_negative_values_and_unchunked_prefill(key):
    with pytest.raises(ValueError, match=key):
        Scheduler(KVCacheManager(4, 4), FCFSPolicy(None), 4, 64, **{key: 8})
    with pytest.raises(ValueError, match=key):
        Scheduler(KVCacheManager(4, 4), FCFSPolicy(None), 4, 64, enable_chunked_prefill=True,
                  **{key: -1})
