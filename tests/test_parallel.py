"""Tensor and pipeline parallelism on CPU (gloo, the tiny model, one thread per process): TP=2,
PP=2 and TP=2 x PP=2 give the single rank's greedy tokens (near-tie rule, tests/numerics.py) for
a batch of mixed lengths, with prefix caching, chunked prefill and preemption in play; log-probs
cross from the last stage; pipeline stages keep two steps in flight. One worker group per
layout (start-up costs seconds on two cores). Also: the layers' sharding rules and the step
message codec, without processes."""

from __future__ import annotations

import random
from functools import partial

import pytest
import torch

from numerics import assert_greedy_match, top2_gaps
from pagebatch.distributed import step_codec
from pagebatch.engine_core import EngineCore, EngineCoreRequest
from pagebatch.errors import ConfigError
from pagebatch.layers.linear import qkv_output_ranges, tp_partition
from pagebatch.request import SamplingParams
from pagebatch.scheduler import ScheduledRequest, SchedulerOutput
from procs import one_thread_children
from tiny import engine_config

# 40 blocks of 4 tokens for 10 requests of up to 44 + 12 tokens: preemption; a 12-token prefix
# shared by half the prompts: prefix-cache hits; a 24-token budget: chunked prefill
ENGINE_KEYS = dict(device="cpu", dtype="float32", num_kv_blocks=40, block_size=4,
                   max_model_len=128, max_num_batched_tokens=24, max_num_seqs=8)
MAX_TOKENS = 12
# (tensor_parallel_size, pipeline_parallel_size, async_scheduling, pipeline_micro_batches,
# custom_all_reduce): TP with asynchronous scheduling (every rank fills in the decodes' input
# tokens from its own samples); TP x PP with one micro-batch more than stages, and the
# row-parallel all-reduces left to the norms after them (partial sums across the stage boundary)
LAYOUTS = [(2, 1, True, None, False), (1, 2, False, None, False), (2, 2, False, 3, True)]

tiny_config = partial(engine_config, keys=ENGINE_KEYS)


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    shared = [rng.randint(3, 255) for _ in range(12)]
    out = []
    for i in range(10):
        own = [rng.randint(3, 255) for _ in range(rng.randint(1, 32))]
        out.append(shared + own if i % 2 else own)
    return out


def _requests(logprobs: int | None = None, tag: str = "r") -> list[EngineCoreRequest]:
    return [EngineCoreRequest(f"{tag}{i}", p, SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
        logprobs=logprobs if i < 2 else None), frozenset({2}), seed=i)
        for i, p in enumerate(_prompts())]


def _run(core: EngineCore, requests: list[EngineCoreRequest]):
    """Tokens and log-prob rows per request, and the most steps that were in flight at once."""
    for r in requests:
        core.add_request(r)
    tokens = {r.request_id: [] for r in requests}
    lps = {r.request_id: [] for r in requests}
    peak = [0]
    start = core.executor.execute_model

    def spy(so):  # steps in flight once this one starts
        if not so.is_empty:
            peak[0] = max(peak[0], len(core._batch_queue) + 1)
        return start(so)

    core.executor.execute_model = spy
    try:
        for _ in range(2000):
            if not core.has_unfinished_requests:
                break
            for o in core.step():
                tokens[o.request_id] += o.new_token_ids
                if o.logprobs is not None:
                    lps[o.request_id] += o.logprobs.logprobs
                assert o.finish_reason in (None, "length"), o
    finally:
        del core.executor.execute_model
    assert not core.has_unfinished_requests
    return tokens, lps, peak[0]


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """The single rank's tokens and, per request, the top-2 gap at each generated position."""
    core = EngineCore.from_config(tiny_config(tiny_model_dir))
    tokens, lps, _ = _run(core, _requests(logprobs=2))
    gaps = {}
    for r in _requests():
        logits = core.runner.forward_scratch(r.prompt_token_ids + tokens[r.request_id])
        gaps[r.request_id] = top2_gaps(logits[len(r.prompt_token_ids) - 1:-1])
    assert core.scheduler.stats.num_preemptions > 0 and core.kv_cache.stats.hits > 0
    core.shutdown()
    return tokens, gaps, lps


@pytest.fixture(scope="module", params=LAYOUTS,
                ids=lambda p: f"tp{p[0]}-pp{p[1]}" + ("-async" if p[2] else "")
                + (f"-mb{p[3]}" if p[3] else "") + ("-fused-ar" if p[4] else ""))
def parallel_core(request, tiny_model_dir):
    tp, pp, asynchronous, micro_batches, fused_all_reduce = request.param
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with one_thread_children():
            core = EngineCore.from_config(tiny_config(
                tiny_model_dir, tensor_parallel_size=tp, pipeline_parallel_size=pp,
                async_scheduling=asynchronous, pipeline_micro_batches=micro_batches,
                custom_all_reduce=fused_all_reduce))
        yield core
        core.shutdown()
    finally:
        torch.set_num_threads(threads)


def test_parallel_greedy_equals_single_rank(parallel_core, reference):
    ref_tokens, gaps, ref_lps = reference
    core = parallel_core
    tokens, lps, in_flight = _run(core, _requests(logprobs=2))
    for rid, ref in ref_tokens.items():
        assert_greedy_match(ref, gaps[rid], tokens[rid], what=rid)
    assert core.scheduler.stats.num_preemptions > 0, "the test should preempt"
    assert core.kv_cache.stats.hits > 0, "the test should hit the prefix cache"
    # log-probs come back (from the last stage under PP) and agree with the single rank's
    for rid in ("r0", "r1"):
        n = len(ref_lps[rid])
        assert n == MAX_TOKENS and len(lps[rid]) == n
        if tokens[rid] == ref_tokens[rid]:
            assert torch.allclose(torch.tensor(lps[rid]), torch.tensor(ref_lps[rid]), atol=1e-3)
    # pipeline stages overlap: as many steps in flight as micro-batches (default: one per
    # stage; asynchronous scheduling: 2)
    cfg = core.config
    assert in_flight == core.executor.max_concurrent_batches == max(
        cfg.pipeline_micro_batches or cfg.pipeline_parallel_size,
        2 if cfg.async_scheduling else 1)
    assert core.scheduler.num_micro_batches == (in_flight if cfg.pipeline_parallel_size > 1
                                                else 1)
    # custom_all_reduce: the norms reduce the row-parallel layers' partial sums (on gloo as an
    # all-reduce, then the norm: the one-shot kernel is CUDA's)
    layer = core.runner.model.layers[0]
    assert layer.mlp.down_proj.reduce_results is not cfg.custom_all_reduce
    assert (layer.post_attention_layernorm.tp is not None) is cfg.custom_all_reduce
    assert core.runner.model.embed_tokens.reduce_results is not cfg.custom_all_reduce
    assert core.runner.parallel.one_shot is None


def test_parallel_runs_again_with_abort(parallel_core, reference):
    """A second batch on the same workers, one request aborted mid-way (its blocks freed while
    it may be in flight): the others still match."""
    ref_tokens, gaps, _ = reference
    core = parallel_core
    reqs = _requests(tag="b")
    for r in reqs:
        core.add_request(r)
    tokens = {r.request_id: [] for r in reqs}
    for _ in range(3):
        for o in core.step():
            tokens[o.request_id] += o.new_token_ids
    core.abort_requests(["b3"])
    while core.has_unfinished_requests:
        for o in core.step():
            tokens[o.request_id] += o.new_token_ids
    for rid, ref in ref_tokens.items():
        if rid != "r3":
            assert_greedy_match(ref, gaps[rid], tokens["b" + rid[1:]], what=rid)


# ---- without processes -------------------------------------------------------------------------

def test_partition_rules():
    assert tp_partition(8, 1, 1, 2) == (4, 4)
    # 4 q heads of 16 over 2 ranks; 2 KV heads over 4 ranks: replicated in pairs
    assert qkv_output_ranges(4, 2, 16, 1, 2) == [(32, 32), (16, 16), (16, 16)]
    assert qkv_output_ranges(4, 2, 16, 3, 4) == [(48, 16), (16, 16), (16, 16)]
    assert qkv_output_ranges(4, 1, 16, 1, 4)[1] == (0, 16)
    with pytest.raises(ValueError):
        tp_partition(6, 1, 0, 4)
    with pytest.raises(ValueError):  # q heads are never replicated
        qkv_output_ranges(2, 2, 16, 0, 4)


class _FakeTP:
    """A TP rank without processes: the all-reduce is left to the test (it sums the ranks)."""

    def __init__(self, rank: int, size: int) -> None:
        self.tp_rank, self.tp_size = rank, size

    def tp_all_reduce(self, x):
        return x


def test_column_and_row_shards_make_the_full_layer():
    """fp16 weights cut by `shard_checkpoint_tensor`: fused column shards concatenate to the
    full output (per shard), row shards sum to it with the bias counted once."""
    from pagebatch.layers.linear import LinearBase
    from pagebatch.quant.fp16 import UnquantizedMethod

    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 8, generator=g)
    w = [torch.randn(6, 8, generator=g), torch.randn(4, 8, generator=g)]
    b = [torch.randn(6, generator=g), torch.randn(4, generator=g)]

    def layer(kind, rank, outs, n_in):
        return LinearBase(n_in, outs, True, UnquantizedMethod(), torch.float32,
                          torch.device("cpu"), parallel=kind, tp=_FakeTP(rank, 2))

    cols = [layer("column", r, [6, 4], 8) for r in range(2)]
    for lin in cols:
        for shard in range(2):
            lin.load("weight", w[shard], shard)
            lin.load("bias", b[shard], shard)
    full = [x @ w[i].T + b[i] for i in range(2)]
    outs = [lin(x) for lin in cols]  # each rank: [its half of shard 0 | its half of shard 1]
    assert torch.allclose(torch.cat([outs[0][:, :3], outs[1][:, :3]], 1), full[0], atol=1e-5)
    assert torch.allclose(torch.cat([outs[0][:, 3:], outs[1][:, 3:]], 1), full[1], atol=1e-5)
    rows = [layer("row", r, [6], 8) for r in range(2)]
    for lin in rows:
        lin.load("weight", w[0], None)
        lin.load("bias", b[0], None)
        assert lin.weight.shape == (6, 4)
    total = rows[0](x[:, :4]) + rows[1](x[:, 4:])
    assert torch.allclose(total, full[0], atol=1e-5)


def test_bad_layouts_are_config_errors(tiny_model_dir):
    """Checked before any worker starts: 4 heads over 3 ranks; 2 layers over 3 stages."""
    with pytest.raises(ConfigError, match="attention heads"):
        EngineCore.from_config(tiny_config(tiny_model_dir, tensor_parallel_size=3))
    with pytest.raises(ConfigError, match="every stage needs at least one layer"):
        EngineCore.from_config(tiny_config(tiny_model_dir, pipeline_parallel_size=3))


def test_step_codec_round_trip():
    """Steps decode to the scheduler's output: new (or resumed) rows with their record and
    whole block table, running rows with the blocks they gained only, finished and preempted
    ids (an id may be finished twice: a reused id)."""
    from pagebatch.sampling_state import SamplingState
    from pagebatch.scheduler import NewRequestData

    assert step_codec.fields_match(), "a SchedulerOutput field is not in the step codec"
    new_a = NewRequestData([5, 6, 7], SamplingState(0.0, 0, 1.0, 1))
    new_b = NewRequestData(list(range(20)), SamplingState(0.7, 5, 0.9, 2, logit_bias={3: 1.5}))
    so = SchedulerOutput([ScheduledRequest("a", [5, 6, 7], 0, [3, 9], False, new_a),
                          ScheduledRequest("bé", [8], 20, [1, 2, 4], True, new_b)],
                         4, ["old", "x"], [])
    first = step_codec.encode_step(so)
    msg = step_codec.decode(first)
    assert msg.kind == step_codec.STEP and msg.so == so
    so2 = SchedulerOutput([ScheduledRequest("a", [11], 3, [10], True)], 1, [], ["bé"])
    second = step_codec.encode_step(so2)
    assert len(second) < len(first) and step_codec.decode(second).so == so2
    so3 = SchedulerOutput([ScheduledRequest("bé", [8, 9], 0, [7, 1], True, new_b),
                           ScheduledRequest("a", [12], 4, [], True)], 3, ["zz", "zz"], [])
    assert step_codec.decode(step_codec.encode_step(so3)).so == so3
    empty = SchedulerOutput([], 0)
    assert step_codec.decode(step_codec.encode_step(empty)).so == empty
    assert step_codec.decode(step_codec.encode_control(step_codec.SHUTDOWN)).kind == \
        step_codec.SHUTDOWN


def test_shm_ring_chunks_and_wraps():
    """Messages larger than a slot span several; every reader gets every message; a writer
    whose readers fall behind waits (and its check can stop the wait)."""
    import threading

    from pagebatch.distributed.shm_ring import ShmRingBuffer

    ring = ShmRingBuffer(2, num_slots=2, slot_bytes=64)
    readers = [ShmRingBuffer.attach(ring.handle(), i) for i in range(2)]
    msgs = [b"", b"x" * 200, bytes(range(48)), b"y" * 47] * 3
    got: list[list[bytes]] = [[], []]
    threads = [threading.Thread(target=lambda i=i: got[i].extend(
        readers[i].read(check=lambda: None) for _ in msgs)) for i in range(2)]
    for t in threads:
        t.start()
    for m in msgs:
        ring.write(m, check=lambda: None)
    for t in threads:
        t.join(10)
    assert got == [msgs, msgs]
    with pytest.raises(TimeoutError):  # nobody reads: the third chunk would wait forever
        ring.write(b"z" * 200, check=_raise_timeout)
    for r in readers:
        r.close()
    ring.close(unlink=True)


def _raise_timeout() -> None:
    raise TimeoutError


def test_pipeline_micro_batches_are_checked(tiny_model_dir):
    for keys in (dict(pipeline_micro_batches=2),  # one stage
                 dict(pipeline_parallel_size=2, pipeline_micro_batches=1)):  # fewer than stages
        with pytest.raises(ConfigError, match="pipeline_micro_batches"):
            tiny_config(tiny_model_dir, **keys)
