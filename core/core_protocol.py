"""`EngineCoreClient`: the one interface the front half (`LLMEngine`, core/engine.py) calls its
engine core by, whichever side of the boundary the core runs on.

Three classes satisfy it: an `EngineCore` used directly (core/engine_core.py: ``LLM`` and the
tests; the caller's own thread runs each step), and the clients of core/core_client.py,
`InprocClient` (the core stepped on whichever thread calls ``step``) and `MPClient` (the core in
a process of its own). Only plain data crosses it: `EngineCoreRequest` in, `EngineCoreOutput`
and `EngineCoreStats` out (core/engine_core.py).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from .engine_core import EngineCoreOutput, EngineCoreRequest, EngineCoreStats

__all__ = ["EngineCoreClient"]


@runtime_checkable
class EngineCoreClient(Protocol):
    """An engine core, or the front half's handle on one. A client's ``step`` may run on one
    thread while others call ``add_request`` / ``abort_requests`` (`AsyncEngine` does); an
    `EngineCore` is used by one thread at a time. Once a client's core is gone every call
    raises EngineDeadError."""

    def add_request(self, request: EngineCoreRequest, /) -> None:
        """Queue a request the front half validated. Raises ValueError when its id is in use
        (a client's core answers that with an output of finish reason ``error`` instead)."""

    def abort_requests(self, request_ids: list[str]) -> list[EngineCoreOutput]:
        """Abort requests (unknown and finished ids are ignored) and free their KV cache
        blocks. Returns the outputs known now, finish reason ``abort``: an `EngineCore`'s for
        each request it still had; a client's always [], its core's answers coming out of a
        later ``step``. Callers handle both, e.g. by processing what it returns like a step's
        outputs."""

    def step(self, timeout: float | None = None) -> list[EngineCoreOutput]:
        """The outputs of the core's next turn (new token ids, finish reasons, errors; [] when
        a turn produced none). ``timeout``: seconds a client waits for its core's turn when
        nothing has arrived yet (None: until something does), then []. An `EngineCore`
        runs its turn in the call and has nothing to wait for: it takes no notice of it."""

    @property
    def has_unfinished_requests(self) -> bool:
        """Whether ``step`` has more to return: a request added is not finished in an output
        returned yet (for an `EngineCore`, also: a step still in flight)."""

    def stats(self) -> EngineCoreStats | None:
        """The core's `EngineCoreStats` after its latest turn; None before a client's first.
        A snapshot's per-request times are those recorded since the previous snapshot, so a
        reader counts each snapshot once: an `EngineCore` makes a new one per call, a client
        returns the same object until its core's next turn arrives."""

    def shutdown(self) -> None:
        """Stop the core (a client's process too) and free its resources; requests still open
        are dropped. Idempotent for clients."""
