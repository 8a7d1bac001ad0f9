"""Requests and their outputs: `SamplingParams`, `Request`, `RequestOutput`, `FinishReason`."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field, fields
from typing import Any

from .errors import SamplingParamsError

# Below this temperature sampling is greedy (avoids overflow of logits / T in fp32).
GREEDY_EPS = 1e-5


@dataclass
class SamplingParams:
    """How to sample one request. Defaults are vLLM's.

    temperature: 0 = greedy. top_p / top_k: nucleus and top-k filters (top_k 0 or -1 = off).
    max_tokens: most new tokens. min_tokens: EOS and stop_token_ids are suppressed until this
    many tokens exist. stop_token_ids: extra token ids that end the request (finish reason
    ``stop``). ignore_eos: keep going past EOS. seed: per-request random seed.
    Raises SamplingParamsError (naming the field, value and limit) from ``validate``.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None

    def validate(self) -> None:
        def bad(name: str, limit: str) -> SamplingParamsError:
            return SamplingParamsError(f"{name}={getattr(self, name)!r} is invalid: {limit}")

        if self.n != 1:
            raise bad("n", "only n=1 is supported so far")
        if not (self.temperature >= 0.0):  # also rejects NaN
            raise bad("temperature", "must be >= 0")
        if not (0.0 < self.top_p <= 1.0):
            raise bad("top_p", "must be in (0, 1]")
        if self.top_k < -1:
            raise bad("top_k", "must be -1, 0 (off) or >= 1")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad("max_tokens", "must be >= 1")
        if self.min_tokens < 0:
            raise bad("min_tokens", "must be >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be <= max_tokens={self.max_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    def with_defaults(self, defaults: dict[str, Any]) -> "SamplingParams":
        """A copy where fields still at the class default take a model's generation_config value."""
        out = SamplingParams(**{f.name: getattr(self, f.name) for f in fields(self)})
        for f in fields(self):
            if f.name in defaults and getattr(self, f.name) == f.default:
                setattr(out, f.name, defaults[f.name])
        return out


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id (later: a stop string)
    LENGTH = "length"  # max_tokens or max_model_len reached
    ABORT = "abort"
    ERROR = "error"

    def __str__(self) -> str:
        return self.value


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED = enum.auto()


_arrival_counter = itertools.count()


@dataclass(eq=False)
class Request:
    """The engine core's view of one request (plain data; owns no tensors).

    There is no prefill/decode phase: ``num_computed_tokens`` of ``num_tokens`` are in the KV
    cache; the scheduler hands out tokens to compute until the two meet, then each step adds one
    sampled token.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    max_total_tokens: int = 0  # max_model_len: prompt + output never exceeds it
    arrival_time: float = 0.0
    priority: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    arrival_seq: int = field(default_factory=lambda: next(_arrival_counter))

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def max_tokens(self) -> int:
        mt = self.sampling_params.max_tokens
        room = self.max_total_tokens - self.num_prompt_tokens
        return room if mt is None else min(mt, room)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def check_stop(self) -> FinishReason | None:
        """Finish reason after the last appended token, or None to go on."""
        n_out = len(self.output_token_ids)
        if n_out == 0:
            return None
        sp = self.sampling_params
        last = self.output_token_ids[-1]
        if n_out >= sp.min_tokens:
            if last in sp.stop_token_ids:
                return FinishReason.STOP
            if not sp.ignore_eos and last in self.eos_token_ids:
                return FinishReason.STOP
        if n_out >= self.max_tokens:
            return FinishReason.LENGTH
        return None


@dataclass
class CompletionOutput:
    """One generated sequence of a request."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """What ``LLM.generate`` returns per prompt (vLLM's shape)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    error: str | None = None
