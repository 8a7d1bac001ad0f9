"""`EngineCore`: scheduler + KV cache manager + model runner + sampler behind plain data.

It takes `EngineCoreRequest`s and aborts, runs steps, and returns `EngineCoreOutput`s (new
token ids and finish reasons). It knows no text: tokenizing and detokenizing belong to the front
half (core/engine.py). Everything crossing this boundary is plain data, so the core runs in the
front half's process (``LLM``, tests) or in its own (core/core_client.py, core/core_proc.py).

The model runs behind an `Executor` (core/executor.py): one runner in this process, or the ranks
of tensor/pipeline parallelism (core/distributed/). An executor that runs steps concurrently
(``max_concurrent_batches`` > 1: pipeline stages) gets that many steps in flight from the
core's batch queue, each holding only requests that no earlier step in flight holds.
"""

from __future__ import annotations

import gc
import logging
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field

from .config import EngineConfig
from .errors import EngineDeadError, SamplingParamsError
from .executor import Executor, StepHandle, UniprocExecutor, async_scheduling
from .kv_cache import KVCacheManager
from .kv_hybrid import HybridKVCacheManager
from .model_runner import ModelRunner, RunnerOutput
from .model_setup import ModelSetup, resolve_model_setup
from .registry import Registry, registry as default_registry
from .sampling_state import SamplingState
from .request import FinishReason, LogprobsLists, Request, RequestStatus, SamplingParams
from .scheduler import Scheduler, SchedulerOutput
from .stall_log import describe_step, turn_clock
from .structured_output import StructuredOutputBackend, StructuredOutputManager

logger = logging.getLogger(__name__)

_GRAMMAR_WAIT_S = 0.02  # an otherwise idle step's longest wait for a constraint's compile


@dataclass
class _WaitingForGrammar:
    """A request held out of the scheduler until its constraint compiles (vLLM's
    ``WAITING_FOR_FSM``)."""

    request: Request
    compiled: Future
    deadline: float  # time.monotonic() past which it ends with an error


@dataclass
class EngineCoreRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]
    seed: int  # the request's seed, or one the front half drew for it
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0
    cache_salt: str | None = None


@dataclass
class EngineCoreOutput:
    """What one request got in one step. logprobs: one row per new token, when the request
    asked for logprobs. prompt_logprobs: the prompt positions computed in this step, when it
    asked for prompt_logprobs (such an output may have no new token: a prefill chunk)."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None
    error_param: str | None = None  # with error: the request field at fault (a user error)
    logprobs: LogprobsLists | None = None
    prompt_logprobs: LogprobsLists | None = None


@dataclass
class EngineCoreStats:
    """A snapshot of the core after a turn (core -> front half, plain data), for metrics.

    Gauges: num_running / num_waiting requests, kv_cache_usage (fraction of KV blocks in use,
    0..1). Counters since the core started: num_preemptions, num_steps (engine steps),
    prefix_cache_queries / prefix_cache_hits (prompt tokens looked up / found cached).
    Per-request times (seconds) since the previous snapshot, one entry per request:
    queue_times (arrival to first scheduled), prefill_times (first scheduled to first token),
    decode_times (first token to finish)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions: int = 0
    num_steps: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    queue_times: list[float] = field(default_factory=list)
    prefill_times: list[float] = field(default_factory=list)
    decode_times: list[float] = field(default_factory=list)


@dataclass
class EngineCoreAbort:
    """Abort these requests (front half -> core). The core answers with an `EngineCoreOutput`
    of finish reason ``abort`` for each one it still had; unknown ids are ignored."""

    request_ids: list[str]


@dataclass
class EngineCoreShutdown:
    """Stop the core's busy loop and free its resources (front half -> core process)."""


def build_executor(config: EngineConfig, setup: ModelSetup, registry: Registry) -> Executor:
    """`UniprocExecutor` for one rank; `MultiprocExecutor` when ``tensor_parallel_size`` x
    ``pipeline_parallel_size`` > 1 (it starts the worker processes, or joins ranks started
    with the torchrun environment; imported only then). Raises ConfigError and what loading
    raises."""
    if config.tensor_parallel_size * config.pipeline_parallel_size == 1:
        return UniprocExecutor(ModelRunner(config, setup, registry),
                               async_scheduling(config, setup))
    from .distributed.executor import MultiprocExecutor

    return MultiprocExecutor(config, setup, registry)


def make_structured_output_backend(config: EngineConfig, setup: ModelSetup,
                                   registry: Registry) -> StructuredOutputBackend:
    """The configured structured output backend over the model's tokenizer (loaded here: the
    core's own process has none otherwise), made at the first constrained request."""
    from .model_loader import eos_token_ids, resolve_model
    from .tokenizer import load_tokenizer

    folder = resolve_model(config.tokenizer).folder if config.tokenizer else setup.source.folder
    tokenizer = load_tokenizer(folder)
    cls = registry.structured_output_backend(config.structured_outputs_backend)
    stop = sorted(eos_token_ids(setup.source.folder, setup.hf_config, tokenizer))
    return cls(tokenizer, int(setup.hf_config.vocab_size), stop)


@dataclass
class _InFlight:
    """A step started and not yet updated from. ``sampling``: request id -> (request, its
    preemption count) at schedule time, for each row that samples (kept only with several
    steps in flight, where a request can be preempted and re-admitted before the step's
    token arrives: such a stale token is dropped)."""

    handle: StepHandle
    so: SchedulerOutput
    sampling: dict[str, tuple[Request, int]] | None = None


class EngineCore:
    def __init__(self, config: EngineConfig, setup: ModelSetup, registry: Registry):
        self.config = config
        self.setup = setup
        max_model_len = setup.max_model_len
        self.executor = build_executor(config, setup, registry)
        self.runner = self.executor.driver_runner  # rank 0's under parallelism
        try:
            num_blocks = self.executor.initialize_kv_cache()
        except BaseException:
            self.executor.shutdown()
            raise
        self._batch_queue: deque[_InFlight] = deque()
        self._max_in_flight = self.executor.max_concurrent_batches
        groups = setup.kv_groups
        self.kv_cache = (HybridKVCacheManager(num_blocks, config.block_size,
                                              config.enable_prefix_caching, groups.windows)
                         if groups is not None else
                         KVCacheManager(num_blocks, config.block_size,
                                        enable_caching=config.enable_prefix_caching,
                                        sliding_window=setup.sliding_window))
        policy = registry.scheduling_policy(config.scheduling_policy)(config)
        self.scheduler = Scheduler(self.kv_cache, policy, config.max_num_seqs,
                                   setup.max_num_batched_tokens,
                                   enable_chunked_prefill=config.enable_chunked_prefill,
                                   long_prefill_token_threshold=(
                                       config.long_prefill_token_threshold),
                                   max_mixed_prefill_tokens=config.max_mixed_prefill_tokens,
                                   async_decode=self.executor.async_decode,
                                   num_micro_batches=self.executor.num_micro_batches)
        self._times = EngineCoreStats()  # only its per-request time lists are used
        self.structured = StructuredOutputManager(
            lambda: make_structured_output_backend(config, setup, registry),
            int(setup.hf_config.vocab_size), config.max_num_seqs)
        self._grammar_wait: dict[str, _WaitingForGrammar] = {}  # request id -> it
        # PAGEBATCH_SLOW_STEP_MS: the phases of a slow turn (core/stall_log.py); the loop that
        # steps the core (core/core_proc.py) starts the clock each turn and logs
        self.clock = turn_clock()
        gc.collect()
        gc.freeze()  # the model's and the cache's objects: never scanned by the collector again
        tokens = num_blocks * config.block_size
        # a decoding request of max_model_len tokens holds this many blocks (fewer with a window)
        per_request = self.kv_cache.max_blocks_held(max_model_len, 1)
        logger.info("KV cache: %d blocks x %d tokens = %d tokens (%.2f GiB, %s); maximum "
                    "concurrency at max_model_len=%d: %.2fx%s", num_blocks, config.block_size,
                    tokens, num_blocks * self.runner.kv_bytes_per_block / 2**30,
                    str(self.runner.kv_cache_dtype).removeprefix("torch."), max_model_len,
                    self.kv_cache.num_blocks / per_request,
                    f" (sliding window {setup.sliding_window}: {per_request} blocks a request)"
                    if setup.sliding_window else
                    f" ({groups.num_groups} KV cache groups of {groups.num_slots} layers, windows "
                    f"{list(groups.windows)}: {per_request} blocks a request)" if groups else "")

    @classmethod
    def from_config(cls, config: EngineConfig, registry: Registry | None = None,
                    setup: ModelSetup | None = None) -> "EngineCore":
        """Build a core from ``config`` alone (as the core's own process does); ``setup`` skips
        resolving the model again. Raises what `resolve_model_setup` and loading raise, and
        CacheTooSmallError."""
        registry = registry or default_registry()
        setup = setup or resolve_model_setup(config, registry)
        return cls(config, setup, registry)

    def shutdown(self) -> None:
        """Finish every request (no outputs), stop the executor's workers and drop the KV cache
        tensors; the core is unusable afterwards."""
        self.scheduler.abort_requests(list(self.scheduler.requests))
        self._grammar_wait.clear()
        self._batch_queue.clear()
        self.executor.shutdown()
        self.clock.close()

    def stats(self) -> EngineCoreStats:
        """The core's state now, and the per-request times recorded since the last call."""
        sched, times = self.scheduler, self._times
        self._times = EngineCoreStats()
        return EngineCoreStats(
            len(sched.running), len(sched.waiting) + len(self._grammar_wait), self.kv_cache.usage,
            sched.stats.num_preemptions, sched.stats.num_steps, self.kv_cache.stats.queries,
            self.kv_cache.stats.hits, times.queue_times, times.prefill_times, times.decode_times)

    def add_request(self, r: EngineCoreRequest) -> None:
        sp = r.sampling_params
        req = Request(r.request_id, list(r.prompt_token_ids), sp, r.eos_token_ids,
                      self.setup.max_model_len, r.arrival_time, r.priority, cache_salt=r.cache_salt,
                      skip_prefix_cache=getattr(sp, "prompt_logprobs", None) is not None)
        req.sampling_state = SamplingState.from_params(sp, r.seed, req.prompt_token_ids,
                                                       r.eos_token_ids)
        if r.request_id in self._grammar_wait or r.request_id in self.scheduler.requests:
            raise ValueError(f"request id {r.request_id!r} is already in the engine")
        so = getattr(sp, "structured_outputs", None)
        # compiled once per distinct constraint, off this thread
        compiled = self.structured.compile(so) if so is not None else None
        if compiled is not None and not compiled.done():  # it joins the scheduler later
            self._grammar_wait[r.request_id] = _WaitingForGrammar(
                req, compiled, time.monotonic() + self.config.structured_outputs_compile_timeout)
            return
        self._admit(req, compiled)  # a cached constraint that failed raises before queueing

    def _admit(self, req: Request, compiled: Future | None) -> None:
        """Into the scheduler, with the matcher of its compiled constraint when it has one
        (tracked only once the scheduler took the id)."""
        tracked = (self.structured.start(req.sampling_params.structured_outputs, compiled)
                   if compiled is not None else None)
        self.scheduler.add_request(req)  # raises ValueError for an id in use
        if tracked is not None:
            self.structured.track(req.request_id, tracked)

    def _admit_compiled(self, wait_s: float = 0.0) -> list[EngineCoreOutput]:
        """Admit the requests whose constraint finished compiling (waiting up to ``wait_s``
        seconds for one); end those whose compile failed or outlasted
        ``structured_outputs_compile_timeout`` with an error naming the field."""
        pending = self._grammar_wait
        if wait_s > 0 and pending:
            nearest = min(w.deadline for w in pending.values()) - time.monotonic()
            wait([w.compiled for w in pending.values()], max(0.0, min(wait_s, nearest)),
                 FIRST_COMPLETED)
        now = time.monotonic()
        outputs = []
        for rid, w in list(pending.items()):
            if not w.compiled.done() and now < w.deadline:
                continue
            del pending[rid]
            try:
                if not w.compiled.done():
                    name = w.request.sampling_params.structured_outputs.constraint().field
                    limit = self.config.structured_outputs_compile_timeout
                    raise SamplingParamsError(
                        f"{name}: compiling the constraint took longer than "
                        f"structured_outputs_compile_timeout={limit:g} s; give a simpler "
                        f"schema or raise the timeout", name or None)
                self._admit(w.request, w.compiled)
            except Exception as e:  # this request alone ends: the others go on
                param = e.param if isinstance(e, SamplingParamsError) else None
                outputs.append(EngineCoreOutput(rid, [], FinishReason.ERROR.value,
                                                f"{type(e).__name__}: {e}", param))
        return outputs

    def abort_requests(self, request_ids: list[str]) -> list[EngineCoreOutput]:
        self.structured.remove(request_ids)
        held = [rid for rid in request_ids if self._grammar_wait.pop(rid, None) is not None]
        return [EngineCoreOutput(rid, [], FinishReason.ABORT.value) for rid in held] + [
            EngineCoreOutput(r.request_id, [], FinishReason.ABORT.value)
            for r in self.scheduler.abort_requests(request_ids)]

    @property
    def has_unfinished_requests(self) -> bool:
        """Requests not finished, or steps still in flight (their results must be taken)."""
        return (self.scheduler.has_unfinished_requests or bool(self._batch_queue)
                or bool(self._grammar_wait))

    @property
    def has_work(self) -> bool:
        """`has_unfinished_requests`, or finished requests the runners have not been told of:
        one more, empty, step frees their input-batch rows, so that an idle engine's loop
        (core/core_proc.py) leaves no request's state behind."""
        return self.has_unfinished_requests or self.scheduler.has_finished_to_report

    def _drain_rejected(self) -> list[EngineCoreOutput]:
        sched = self.scheduler
        if not sched.rejected:
            return []
        bs, total = self.kv_cache.block_size, self.kv_cache.num_blocks
        out = [EngineCoreOutput(r.request_id, [], FinishReason.ERROR.value,
                                f"request needs {sched.max_blocks_held(r)} KV cache blocks of {bs} "
                                f"tokens; the whole cache has {total}")
               for r in sched.rejected]
        self.structured.remove(r.request_id for r in sched.rejected)
        sched.rejected.clear()
        return out

    def step(self, timeout: float | None = None) -> list[EngineCoreOutput]:
        """Schedule a step and start it, then return the outputs of the oldest step in flight
        (vLLM v1's ``step_with_batch_queue``). With one step at a time (the CPU, or no async
        scheduling): schedule, execute, sample, update. With ``max_concurrent_batches`` > 1
        (async scheduling: 2; pipeline stages: ``pipeline_micro_batches``, by default one per
        stage) the call returns at once while fewer steps are in flight and something new could
        be scheduled; otherwise it waits for the oldest.

        Raises EngineDeadError when a model step raises (the engine cannot go on safely:
        `_step_failed`) or the executor cannot run steps any more (a parallel worker died).
        A request's own failure (its detokenizer, its stop check, a bad input) is the front
        half's and fails that request alone.

        A structured output request's bitmask needs every earlier token accepted by its
        matcher (core/structured_output.py). While one is in the engine and a step is in
        flight, the next step's forward is launched first (`Executor.start_forward`), then the
        oldest step's tokens are taken and accepted, then the bitmask is built and the new step
        sampled with it: the host's matcher work overlaps the GPU's forward, as in vLLM's
        async scheduling with structured outputs. An executor that cannot defer sampling runs
        such steps one at a time."""
        outputs: list[EngineCoreOutput] = []
        queue = self._batch_queue
        sched = self.scheduler
        if self._grammar_wait:  # with nothing else to run, wait a little for a compile
            idle = not queue and not sched.has_unfinished_requests
            outputs = self._admit_compiled(_GRAMMAR_WAIT_S if idle else 0.0)
            if idle and not sched.has_unfinished_requests and not sched.has_finished_to_report:
                return outputs
        structured = self.structured.has_requests
        defer = bool(queue) and structured and self.executor.supports_deferred_sampling
        if len(queue) < self._max_in_flight and not (queue and structured and not defer):
            so = self.scheduler.schedule()
            if structured and not defer:
                so.structured_output = self._bitmask(so)
            self._mark_scheduled(so)
            clock = self.clock
            clock.mark("schedule")
            if clock.enabled and not so.is_empty:
                clock.note("scheduled " + describe_step(so))
            outputs += self._drain_rejected()
            if defer:
                return outputs + self._step_deferred(so)
            try:  # an empty step still tells the runners which requests finished
                handle = self.executor.execute_model(so)
            except EngineDeadError:
                raise
            except Exception as e:
                raise self._step_failed(so, e) from e
            clock.mark("launch")
            if not so.is_empty:
                queue.append(_InFlight(handle, so, self._sampling_snapshot(so)))
                if len(queue) < self._max_in_flight and (
                        not self.structured.has_requests
                        or self.executor.supports_deferred_sampling):
                    return outputs
        if not queue:
            return outputs
        return outputs + self._finish_oldest()

    def _bitmask(self, so: SchedulerOutput):
        return self.structured.batch([sr.request_id for sr in so.scheduled if sr.sample])

    def _finish_oldest(self) -> list[EngineCoreOutput]:
        step = self._batch_queue.popleft()
        try:
            result = step.handle.result()
        except EngineDeadError:
            raise
        except Exception as e:
            raise self._step_failed(step.so, e) from e
        clock = self.clock
        clock.mark("wait")
        if clock.enabled:
            clock.note("finished " + describe_step(step.so))
        outputs = self._update(step, result)
        clock.mark("update")
        return outputs

    def _step_deferred(self, so: SchedulerOutput) -> list[EngineCoreOutput]:
        """Step ``so`` with a structured output request in the engine and a step in flight:
        its forward, then the oldest step's outputs (its tokens accepted by the matchers), then
        ``so``'s bitmask and sampling."""
        snapshot = self._sampling_snapshot(so)
        try:
            pending = self.executor.start_forward(so)
        except EngineDeadError:
            raise
        except Exception as e:
            raise self._step_failed(so, e) from e
        outputs = self._finish_oldest()
        try:
            so.structured_output = self._bitmask(so)  # finished requests have no matcher now
            handle = pending.finish(so.structured_output)
        except EngineDeadError:
            raise
        except Exception as e:
            raise self._step_failed(so, e) from e
        if not so.is_empty:
            self._batch_queue.append(_InFlight(handle, so, snapshot))
        return outputs

    def _mark_scheduled(self, so: SchedulerOutput) -> None:
        now = time.monotonic()
        for sr in so.scheduled:
            req = self.scheduler.requests.get(sr.request_id)
            if req is not None and req.first_scheduled_time is None:
                req.first_scheduled_time = now
                self._times.queue_times.append(now - req.arrival_time)

    def _sampling_snapshot(self, so: SchedulerOutput) -> dict[str, tuple[Request, int]] | None:
        if self._max_in_flight == 1:
            return None
        reqs = self.scheduler.requests
        return {sr.request_id: (reqs[sr.request_id], reqs[sr.request_id].num_preemptions)
                for sr in so.scheduled if sr.sample}

    def _step_failed(self, so: SchedulerOutput, e: Exception) -> EngineDeadError:
        """A model step raised: the engine is dead (as vLLM's). The device state the step was
        changing (the KV cache it was writing, the runner's persistent batch, CUDA graphs, a
        CUDA context after a device error) cannot be trusted for the requests that remain, so
        none is run on it; every open request gets the error, and a served engine exits."""
        logger.exception("model step of %d requests failed; the engine is dead",
                         len(so.scheduled))
        return EngineDeadError(f"a model step failed: {type(e).__name__}: {e}")

    def _update(self, step: _InFlight, result: RunnerOutput) -> list[EngineCoreOutput]:
        """Append the step's sampled tokens to their requests and build the outputs."""
        sampled, lps, prompt_lps = result.sampled, result.logprobs, result.prompt_logprobs
        if step.sampling is not None:  # drop tokens of requests preempted or replaced since
            reqs = self.scheduler.requests
            sampled = {rid: t for rid, t in sampled.items()
                       if (snap := step.sampling.get(rid)) is not None
                       and reqs.get(rid) is snap[0] and (
                           snap[0].num_preemptions == snap[1]
                           # preempted and still waiting: the token is good (its KV will be
                           # recomputed with it); dropped only once the request runs again
                           or snap[0].status == RequestStatus.PREEMPTED)}
        constrained = step.so.structured_output  # the step's constrained rows that sampled
        failed = ({} if constrained is None
                  else self._accept_structured(constrained.request_ids, sampled))
        outputs = []
        now = time.monotonic()
        for req, new in self.scheduler.update_from_output(step.so, sampled):
            self._record_times(req, now)
            reason = req.finish_reason.value if req.is_finished else None
            outputs.append(EngineCoreOutput(req.request_id, new, reason,
                                            logprobs=lps.get(req.request_id),
                                            prompt_logprobs=prompt_lps.pop(req.request_id, None)))
        for rid, plp in prompt_lps.items():  # prompt chunks that sampled nothing this step
            if rid in self.scheduler.requests:
                outputs.append(EngineCoreOutput(rid, [], prompt_logprobs=plp))
        for req in self.scheduler.fail_requests(list(failed)):
            e = failed[req.request_id]
            outputs.append(EngineCoreOutput(req.request_id, [], FinishReason.ERROR.value,
                                            str(e), e.param))
        if constrained is not None:  # a constrained request finishes only in a step it samples in
            reqs = self.scheduler.requests
            self.structured.remove(rid for rid in constrained.request_ids if rid not in reqs)
        return outputs

    def _accept_structured(self, request_ids: list[str],
                           sampled: dict[str, int]) -> dict[str, SamplingParamsError]:
        """Advance the matchers of ``request_ids`` (the step's constrained sampling rows) that
        got a token (the same ones `update_from_output` appends to); a token the constraint
        forbids is taken out of ``sampled`` and its request is returned (id -> error) to
        finish with an error. Unconstrained rows are not visited."""
        failed = {}
        reqs = self.scheduler.requests
        for rid in request_ids:
            tok = sampled.get(rid)
            req = reqs.get(rid)
            if tok is None or req is None or rid not in self.structured or req.status not in (
                    RequestStatus.RUNNING, RequestStatus.PREEMPTED):
                continue
            error = self.structured.accept(rid, tok)
            if error is not None:
                del sampled[rid]
                failed[rid] = error
        return failed

    def _record_times(self, req: Request, now: float) -> None:
        """Prefill time at a request's first token, decode time when it finishes."""
        if req.first_token_time is None:
            req.first_token_time = now
            if req.first_scheduled_time is not None:
                self._times.prefill_times.append(now - req.first_scheduled_time)
        if req.is_finished:
            self._times.decode_times.append(now - req.first_token_time)
