"""`EngineCore`: scheduler + KV cache manager + model runner + sampler behind plain data.

It takes `EngineCoreRequest`s and aborts, runs steps, and returns `EngineCoreOutput`s (new
token ids and finish reasons). It knows no text: tokenizing and detokenizing belong to the front
half (core/engine.py). Everything crossing this boundary is plain data, so the core can later run
in its own process.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from .config import EngineConfig
from .kv_cache import KVCacheManager
from .model_loader import ModelSource
from .model_runner import ModelRunner, SamplingState
from .registry import Registry
from .request import FinishReason, Request, SamplingParams
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


@dataclass
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None


class EngineCore:
    def __init__(self, config: EngineConfig, source: ModelSource, hf_config,
                 registry: Registry, max_model_len: int, max_num_batched_tokens: int):
        self.config = config
        self.max_model_len = max_model_len
        self.runner = ModelRunner(config, source, hf_config, registry, max_model_len,
                                  max_num_batched_tokens)
        num_blocks = self.runner.determine_num_blocks()
        self.runner.allocate_kv_cache(num_blocks)
        self.kv_cache = KVCacheManager(num_blocks, config.block_size)
        policy = registry.scheduling_policy(config.scheduling_policy)(config)
        self.scheduler = Scheduler(self.kv_cache, policy, config.max_num_seqs,
                                   max_num_batched_tokens)
        tokens = num_blocks * config.block_size
        logger.info("KV cache: %d blocks x %d tokens = %d tokens (%.2f GiB, %s); maximum "
                    "concurrency at max_model_len=%d: %.2fx", num_blocks, config.block_size,
                    tokens, num_blocks * self.runner.kv_bytes_per_block / 2**30,
                    str(self.runner.dtype).removeprefix("torch."), max_model_len,
                    tokens / max_model_len)

    @property
    def kv_capacity_tokens(self) -> int:
        return self.kv_cache.num_blocks * self.config.block_size

    def add_request(self, r: EngineCoreRequest) -> None:
        sp = r.sampling_params
        req = Request(r.request_id, list(r.prompt_token_ids), sp, r.eos_token_ids,
                      self.max_model_len, r.arrival_time, r.priority)
        self.runner.add_request_state(r.request_id, SamplingState(
            sp.temperature, sp.top_k if sp.top_k > 0 else 0, sp.top_p, r.seed))
        self.scheduler.add_request(req)

    def abort_requests(self, request_ids: list[str]) -> list[EngineCoreOutput]:
        return [EngineCoreOutput(r.request_id, [], FinishReason.ABORT.value)
                for r in self.scheduler.abort_requests(request_ids)]

    @property
    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests

    def step(self) -> list[EngineCoreOutput]:
        """Schedule, execute, sample, update. A failure of the model step finishes the requests
        of that step with reason ``error``; the engine goes on with the others."""
        so = self.scheduler.schedule()
        try:
            sampled = self.runner.execute(so)
        except Exception as e:  # one bad step must not kill the engine
            logger.exception("model step failed; finishing its %d requests with an error",
                             len(so.scheduled))
            ids = [sr.request_id for sr in so.scheduled]
            reqs = self.scheduler.abort_requests(ids)
            msg = f"{type(e).__name__}: {e}"
            return [EngineCoreOutput(r.request_id, [], FinishReason.ERROR.value, msg)
                    for r in reqs]
        outputs = []
        for req, new in self.scheduler.update_from_output(so, sampled):
            reason = req.finish_reason.value if req.is_finished else None
            outputs.append(EngineCoreOutput(req.request_id, new, reason))
        return outputs
