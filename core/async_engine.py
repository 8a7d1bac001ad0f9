"""`AsyncEngine`: the asyncio front half that serving frontends call.

    engine = AsyncEngine.from_config(config)                  # the core in its own process
    stream = await engine.add_request("Hello", SamplingParams(max_tokens=32))
    async for out in stream:                                   # one RequestOutput per step
        print(out.outputs[0].text)
    engine.shutdown()

It is an `LLMEngine` (validation, tokenization and output processing: core/engine.py) over a
client of the core (core/core_client.py), plus an output thread that steps the client and routes
each `RequestOutput` to its request's asyncio queue, on the event loop that added the request.
A lock keeps the front half's state to one thread at a time. Per-request failures end only
that request's stream; when the core dies, every open stream and every later call raises
`EngineDeadError`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from .config import EngineConfig
from .core_client import client_factory
from .engine import LLMEngine, PromptType
from .engine_core import EngineCoreStats
from .errors import EngineDeadError
from .registry import Registry
from .request import RequestOutput, SamplingParams
from .stall_log import NullClock, TurnClock, turn_clock
from .structured_output import StructuredOutputsParams

logger = logging.getLogger(__name__)

_STEP_WAIT_S = 0.2  # the output thread's longest wait for the core, between shutdown checks
# Threads that tokenize and apply chat templates, off the event loop (work that scales with the
# input); bounded, so that many large bodies queue here instead of taking every core.
TOKENIZER_THREADS = 2
# Text up to this many characters (a conversation: in all, in at most INLINE_MESSAGES messages,
# without tools) is tokenized on the event loop (well under a millisecond), so that small
# requests never queue behind large ones on the tokenizer threads.
INLINE_CHARS = 2048
INLINE_MESSAGES = 16


def _small_chat(messages: Any, tools: Any) -> bool:
    if tools or not isinstance(messages, list) or len(messages) > INLINE_MESSAGES:
        return False
    total = 0
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if content is not None and not isinstance(content, str):
            return False
        total += len(content or "") + sum(len(str(v)) for k, v in m.items() if k != "content")
    return total <= INLINE_CHARS


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for queue, out in items:
        queue.put_nowait(out)


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]


class AsyncEngine:
    """Concurrent requests over one engine core; see the module docstring.

    ``engine.core`` must be a client (core/core_client.py): the output thread steps it.
    """

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._lock = threading.Lock()
        self._streams: dict[str, _Stream] = {}
        self._dead: EngineDeadError | None = None
        self._stopping = threading.Event()
        self._stats_listeners: list[Callable[[EngineCoreStats], None]] = []
        self._tokenizer_pool = ThreadPoolExecutor(TOKENIZER_THREADS,
                                                  thread_name_prefix="pagebatch-tokenize")
        self._thread = threading.Thread(target=self._output_loop, name="pagebatch-output",
                                        daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig, multiprocess: bool = True,
                    registry: Registry | None = None) -> "AsyncEngine":
        """Build the front half here and the core in its own process (``multiprocess``, for
        serving) or on this engine's output thread. Raises the core's startup errors with
        their own types (ModelNotFoundError, ConfigError, CacheTooSmallError, ...)."""
        return cls(LLMEngine(config, registry, core=client_factory(multiprocess)))

    # ---- requests -----------------------------------------------------------------------------

    async def add_request(self, prompt: PromptType, params: SamplingParams | None = None,
                          request_id: str | None = None,
                          priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Validate and queue one request; returns an async iterator of its `RequestOutput`s
        (one per step with new tokens, or the newest of several when the caller fell behind;
        the last has ``finished``, and on a core failure ``error`` and finish reason
        ``error``).

        Raises InvalidRequestError subclasses before anything is queued, EngineDeadError when
        the core is gone. Leaving the iteration early (break, cancellation) aborts the request.
        """
        loop = asyncio.get_running_loop()
        self.check_health()
        prompt = await self._tokenized(prompt, params)
        so = getattr(params, "structured_outputs", None)
        if isinstance(so, StructuredOutputsParams) and len(so.constraint().spec) > INLINE_CHARS:
            await self.run_off_loop(self.engine.check_constraint, so)  # remembered: `prepare`
        with self._lock:
            self.check_health()
            core_req, state = self.engine.prepare(prompt, params, request_id, priority)
            rid = core_req.request_id
            stream = _Stream(loop, asyncio.Queue())
            self._streams[rid] = stream
            try:
                self.engine.submit(core_req, state)
            except BaseException:
                del self._streams[rid]
                raise
        return self._iterate(rid, stream.queue)

    async def _tokenized(self, prompt: PromptType, params: SamplingParams | None) -> PromptType:
        """A text prompt as ``{"prompt", "prompt_token_ids"}`` (plus its other keys),
        tokenized on a worker thread; other prompts unchanged."""
        text = prompt if isinstance(prompt, str) else (
            prompt.get("prompt") if isinstance(prompt, dict)
            and "prompt_token_ids" not in prompt else None)
        if not isinstance(text, str):
            return prompt
        max_tokens = params.max_tokens if params is not None else None
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
            max_tokens = None  # validate() words a bad value, under the lock
        ids = (self.engine.tokenize_text(text, max_tokens) if len(text) <= INLINE_CHARS
               else await self.run_off_loop(self.engine.tokenize_text, text, max_tokens))
        rest = prompt if isinstance(prompt, dict) else {}
        return {**rest, "prompt": text, "prompt_token_ids": ids}

    async def chat_prompt(self, messages: list[dict[str, Any]], max_tokens: int | None = None,
                          tools: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """`LLMEngine.chat_prompt` (the chat template, then tokenization) on a worker thread
        (a small conversation: here, see INLINE_CHARS)."""
        if _small_chat(messages, tools):
            return self.engine.chat_prompt(messages, max_tokens, tools)
        return await self.run_off_loop(self.engine.chat_prompt, messages, max_tokens, tools)

    async def run_off_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on the tokenizer threads (TOKENIZER_THREADS): for work on user input
        that scales with it (tokenizing, templating, decoding), which must not stall the event
        loop and every other client with it."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, fn, *args)

    async def _iterate(self, rid: str, queue: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        """The request's outputs as they come; when the caller fell behind (several queued),
        only the newest, which holds all the others do (outputs are cumulative: text, token
        ids and log-probs of every sample so far), as vLLM's output collector merges them. So
        a caller that cannot keep up with the steps (one busy event loop under many streams)
        sends one event for two steps instead of two back to back, and catches up."""
        finished = False
        error: BaseException | None = None
        try:
            while not finished:
                item = error if error is not None else await queue.get()
                while not isinstance(item, BaseException) and not item.finished \
                        and not queue.empty():
                    newer = queue.get_nowait()
                    if isinstance(newer, BaseException):
                        error = newer  # raised after the output before it
                        break
                    item = newer
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:  # the caller stopped listening: free the request's blocks
                self._abort(rid)

    async def abort(self, request_id: str) -> None:
        """Abort a request: its stream ends with finish reason ``abort`` and the core frees its
        KV cache blocks. Unknown and finished ids are ignored."""
        self._abort(request_id)

    def _abort(self, rid: str) -> None:
        with self._lock:
            if self._dead is not None or rid not in self._streams:
                return
            try:
                outputs = self.engine.abort_request([rid])  # a client answers through step
            except EngineDeadError:
                return  # the output thread fails every stream
            self._deliver(outputs)

    def add_stats_listener(self, listener: Callable[[EngineCoreStats], None]) -> None:
        """Call ``listener(stats)`` on the output thread with each new `EngineCoreStats` of the
        core, once per snapshot (e.g. a metrics exporter; keep it short)."""
        self._stats_listeners.append(listener)

    @property
    def core_stats(self) -> EngineCoreStats | None:
        """The core's latest `EngineCoreStats` (None before its first outputs)."""
        return self.engine.core.stats()

    def check_health(self) -> None:
        """Raises EngineDeadError when the core is gone or the engine was shut down."""
        if self._dead is not None:
            raise EngineDeadError(str(self._dead))

    # ---- the output thread --------------------------------------------------------------------

    def _output_loop(self) -> None:
        clock = turn_clock()  # PAGEBATCH_SLOW_STEP_MS (core/stall_log.py)
        try:
            self._output_turns(clock)
        finally:
            clock.close()

    def _output_turns(self, clock: TurnClock | NullClock) -> None:
        core = self.engine.core
        reported = None
        while not self._stopping.is_set():
            try:
                outputs = core.step(timeout=_STEP_WAIT_S)
                clock.start()  # the wait for the core is not this thread's time
                if outputs:
                    with self._lock:
                        clock.mark("lock")
                        processed = self.engine.process_outputs(outputs)
                        clock.mark("detokenize")
                        self._deliver(processed)
                        clock.mark("deliver")
                stats = core.stats()
                if stats is not reported:  # a new snapshot, with or without outputs
                    reported = stats
                    self._report_stats(reported)
                clock.mark("stats")
                if clock.slow:
                    clock.note(f"{len(outputs)} outputs")
                    logger.warning("slow output thread turn: %s", clock.describe())
            except EngineDeadError as e:
                self._fail_all(e)
                return
            except Exception as e:  # a bug here would leave every caller waiting forever
                logger.exception("the engine's output loop failed")
                self._fail_all(EngineDeadError(f"the engine's output loop failed: "
                                               f"{type(e).__name__}: {e}"))
                return

    def _report_stats(self, stats: EngineCoreStats | None) -> None:
        for listener in self._stats_listeners if stats is not None else ():
            try:
                listener(stats)
            except Exception:  # a broken exporter must not stop the engine
                logger.exception("a stats listener raised; ignored")

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Hand each output to its stream (call with the lock held): one wake-up of each event
        loop per call, not one per output (each ``call_soon_threadsafe`` writes to the loop's
        self-pipe: at 256 streams that was ~11 % of the serving process's busy time)."""
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            batches.setdefault(stream.loop, []).append((stream.queue, out))
        for loop, items in batches.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # its event loop is closed: nobody is listening
                pass

    def _fail_all(self, error: EngineDeadError) -> None:
        with self._lock:
            if self._dead is None:
                self._dead = error
            streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            try:
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait,
                                                 EngineDeadError(str(error)))
            except RuntimeError:
                pass

    # ---- lifecycle ----------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop the output thread and the core (its process too). Open streams raise
        EngineDeadError. Idempotent."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)
        self._thread.join(timeout=30)
        self.engine.shutdown()
        self._fail_all(EngineDeadError("the engine was shut down"))

    def __enter__(self) -> "AsyncEngine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    async def __aenter__(self) -> "AsyncEngine":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await asyncio.to_thread(self.shutdown)  # joins threads and a process: off the loop
