"""`LLMEngine`: the front half. Tokenizes and validates requests (a clear error, nothing
queued), hands plain-data requests to the `EngineCore`, and turns new token ids into text.

The core is an `EngineCore` in this process (``LLM``, tests) or a client of one in a thread or
its own process (core/core_client.py), either behind the `EngineCoreClient` protocol
(core/core_protocol.py); `AsyncEngine` (core/async_engine.py) drives an
`LLMEngine` over such a client, so validation and output processing live here only."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import random
import threading
from typing import Any, Callable

from .config import EngineConfig
from .core_protocol import EngineCoreClient
from .detokenizer import IncrementalDetokenizer
from .engine_core import EngineCore, EngineCoreOutput, EngineCoreRequest
from .model_setup import ModelSetup, resolve_model_setup
from .errors import (ContextLengthError, InvalidRequestError, InvalidTokenError, ModelNotFoundError,
                     SamplingParamsError)
from .model_loader import eos_token_ids, generation_defaults, resolve_model
from .registry import Registry, registry as default_registry
from .output import RequestState, SampleState
from .prompt_length import tokenize_within
from .request import FinishReason, RequestOutput, SamplingParams
from .structured_output import StructuredOutputsParams
from .tokenizer import chat_prompt_ids, load_tokenizer, read_chat_template

CHECKED_CONSTRAINTS = 256  # distinct constraints whose check is remembered

logger = logging.getLogger(__name__)

PromptType = str | dict[str, Any]
# (config, registry, setup) -> an EngineCore or a client of one (core/core_client.py)
CoreFactory = Callable[[EngineConfig, Registry, ModelSetup], EngineCoreClient]


class LLMEngine:
    """The front half over one engine core.

    ``core(config, registry, setup)`` builds what it talks to, an `EngineCoreClient`
    (core/core_protocol.py): by default an `EngineCore` in this process (tests reach into it
    as ``engine.core``); `AsyncEngine` passes a client (core/core_client.py).
    """

    def __init__(self, config: EngineConfig, registry: Registry | None = None,
                 core: CoreFactory | None = None):
        self.config = config
        self.registry = registry or default_registry()
        setup = resolve_model_setup(config, self.registry)
        self.source, self.hf_config = setup.source, setup.hf_config
        self.tokenizer = self._load_tokenizer()
        self.vocab_size = int(self.hf_config.vocab_size)
        self.max_model_len = setup.max_model_len
        self.core: EngineCoreClient = (core or EngineCore.from_config)(config, self.registry, setup)
        self.eos_token_ids = eos_token_ids(self.source.folder, self.hf_config, self.tokenizer)
        self.sampling_defaults = (generation_defaults(self.source.folder)
                                  if config.generation_config == "auto" else {})
        self._seeds = random.Random(config.seed)
        self._ids = itertools.count()
        self._states: dict[str, RequestState] = {}
        self._core_ids: dict[str, tuple[str, int]] = {}  # core request id -> (request id, index)
        self._token_text: dict[int, str] = {}  # decoded single tokens, for log-prob dicts
        self._checked_constraints: dict[Any, None] = {}  # Constraint -> None, oldest first
        self._checked_lock = threading.Lock()  # check_constraint runs on worker threads too
        self.registry.engine_started(config)

    def _load_tokenizer(self) -> Any:
        """The tokenizer of ``tokenizer`` (a folder or a model name such as smollm2-135m), else
        the model folder's. With dummy weights and no tokenizer files there is none: requests
        must then give prompt_token_ids."""
        name = self.config.tokenizer
        folder = resolve_model(name).folder if name else self.source.folder
        try:
            tok = load_tokenizer(folder)
        except ModelNotFoundError:
            if name or self.config.load_format != "dummy":
                raise
            logger.warning("no tokenizer in %s: only prompt_token_ids prompts work", folder)
            return None
        if self.config.chat_template:  # the configured template replaces the tokenizer's
            tok.chat_template = read_chat_template(self.config.chat_template)
        return tok

    # ---- requests -----------------------------------------------------------------------------

    def default_sampling_params(self) -> SamplingParams:
        return SamplingParams(**self.sampling_defaults)

    def prepare(self, prompt: PromptType, params: SamplingParams | None,
                request_id: str | None = None,
                priority: int = 0) -> tuple[EngineCoreRequest, RequestState]:
        """Tokenize and validate; raises InvalidRequestError subclasses. Queues nothing.

        ``prompt``: a string or ``{"prompt_token_ids": [...]}`` (or ``{"prompt": str}``), either
        dict optionally with ``"cache_salt"`` (a string mixed into the prefix-cache hashes:
        requests only share cached blocks with requests of the same salt). ``priority``: for
        the ``priority`` policy, lower runs first.
        Returns the request for the core and the front half's state; `submit` sends it (as n
        core requests when ``params.n > 1``)."""
        if params is None:  # as vLLM: the model's generation_config only fills in a default
            params = self.default_sampling_params()
        params.validate()
        self._check_vocab(params)
        text, ids = self._tokenize(prompt, params.max_tokens)
        if not ids:
            raise InvalidRequestError("prompt is empty: give at least one token")
        self._check_length(len(ids), params.max_tokens)
        bad = [(i, t) for i, t in enumerate(ids) if not (0 <= t < self.vocab_size)]
        if bad:
            i, t = bad[0]
            raise InvalidTokenError(f"prompt token id {t} at position {i} is outside the "
                                    f"vocabulary [0, {self.vocab_size})")
        rid = request_id if request_id is not None else str(next(self._ids))
        # n > 1: vLLM's child ids and seeds (seed + index when seeded, else drawn per sample)
        core_ids = [rid] if params.n == 1 else [f"{i}_{rid}" for i in range(params.n)]
        if rid in self._states or any(c in self._core_ids for c in core_ids):
            raise InvalidRequestError(f"request id {rid!r} is already in use")
        seeds = [(params.seed + i) % (1 << 63) if params.seed is not None
                 else self._seeds.getrandbits(63) for i in range(params.n)]
        samples = []
        for i, (cid, seed) in enumerate(zip(core_ids, seeds)):
            detok = (IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens)
                     if self.tokenizer else None)
            samples.append(SampleState(i, cid, seed, params, detok,
                                       self._decode_token if self.tokenizer else None))
        salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise InvalidRequestError(f"cache_salt must be a non-empty string, got {salt!r}")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise InvalidRequestError(f"priority must be an integer, got {priority!r}")
        core_req = EngineCoreRequest(rid, ids, params, self.eos_token_ids, seeds[0],
                                     priority=priority, cache_salt=salt)
        return core_req, RequestState(text, ids, params, samples)

    def _check_vocab(self, params: SamplingParams) -> None:
        """Token ids in the sampling params against the vocabulary; stop strings need text."""
        v = self.vocab_size
        for name, ids in (("stop_token_ids", params.stop_token_ids),
                          ("logit_bias", list(params.logit_bias or {}))):
            bad = [t for t in ids if t >= v]
            if bad:
                raise SamplingParamsError(f"{name} has token id {bad[0]}, outside the "
                                          f"vocabulary [0, {v})")
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(params, name)
            if n is not None and n > v:
                raise SamplingParamsError(f"{name}={n} is invalid: more than the vocabulary "
                                          f"size {v}")
        if params.structured_outputs is not None:
            self.check_constraint(params.structured_outputs)
        if params.stop_strings and self.tokenizer is None:
            raise InvalidRequestError(f"stop={params.stop!r} needs a tokenizer to find text; "
                                      f"this engine has none (dummy weights): use "
                                      f"stop_token_ids")

    def check_constraint(self, so: StructuredOutputsParams) -> None:
        """Parse ``so``'s constraint and build it without a tokenizer (an invalid schema fails
        here, before anything is queued); each distinct constraint checked once (the last
        CHECKED_CONSTRAINTS kept). Its time grows with the constraint's size: `AsyncEngine`
        calls it on a worker thread for a large one. Raises SamplingParamsError naming the
        field, InvalidRequestError without a tokenizer."""
        if self.tokenizer is None:
            raise InvalidRequestError("structured_outputs needs the model's tokenizer; this "
                                      "engine has none (dummy weights)")
        c = so.constraint()
        checked = self._checked_constraints
        if c in checked:
            return
        self.registry.structured_output_backend(self.config.structured_outputs_backend).validate(c)
        with self._checked_lock:
            checked[c] = None
            while len(checked) > CHECKED_CONSTRAINTS:
                checked.pop(next(iter(checked)), None)

    def _decode_token(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text

    def tokenize_text(self, text: str, max_tokens: int | None = None) -> list[int]:
        """``text``'s prompt token ids; raises ContextLengthError as soon as a prefix of it
        cannot fit max_model_len with ``max_tokens`` (core/prompt_length.py), and
        InvalidRequestError without a tokenizer. Touches no engine state: `AsyncEngine` calls
        it on a worker thread."""
        if self.tokenizer is None:
            raise InvalidRequestError("this engine has no tokenizer (dummy weights): give "
                                      "{'prompt_token_ids': [...]}")
        return tokenize_within(self.tokenizer, text, self.max_model_len, max_tokens) if text else []

    def _check_length(self, n: int, max_tokens: int | None) -> None:
        """ContextLengthError unless a prompt of ``n`` tokens and ``max_tokens`` fit."""
        limit = self.max_model_len
        if max_tokens is None:
            if n >= limit:
                raise ContextLengthError(f"prompt has {n} tokens; max_model_len={limit} leaves "
                                         f"no room for output")
        elif n + max_tokens > limit:
            raise ContextLengthError(
                f"prompt ({n} tokens) + max_tokens ({max_tokens}) = "
                f"{n + max_tokens} exceeds max_model_len={limit}")

    def _tokenize(self, prompt: PromptType,
                  max_tokens: int | None = None) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenize_text(prompt, max_tokens)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if isinstance(ids, (list, tuple)):  # the length before a scan of every id
                    self._check_length(len(ids), max_tokens)
                if not isinstance(ids, (list, tuple)) or not all(
                        isinstance(t, int) and not isinstance(t, bool) for t in ids):
                    raise InvalidRequestError("prompt_token_ids must be a list of integers")
                return prompt.get("prompt"), list(ids)
            if "prompt" in prompt:
                return self._tokenize(prompt["prompt"], max_tokens)
        raise InvalidRequestError(f"a prompt is a string or {{'prompt_token_ids': [...]}}, "
                                  f"got {type(prompt).__name__}")

    def chat_prompt(self, messages: list[dict[str, Any]], max_tokens: int | None = None,
                    tools: list[dict[str, Any]] | None = None,
                    chat_template: str | None = None) -> dict[str, Any]:
        """``{"prompt_token_ids": [...]}`` of ``messages`` (and ``tools``, OpenAI tool objects)
        through the chat template (``chat_template``: a template text instead of the
        tokenizer's); text that cannot fit max_model_len with ``max_tokens`` is
        refused early (as `tokenize_text`). Touches no engine state (`AsyncEngine` calls it on
        a worker thread)."""
        if self.tokenizer is None:
            raise InvalidRequestError("this engine has no tokenizer (dummy weights)")
        return {"prompt_token_ids": chat_prompt_ids(self.tokenizer, messages,
                                                    max_model_len=self.max_model_len,
                                                    max_tokens=max_tokens, tools=tools,
                                                    chat_template=chat_template)}

    def add_request(self, prompt: PromptType, params: SamplingParams | None = None,
                    request_id: str | None = None, priority: int = 0) -> str:
        core_req, state = self.prepare(prompt, params, request_id, priority)
        self.submit(core_req, state)
        return core_req.request_id

    def submit(self, core_req: EngineCoreRequest, state: RequestState) -> None:
        """Queue a prepared request: one core request per sample (n > 1 fans out into n core
        requests with their own ids and seeds; only the first computes prompt log-probs)."""
        rid = core_req.request_id
        self._states[rid] = state
        for s in state.samples:
            self._core_ids[s.core_id] = (rid, s.index)
        if len(state.samples) == 1:
            self.core.add_request(core_req)
            return
        for s in state.samples:
            params = dataclasses.replace(
                core_req.sampling_params, n=1,
                prompt_logprobs=core_req.sampling_params.prompt_logprobs if s.index == 0
                else None)
            self.core.add_request(dataclasses.replace(
                core_req, request_id=s.core_id, sampling_params=params, seed=s.seed))

    def abort_request(self, request_ids: list[str]) -> list[RequestOutput]:
        """Abort requests (all n samples of each). Returns their final outputs (finish reason
        ``abort``) when the core answers at once (an EngineCore here); a client's core answers
        through `step`."""
        core_ids = []
        for rid in request_ids:
            st = self._states.get(rid)
            core_ids += ([s.core_id for s in st.samples if not s.finished] if st is not None
                         else [rid])
        return self.process_outputs(self.core.abort_requests(core_ids))

    @property
    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests

    def step(self) -> list[RequestOutput]:
        """One engine step; returns an output for every request that changed."""
        return self.process_outputs(self.core.step())

    def shutdown(self) -> None:
        """Stop the core (and its process, when it has one); pending requests are dropped."""
        self.core.shutdown()

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> list[RequestOutput]:
        """The front half's output processing, for `step` and `AsyncEngine` alike: one
        `RequestOutput` per request with a core output here (all n samples, cumulative text),
        for requests still open here (outputs of samples finished here already, e.g. the core's
        answer to an abort sent below, are dropped).

        A sample that this side finishes while the core has not (a stop string) is aborted in
        the core. A request whose processing raises is finished with finish reason ``error``
        and its samples aborted; the others go on. See core/output.py for stop strings.
        """
        touched: dict[str, None] = {}
        to_abort: list[str] = []
        for o in outputs:
            link = self._core_ids.get(o.request_id)
            if link is None:
                continue
            rid = link[0]
            try:
                if self._process(o):
                    to_abort.append(o.request_id)
            except Exception as e:  # one request's failure must not lose the others
                logger.exception("output processing of request %r failed", o.request_id)
                to_abort += self._fail(rid, f"{type(e).__name__}: {e}")
            touched[rid] = None
        states = self._states
        results = [self._request_output(rid) for rid in touched
                   if not states[rid].final_only or states[rid].finished]
        if to_abort:
            self.core.abort_requests(to_abort)
        return results

    def _process(self, o: EngineCoreOutput) -> bool:
        """Apply one core output to its sample. Returns True when the front half finished the
        sample (a stop string) and the core must abort it."""
        rid, index = self._core_ids[o.request_id]
        st = self._states[rid]
        if o.prompt_logprobs is not None:
            st.add_prompt_logprobs(o.prompt_logprobs, self._decode_token if self.tokenizer
                                   else None)
        if o.error is not None and st.error is None:
            st.error, st.error_param = o.error, o.error_param
        sample = st.samples[index]
        abort = sample.update(o)
        if sample.finished:
            del self._core_ids[o.request_id]
        return abort

    def _fail(self, rid: str, error: str) -> list[str]:
        """Finish every open sample of ``rid`` with reason ``error``; returns their core ids."""
        st = self._states[rid]
        st.error = st.error or error
        ids = [s.core_id for s in st.samples if not s.finished]
        for s in st.samples:
            if not s.finished:
                s.finish_reason = FinishReason.ERROR.value
            self._core_ids.pop(s.core_id, None)
        return ids

    def _request_output(self, rid: str) -> RequestOutput:
        out = self._states[rid].output(rid)
        if out.finished:
            del self._states[rid]
            try:
                self.registry.request_finished(out)
            except Exception:  # a broken stats plugin must not stop the engine
                logger.exception("a request_finished hook raised; ignored")
        return out
