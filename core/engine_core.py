"""`EngineCore`: scheduler + KV cache manager + model runner + sampler behind plain data.

It takes `EngineCoreRequest`s and aborts, runs steps, and returns `EngineCoreOutput`s (new
token ids and finish reasons). It knows no text: tokenizing and detokenizing belong to the front
half (core/engine.py). Everything crossing this boundary is plain data, so the core runs in the
front half's process (``LLM``, tests) or in its own (core/core_client.py, core/core_proc.py).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from .config import EngineConfig, check_token_budget
from .errors import ConfigError
from .kv_cache import KVCacheManager
from .model_loader import ModelSource, architecture, load_hf_config, resolve_model
from .model_runner import ModelRunner, SamplingState
from .registry import Registry, registry as default_registry
from .request import FinishReason, LogprobsLists, Request, SamplingParams
from .scheduler import Scheduler

logger = logging.getLogger(__name__)


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


@dataclass
class ModelSetup:
    """What building an engine core needs besides the `EngineConfig`, resolved from it: the
    model's folder, its Hugging Face config, and the token limits that follow from both."""

    source: ModelSource
    hf_config: Any
    max_model_len: int
    max_num_batched_tokens: int


def resolve_model_setup(config: EngineConfig, registry: Registry) -> ModelSetup:
    """Resolve the model and the limits of ``config``. The front half and the engine core's own
    process both call this. Raises ModelNotFoundError, ConfigError, PluginError."""
    source = resolve_model(config.model, config.load_format)
    hf_config = load_hf_config(source.folder)
    max_model_len = _resolve_max_model_len(config, hf_config, registry)
    mnbt = config.max_num_batched_tokens or (
        8192 if config.enable_chunked_prefill else max(max_model_len, 2048))
    check_token_budget(mnbt, max_model_len, config.enable_chunked_prefill)
    return ModelSetup(source, hf_config, max_model_len, mnbt)


def _resolve_max_model_len(config: EngineConfig, hf_config: Any, registry: Registry) -> int:
    model_max = getattr(hf_config, "max_position_embeddings", None)
    want = config.max_model_len
    if want is None:
        if model_max is None:
            raise ConfigError("the model's config.json has no max_position_embeddings: "
                              "set max_model_len")
        return _cap_max_model_len(int(model_max), hf_config, registry)
    if model_max is not None and want > model_max:
        raise ConfigError(f"max_model_len={want} exceeds the model's "
                          f"max_position_embeddings={model_max}")
    return _cap_max_model_len(want, hf_config, registry)


def _cap_max_model_len(max_model_len: int, hf_config: Any, registry: Registry) -> int:
    """Apply the model class's optional ``max_model_len_limit(hf_config) -> int | None``
    (e.g. Mistral's sliding window, which the attention backends do not implement):
    a larger max_model_len is lowered to it, with a warning."""
    arch = architecture(hf_config)
    limit_fn = getattr(registry.model_class(arch), "max_model_len_limit", None)
    limit = limit_fn(hf_config) if limit_fn is not None else None
    if limit is not None and limit < max_model_len:
        logger.warning("max_model_len lowered from %d to %d: %s runs this config exactly "
                       "only up to %d tokens (its max_model_len_limit, e.g. a sliding "
                       "attention window, which the attention backends do not implement)",
                       max_model_len, limit, arch, limit)
        return int(limit)
    return max_model_len


class EngineCore:
    def __init__(self, config: EngineConfig, source: ModelSource, hf_config,
                 registry: Registry, max_model_len: int, max_num_batched_tokens: int):
        self.config = config
        self.max_model_len = max_model_len
        self.runner = ModelRunner(config, source, hf_config, registry, max_model_len,
                                  max_num_batched_tokens)
        num_blocks = self.runner.determine_num_blocks()
        self.runner.allocate_kv_cache(num_blocks)
        self.kv_cache = KVCacheManager(num_blocks, config.block_size,
                                       enable_caching=config.enable_prefix_caching)
        policy = registry.scheduling_policy(config.scheduling_policy)(config)
        self.scheduler = Scheduler(self.kv_cache, policy, config.max_num_seqs,
                                   max_num_batched_tokens,
                                   enable_chunked_prefill=config.enable_chunked_prefill)
        self._times = EngineCoreStats()  # only its per-request time lists are used
        tokens = num_blocks * config.block_size
        logger.info("KV cache: %d blocks x %d tokens = %d tokens (%.2f GiB, %s); maximum "
                    "concurrency at max_model_len=%d: %.2fx", num_blocks, config.block_size,
                    tokens, num_blocks * self.runner.kv_bytes_per_block / 2**30,
                    str(self.runner.dtype).removeprefix("torch."), max_model_len,
                    tokens / max_model_len)

    @classmethod
    def from_config(cls, config: EngineConfig, registry: Registry | None = None,
                    setup: ModelSetup | None = None) -> "EngineCore":
        """Build a core from ``config`` alone (as the core's own process does); ``setup`` skips
        resolving the model again. Raises what `resolve_model_setup` and loading raise, and
        CacheTooSmallError."""
        registry = registry or default_registry()
        setup = setup or resolve_model_setup(config, registry)
        return cls(config, setup.source, setup.hf_config, registry, setup.max_model_len,
                   setup.max_num_batched_tokens)

    def shutdown(self) -> None:
        """Finish every request (no outputs) and drop the KV cache tensors; the core is unusable
        afterwards."""
        self.scheduler.abort_requests(list(self.scheduler.requests))
        self.runner.kv_caches = []

    def stats(self) -> EngineCoreStats:
        """The core's state now, and the per-request times recorded since the last call."""
        sched, times = self.scheduler, self._times
        self._times = EngineCoreStats()
        return EngineCoreStats(
            len(sched.running), len(sched.waiting), self.kv_cache.usage,
            sched.stats.num_preemptions, sched.stats.num_steps, self.kv_cache.stats.queries,
            self.kv_cache.stats.hits, times.queue_times, times.prefill_times, times.decode_times)

    def add_request(self, r: EngineCoreRequest) -> None:
        sp = r.sampling_params
        req = Request(r.request_id, list(r.prompt_token_ids), sp, r.eos_token_ids,
                      self.max_model_len, r.arrival_time, r.priority, cache_salt=r.cache_salt,
                      skip_prefix_cache=getattr(sp, "prompt_logprobs", None) is not None)
        self.scheduler.add_request(req)  # first: it rejects an id in use
        self.runner.add_request_state(r.request_id, SamplingState.from_params(
            sp, r.seed, r.prompt_token_ids, r.eos_token_ids))

    def abort_requests(self, request_ids: list[str]) -> list[EngineCoreOutput]:
        return [EngineCoreOutput(r.request_id, [], FinishReason.ABORT.value)
                for r in self.scheduler.abort_requests(request_ids)]

    @property
    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests

    def _drain_rejected(self) -> list[EngineCoreOutput]:
        sched = self.scheduler
        if not sched.rejected:
            return []
        bs, total = self.kv_cache.block_size, self.kv_cache.num_blocks
        out = [EngineCoreOutput(r.request_id, [], FinishReason.ERROR.value,
                                f"request needs {-(-r.num_tokens // bs)} KV cache blocks of {bs} "
                                f"tokens; the whole cache has {total}")
               for r in sched.rejected]
        sched.rejected.clear()
        return out

    def step(self) -> list[EngineCoreOutput]:
        """Schedule, execute, sample, update. A failure of the model step finishes the requests
        of that step with reason ``error``; the engine goes on with the others."""
        so = self.scheduler.schedule()
        now = time.monotonic()
        for sr in so.scheduled:
            req = self.scheduler.requests.get(sr.request_id)
            if req is not None and req.first_scheduled_time is None:
                req.first_scheduled_time = now
                self._times.queue_times.append(now - req.arrival_time)
        rejected = self._drain_rejected()
        try:
            sampled = self.runner.execute(so)
        except Exception as e:  # one bad step must not kill the engine
            logger.exception("model step failed; finishing its %d requests with an error",
                             len(so.scheduled))
            ids = [sr.request_id for sr in so.scheduled]
            reqs = self.scheduler.abort_requests(ids)
            msg = f"{type(e).__name__}: {e}"
            return rejected + [EngineCoreOutput(r.request_id, [], FinishReason.ERROR.value, msg)
                    for r in reqs]
        outputs = rejected
        lps, prompt_lps = self.runner.step_logprobs, self.runner.step_prompt_logprobs
        now = time.monotonic()
        for req, new in self.scheduler.update_from_output(so, sampled):
            self._record_times(req, now)
            reason = req.finish_reason.value if req.is_finished else None
            outputs.append(EngineCoreOutput(req.request_id, new, reason,
                                            logprobs=lps.get(req.request_id),
                                            prompt_logprobs=prompt_lps.pop(req.request_id, None)))
        for rid, plp in prompt_lps.items():  # prompt chunks that sampled nothing this step
            if rid in self.scheduler.requests:
                outputs.append(EngineCoreOutput(rid, [], prompt_logprobs=plp))
        return outputs

    def _record_times(self, req: Request, now: float) -> None:
        """Prefill time at a request's first token, decode time when it finishes."""
        if req.first_token_time is None:
            req.first_token_time = now
            if req.first_scheduled_time is not None:
                self._times.prefill_times.append(now - req.first_scheduled_time)
        if req.is_finished:
            self._times.decode_times.append(now - req.first_token_time)
