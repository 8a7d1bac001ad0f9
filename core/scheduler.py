"""Continuous batching: the `Scheduler` mechanics and the `SchedulingPolicy` interface.

Every step the scheduler hands out a token budget (``max_num_batched_tokens``): first to running
requests (a decode is one token), then to waiting ones in the order the policy plugin chooses
(a prompt is all of its uncomputed tokens). Requests join and leave the batch every step; there
is no prefill or decode phase, only ``num_computed_tokens`` catching up with ``num_tokens``.
With ``long_prefill_token_threshold`` = L > 0 (vLLM's option of that name) no request computes
more than L tokens in one step, so a burst of new prompts is spread over several shorter steps
and the decodes beside them wait less (ITL) at the cost of the prompts' TTFT. With
``max_mixed_prefill_tokens`` = P > 0 a step that carries decodes computes at most P prompt tokens
in all (steps of prompts alone keep the whole budget): a step beside running streams is never
longer than P prompt tokens make it, while a lone prompt of up to P tokens still goes in one step.

When a running request needs a block and none is free, the policy picks a victim, whose blocks
are freed; it goes back to waiting and later recomputes its KV (preemption by recompute).

``num_computed_tokens`` advances when a step is *scheduled*, so the next step can be scheduled
before the sampled tokens of this one are back. By default a request whose last step is still
in flight is skipped; with ``async_decode`` its next decode is scheduled at once, the unknown
input token given as `PLACEHOLDER_TOKEN` (the model runner fills it in on the device from the
previous step's sampled ids), so that the CPU work of step N+1 overlaps the GPU work of step N
(vLLM's async scheduling). With pipeline stages (``num_micro_batches`` > 1) each step takes
only its share of the requests, so that the stages work on different micro-batches at once.
"""

from __future__ import annotations

import bisect
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

from .block_hash import extend_block_hashes
from .kv_cache import KVCacheManager
from .request import FinishReason, Request, RequestStatus
from .sampling_state import SamplingState
from .structured_output import StructuredOutputBatch


@dataclass
class PolicyContext:
    """What a policy may look at when it orders the waiting queue."""

    now: float  # seconds, from the scheduler's clock
    kv_cache: KVCacheManager


class SchedulingPolicy(ABC):
    """Decides admission order and the preemption victim. Plugins implement this.

    Registered with ``register_scheduling_policies``; constructed as ``cls(config)`` where
    ``config`` is the EngineConfig (plugin options in ``config.plugin_options``).
    """

    def __init__(self, config: object | None = None) -> None:
        self.config = config

    @abstractmethod
    def order_waiting(self, waiting: Sequence[Request], ctx: PolicyContext) -> Iterable[Request]:
        """The waiting requests in the order they should be admitted.

        ``waiting`` is in arrival order (a preempted request keeps its original arrival). The
        scheduler admits from the front until one does not fit, then stops for this step. A
        request left out of the result stays waiting this step.
        """

    @abstractmethod
    def select_victim(self, candidates: Sequence[Request]) -> Request:
        """The running request to preempt when blocks run out.

        ``candidates`` are in admission order and always non-empty.
        """


PLACEHOLDER_TOKEN = -1  # a sampled token still on the device (async scheduling)


@dataclass
class NewRequestData:
    """What the runner needs to take in a request scheduled for the first time or resumed after
    preemption (vLLM v1's ``NewRequestData``); its block table is the row's ``new_block_ids``.

    prompt_token_ids: the request's prompt (the Request's own list). sampling: its
    `SamplingState`, built once when the engine core admitted it (None only in scheduler tests
    that build requests without one).
    """

    prompt_token_ids: list[int]
    sampling: SamplingState | None


@dataclass
class ScheduledRequest:
    """One request's share of a step: the only record of it that reaches the runner.

    ``new`` is set for a request scheduled for the first time or resumed after preemption, and
    ``new_block_ids`` is then its whole block table; for a request that was running it holds
    only the blocks gained in this step (what `KVCacheManager.allocate_slots` returned), which
    the runner appends to the table it keeps (vLLM v1's ``CachedRequestData``).
    """

    request_id: str
    token_ids: list[int]  # tokens to compute this step (PLACEHOLDER_TOKEN: still in flight)
    start_pos: int  # position of token_ids[0] (= num_computed_tokens before this step)
    new_block_ids: list[int]
    sample: bool  # this step computes the request's last known token: sample the next one
    new: NewRequestData | None = None


@dataclass
class SchedulerOutput:
    """One step, for the runner: the scheduled rows in batch order, and the ids of requests
    finished (or aborted) and preempted since the previous step. The runner applies the
    finished ids first, then the preempted ones, then the rows: an id that finished and came
    back (a reused request id) arrives as finished and, in the same or a later step, as new."""

    scheduled: list[ScheduledRequest]
    num_scheduled_tokens: int
    finished_request_ids: list[str] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)
    # the token bitmask of the step's constrained sampled rows (set by the engine core after
    # scheduling; core/structured_output.py), None when there are none
    structured_output: StructuredOutputBatch | None = None

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class SchedulerStats:
    """Counters since the scheduler started (gauges are read off ``running`` / ``waiting``)."""

    num_preemptions: int = 0
    num_steps: int = 0


class Scheduler:
    """The mechanics of continuous batching; ordering decisions belong to ``policy``."""

    def __init__(
        self,
        kv_cache: KVCacheManager,
        policy: SchedulingPolicy,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        clock: Callable[[], float] = time.monotonic,
        enable_chunked_prefill: bool = False,
        async_decode: bool = False,
        num_micro_batches: int = 1,
        long_prefill_token_threshold: int = 0,
        max_mixed_prefill_tokens: int = 0,
    ) -> None:
        if num_micro_batches < 1:
            raise ValueError(f"num_micro_batches must be >= 1, got {num_micro_batches}")
        for name, value in (("long_prefill_token_threshold", long_prefill_token_threshold),
                            ("max_mixed_prefill_tokens", max_mixed_prefill_tokens)):
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
            if value and not enable_chunked_prefill:
                raise ValueError(f"{name}={value} cuts prompts into chunks: it needs "
                                 f"enable_chunked_prefill")
        self.kv_cache = kv_cache
        self.policy = policy
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.async_decode = async_decode
        self.num_micro_batches = num_micro_batches
        # most tokens one request computes in a step (0: no cap but the budget)
        self.max_chunk = long_prefill_token_threshold or max_num_batched_tokens
        # most prompt tokens of a step that also carries decodes (0: no cap but the budget)
        self.max_mixed_prefill = max_mixed_prefill_tokens
        self.clock = clock
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []  # sorted by arrival_seq
        self.running: list[Request] = []  # admission order
        self._finished_ids: list[str] = []
        self.rejected: list[Request] = []  # finished with an error by the scheduler itself
        self.stats = SchedulerStats()

    # ---- queue changes ------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in the engine")
        # an id finished since the last step may be live again: the runner gets the old one's
        # finish before the new one's first row
        self.requests[request.request_id] = request
        request.status = RequestStatus.WAITING
        self._update_hashes(request)
        self._enqueue_waiting(request)

    def _update_hashes(self, request: Request) -> None:
        """Hash the blocks that just filled (each block once, when it fills)."""
        kv = self.kv_cache
        if kv.enable_caching and request.num_tokens // kv.block_size > len(request.block_hashes):
            extend_block_hashes(request.block_hashes, request.all_token_ids,
                                self.kv_cache.block_size, request.cache_salt)

    def _enqueue_waiting(self, request: Request) -> None:
        keys = [r.arrival_seq for r in self.waiting]
        self.waiting.insert(bisect.bisect(keys, request.arrival_seq), request)

    def abort_requests(self, request_ids: Iterable[str]) -> list[Request]:
        """Finish the named requests with reason ``abort``; their blocks are freed now."""
        return self._finish_named(request_ids, FinishReason.ABORT)

    def fail_requests(self, request_ids: Iterable[str]) -> list[Request]:
        """Finish the named requests with reason ``error`` (the engine core's own verdict, e.g.
        a structured output constraint that cannot be met); their blocks are freed now."""
        return self._finish_named(request_ids, FinishReason.ERROR)

    def _finish_named(self, request_ids: Iterable[str], reason: FinishReason) -> list[Request]:
        """The named requests still known, finished with ``reason`` (unknown or repeated ids
        skipped)."""
        out = [req for rid in dict.fromkeys(request_ids)
               if (req := self.requests.get(rid)) is not None]
        for req in out:
            self._finish(req, reason)
        return out

    def _finish(self, req: Request, reason: FinishReason) -> None:
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        self.kv_cache.free(req.request_id)
        del self.requests[req.request_id]
        self._finished_ids.append(req.request_id)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv_cache.free(req.request_id)
        req.num_computed_tokens = 0
        req.num_pending_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.stats.num_preemptions += 1
        self._enqueue_waiting(req)

    @property
    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def has_finished_to_report(self) -> bool:
        """Requests finished since the last `schedule`, which the next SchedulerOutput tells
        the runner of (it frees their input-batch rows)."""
        return bool(self._finished_ids)

    # ---- one step -----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Pick this step's requests and tokens, allocating their blocks.

        Running requests come first, decodes before prefill chunks; then waiting requests in
        the policy's order. Requests with nothing to compute (their last step is still in
        flight) are skipped, so a step can be scheduled before the previous one's tokens are
        back.
        """
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        scheduled_ids: set[str] = set()
        preempted: list[str] = []
        cap = self._step_seq_cap()
        budget = self._schedule_running(budget, cap, scheduled, scheduled_ids, preempted)
        if not preempted:
            self._schedule_waiting(budget, cap, scheduled)
        for sr in scheduled:
            req = self.requests[sr.request_id]
            req.num_computed_tokens += len(sr.token_ids)
            req.num_pending_tokens += sr.sample
        out = SchedulerOutput(scheduled, sum(len(s.token_ids) for s in scheduled),
                              self._finished_ids, preempted)
        self._finished_ids = []
        if scheduled or self.requests:  # not the idle step that only reports finished ids
            self.stats.num_steps += 1
        return out

    def _step_seq_cap(self) -> int:
        """Sequences one step may hold. With ``num_micro_batches`` = k > 1 (pipeline stages, k
        steps in flight) the requests split into k micro-batches of about equal size: a step
        takes at most ceil(n / k) of the n requests that are or could be running, so that the
        next step finds the others free (their tokens are not in flight) and the stages overlap
        instead of passing one whole batch from stage to stage."""
        k = self.num_micro_batches
        if k == 1:
            return self.max_num_seqs
        n = min(self.max_num_seqs, len(self.running) + len(self.waiting))
        return max(1, -(-n // k))

    def _to_compute(self, req: Request) -> int:
        """Tokens ``req`` could compute now: with async_decode, a token still being sampled
        counts (unless it is the request's last one)."""
        n = req.num_tokens - req.num_computed_tokens
        if n == 0 and self.async_decode and req.num_pending_tokens:
            total = req.num_tokens + req.num_pending_tokens
            if (len(req.output_token_ids) + req.num_pending_tokens < req.max_tokens
                    and total < req.max_total_tokens):
                return 1
        return n

    def _schedule_running(self, budget: int, cap: int, scheduled: list[ScheduledRequest],
                          scheduled_ids: set[str], preempted: list[str]) -> int:
        todo = [(r, self._to_compute(r)) for r in self.running]
        decodes = [(r, n) for r, n in todo if n == 1]
        chunks = [(r, n) for r, n in todo if n > 1]
        budget = self._schedule_rows(decodes, budget, cap, scheduled, scheduled_ids, preempted)
        if scheduled and self.max_mixed_prefill:  # decodes run: cap this step's prompt tokens
            budget = min(budget, self.max_mixed_prefill)
        return self._schedule_rows(chunks, budget, cap, scheduled, scheduled_ids, preempted)

    def _schedule_rows(self, todo: list[tuple[Request, int]], budget: int, cap: int,
                       scheduled: list[ScheduledRequest], scheduled_ids: set[str],
                       preempted: list[str]) -> int:
        """Schedule running requests (request, tokens wanted) in order until the budget or the
        step's sequence cap runs out, preempting for blocks; returns the budget left."""
        for req, want in todo:
            if req.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = min(want, budget, self.max_chunk)
            if n == 0 or len(scheduled) >= cap:
                break
            while (new_blocks := self._allocate(req, req.num_computed_tokens + n)) is None:
                candidates = [r for r in self.running if r.request_id not in scheduled_ids]
                victim = self.policy.select_victim(candidates)
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    break
            if req.status != RequestStatus.RUNNING:
                continue
            scheduled.append(self._scheduled(req, n, new_blocks))
            scheduled_ids.add(req.request_id)
            budget -= n
        return budget

    def _allocate(self, req: Request, num_tokens: int, hits=(),
                  num_computed: int | None = None) -> list[int] | None:
        """Blocks for ``req`` to cover ``num_tokens``; with a sliding window those behind the
        window of ``num_computed`` (default: the request's computed tokens) go back first."""
        return self.kv_cache.allocate_slots(
            req.request_id, num_tokens, hits, req.block_hashes,
            req.num_computed_tokens if num_computed is None else num_computed)

    def max_blocks_held(self, req: Request) -> int:
        """The most blocks ``req`` will hold at once (all of its tokens' without a window)."""
        step = self.max_chunk if self.enable_chunked_prefill else req.num_tokens
        return self.kv_cache.max_blocks_held(req.num_tokens, step)

    def _schedule_waiting(self, budget: int, cap: int,
                          scheduled: list[ScheduledRequest]) -> None:
        if not self.waiting:
            return
        kv = self.kv_cache
        ctx = PolicyContext(now=self.clock(), kv_cache=kv)
        for req in list(self.policy.order_waiting(list(self.waiting), ctx)):
            if len(self.running) >= self.max_num_seqs or budget == 0 or len(scheduled) >= cap:
                break
            if self.max_blocks_held(req) > kv.num_blocks:
                self._reject(req)  # could never fit: don't let it block the queue
                continue
            hits = ([] if req.skip_prefix_cache
                    else kv.get_computed_blocks(req.block_hashes, req.num_tokens))
            num_cached = len(hits) * kv.block_size
            n = req.num_tokens - num_cached
            if self.enable_chunked_prefill:
                n = min(n, budget, self.max_chunk)
            elif n > budget:
                break
            if self._allocate(req, num_cached + n, hits, num_cached) is None:
                break
            if req.num_preemptions == 0:
                kv.record_lookup(req.num_tokens, num_cached)
                req.num_cached_tokens = num_cached
            req.num_computed_tokens = num_cached
            self.waiting.remove(req)
            self.running.append(req)
            req.status = RequestStatus.RUNNING
            scheduled.append(self._scheduled(
                req, n, list(kv.block_ids(req.request_id)),
                NewRequestData(req.prompt_token_ids, req.sampling_state)))
            budget -= n

    def _reject(self, req: Request) -> None:
        self._finish(req, FinishReason.ERROR)
        self.rejected.append(req)

    def _scheduled(self, req: Request, n: int, new_block_ids: list[int],
                   new: NewRequestData | None = None) -> ScheduledRequest:
        start = req.num_computed_tokens
        prompt, output = req.prompt_token_ids, req.output_token_ids
        p = len(prompt)
        if start >= p:  # decode (or recompute of outputs): no copy of the prompt
            tokens = output[start - p:start - p + n]
            if len(tokens) < n:  # async_decode: the input token is still being sampled
                tokens.append(PLACEHOLDER_TOKEN)
        elif start + n <= p:
            tokens = prompt[start:start + n]
        else:
            tokens = prompt[start:] + output[:start + n - p]
        return ScheduledRequest(
            request_id=req.request_id,
            token_ids=tokens,
            start_pos=start,
            new_block_ids=new_block_ids,
            sample=start + n >= req.num_tokens,
            new=new,
        )

    # ---- results ------------------------------------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, sampled: dict[str, int]
    ) -> list[tuple[Request, list[int]]]:
        """Append sampled tokens, finish requests that hit a stop condition.

        ``sampled``: request id -> new token id, for the scheduled requests with ``sample``.
        Returns (request, new token ids) for each request that got a token, finished or not.
        Tokens for requests finished since the step was scheduled are dropped; a request
        preempted since keeps its token (its KV is recomputed with it).
        """
        out = []
        for rid, tok in sampled.items():
            req = self.requests.get(rid)
            if req is None:
                continue
            req.num_pending_tokens = max(req.num_pending_tokens - 1, 0)
            if req.status not in (RequestStatus.RUNNING, RequestStatus.PREEMPTED):
                continue
            req.output_token_ids.append(tok)
            self._update_hashes(req)
            out.append((req, [tok]))
            reason = req.check_stop()
            if reason is not None:
                self._finish(req, reason)
        return out
