"""`LLMEngine`: the front half. Tokenizes and validates requests (a clear error, nothing
queued), hands plain-data requests to the `EngineCore`, and turns new token ids into text."""

from __future__ import annotations

import itertools
import logging
import random
from dataclasses import dataclass
from typing import Any

from .config import EngineConfig
from .detokenizer import IncrementalDetokenizer
from .engine_core import EngineCore, EngineCoreOutput, EngineCoreRequest
from .errors import (ConfigError, ContextLengthError, InvalidRequestError, InvalidTokenError,
                     ModelNotFoundError)
from .model_loader import (eos_token_ids, generation_defaults, load_hf_config, resolve_model)
from .registry import Registry, registry as default_registry
from .request import CompletionOutput, RequestOutput, SamplingParams
from .tokenizer import chat_prompt_ids, load_tokenizer

logger = logging.getLogger(__name__)

PromptType = str | dict[str, Any]


@dataclass
class _RequestState:
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detok: IncrementalDetokenizer | None
    output_token_ids: list[int]


class LLMEngine:
    def __init__(self, config: EngineConfig, registry: Registry | None = None):
        self.config = config
        self.registry = registry or default_registry()
        self.source = resolve_model(config.model, config.load_format)
        self.hf_config = load_hf_config(self.source.folder)
        self.tokenizer = self._load_tokenizer()
        self.vocab_size = int(self.hf_config.vocab_size)
        self.max_model_len = self._resolve_max_model_len()
        mnbt = config.max_num_batched_tokens or max(self.max_model_len, 2048)
        if mnbt < self.max_model_len:
            raise ConfigError(
                f"max_num_batched_tokens={mnbt} is below max_model_len={self.max_model_len}: "
                f"without chunked prefill a prompt of max_model_len tokens could never be "
                f"scheduled; raise max_num_batched_tokens or lower max_model_len")
        self.core = EngineCore(config, self.source, self.hf_config, self.registry,
                               self.max_model_len, mnbt)
        self.eos_token_ids = eos_token_ids(self.source.folder, self.hf_config, self.tokenizer)
        self.sampling_defaults = (generation_defaults(self.source.folder)
                                  if config.generation_config == "auto" else {})
        self._seeds = random.Random(config.seed)
        self._ids = itertools.count()
        self._states: dict[str, _RequestState] = {}
        self.registry.engine_started(config)

    def _load_tokenizer(self) -> Any:
        """The tokenizer of ``tokenizer`` (a folder or a model name such as smollm2-135m), else
        the model folder's. With dummy weights and no tokenizer files there is none: requests
        must then give prompt_token_ids."""
        name = self.config.tokenizer
        folder = resolve_model(name).folder if name else self.source.folder
        try:
            return load_tokenizer(folder)
        except ModelNotFoundError:
            if name or self.config.load_format != "dummy":
                raise
            logger.warning("no tokenizer in %s: only prompt_token_ids prompts work", folder)
            return None

    def _resolve_max_model_len(self) -> int:
        model_max = getattr(self.hf_config, "max_position_embeddings", None)
        want = self.config.max_model_len
        if want is None:
            if model_max is None:
                raise ConfigError("the model's config.json has no max_position_embeddings: "
                                  "set max_model_len")
            return int(model_max)
        if model_max is not None and want > model_max:
            raise ConfigError(f"max_model_len={want} exceeds the model's "
                              f"max_position_embeddings={model_max}")
        return want

    # ---- requests -----------------------------------------------------------------------------

    def default_sampling_params(self) -> SamplingParams:
        return SamplingParams().with_defaults(self.sampling_defaults)

    def prepare(self, prompt: PromptType, params: SamplingParams | None,
                request_id: str | None = None) -> tuple[EngineCoreRequest, _RequestState]:
        """Tokenize and validate; raises InvalidRequestError subclasses. Queues nothing."""
        if params is None:  # as vLLM: the model's generation_config only fills in a default
            params = self.default_sampling_params()
        params.validate()
        text, ids = self._tokenize(prompt)
        if not ids:
            raise InvalidRequestError("prompt is empty: give at least one token")
        bad = [(i, t) for i, t in enumerate(ids) if not (0 <= t < self.vocab_size)]
        if bad:
            i, t = bad[0]
            raise InvalidTokenError(f"prompt token id {t} at position {i} is outside the "
                                    f"vocabulary [0, {self.vocab_size})")
        n, limit = len(ids), self.max_model_len
        if params.max_tokens is None:
            if n >= limit:
                raise ContextLengthError(f"prompt has {n} tokens; max_model_len={limit} leaves "
                                         f"no room for output")
        elif n + params.max_tokens > limit:
            raise ContextLengthError(
                f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) = "
                f"{n + params.max_tokens} exceeds max_model_len={limit}")
        rid = request_id if request_id is not None else str(next(self._ids))
        if rid in self._states:
            raise InvalidRequestError(f"request id {rid!r} is already in use")
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        core_req = EngineCoreRequest(rid, ids, params, self.eos_token_ids, seed)
        detok = IncrementalDetokenizer(self.tokenizer, ids) if self.tokenizer else None
        state = _RequestState(text, ids, params, detok, [])
        return core_req, state

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this engine has no tokenizer (dummy weights): give "
                                          "{'prompt_token_ids': [...]}")
            return prompt, self.tokenizer(prompt)["input_ids"] if prompt else []
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, (list, tuple)) or not all(
                        isinstance(t, int) and not isinstance(t, bool) for t in ids):
                    raise InvalidRequestError("prompt_token_ids must be a list of integers")
                return prompt.get("prompt"), list(ids)
            if "prompt" in prompt:
                return self._tokenize(prompt["prompt"])
        raise InvalidRequestError(f"a prompt is a string or {{'prompt_token_ids': [...]}}, "
                                  f"got {type(prompt).__name__}")

    def chat_prompt(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        if self.tokenizer is None:
            raise InvalidRequestError("this engine has no tokenizer (dummy weights)")
        return {"prompt_token_ids": chat_prompt_ids(self.tokenizer, messages)}

    def add_request(self, prompt: PromptType, params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        core_req, state = self.prepare(prompt, params, request_id)
        self.submit(core_req, state)
        return core_req.request_id

    def submit(self, core_req: EngineCoreRequest, state: _RequestState) -> None:
        self._states[core_req.request_id] = state
        self.core.add_request(core_req)

    def abort_request(self, request_ids: list[str]) -> list[RequestOutput]:
        return [self._process(o) for o in self.core.abort_requests(request_ids)]

    @property
    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests

    def step(self) -> list[RequestOutput]:
        """One engine step; returns an output for every request that changed."""
        return [self._process(o) for o in self.core.step()]

    def _process(self, o: EngineCoreOutput) -> RequestOutput:
        st = self._states[o.request_id]
        finished = o.finish_reason is not None
        st.output_token_ids.extend(o.new_token_ids)
        if st.detok is not None:
            st.detok.add_tokens(o.new_token_ids, final=finished)
        stop_reason = None
        if o.finish_reason == "stop" and st.output_token_ids:
            last = st.output_token_ids[-1]
            stop_reason = last if last in st.params.stop_token_ids else None
        text = st.detok.text if st.detok is not None else ""
        comp = CompletionOutput(0, text, list(st.output_token_ids), o.finish_reason,
                                stop_reason)
        out = RequestOutput(o.request_id, st.prompt, st.prompt_token_ids, [comp], finished,
                            o.error)
        if finished:
            del self._states[o.request_id]
            try:
                self.registry.request_finished(out)
            except Exception:  # a broken stats plugin must not stop the engine
                logger.exception("a request_finished hook raised; ignored")
        return out
