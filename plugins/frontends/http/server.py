"""The starlette app of ``pagebatch serve`` and its uvicorn runner.

The engine core runs in its own process (`AsyncEngine.from_config(config, multiprocess=True)`);
this process tokenizes, detokenizes and speaks HTTP. Endpoints: POST /v1/completions,
POST /v1/chat/completions (both streaming as server-sent events), GET /v1/models, GET /health,
GET /version, POST /tokenize, POST /detokenize, GET /metrics, GET /openapi.json. Errors are
OpenAI's body
``{"error": {"message", "type", "param", "code"}}``: input errors 400 (before a stream opens),
unknown model 404, API key 401, body too large 413, dead engine 503. A client that disconnects
has its request aborted (all n samples) at once, written to or not (streams.py). On SIGTERM the
server drains (`draining_server`); when the engine core dies it shuts itself down, exit status 1.
"""

from __future__ import annotations

import asyncio
import gc
import hmac
import json
import logging
import os
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any, AsyncIterator, Callable

from pydantic import BaseModel
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import pagebatch
from pagebatch import AsyncEngine, EngineConfig
from pagebatch.errors import ConfigError, EngineDeadError
from pagebatch.prompt_length import tokenize_within
from pagebatch.registry import registry
from pagebatch.request import SamplingParams
from pagebatch.stall_log import slow_step_threshold_s, watch_event_loop
from pagebatch.tool_parser import ToolParser

from . import protocol as proto
from . import schemas
from .completions import Completions
from .errors import as_api_error, error_response
from .metrics import Metrics
from .openapi import openapi_document
from .tools import template_messages

logger = logging.getLogger(__name__)


@dataclass
class Settings:
    """The server's options (``EngineConfig.plugin_options``, see this plugin's OPTIONS)."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None
    max_request_body_bytes: int = 16 * 2**20
    max_prompts_per_request: int = 256
    max_n_per_request: int = 128
    allowed_origins: list[str] = field(default_factory=list)
    shutdown_timeout: float = 30.0
    metrics_vllm_names: bool = False
    metrics_require_api_key: bool = False
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    exclude_tools_when_tool_choice_none: bool = False

    @classmethod
    def from_config(cls, config: EngineConfig) -> "Settings":
        opts = {k: v for k, v in config.plugin_options.items()
                if k in cls.__dataclass_fields__}
        s = cls(**opts)
        if s.api_key is None:
            s.api_key = os.environ.get("PAGEBATCH_API_KEY") or None
        if s.tool_call_parser is not None:
            registry().tool_parser(s.tool_call_parser)  # an unknown name: PluginError
        if s.enable_auto_tool_choice and s.tool_call_parser is None:
            raise ConfigError("enable_auto_tool_choice needs tool_call_parser (e.g. "
                              "--tool-call-parser hermes); registered parsers: "
                              f"{registry().names('tool_parser')}")
        return s


async def _http_error(request: Request, exc: HTTPException) -> Response:
    """Starlette's own errors (an unknown path 404, a wrong method 405 with its Allow header) in
    the OpenAI error shape that every other answer has."""
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    err = proto.ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                         code=code)
    return error_response(err, exc.headers)


# Routes that read or compute on user input, and so need the API key when one is set: every
# /v1/* route and these. /health and /version stay open; /metrics is open unless
# metrics_require_api_key (docs/serving.md lists each route's rule).
KEYED_PATHS = ("/tokenize", "/detokenize")


def _bearer_token(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """The credentials of the one ``Authorization: Bearer TOKEN`` header (the scheme is
    case-insensitive, RFC 7235), else None (none, several, or another scheme)."""
    values = [v for k, v in headers if k == b"authorization"]
    if len(values) != 1:
        return None
    scheme, _, token = values[0].strip().partition(b" ")
    return token.strip() if scheme.lower() == b"bearer" else None


class _ApiKeyMiddleware:
    """401 unless ``Authorization: Bearer KEY`` matches (constant-time compare), on /v1/*,
    KEYED_PATHS and (``metrics``) /metrics. The path is the ASGI scope's, so a forged Host
    header or absolute URL cannot dodge it."""

    def __init__(self, app: Any, api_key: str, metrics: bool = False) -> None:
        self.app, self.key = app, api_key.encode()
        self.paths = KEYED_PATHS + (("/metrics",) if metrics else ())

    def _keyed(self, path: str) -> bool:
        return path == "/v1" or path.startswith("/v1/") or path.rstrip("/") in self.paths

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] != "OPTIONS" and self._keyed(
                scope["path"]):
            given = _bearer_token(scope.get("headers", []))
            if given is None or not hmac.compare_digest(given, self.key):
                err = proto.ApiError(401, "invalid or missing API key: send 'Authorization: "
                                     "Bearer KEY'", code="invalid_api_key")
                await error_response(err)(scope, receive, send)
                return
        await self.app(scope, receive, send)


# Bodies up to this size are parsed on the event loop (well under a millisecond); larger ones
# on the engine's tokenizer threads.
INLINE_JSON_BYTES = 64 * 2**10


def _parse_json(data: bytes) -> Any:
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise proto.bad(f"request body is not valid JSON: {e}") from None
    except RecursionError:
        raise proto.bad("request body is nested too deeply to parse") from None


def _parse_body(data: bytes, schema: type[BaseModel] | None,
                then: Callable[[dict[str, Any]], Any] | None = None) -> Any:
    """``data`` as a JSON object, checked against ``schema`` when given (ApiError 400 if not),
    or ``then`` of it."""
    body = _parse_json(data)
    if not isinstance(body, dict):
        raise proto.bad("request body must be a JSON object")
    if schema is not None:
        schemas.validate(schema, body)
    return body if then is None else then(body)


class Server:
    """The state behind the routes: the engine, the settings, the metrics."""

    def __init__(self, engine: AsyncEngine, config: EngineConfig, settings: Settings) -> None:
        self.engine, self.config, self.settings = engine, config, settings
        self.model_name = settings.served_model_name or config.model
        self.max_model_len = engine.engine.max_model_len
        self.tokenizer = engine.engine.tokenizer
        # the model's generation_config.json defaults (generation_config: auto), as vLLM
        self.sampling_defaults = dict(engine.engine.sampling_defaults)
        if self.sampling_defaults:
            logger.info("sampling defaults from the model's generation_config.json for "
                        "fields a request leaves unset: %s", self.sampling_defaults)
        self.metrics = Metrics(self.model_name, lambda: engine.core_stats,
                               vllm_names=settings.metrics_vllm_names)
        engine.add_stats_listener(self.metrics.on_core_stats)
        self.draining = False
        self.active: set[str] = set()  # engine request ids of running HTTP requests
        self._abort_task: asyncio.Task | None = None
        # the tool-call parser of tool_choice 'auto'
        self.tool_parser: ToolParser | None = None
        if settings.tool_call_parser is not None:
            cls = registry().tool_parser(settings.tool_call_parser)
            self.tool_parser = cls(self.tokenizer)
        self.completions = Completions(self)
        self._openapi = openapi_document(bool(settings.api_key))

    # ---- helpers ------------------------------------------------------------------------------

    def decode(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else ""

    def check_model_and_user(self, body: dict[str, Any]) -> None:
        """The request's ``model`` (optional) must be the served name: 400 if it is not a
        string, 404 if it names another model (with --served-model-name, the model's path is
        another name, as in vLLM). Also checks ``user`` (OpenAI's end-user id) is a string."""
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise proto.bad(f"model must be a string, got {model!r:.50}", "model")
        if model is not None and model != self.model_name:
            raise proto.ApiError(404, f"the model {model!r:.200} does not exist; this server "
                                 f"serves {self.model_name!r}", param="model",
                                 code="model_not_found")
        user = body.get("user")
        if user is not None and not isinstance(user, str):
            raise proto.bad(f"user must be a string, got {user!r:.50}", "user")

    async def read_json(self, request: Request, schema: type[BaseModel] | None = None,
                        then: Callable[[dict[str, Any]], Any] | None = None) -> Any:
        """The request body as a JSON object, checked against ``schema`` (schemas.py) when
        given; 413 past max_request_body_bytes, 400 if not a JSON object or not the schema's.
        With ``then``, returns ``then(body)`` instead: the parsing of the body's fields, which
        scales with it too, so it runs where the body was checked (a large body's: on a worker
        thread, off the event loop)."""
        limit = self.settings.max_request_body_bytes
        too_big = proto.ApiError(413, f"request body is larger than {limit} bytes "
                                 f"(max_request_body_bytes)", code="request_too_large")
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise too_big
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_big
            chunks.append(chunk)
        data = b"".join(chunks)
        # a large body is parsed and checked on a worker thread (validating 100k messages takes
        # seconds; the event loop serves the others meanwhile)
        if len(data) <= INLINE_JSON_BYTES:
            return _parse_body(data, schema, then)
        return await self.engine.run_off_loop(_parse_body, data, schema, then)

    def check_accepting(self) -> None:
        if self.draining:
            raise proto.ApiError(503, "the server is shutting down", type="service_unavailable",
                                 code="shutting_down")
        self.engine.check_health()

    # ---- routes -------------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        try:
            self.check_accepting()
        except (EngineDeadError, proto.ApiError):
            return Response(status_code=503)
        return Response(status_code=200)

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": pagebatch.__version__})

    async def models(self, request: Request) -> Response:
        card = {"id": self.model_name, "object": "model", "created": int(time.time()),
                "owned_by": "pagebatch", "root": self.config.model, "parent": None,
                "max_model_len": self.max_model_len}
        return JSONResponse({"object": "list", "data": [card]})

    async def openapi(self, request: Request) -> Response:
        return JSONResponse(self._openapi)

    async def metrics_endpoint(self, request: Request) -> Response:
        return Response(self.metrics.render(),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    async def tokenize(self, request: Request) -> Response:
        try:
            body, msgs = await self.read_json(request, schemas.TokenizeRequest,
                                              self._tokenize_body)
            if self.tokenizer is None:
                raise proto.bad("this model has no tokenizer (dummy weights)")
            if msgs is not None:
                ids = (await self.engine.chat_prompt(msgs, None, body.get("tools")))[
                    "prompt_token_ids"]
            else:
                prompt = body.get("prompt")
                if not isinstance(prompt, str):
                    raise proto.bad("prompt must be a string (or give messages)", "prompt")
                special = proto.flag(body, "add_special_tokens", True)
                ids = await self.engine.run_off_loop(
                    partial(tokenize_within, self.tokenizer, proto.check_text(prompt, "prompt"),
                            self.max_model_len, None, add_special_tokens=special))
        except Exception as e:
            return error_response(as_api_error(e))
        return JSONResponse({"tokens": ids, "count": len(ids),
                             "max_model_len": self.max_model_len})

    def _tokenize_body(self, body: dict[str, Any]) -> tuple[dict[str, Any], Any]:
        self.check_model_and_user(body)
        if "messages" in body and body.get("prompt") is not None:
            raise proto.bad("give prompt or messages, not both", "messages")
        msgs = (template_messages(proto._messages(body["messages"])) if "messages" in body
                else None)
        return body, msgs

    def _detokenize_ids(self, body: dict[str, Any]) -> list[int]:
        self.check_model_and_user(body)
        ids = body.get("tokens")
        vocab = self.engine.engine.vocab_size
        if isinstance(ids, list) and len(ids) > self.max_model_len:  # decoding holds the GIL
            raise proto.bad(f"tokens has {len(ids)} ids; at most max_model_len="
                            f"{self.max_model_len} are decoded", "tokens")
        if not isinstance(ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                for t in ids):
            raise proto.bad(f"tokens must be a list of token ids in [0, {vocab})", "tokens")
        return ids

    async def detokenize(self, request: Request) -> Response:
        try:
            ids = await self.read_json(request, schemas.DetokenizeRequest,
                                       self._detokenize_ids)
            if self.tokenizer is None:
                raise proto.bad("this model has no tokenizer (dummy weights)")
            text = await self.engine.run_off_loop(self.tokenizer.decode, ids)
        except Exception as e:
            return error_response(as_api_error(e))
        return JSONResponse({"prompt": text})

    # ---- running requests ---------------------------------------------------------------------

    async def start(self, prompts: list[dict[str, Any]], params: SamplingParams,
                    priority: int, prefix: str) -> tuple[list[str], list[AsyncIterator]]:
        """Queue one request per prompt (ids ``prefix-i``). If one is rejected, the ones
        queued before it are aborted and its error raised: nothing is left running."""
        rids, streams = [], []
        try:
            for i, p in enumerate(prompts):
                rid = f"{prefix}-{i}"
                streams.append(await self.engine.add_request(p, params, rid, priority))
                rids.append(rid)
                self.active.add(rid)
        except BaseException:
            await self.abort(rids)
            raise
        return rids, streams

    async def abort(self, rids: list[str]) -> None:
        for rid in rids:  # finished and unknown ids are ignored
            self.active.discard(rid)
            await self.engine.abort(rid)

    def abort_all(self) -> None:
        """Abort every running request (shutdown_timeout passed): each stream ends with finish
        reason ``abort``, then ``[DONE]``. Call on the event loop."""
        if self.active:
            logger.warning("shutdown_timeout (%gs) passed: aborting %d running requests",
                           self.settings.shutdown_timeout, len(self.active))
            self._abort_task = asyncio.ensure_future(self.abort(list(self.active)))


def build_app(engine: AsyncEngine, config: EngineConfig,
              settings: Settings | None = None) -> Starlette:
    """The ASGI app over a running ``engine`` (which the caller owns and shuts down)."""
    settings = settings or Settings.from_config(config)
    server = Server(engine, config, settings)
    c = server.completions
    routes = [
        Route("/v1/completions", c.completions, methods=["POST"]),
        Route("/v1/chat/completions", c.chat, methods=["POST"]),
        Route("/v1/models", server.models, methods=["GET"]),
        Route("/health", server.health, methods=["GET"]),
        Route("/version", server.version, methods=["GET"]),
        Route("/metrics", server.metrics_endpoint, methods=["GET"]),
        Route("/openapi.json", server.openapi, methods=["GET"]),
        Route("/tokenize", server.tokenize, methods=["POST"]),
        Route("/detokenize", server.detokenize, methods=["POST"]),
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: _http_error})
    app.state.server = server
    if settings.api_key:
        app.add_middleware(_ApiKeyMiddleware, api_key=settings.api_key,
                           metrics=settings.metrics_require_api_key)
    if settings.allowed_origins:
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=settings.allowed_origins,
                           allow_methods=["*"], allow_headers=["*"])
    return app


# After the aborts at shutdown_timeout, the seconds left for the aborted responses to be sent
# before uvicorn cancels what still runs (a backstop: aborts answer within an engine step).
ABORT_GRACE_S = 5.0
# After the engine core dies, the seconds the server stays up answering 503 (running streams get
# their error event, a probe sees /health 503) before it shuts itself down with exit status 1.
ENGINE_DEAD_GRACE_S = 5.0


def serve(config: EngineConfig) -> int:
    """``pagebatch serve``: start the engine core process, then serve until SIGINT/SIGTERM.
    On SIGTERM the server stops accepting (/health and new requests answer 503, then the
    listening socket closes), running requests get ``shutdown_timeout`` seconds to finish, the
    rest are aborted (their streams end with finish reason ``abort`` and ``[DONE]``), the engine
    core process is stopped, and the process exits with status 0. When the engine core dies
    (its process exits, or a parallel worker does) the server answers 503 for
    ``ENGINE_DEAD_GRACE_S`` seconds, then shuts down and returns 1, so that a supervisor
    (Kubernetes) restarts it, as vLLM's API server does."""
    import uvicorn

    settings = Settings.from_config(config)
    engine = AsyncEngine.from_config(config, multiprocess=True)
    try:
        app = build_app(engine, config, settings)
        level = logging.getLevelName(logging.getLogger().getEffectiveLevel()).lower()
        loop, http = uvicorn_implementations()
        server = draining_server(app.state.server, uvicorn.Config(
            app, host=settings.host, port=settings.port, log_level=level,  # --log-level
            loop=loop, http=http,
            timeout_graceful_shutdown=settings.shutdown_timeout + ABORT_GRACE_S))
        logger.info("serving %s on http://%s:%d (max_num_seqs=%d, max_mixed_prefill_tokens=%d, "
                    "piecewise_cuda_graph_max_tokens=%d; uvicorn on %s, %s)",
                    app.state.server.model_name, settings.host, settings.port,
                    config.max_num_seqs, config.max_mixed_prefill_tokens,
                    config.piecewise_cuda_graph_max_tokens, loop, http)
        # start-up's objects (torch, transformers, the tokenizer, the app: ~310k) never scanned
        # again: a full collection of them takes 140-180 ms on the CPU machine
        # (scripts/frontend_gc_cost.py), a stall of every stream at once; the engine core
        # process freezes its own (engine_core.py)
        gc.collect()
        gc.freeze()
        server.run()
        failure = engine_failure(engine)  # before our own shutdown marks the engine dead
    finally:
        engine.shutdown()
    if failure is not None:
        logger.error("pagebatch serve exits with status 1: the engine core died (%s)", failure)
        return 1
    return 0


def uvicorn_implementations() -> tuple[str, str]:
    """uvicorn's event loop and HTTP/1.1 implementation for `serve`: ``uvloop`` and
    ``httptools`` where installed (the package depends on both; they are what
    ``uvicorn[standard]`` adds and what vLLM's server runs), else ``asyncio`` and ``h11``. With
    both, the front half spends ~8 % less CPU per streamed token (scripts/frontend_cost.sh:
    58.6-58.9 against 63.5-63.8 us on the CPU machine; docs/benchmarks.md, "Session 46")."""
    import importlib.util

    loop = "uvloop" if importlib.util.find_spec("uvloop") is not None else "asyncio"
    http = "httptools" if importlib.util.find_spec("httptools") is not None else "h11"
    return loop, http


def engine_failure(engine: AsyncEngine) -> EngineDeadError | None:
    """The engine's `EngineDeadError` once its core is gone, else None."""
    try:
        engine.check_health()
    except EngineDeadError as e:
        return e
    return None


def draining_server(state: Server, config: Any) -> Any:
    """A uvicorn Server that drains: on a shutdown signal the app answers 503 (``draining``),
    uvicorn stops listening and waits for running responses; at ``shutdown_timeout`` the
    requests still running are aborted, so their clients get a last chunk with finish reason
    ``abort`` (or a 200 body saying so) instead of a cut connection. It also watches the engine
    (every 0.1 s, uvicorn's tick): ``ENGINE_DEAD_GRACE_S`` after the core died it shuts down,
    waiting at most that long again for the connections left."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        dead_since: float | None = None  # time.monotonic() when the engine was seen dead

        async def on_tick(self, counter: int) -> bool:
            if self.dead_since is None:
                failure = engine_failure(state.engine)
                if failure is not None:
                    self.dead_since = time.monotonic()
                    logger.error("the engine core died (%s); /health and new requests answer "
                                 "503, the server shuts down in %gs (exit status 1)", failure,
                                 ENGINE_DEAD_GRACE_S)
            elif time.monotonic() - self.dead_since >= ENGINE_DEAD_GRACE_S:
                self.should_exit = True
            return await super().on_tick(counter)

        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            threshold = slow_step_threshold_s()  # PAGEBATCH_SLOW_STEP_MS: core/stall_log.py
            if threshold is not None:
                self.loop_watch = watch_event_loop(threshold)

        def handle_exit(self, sig: int, frame: Any) -> None:
            state.draining = True
            super().handle_exit(sig, frame)
            # uvicorn re-raises captured signals once it has shut down, which would kill
            # the process (status -15) before `serve` stops the engine core; a drained
            # shutdown is a clean exit (status 0) instead.
            self._captured_signals.clear()

        async def shutdown(self, sockets: Any = None) -> None:
            state.draining = True
            if self.dead_since is not None:  # the streams have had their error events
                self.config.timeout_graceful_shutdown = ENGINE_DEAD_GRACE_S
            timer = asyncio.get_running_loop().call_later(state.settings.shutdown_timeout,
                                                          state.abort_all)
            try:
                await super().shutdown(sockets)
            finally:
                timer.cancel()

    return DrainingServer(config)
