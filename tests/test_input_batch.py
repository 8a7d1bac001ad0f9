"""The persistent input batch and the CUDA-graph bucket logic, without a model or a GPU."""

from __future__ import annotations

import numpy as np
import pytest

from pagebatch.cuda_graphs import bucket_for, capture_sizes
from pagebatch.input_batch import InputBatch
from pagebatch.sampling_state import SamplingState
from pagebatch.scheduler import NewRequestData, ScheduledRequest, SchedulerOutput
from pagebatch.step_layout import PAD_SLOT, StepLayout

BS = 4  # block size


def _batch(max_num_seqs=4, max_blocks=8, max_tokens=64) -> InputBatch:
    return InputBatch(max_num_seqs, max_blocks, BS, max_tokens, pin_memory=False)


def _so(*reqs, finished=(), preempted=()) -> SchedulerOutput:
    return SchedulerOutput(list(reqs), sum(len(r.token_ids) for r in reqs), list(finished),
                           list(preempted))


def _new(rid, tokens, start, blocks, sample) -> ScheduledRequest:
    """A request's first (or resumed) row: its whole block table and its new-request record."""
    return ScheduledRequest(rid, tokens, start, blocks, sample,
                            NewRequestData(list(range(start + len(tokens))), None))


def _expected_slots(blocks: list[int], start: int, n: int) -> list[int]:
    return [blocks[p // BS] * BS + p % BS for p in range(start, start + n)]


def test_mixed_step_layout_and_slot_mapping():
    ib = _batch()
    a = _new("a", [11, 12, 13, 14, 15], 0, [7, 3], sample=True)
    b = _new("b", [21], 9, [0, 5, 6], sample=True)
    c = _new("c", [31, 32, 33], 2, [2, 4], sample=False)  # a prefill chunk
    inp = ib.prepare(_so(a, b, c))
    h = inp.host
    assert inp.layout == StepLayout(9, 3, 3) and not inp.padded
    assert h["input_ids"].tolist() == [11, 12, 13, 14, 15, 21, 31, 32, 33]
    assert h["positions"].tolist() == [0, 1, 2, 3, 4, 9, 2, 3, 4]
    assert h["slot_mapping"].tolist() == (_expected_slots([7, 3], 0, 5)
                                          + _expected_slots([0, 5, 6], 9, 1)
                                          + _expected_slots([2, 4], 2, 3))
    assert h["query_start_loc"].tolist() == [0, 5, 6, 9]
    assert h["seq_lens"].tolist() == [5, 10, 5]
    assert h["logits_rows"][:2].tolist() == [4, 5]
    assert h["block_tables"].tolist() == [[7, 3, 0], [0, 5, 6], [2, 4, 0]]
    assert inp.sample_ids == ["a", "b"] and inp.sample_positions == [4, 9]
    assert (inp.max_query_len, inp.max_seq_len) == (5, 10)


def test_block_tables_update_incrementally_and_slots_are_reused():
    ib = _batch(max_num_seqs=2)
    ib.prepare(_so(_new("a", [1, 2, 3, 4], 0, [5], True)))
    slot_a = ib.slot_of["a"]
    ib.prepare(_so(ScheduledRequest("a", [9], 4, [8], True)))  # running: the block it gained
    assert ib.block_table[slot_a, :2].tolist() == [5, 8] and ib.num_blocks[slot_a] == 2
    # a finished request frees its slot; a preempted one too, and comes back with new blocks
    ib.prepare(_so(_new("b", [1], 0, [1], True), finished={"a"}))
    assert "a" not in ib.slot_of
    ib.prepare(_so(_new("c", [1], 0, [2], True)))
    assert len(ib.slot_of) == 2
    inp = ib.prepare(_so(_new("b", [1, 2, 3, 4, 5], 0, [6, 7], True), preempted=["b"]))
    assert inp.host["block_tables"][0].tolist() == [6, 7]
    with pytest.raises(RuntimeError, match="max_num_seqs=2"):
        ib.prepare(_so(_new("d", [1], 0, [3], True)))


def test_graph_layout_pads_to_the_bucket():
    ib = _batch(max_num_seqs=8, max_blocks=3)
    reqs = [_new(f"r{i}", [100 + i], 5 + i, [i, 10 + i], True) for i in range(3)]
    inp = ib.prepare(_so(*reqs), graph_bucket=lambda n: bucket_for(n, [1, 2, 4, 8]))
    assert inp.padded and inp.layout == StepLayout.for_graph(4, 3) and inp.num_reqs == 3
    h = inp.host
    assert h["input_ids"].tolist() == [100, 101, 102, 0]
    assert h["slot_mapping"].tolist()[3] == PAD_SLOT
    assert h["query_start_loc"].tolist() == [0, 1, 2, 3, 4]
    assert h["seq_lens"].tolist() == [6, 7, 8, 1]
    assert h["block_tables"].tolist() == [[0, 10, 0], [1, 11, 0], [2, 12, 0], [0, 0, 0]]
    # a step with a prefill chunk, or a decode that does not sample, stays eager
    mixed = [ScheduledRequest("r0", [1], 7, [], True), _new("p", [1, 2], 0, [4], True)]
    assert not ib.prepare(_so(*mixed), graph_bucket=lambda n: 4).padded
    quiet = [ScheduledRequest("r1", [1], 8, [], False)]
    assert not ib.prepare(_so(*quiet), graph_bucket=lambda n: 4).padded


def test_layout_views_are_disjoint_and_fill_the_buffer():
    import torch

    layout = StepLayout(10, 3, 5)
    buf = torch.arange(layout.size + 7, dtype=torch.int32)
    views = layout.views(buf)
    seen = np.concatenate([v.flatten().numpy() for v in views.values()])
    assert sorted(seen.tolist()) == list(range(layout.size))


def test_capture_sizes_and_buckets():
    assert capture_sizes(1) == [1]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(256)[:6] == [1, 2, 4, 8, 16, 32] and capture_sizes(256)[-1] == 256
    sizes = capture_sizes(40)
    assert [bucket_for(n, sizes) for n in (1, 3, 5, 16, 17, 33, 40, 41)] == [
        1, 4, 8, 16, 32, 40, 40, None]


def test_an_empty_step_that_preempts_frees_the_slot():
    """A step that schedules nothing can still preempt (async scheduling: the running requests'
    tokens are in flight, the one admitted last is its own victim): its slot must go, or its
    next block table would keep the old block ids."""
    ib = _batch()
    ib.prepare(_so(_new("b", [1, 2, 3, 4, 5], 0, [2, 1], True)))
    ib.retire(_so(preempted=["b"]))
    assert "b" not in ib.slot_of
    inp = ib.prepare(_so(_new("b", [1, 2, 3, 4, 5, 6], 0, [0, 3], True)))
    assert inp.host["block_tables"][0].tolist() == [0, 3]


def test_the_runner_retires_slots_on_an_empty_step(tiny_model_dir):
    from pagebatch import LLM

    llm = LLM(str(tiny_model_dir), device="cpu", num_kv_blocks=64, block_size=4)
    runner = llm.engine.core.runner
    runner.input_batch.prepare(_so(_new("x", [1, 2, 3], 0, [5], False)))
    assert "x" in runner.input_batch.slot_of
    runner.execute(_so(preempted=["x"]))
    assert "x" not in runner.input_batch.slot_of


def _plp(rid, prompt, tokens, start, blocks, sample, num=2) -> ScheduledRequest:
    """A new row of a request asking for ``num`` prompt log-probs."""
    st = SamplingState(0.0, 0, 1.0, 0, num_prompt_tokens=len(prompt), prompt_logprobs=num)
    return ScheduledRequest(rid, tokens, start, blocks, sample, NewRequestData(list(prompt), st))


def _jobs(inp):
    return [(j.request_id, j.row0, j.start, j.targets, j.num) for j in inp.prompt_jobs]


def test_prompt_logprob_jobs_visit_only_rows_with_prompt_work_left():
    """Chunked prompts of two prompt-logprob requests beside a plain one: each prompt index is
    handed out once, in batch order; a request whose prompt is done stops being visited, and a
    preempted one resumes where it was (nothing handed out twice)."""
    ib = _batch(max_num_seqs=4, max_blocks=8)
    pa, pb = [10, 11, 12, 13, 14, 15], [20, 21, 22]
    inp = ib.prepare(_so(_new("x", [1, 2], 0, [1], True),
                         _plp("b", pb, pb, 0, [2], True),
                         _plp("a", pa, pa[:4], 0, [3, 4], False)))
    assert _jobs(inp) == [("b", 2, 1, [21, 22], 2), ("a", 5, 1, [11, 12, 13, 14], 2)]
    assert list(ib.sampling.prompt_logprobs_pending) == ["a"]  # b's prompt is done
    inp = ib.prepare(_so(ScheduledRequest("x", [5], 2, [], True),
                         ScheduledRequest("b", [23], 3, [], True),
                         ScheduledRequest("a", pa[4:], 4, [], True)))
    assert _jobs(inp) == [("a", 2, 5, [15], 2)]
    assert not ib.sampling.prompt_logprobs_pending
    inp = ib.prepare(_so(ScheduledRequest("a", [30], 6, [5], True)))
    assert inp.prompt_jobs == []
    # preempted mid-prompt: the recompute hands out only what was not sent
    ib.retire(_so(finished=["a", "b", "x"]))
    ib.prepare(_so(_plp("c", pa, pa[:3], 0, [6], False)))
    ib.retire(_so(preempted=["c"]))
    assert "c" in ib.sampling.prompt_logprobs_pending
    inp = ib.prepare(_so(_new("x2", [7], 0, [7], True), _plp("c", pa, pa, 0, [6, 0], True)))
    assert _jobs(inp) == [("c", 1 + 3, 4, [14, 15], 2)]
    ib.remove(["c", "x2"])
    assert not ib.sampling.prompt_logprobs_pending


def test_a_finished_prompt_logprob_request_leaves_the_pending_records():
    ib = _batch()
    p = [10, 11, 12, 13, 14, 15]
    ib.prepare(_so(_plp("a", p, p[:2], 0, [1, 2], False)))
    assert "a" in ib.sampling.prompt_logprobs_pending
    ib.retire(_so(finished=["a"]))
    assert not ib.sampling.prompt_logprobs_pending
