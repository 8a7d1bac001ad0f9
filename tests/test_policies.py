"""Admission order and preemption victims of the fcfs, priority and lpm policies, no model."""

from __future__ import annotations

from types import SimpleNamespace

from helpers_sched import make_request, reference_outputs
from pagebatch.config import EngineConfig
from pagebatch.kv_cache import KVCacheManager
from pagebatch.scheduler import PolicyContext, Scheduler
from pagebatch.schedulers.fcfs import FCFSPolicy
from pagebatch.schedulers.lpm import LPMPolicy
from pagebatch.schedulers.priority import PriorityPolicy
from test_prefix_cache import SharedCacheRunner, run


def req(rid, prompt, priority=0, arrival=0.0, max_tokens=4):
    r = make_request(rid, 0, max_tokens, prompt=prompt)
    r.priority, r.arrival_time = priority, arrival
    return r


def admitted_order(policy, reqs, num_blocks=64, bs=4, max_num_seqs=1, clock=lambda: 0.0,
                   warm=()):
    """Run to completion with one request at a time; the order requests got admitted."""
    kv = KVCacheManager(num_blocks, bs, enable_caching=True)
    sched = Scheduler(kv, policy, max_num_seqs, 256, clock=clock)
    runner = SharedCacheRunner(bs)
    for w in warm:
        sched.add_request(w)
    run(sched, runner)
    for r in reqs:
        sched.add_request(r)
    order = []
    while sched.has_unfinished_requests:
        so = sched.schedule()
        order += [s.request_id for s in so.scheduled if s.request_id not in order]
        sched.update_from_output(so, runner.execute(so))
    for r in reqs:
        assert r.output_token_ids == reference_outputs(r)[0]
    return order


def test_fcfs_order_and_victim():
    reqs = [req(f"r{i}", [3 + i] * 5) for i in range(4)]
    assert admitted_order(FCFSPolicy(None), reqs) == ["r0", "r1", "r2", "r3"]
    assert FCFSPolicy(None).select_victim(reqs).request_id == "r3"


def test_priority_order_ties_by_arrival_and_victim():
    reqs = [req("a", [3] * 5, priority=2), req("b", [4] * 5, priority=0),
            req("c", [5] * 5, priority=1), req("d", [6] * 5, priority=0)]
    assert admitted_order(PriorityPolicy(None), reqs) == ["b", "d", "c", "a"]
    running = [reqs[1], reqs[0], reqs[3]]
    assert PriorityPolicy(None).select_victim(running).request_id == "a"
    assert PriorityPolicy(None).select_victim([reqs[1], reqs[3]]).request_id == "d"


def test_priority_preempted_request_keeps_its_place():
    kv = KVCacheManager(6, 2, enable_caching=False)
    sched = Scheduler(kv, PriorityPolicy(None), 8, 64)
    runner = SharedCacheRunner(2)
    hi = req("hi", [3, 4, 5], priority=0, max_tokens=6)
    lo = req("lo", [6, 7, 8], priority=5, max_tokens=6)
    sched.add_request(hi)
    sched.add_request(lo)
    victims = []
    while sched.has_unfinished_requests:
        so = sched.schedule()
        victims += so.preempted_request_ids
        sched.update_from_output(so, runner.execute(so))
    assert victims and set(victims) == {"lo"}  # the worst priority is the one preempted
    assert hi.output_token_ids == reference_outputs(hi)[0]
    assert lo.output_token_ids == reference_outputs(lo)[0]


def lpm(**opts):
    return LPMPolicy(SimpleNamespace(plugin_options=opts))


SYSTEM = list(range(100, 116))  # a 16-token shared system prompt (4 blocks of 4)


def test_lpm_longest_cached_prefix_first_stable():
    warm = [req("warm", SYSTEM + [50, 51])]
    reqs = [req("miss1", [7] * 18), req("hit1", SYSTEM + [60, 61]),
            req("miss2", [8] * 18), req("hit2", SYSTEM[:8] + [70] * 10)]
    order = admitted_order(lpm(), reqs, warm=warm)
    assert order == ["hit1", "hit2", "miss1", "miss2"]
    assert admitted_order(FCFSPolicy(None), [req(r.request_id, r.prompt_token_ids)
                                             for r in reqs], warm=[req("w", SYSTEM + [50])]) \
        == ["miss1", "hit1", "miss2", "hit2"]


def test_lpm_falls_back_to_fcfs_over_the_threshold():
    warm = [req("warm", SYSTEM + [50, 51])]
    reqs = [req("miss1", [7] * 18), req("hit1", SYSTEM + [60, 61]), req("miss2", [8] * 18)]
    assert admitted_order(lpm(lpm_fcfs_threshold=2), reqs, warm=warm) == \
        ["miss1", "hit1", "miss2"]


def test_lpm_only_one_of_a_shared_uncached_prefix_goes_first():
    policy = lpm()
    kv = KVCacheManager(64, 4, enable_caching=True)
    sched = Scheduler(kv, policy, 8, 512, clock=lambda: 0.0)
    a = req("a", SYSTEM + [1, 2])
    b = req("b", SYSTEM + [3, 4])
    c = req("c", [9] * 18)
    for r in (a, b, c):
        sched.add_request(r)
    so = sched.schedule()
    assert [s.request_id for s in so.scheduled] == ["a", "c"]  # b waits for a's blocks
    runner = SharedCacheRunner(4)
    sched.update_from_output(so, runner.execute(so))
    so = sched.schedule()
    (sb,) = [s for s in so.scheduled if s.request_id == "b"]
    assert sb.start_pos == 16 and b.num_cached_tokens == 16  # ... and hits them


def test_lpm_aging_bound_serves_old_requests_in_arrival_order():
    now = {"t": 0.0}
    warm = [req("warm", SYSTEM + [50, 51])]
    old = req("old-miss", [7] * 18, arrival=0.0)
    hit = req("hit", SYSTEM + [60, 61], arrival=5.0)
    # at t=20 nothing has waited 30 s: the hit goes first
    assert admitted_order(lpm(lpm_max_wait=30.0), [old, hit], warm=warm,
                          clock=lambda: 20.0)[:1] == ["hit"]
    old = req("old-miss", [7] * 18, arrival=0.0)
    hit = req("hit", SYSTEM + [60, 61], arrival=5.0)
    now["t"] = 31.0
    assert admitted_order(lpm(lpm_max_wait=30.0), [old, hit], warm=warm,
                          clock=lambda: now["t"])[:1] == ["old-miss"]


def test_lpm_caches_match_lengths_between_cache_changes(monkeypatch):
    policy = lpm()
    kv = KVCacheManager(64, 4, enable_caching=True)
    sched = Scheduler(kv, FCFSPolicy(None), 8, 512)
    sched.add_request(req("warm", SYSTEM + [50, 51]))
    run(sched, SharedCacheRunner(4))
    waiting = [req(f"w{i}", SYSTEM + [60 + i] * 3) for i in range(5)]
    from pagebatch.block_hash import extend_block_hashes
    for r in waiting:
        extend_block_hashes(r.block_hashes, r.all_token_ids, 4)
    calls = []
    real = kv.num_cached_prefix_blocks
    monkeypatch.setattr(kv, "num_cached_prefix_blocks",
                        lambda h, start=0: calls.append(start) or real(h, start))
    ctx = PolicyContext(now=0.0, kv_cache=kv)
    list(policy.order_waiting(waiting, ctx))
    assert len(calls) == 5 and [policy.match_blocks(r, kv) for r in waiting] == [4] * 5
    list(policy.order_waiting(waiting, ctx))
    assert len(calls) == 5  # nothing changed in the cache: no re-matching
    kv.allocate_slots("x", 8, (), [b"\x01" * 32, b"\x02" * 32])  # an insert, no eviction
    list(policy.order_waiting(waiting, ctx))
    assert calls[5:] == [4] * 5  # re-checked, but only from the old match length on


def test_lpm_options_are_declared_and_set_from_the_config_file(tmp_path):
    from pagebatch.registry import registry

    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("scheduling_policy: lpm\nlpm-fcfs-threshold: 7\nlpm_max_wait: 2.5\n")
    cfg = EngineConfig.from_sources(file=cfg_file)
    policy = registry().scheduling_policy("lpm")(cfg)
    assert (policy.fcfs_threshold, policy.max_wait) == (7, 2.5)
    import pytest

    from pagebatch.errors import ConfigError
    with pytest.raises(ConfigError, match="lpm_max_wait"):
        EngineConfig.from_sources(cli={"lpm_max_wait": -1})
