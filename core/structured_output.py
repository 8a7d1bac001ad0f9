"""Structured output: constrain a request's tokens to a JSON schema, any JSON object, a regex,
a choice of strings or an EBNF grammar (vLLM's ``StructuredOutputsParams``).

The interface plugins implement is `StructuredOutputBackend` (registered through the
``register_structured_output_backends`` hook; the built-in is ``xgrammar``,
plugins/structured_output/xgrammar_backend.py). A backend compiles a `Constraint` once (the
engine core caches compiled constraints by their key) and makes a `GrammarMatcher` per request,
which the core advances with each accepted token and asks for the next token bitmask.

The token bitmask is xgrammar's layout: int32 [rows, ceil(vocab / 32)], bit ``t % 32`` of word
``t // 32`` set when token ``t`` may come next. The engine core fills one row per constrained
request that samples in a step, after scheduling and before the step is launched, into one
buffer of ``max_num_seqs`` rows kept for the engine's life (rows are overwritten whole, never
cleared), and sends the filled rows to the runner in the `SchedulerOutput`
(`StructuredOutputBatch`, with each row's logits row); the runner masks those rows' logits
(core/sampler.py's `apply_token_bitmask`) before the sampler. Steps without a constrained row
carry None and do no extra work; the host never scans a bitmask, except to explain a request
that failed. A request's constraint is parsed once (`StructuredOutputsParams.constraint`,
memoized, travels with the params to the core's process) and compiled once per distinct one.

Compiling off the step loop: a constraint's compile time grows faster than its size (a
3,000-property JSON schema takes 27-33 s in xgrammar on a 2-core CPU, a 50,000-property one
far longer: scripts/bench_grammar_compile.py), so the core never compiles on its own thread.
`StructuredOutputManager.compile` hands a constraint not yet compiled to the manager's compile
threads (daemon threads: xgrammar releases the GIL while it compiles, and a compile that never ends
cannot hold the process at exit; they run at a lower CPU priority than the step loop) and returns a
future; the engine core keeps the request out of the scheduler until the future is done (vLLM's
``WAITING_FOR_FSM``), stepping every other request meanwhile, and ends it with an error naming its
field when the compile fails or outlasts ``structured_outputs_compile_timeout``
(core/engine_core.py). A thread still compiling past the timeout keeps running (a C++ compile cannot
be stopped); later constraints queue behind at most `COMPILE_THREADS` such compiles.

Overlap (async scheduling): a step's bitmask needs every earlier token of its requests accepted
by their matchers. With a step in flight, the engine core launches the next step's forward
first (`Executor.start_forward`), then takes the step in flight's tokens and advances the
matchers, then fills the new step's bitmask and samples it (`PendingForward.finish`): the
host's matcher and bitmask work runs while the GPU runs the forward (as vLLM's async
scheduling with structured outputs does: its model runner samples after the grammar bitmask
arrives). Executors that cannot defer sampling (tensor / pipeline parallel) run constrained
steps one at a time (`EngineCore.step`).
"""

from __future__ import annotations

import json
import os
import queue
import threading
from abc import ABC, abstractmethod
from concurrent.futures import Future
from dataclasses import dataclass, field
from dataclasses import field as dc_field
from typing import Any, Iterable, Protocol

import numpy as np

from .errors import RequestFailedError, SamplingParamsError


KINDS = ("json", "json_object", "regex", "choice", "grammar")
COMPILE_NICENESS = 10  # added to the compile threads' nice value


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One constraint on a request's output (set exactly one field). vLLM's names.

    json: a JSON schema (a dict, or its JSON text). json_object: any JSON object. regex: a
    regular expression the whole output matches. choice: the output is one of these strings.
    grammar: an EBNF grammar (xgrammar's / GBNF dialect, root rule ``root``).
    origin: the request field it came from, for error messages (default
    ``structured_outputs.<field>``; the HTTP frontend sets e.g. ``guided_json``).
    Raises SamplingParamsError naming the field from ``validate``.
    """

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    origin: str | None = field(default=None, compare=False)

    def validate(self) -> None:
        set_ = [k for k in KINDS if (getattr(self, k) not in (None, False))]
        if len(set_) != 1:
            name = self.origin or "structured_outputs"
            raise SamplingParamsError(
                f"{name} must set exactly one of {list(KINDS)}, got {set_ or 'none'}", name)
        self.constraint()  # raises for a malformed value

    def constraint(self) -> "Constraint":
        """The canonical `Constraint` (hashable: the compile cache key), parsed on the first
        call and kept on the params (they are frozen), so that validating, the front half's
        compile check and the engine core (the params are pickled with it) share one parse.
        Raises SamplingParamsError for a value of the wrong shape (not for what only compiling
        can tell: `StructuredOutputBackend.validate`)."""
        c = self.__dict__.get("_constraint")
        if c is None:
            c = self._parse()
            object.__setattr__(self, "_constraint", c)  # not a field: eq, hash, repr ignore it
        return c

    def _parse(self) -> "Constraint":
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as e:
                    raise self._bad("json", f"is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise self._bad("json", "must be a JSON schema (an object)")
            # key order kept: a backend generates an object's properties in schema order
            return Constraint("json", json.dumps(schema), self._field("json"))
        if self.json_object:
            return Constraint("json_object", "", self._field("json_object"))
        if self.regex is not None:
            if not isinstance(self.regex, str) or not self.regex:
                raise self._bad("regex", "must be a non-empty string")
            return Constraint("regex", self.regex, self._field("regex"))
        if self.choice is not None:
            c = self.choice
            if not isinstance(c, (list, tuple)) or not c or not all(
                    isinstance(s, str) and s for s in c):
                raise self._bad("choice", "must be a non-empty list of non-empty strings")
            return Constraint("choice", json.dumps(list(c)), self._field("choice"))
        if not isinstance(self.grammar, str) or not self.grammar.strip():
            raise self._bad("grammar", "must be a non-empty EBNF string")
        return Constraint("grammar", self.grammar, self._field("grammar"))

    def _field(self, kind: str) -> str:
        return self.origin or f"structured_outputs.{kind}"

    def _bad(self, kind: str, why: str) -> SamplingParamsError:
        return SamplingParamsError(f"{self._field(kind)} {why}", self._field(kind))


@dataclass(frozen=True)
class Constraint:
    """A constraint in canonical form: ``kind`` one of `KINDS`; ``spec`` the schema as JSON
    text (in its own key order, which is the order of generated properties), the regex, the
    choices as a JSON list, the grammar ('' for json_object). Hashable: (kind, spec) is the
    compile cache key."""

    kind: str
    spec: str
    field: str = dc_field(default="", compare=False)  # the request field, for error messages


class GrammarMatcher(Protocol):
    """A request's position in its compiled constraint (one per request)."""

    def accept_token(self, token_id: int) -> bool:
        """Advance by one token; False (state unchanged) when the constraint forbids it."""

    def fill_next_token_bitmask(self, bitmask: np.ndarray, index: int) -> None:
        """Write row ``index`` of ``bitmask`` (int32 [rows, ceil(vocab / 32)]): the tokens
        allowed next. Every word of the row is written (the core reuses one buffer across
        steps: the row holds another request's mask before)."""

    def is_terminated(self) -> bool:
        """Whether the constraint is complete and its stop token was accepted."""


class StructuredOutputBackend(ABC):
    """Compiles constraints and makes matchers; one per engine core.

    ``__init__(tokenizer, vocab_size, stop_token_ids)``: the Hugging Face tokenizer, the
    model's vocabulary size (the logits' width, which may exceed the tokenizer's) and the ids
    that end a request (EOS). Raises what the library raises for an unusable tokenizer.
    """

    @abstractmethod
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None: ...

    @classmethod
    @abstractmethod
    def validate(cls, constraint: Constraint) -> None:
        """Check that ``constraint`` compiles, without a tokenizer (the front half calls this
        before anything is queued). Raises SamplingParamsError naming ``constraint.field``."""

    @abstractmethod
    def compile(self, constraint: Constraint) -> Any:
        """Compile once (the engine core caches the result by ``constraint``); raises
        SamplingParamsError naming ``constraint.field``."""

    @abstractmethod
    def matcher(self, compiled: Any) -> GrammarMatcher:
        """A fresh matcher at the start of ``compiled``."""


@dataclass
class StructuredOutputBatch:
    """A step's constrained sampled rows (engine core -> runner, in the SchedulerOutput).

    request_ids: the constrained requests that sample in the step; bitmask: int32 [len, ceil(
    vocab / 32)], row i for request_ids[i] (xgrammar's layout; from the manager, a view of its
    buffer, valid until its next `StructuredOutputManager.batch`). rows: row i's index among
    the step's sampling rows in batch order (the runner's logits rows), or None (then the
    runner finds them by id)."""

    request_ids: list[str]
    bitmask: np.ndarray
    rows: list[int] | None = None


def bitmask_width(vocab_size: int) -> int:
    return -(-vocab_size // 32)


@dataclass
class TrackedRequest:
    """The core's one record of a constrained request: its matcher and its constraint."""

    matcher: GrammarMatcher
    constraint: Constraint


class StructuredOutputManager:
    """The engine core's structured output state: the backend (made on first use, with the
    model's tokenizer, on a compile thread), compiled constraints by key, a matcher per
    constrained request, and the bitmask buffer the steps' rows are filled into.

    ``make_backend()`` -> a `StructuredOutputBackend` (the core binds the configured plugin,
    the tokenizer and the vocabulary). ``max_num_seqs``: rows of the bitmask buffer (made at
    the first constrained step; a step with more constrained rows grows it)."""

    MAX_CACHED = 256  # compiled constraints kept (oldest dropped first)
    COMPILE_THREADS = 2  # constraints compiled at once (each xgrammar compile uses 2 threads)

    def __init__(self, make_backend, vocab_size: int, max_num_seqs: int = 1) -> None:
        self._make_backend = make_backend
        self._backend: StructuredOutputBackend | None = None
        self._backend_lock = threading.Lock()
        self.vocab_size = vocab_size
        self.max_num_seqs = max_num_seqs
        self._compiled: dict[Constraint, Any] = {}
        self._compiling: dict[Constraint, Future] = {}  # submitted, not yet taken by `start`
        self._jobs: queue.SimpleQueue[tuple[Constraint, Future]] | None = None
        self._requests: dict[str, TrackedRequest] = {}
        # request id -> the error its matcher raised
        self._faults: dict[str, RequestFailedError] = {}
        self._bitmask: np.ndarray | None = None  # int32 [rows, bitmask_width(vocab_size)]
        self.num_compiles = 0  # for tests: distinct constraints compiled

    @property
    def has_requests(self) -> bool:
        return bool(self._requests)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def add_request(self, request_id: str, params: StructuredOutputsParams) -> None:
        """Compile (or reuse) the request's constraint, waiting for it, and start its matcher
        (`start` then `track`). Raises SamplingParamsError naming the field."""
        self.track(request_id, self.start(params))

    def compile(self, params: StructuredOutputsParams) -> Future:
        """A future of the params' compiled constraint: done at once when it is cached, else
        compiled on a compile thread (one compile per distinct constraint, however many
        requests wait on it). The future's ``result()`` raises SamplingParamsError naming the
        field when the constraint cannot be compiled. Call from the core's thread."""
        c = params.constraint()
        compiled = self._compiled.get(c)
        if compiled is not None:
            done: Future = Future()
            done.set_result(compiled)
            return done
        fut = self._compiling.get(c)
        if fut is None:
            fut = self._compiling[c] = Future()
            self._submit(c, fut)
        return fut

    def start(self, params: StructuredOutputsParams, compiled: Future | None = None
              ) -> TrackedRequest:
        """A matcher at the start of the params' constraint, from ``compiled`` (the future
        `compile` returned for it) or a new `compile`, waiting for it if it is not done;
        nothing is tracked yet (`track`). Raises what the future raises: SamplingParamsError
        naming the field."""
        c = params.constraint()
        fut = compiled if compiled is not None else self.compile(params)
        try:
            grammar = fut.result()
        finally:
            if self._compiling.get(c) is fut:  # taken: cached below, or failed for good
                del self._compiling[c]
        if c not in self._compiled:
            self.num_compiles += 1
            if len(self._compiled) >= self.MAX_CACHED:
                self._compiled.pop(next(iter(self._compiled)))
            self._compiled[c] = grammar
        return TrackedRequest(self._backend.matcher(grammar), c)

    def _submit(self, c: Constraint, fut: Future) -> None:
        if self._jobs is None:
            self._jobs = queue.SimpleQueue()
            for i in range(self.COMPILE_THREADS):
                threading.Thread(target=self._compile_loop, args=(self._jobs,), daemon=True,
                                 name=f"pagebatch-grammar-{i}").start()
        self._jobs.put((c, fut))

    def _compile_loop(self, jobs: queue.SimpleQueue) -> None:
        try:  # below the step loop's priority (Linux: per thread, inherited by the threads
            # xgrammar starts from here), so that a long compile never slows the steps
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), COMPILE_NICENESS)
        except (AttributeError, OSError):  # not Linux / not permitted: normal priority
            pass
        while True:  # a daemon thread: it ends with the process
            c, fut = jobs.get()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                with self._backend_lock:
                    if self._backend is None:
                        self._backend = self._make_backend()
                fut.set_result(self._backend.compile(c))
            except BaseException as e:  # the waiting requests end with it; the thread goes on
                fut.set_exception(e)

    def track(self, request_id: str, tracked: TrackedRequest) -> None:
        """Constrain ``request_id`` by ``tracked`` (from `start`) from its next step on."""
        self._requests[request_id] = tracked

    def remove(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self._requests.pop(rid, None)
            self._faults.pop(rid, None)

    def batch(self, sampled_ids: list[str]) -> StructuredOutputBatch | None:
        """The bitmask of the constrained requests among ``sampled_ids`` (the step's rows that
        sample, in batch order), or None when there are none. Only those rows are filled, in
        the manager's buffer: the batch's bitmask is valid until the next call."""
        reqs = self._requests
        rows = [i for i, rid in enumerate(sampled_ids) if rid in reqs]
        if not rows:
            return None
        n = len(rows)
        buf = self._bitmask
        if buf is None or len(buf) < n:
            buf = self._bitmask = np.empty((max(n, self.max_num_seqs),
                                            bitmask_width(self.vocab_size)), dtype=np.int32)
        ids = [sampled_ids[i] for i in rows]
        for i, rid in enumerate(ids):
            try:
                reqs[rid].matcher.fill_next_token_bitmask(buf, i)
            except Exception as e:  # the backend failed this request alone: it ends with
                buf[i] = -1  # an error when its token is accepted; the step goes on
                self._faults[rid] = self._fault(reqs[rid], e)
        return StructuredOutputBatch(ids, buf[:n], rows)

    @staticmethod
    def _fault(t: "TrackedRequest", e: Exception) -> RequestFailedError:
        return RequestFailedError(f"{t.constraint.field}: the structured output backend failed: "
                                  f"{type(e).__name__}: {e}")

    def accept(self, request_id: str, token_id: int
               ) -> SamplingParamsError | RequestFailedError | None:
        """Advance the request's matcher; None when the token is allowed (or the request is not
        constrained), else the error that ends the request (returned, not raised): a
        SamplingParamsError whose ``param`` is the constraint's request field (an HTTP 400) when
        the constraint cannot be met, a RequestFailedError when the backend raised."""
        t = self._requests.get(request_id)
        if t is None:
            return None
        fault = self._faults.pop(request_id, None)
        if fault is not None:
            return fault
        try:
            if t.matcher.accept_token(token_id):
                return None
        except Exception as e:
            return self._fault(t, e)
        # only now is a bitmask read on the host: the matcher did not move (it rejected the
        # token), so its mask now is the one this step sampled under
        row = np.empty((1, bitmask_width(self.vocab_size)), dtype=np.int32)
        t.matcher.fill_next_token_bitmask(row, 0)
        if not row.any():
            why = "no token can continue it"
        else:  # e.g. only EOS continues it, and min_tokens masks EOS out
            why = (f"token {token_id} was sampled, which it forbids (every token it allows was "
                   f"masked out, e.g. by min_tokens or logit_bias)")
        return SamplingParamsError(f"{t.constraint.field}: the constraint cannot be met: {why}",
                                   t.constraint.field or None)
