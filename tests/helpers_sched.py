"""Helpers that drive the scheduler and the block manager with no model and no GPU.

- ``make_request`` builds a core ``Request`` with chosen lengths and stop conditions.
- ``make_scheduler`` builds a ``Scheduler`` over a small ``KVCacheManager`` with the fcfs policy.
- ``FakeRunner`` stands in for the model runner and sampler: it writes each scheduled token into a
  fake paged KV cache (slot -> (request id, position, token id)) through the block table it is
  handed, reads the whole sequence back through the same table, and returns a token that is a
  function of that sequence. A wrong block table, a block shared by two live requests or a wrong
  token list therefore changes the tokens a request ends with.
- ``check_block_invariants`` / ``check_scheduler_invariants`` assert the bookkeeping as data.
"""

from __future__ import annotations

from typing import Callable, Iterable

from pagebatch.kv_cache import KVCacheManager
from pagebatch.request import FinishReason, Request, RequestStatus, SamplingParams
from pagebatch.scheduler import Scheduler, SchedulerOutput
from pagebatch.schedulers.fcfs import FCFSPolicy

VOCAB = 97
FIRST_FREE_ID = 3  # ids 0..2 are kept for EOS / stop tokens in the tests


def default_next_token(request_id: str, seq: list[int]) -> int:
    """A deterministic 'model': the next token is a function of the whole sequence so far, never
    an id below FIRST_FREE_ID (so it never hits EOS by accident)."""
    h = 0
    for t in seq:
        h = (h * 31 + t + 7) % 1_000_003
    return FIRST_FREE_ID + h % (VOCAB - FIRST_FREE_ID)


def make_request(
    request_id: str,
    prompt_len: int,
    max_tokens: int | None = 16,
    *,
    prompt: list[int] | None = None,
    min_tokens: int = 0,
    eos: Iterable[int] = (),
    stop_token_ids: Iterable[int] = (),
    ignore_eos: bool = False,
    max_total_tokens: int = 100_000,
) -> Request:
    """A Request whose prompt is ``prompt`` or ``prompt_len`` ids derived from its id."""
    if prompt is None:
        base = sum(ord(c) for c in request_id)
        prompt = [FIRST_FREE_ID + (base + 5 * i) % (VOCAB - FIRST_FREE_ID)
                  for i in range(prompt_len)]
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=min_tokens,
                        stop_token_ids=list(stop_token_ids), ignore_eos=ignore_eos)
    sp.validate()
    return Request(request_id, list(prompt), sp, frozenset(eos), max_total_tokens)


def make_scheduler(num_blocks: int, block_size: int, max_num_seqs: int = 16,
                   max_num_batched_tokens: int = 1024) -> Scheduler:
    return Scheduler(KVCacheManager(num_blocks, block_size), FCFSPolicy(None), max_num_seqs,
                     max_num_batched_tokens, clock=lambda: 0.0)


def slot_of(block_ids: list[int], pos: int, block_size: int) -> int:
    """Slot of token ``pos`` through a block table (PagedAttention's slot mapping)."""
    return block_ids[pos // block_size] * block_size + pos % block_size


class BlockTables:
    """The block tables a runner keeps from the scheduler output alone (the only channel):
    a new or resumed row's ``new_block_ids`` are its whole table, a running row's are appended,
    finished and preempted ids drop theirs. ``apply(so)`` returns request id -> whole table of
    ``so``'s rows; applying the same output again returns the same tables."""

    def __init__(self) -> None:
        self.tables: dict[str, list[int]] = {}
        self._last: tuple[SchedulerOutput, dict[str, list[int]]] | None = None

    def apply(self, so: SchedulerOutput) -> dict[str, list[int]]:
        if self._last is not None and self._last[0] is so:
            return self._last[1]
        for rid in list(so.finished_request_ids) + list(so.preempted_request_ids):
            self.tables.pop(rid, None)
        for sr in so.scheduled:
            if sr.new is not None:
                self.tables[sr.request_id] = list(sr.new_block_ids)
            else:
                assert sr.request_id in self.tables, f"{sr.request_id} runs but was never new"
                self.tables[sr.request_id].extend(sr.new_block_ids)
        snap = {sr.request_id: list(self.tables[sr.request_id]) for sr in so.scheduled}
        self._last = (so, snap)
        return snap


class FakeRunner:
    """Model runner + sampler stand-in over a fake paged KV cache (see the module docstring).

    ``next_token(request_id, seq)`` chooses each sampled token; ``seq`` is the request's whole
    sequence (prompt + outputs so far) as read back from the fake cache.
    """

    def __init__(self, block_size: int,
                 next_token: Callable[[str, list[int]], int] = default_next_token,
                 shared_reads: bool = False, window: int | None = None) -> None:
        self.block_size = block_size
        self.window = window  # a sliding window: read back (and pass on) only its last tokens
        self.shared_reads = shared_reads  # prefix caching: reading another request's slot is OK
        self.next_token = next_token
        self.slots: dict[int, tuple[str, int, int]] = {}
        self.steps: list[SchedulerOutput] = []
        self.tables = BlockTables()

    def execute(self, so: SchedulerOutput) -> dict[str, int]:
        self.steps.append(so)
        bs = self.block_size
        tables = self.tables.apply(so)
        for sr in so.scheduled:  # write KV of the whole batch first, then attend (as a model does)
            table = tables[sr.request_id]
            assert len(table) * bs >= sr.start_pos + len(sr.token_ids), sr
            for i, tok in enumerate(sr.token_ids):
                pos = sr.start_pos + i
                self.slots[slot_of(table, pos, bs)] = (sr.request_id, pos, tok)
        out = {}
        for sr in so.scheduled:
            if not sr.sample:
                continue
            seq = []
            end = sr.start_pos + len(sr.token_ids)
            for pos in range(0 if self.window is None else max(0, end - self.window), end):
                owner, p, tok = self.slots[slot_of(tables[sr.request_id], pos, bs)]
                if self.shared_reads:
                    owner = sr.request_id
                assert (owner, p) == (sr.request_id, pos), (
                    f"{sr.request_id} pos {pos} reads a slot written by {owner} pos {p}")
                seq.append(tok)
            out[sr.request_id] = self.next_token(sr.request_id, seq)
        return out


def scripted(scripts: dict[str, list[int]], prompt_lens: dict[str, int],
             fallback: Callable[[str, list[int]], int] = default_next_token):
    """A next_token function that emits ``scripts[rid][k]`` as output token k."""

    def next_token(rid: str, seq: list[int]) -> int:
        if rid in scripts:
            return scripts[rid][len(seq) - prompt_lens[rid]]
        return fallback(rid, seq)

    return next_token


def step(sched: Scheduler, runner: FakeRunner):
    """One engine step: schedule, execute, update. Returns (SchedulerOutput, sampled)."""
    so = sched.schedule()
    sampled = runner.execute(so)
    sched.update_from_output(so, sampled)
    return so, sampled


def run_until_done(sched: Scheduler, runner: FakeRunner, max_steps: int = 10_000,
                   check: bool = True) -> list[SchedulerOutput]:
    outs = []
    for _ in range(max_steps):
        if not sched.has_unfinished_requests:
            return outs
        outs.append(step(sched, runner)[0])
        if check:
            check_scheduler_invariants(sched)
    raise AssertionError(f"not finished after {max_steps} steps: {sched.requests}")


def reference_outputs(req: Request,
                      next_token: Callable[[str, list[int]], int] = default_next_token
                      ) -> tuple[list[int], FinishReason]:
    """The tokens and finish reason a request gets when it runs alone (no batching, no cache)."""
    clone = make_request(req.request_id, 0, req.sampling_params.max_tokens,
                         prompt=list(req.prompt_token_ids),
                         min_tokens=req.sampling_params.min_tokens, eos=req.eos_token_ids,
                         stop_token_ids=req.sampling_params.stop_token_ids,
                         ignore_eos=req.sampling_params.ignore_eos,
                         max_total_tokens=req.max_total_tokens)
    while True:
        clone.output_token_ids.append(next_token(clone.request_id, clone.all_token_ids))
        reason = clone.check_stop()
        if reason is not None:
            return clone.output_token_ids, reason


# ---- invariants ---------------------------------------------------------------------------------

def check_block_invariants(kv: KVCacheManager) -> None:
    """No block leaked, double-freed or held twice; ref counts equal live users."""
    pool = kv.pool
    null = kv.null_block  # sliding window: the entry of every skipped block, held by no one
    req_blocks = {rid: [b for b in t.blocks if b is not null] for rid, t in kv.block_tables.items()}
    for rid, t in kv.block_tables.items():  # one record: its ids are its blocks'
        assert t.block_ids == [b.block_id for b in t.blocks], (rid, t)
        assert all(b is null for b in t.blocks[:t.num_skipped]), (rid, t)
        assert null not in t.blocks[t.num_skipped:], (rid, t)
    free_ids = pool.free_queue.block_ids()
    assert len(free_ids) == len(set(free_ids)), f"a block is twice in the free queue: {free_ids}"
    for rid, blocks in req_blocks.items():  # shared across requests (prefix hits), not within
        ids = [b.block_id for b in blocks]
        assert len(ids) == len(set(ids)), f"{rid} holds a block twice: {ids}"
    held = sorted({b.block_id for blocks in req_blocks.values() for b in blocks})
    if not kv.enable_caching:
        n_held = sum(len(blocks) for blocks in req_blocks.values())
        assert n_held == len(held), f"a block is held twice: {req_blocks}"
    assert not set(free_ids) & set(held), f"blocks both free and held: {set(free_ids) & set(held)}"
    reserved = [] if null is None else [null.block_id]
    assert null is None or (null.ref_cnt == 0 and null.block_hash is None)
    assert sorted(free_ids + held + reserved) == list(range(pool.num_blocks)), "a block leaked"
    assert pool.num_free_blocks == len(free_ids)
    users: dict[int, int] = {}
    for blocks in req_blocks.values():
        for b in blocks:
            users[b.block_id] = users.get(b.block_id, 0) + 1
    for b in pool.blocks:
        assert b.ref_cnt == users.get(b.block_id, 0), (b, users.get(b.block_id, 0))


def check_scheduler_invariants(sched: Scheduler) -> None:
    kv = sched.kv_cache
    check_block_invariants(kv)
    running = {r.request_id for r in sched.running}
    waiting = {r.request_id for r in sched.waiting}
    assert not running & waiting
    assert running | waiting == set(sched.requests)
    assert len(sched.running) <= sched.max_num_seqs
    # only running requests hold blocks, and enough to cover what they have computed
    assert {rid for rid, t in kv.block_tables.items() if t.blocks} <= running
    for r in sched.running:
        assert r.status == RequestStatus.RUNNING
        assert len(kv.block_ids(r.request_id)) * kv.block_size >= r.num_computed_tokens
    for r in sched.waiting:
        assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        assert r.num_computed_tokens == 0
    seqs = [r.arrival_seq for r in sched.waiting]
    assert seqs == sorted(seqs), "waiting queue is not in arrival order"
