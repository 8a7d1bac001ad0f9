"""Requests and their outputs: `SamplingParams`, `Request`, `RequestOutput`, `FinishReason`,
and the log-prob types `Logprob` (front half) and `LogprobsLists` (engine-core boundary)."""

from __future__ import annotations

import enum
import functools
import itertools
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .errors import SamplingParamsError
from .structured_output import StructuredOutputsParams

if TYPE_CHECKING:  # (sampling_state.py imports this module)
    from .sampling_state import SamplingState

# Below this temperature sampling is greedy (avoids overflow of logits / T in fp32).
GREEDY_EPS = 1e-5


# Caps of the request fields whose cost grows with the value (vLLM caps logprobs at 20 too).
MAX_N = 128
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a logit_bias value: [-100, 100]
# Stop strings are searched in the new text of every step (core/output.py), so their number and
# length bound that work per token (OpenAI's API takes at most 4).
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass
class SamplingParams:
    """How to sample one request. Defaults and meanings are vLLM's (OpenAI's for the penalties).

    n: parallel samples of the prompt (1..MAX_N), each with its own seed (``seed + index`` when
    seeded). temperature: 0 (below GREEDY_EPS) = greedy. top_p / top_k: nucleus and top-k
    filters (top_k 0 or -1 = off). min_p: drop tokens whose probability is below min_p times the
    most likely token's (0 = off). presence_penalty / frequency_penalty in [-2, 2]: subtracted
    from the logit of every token the output holds, once / once per occurrence.
    repetition_penalty > 0: the logit of every token in the prompt or output is divided by it
    when positive, multiplied when negative (1 = off). logit_bias: token id -> value in
    [-100, 100] added to that token's logit.
    max_tokens: most new tokens. min_tokens: every EOS id and stop_token_ids are masked out of
    the logits, and stop strings ignored, until this many tokens exist. stop_token_ids: extra
    token ids that end the request (finish reason ``stop``). ignore_eos: keep going past EOS.
    stop: a string or list of strings that end the request when the text produces one (not
    shown, unless include_stop_str_in_output; finish reason ``stop``, stop_reason the string).
    logprobs: log-probs of the top-N tokens (0..MAX_LOGPROBS) at each sampled position, plus
    the sampled token's; prompt_logprobs: the same for every prompt position after the first.
    Both come from the raw model distribution (before penalties, temperature and filters).
    seed: per-request random seed. skip_special_tokens: leave special tokens out of the text.
    structured_outputs: a constraint on the output (JSON schema, any JSON object, regex,
    choice, grammar: core/structured_output.py), or None; a dict is taken as its fields.
    Raises SamplingParamsError (naming the field, value and limit) from ``validate``.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    seed: int | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None

    def validate(self) -> None:
        def bad(name: str, limit: str) -> SamplingParamsError:
            return SamplingParamsError(f"{name}={getattr(self, name)!r:.200} is invalid: {limit}",
                                       name)

        if not _is_int(self.n) or not (1 <= self.n <= MAX_N):
            raise bad("n", f"must be an integer in [1, {MAX_N}]")
        if not (_is_number(self.temperature) and self.temperature >= 0.0):  # rejects NaN, inf
            raise bad("temperature", "must be a finite number >= 0")
        if not (_is_number(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise bad("top_p", "must be a number in (0, 1]")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise bad("top_k", "must be -1, 0 (off) or >= 1")
        if not (_is_number(self.min_p) and 0.0 <= self.min_p <= 1.0):
            raise bad("min_p", "must be a number in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not (_is_number(v) and -2.0 <= v <= 2.0):
                raise bad(name, "must be a number in [-2, 2]")
        if not (_is_number(self.repetition_penalty) and self.repetition_penalty > 0.0):
            raise bad("repetition_penalty", "must be a finite number > 0 (1 = off)")
        self._validate_logit_bias()
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad("max_tokens", "must be an integer >= 1")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be <= max_tokens={self.max_tokens}")
        if not isinstance(self.stop, (str, list, tuple, type(None))) or not all(
                isinstance(s, str) and s for s in self.stop_strings):
            raise bad("stop", "must be a non-empty string or a list of non-empty strings")
        stops = self.stop_strings
        if len(stops) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_STRING_CHARS for s in stops):
            raise bad("stop", f"must be at most {MAX_STOP_STRINGS} strings of at most "
                              f"{MAX_STOP_STRING_CHARS} characters each (got {len(stops)}, "
                              f"the longest {max(map(len, stops))})")
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
                _is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be a list of token ids >= 0")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or not (0 <= v <= MAX_LOGPROBS)):
                raise bad(name, f"must be None or an integer in [0, {MAX_LOGPROBS}]")
        if self.seed is not None and not (_is_int(self.seed) and -2**63 <= self.seed < 2**63):
            raise bad("seed", "must be None or a 64-bit integer (in [-2^63, 2^63))")
        so = self.structured_outputs
        if isinstance(so, dict):
            try:
                so = self.structured_outputs = StructuredOutputsParams(**so)
            except TypeError as e:
                raise SamplingParamsError(f"structured_outputs is invalid: {e}",
                                          "structured_outputs") from None
        if so is not None:
            if not isinstance(so, StructuredOutputsParams):
                raise bad("structured_outputs", "must be a StructuredOutputsParams or a dict")
            so.validate()

    def _validate_logit_bias(self) -> None:
        lb = self.logit_bias
        if lb is None:
            return
        if not isinstance(lb, dict):
            raise SamplingParamsError(f"logit_bias={lb!r} is invalid: must be a dict of token "
                                      f"id -> bias", "logit_bias")
        for tok, v in lb.items():
            if not _is_int(tok) or tok < 0:
                raise SamplingParamsError(f"logit_bias key {tok!r} is invalid: must be a token "
                                          f"id (an integer >= 0)", "logit_bias")
            if not (_is_number(v) and -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS):
                raise SamplingParamsError(f"logit_bias[{tok}]={v!r} is invalid: must be in "
                                          f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]",
                                          "logit_bias")

    @property
    def stop_strings(self) -> list[str]:
        """``stop`` as a list (a single string is one stop string)."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
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
    # tokens being sampled by steps in flight (async scheduling): scheduled, not yet appended
    num_pending_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    arrival_seq: int = field(default_factory=lambda: next(_arrival_counter))
    cache_salt: str | None = None  # joins the prefix-cache hash of the first block
    block_hashes: list = field(default_factory=list)  # kv_cache.BlockHash per full block, chained
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    skip_prefix_cache: bool = False  # e.g. prompt logprobs need every prompt position computed
    first_scheduled_time: float | None = None  # time.monotonic(), for queue-time metrics
    first_token_time: float | None = None  # time.monotonic() of the first sampled token
    # the runner's sampling state, built once at admission (EngineCore.add_request); it travels
    # to the runner in the scheduler output's new-request record
    sampling_state: SamplingState | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @functools.cached_property
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
class LogprobsLists:
    """Log-probs of some positions as plain lists (vLLM's ``LogprobsLists``): crosses the
    engine-core boundary. Row i is one position: ``token_ids[i]`` is that position's actual
    token (sampled, or the prompt's) followed by the top-N tokens, ``logprobs[i]`` their
    log-probs (same shape), ``ranks[i]`` the actual token's rank (1 = most likely).
    ``start``: for prompt log-probs, the prompt index of row 0's token (>= 1)."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]
    start: int = 0


@dataclass
class Logprob:
    """One token's entry in a position's log-probs (vLLM's shape). rank: 1 = most likely."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per position, token id -> Logprob (the actual token first, then the top-N by rank).
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One generated sequence of a request.

    text is cumulative (everything so far, never a stop string unless
    include_stop_str_in_output); a streaming consumer takes the part past what it has shown.
    stop_reason: the stop string or stop token id that ended it (None for EOS and the rest).
    logprobs: one PositionLogprobs per token when the request asked for logprobs, and
    cumulative_logprob the sum of the sampled tokens' log-probs.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """What ``LLM.generate`` returns per prompt (vLLM's shape): ``outputs`` holds the request's
    n samples, index 0..n-1; ``finished`` once all n are. prompt_logprobs (when asked): None
    for the first prompt token, then one PositionLogprobs per prompt token. error: why the
    request failed (its samples' finish reason ``error``); error_param: the request field at
    fault when it is the request's fault (e.g. ``guided_choice`` for a constraint that can no
    longer be met), which the HTTP frontend answers as a 400 naming it; None for an engine
    failure."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    error: str | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    error_param: str | None = None
