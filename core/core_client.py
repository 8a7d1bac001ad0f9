"""Clients of the engine core: the front half's handle on an `EngineCore` that runs on another
thread of this process (`InprocClient`) or in a process of its own (`MPClient`).

Both implement `EngineCoreClient` (core/core_protocol.py), the interface `LLMEngine` calls its
``core`` by, as an `EngineCore` used directly does. Unlike an `EngineCore`, a client's
``abort_requests`` returns []: the core's answers (finish reason ``abort``) come out of a later
``step``. ``step`` may run on one thread while another calls ``add_request`` /
``abort_requests`` (that is how `AsyncEngine` uses a client).

When the core process dies, every call raises `EngineDeadError` within about `POLL_S` seconds
(EOF on its pipe is seen at once), and the process is reaped.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading
import time
import weakref
from abc import ABC, abstractmethod
from typing import Any

from .config import EngineConfig
from .core_proc import CoreBusyLoop, run_engine_core
from .core_protocol import EngineCoreClient
from .engine_core import (EngineCore, EngineCoreAbort, EngineCoreOutput, EngineCoreRequest,
                          EngineCoreShutdown, EngineCoreStats)
from .errors import EngineDeadError
from .model_setup import ModelSetup
from .registry import Registry

POLL_S = 0.5  # longest wait on the core's pipe between liveness checks
SHUTDOWN_TIMEOUT_S = 5.0  # graceful stop, then SIGKILL


__all__ = ["EngineCoreClient", "InprocClient", "MPClient", "client_factory"]


class BusyLoopClient(ABC):
    """An `EngineCoreClient` whose core runs a `CoreBusyLoop` (core/core_proc.py) and talks to
    it in messages: subclasses send `EngineCoreRequest` / `EngineCoreAbort` and receive each
    turn's outputs and `EngineCoreStats`."""

    def __init__(self) -> None:
        self._unfinished: set[str] = set()
        self._stats: EngineCoreStats | None = None

    def stats(self) -> EngineCoreStats | None:
        """The core's state after the turn whose outputs `step` returned last (None before
        any): the same object until the next turn; its per-request times are new in it, so
        count each snapshot once."""
        return self._stats

    @property
    def has_unfinished_requests(self) -> bool:
        """Whether a request sent is not finished in an output returned by `step` yet."""
        return bool(self._unfinished)

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request (validated by the front half). Raises EngineDeadError."""
        self._unfinished.add(request.request_id)
        self._send(request)

    def abort_requests(self, request_ids: list[str]) -> list[EngineCoreOutput]:
        """Queue an abort; the core's answers come out of `step`. Returns []."""
        self._send(EngineCoreAbort(list(request_ids)))
        return []

    def step(self, timeout: float | None = None) -> list[EngineCoreOutput]:
        """The outputs of the core's next turn, waiting up to ``timeout`` seconds (None:
        until there are some); [] on timeout. Raises EngineDeadError."""
        outputs = self._receive(timeout)
        for o in outputs:
            if o.finish_reason is not None:
                self._unfinished.discard(o.request_id)
        return outputs

    @abstractmethod
    def _send(self, msg: Any) -> None: ...

    @abstractmethod
    def _receive(self, timeout: float | None) -> list[EngineCoreOutput]: ...

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the core; later calls raise EngineDeadError. Idempotent."""


class InprocClient(BusyLoopClient):
    """An `EngineCore` in this process, run by whichever thread calls `step` (one at a time);
    other threads' requests and aborts wait in the loop's inbox for that thread."""

    def __init__(self, core: EngineCore) -> None:
        super().__init__()
        self.core = core
        self._loop = CoreBusyLoop(core)
        self._closed = False

    def _send(self, msg: Any) -> None:
        if self._closed:
            raise EngineDeadError("the engine core was shut down")
        self._loop.inbox.put(msg)

    def _receive(self, timeout: float | None) -> list[EngineCoreOutput]:
        if self._closed or self._loop.stopped:
            raise EngineDeadError("the engine core was shut down")
        outputs = self._loop.run_once(timeout)
        if outputs:
            self._stats = self.core.stats()
        self._loop.log_if_slow()
        return outputs

    def shutdown(self) -> None:
        """Call it when no thread is in `step` (a blocked `step` is woken up)."""
        if not self._closed:
            self._closed = True
            self._loop.inbox.put(EngineCoreShutdown())
            self.core.shutdown()


class MPClient(BusyLoopClient):
    """An `EngineCore` in its own process (multiprocessing "spawn"), which loads the plugins
    itself (from entry points: plugins registered by hand in this process are not there).

    The constructor returns once the core is built (weights loaded, KV cache allocated) and
    raises the core's startup error as its own type and message (ModelNotFoundError,
    ConfigError, CacheTooSmallError, ...). The process stops on `shutdown`, when this object is
    garbage-collected, at interpreter exit, and on its own when this process dies.

    As with any "spawn" child, a script that builds one must guard its entry point with
    ``if __name__ == "__main__":``. The process is daemonic (multiprocessing also ends it at
    exit), except with tensor/pipeline parallelism: a daemonic process cannot start the worker
    processes, so it is then stopped by this class's own cleanup alone.
    """

    def __init__(self, config: EngineConfig) -> None:
        super().__init__()
        ctx = multiprocessing.get_context("spawn")
        core_in, self._to_core = ctx.Pipe(duplex=False)
        self._from_core, core_out = ctx.Pipe(duplex=False)
        log_level = logging.getLogger("pagebatch").getEffectiveLevel()
        self.proc = ctx.Process(target=run_engine_core, name="pagebatch-engine-core",
                                args=(config, core_in, core_out, os.getpid(), log_level),
                                daemon=config.tensor_parallel_size
                                * config.pipeline_parallel_size == 1)
        self.proc.start()
        core_in.close()  # the child holds the only copies now: its death is EOF here
        core_out.close()
        self._send_lock = threading.Lock()
        self._dead: str | None = None
        self._finalizer = weakref.finalize(self, _stop_process, self.proc, self._to_core,
                                           self._from_core, os.getpid())
        try:
            self.info: dict[str, Any] = self._wait_ready()
        except BaseException:
            self._finalizer()
            raise

    @property
    def pid(self) -> int | None:
        return self.proc.pid

    def _wait_ready(self) -> dict[str, Any]:
        msg = None
        while msg is None:
            try:
                if self._from_core.poll(POLL_S):
                    msg = self._from_core.recv()
                elif not self.proc.is_alive() and not self._from_core.poll(0):
                    break  # (it may have sent its error just before exiting: read that first)
            except (EOFError, OSError):
                break
        if msg is not None:
            if msg[0] == "ready":
                return msg[1]
            _, exc, tb = msg  # "startup_error" (or "error")
            self.proc.join(SHUTDOWN_TIMEOUT_S)
            exc.__cause__ = _RemoteTraceback(tb)
            raise exc
        self.proc.join(SHUTDOWN_TIMEOUT_S)
        raise EngineDeadError(f"the engine core process exited during startup "
                              f"({_exit_description(self.proc)})")

    def _send(self, msg: Any) -> None:
        self._check_alive()
        try:
            with self._send_lock:
                self._to_core.send(msg)
        except (OSError, ValueError):  # broken pipe, or closed by shutdown
            raise self._died("its pipe is closed") from None

    def _receive(self, timeout: float | None) -> list[EngineCoreOutput]:
        self._check_alive()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = POLL_S if deadline is None else max(0.0, min(POLL_S,
                                                                deadline - time.monotonic()))
            try:
                ready = self._from_core.poll(wait)
                msg = self._from_core.recv() if ready else None
            except (EOFError, OSError):
                raise self._died() from None
            if msg is not None:
                if msg[0] == "outputs":
                    self._stats = msg[2]
                    return msg[1]
                _, exc, tb = msg  # "error": the core's loop failed and the process exits
                raise self._died(f"{type(exc).__name__}: {exc}\n{tb}")
            if not self.proc.is_alive() and not self._from_core.poll(0):
                raise self._died()
            if deadline is not None and time.monotonic() >= deadline:
                return []

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)

    def _died(self, detail: str = "") -> EngineDeadError:
        """Record the death, reap the process, and return the error to raise."""
        if self._dead is None:
            if self._finalizer.alive:
                self.proc.join(SHUTDOWN_TIMEOUT_S if detail else 1.0)
                self._finalizer()  # kills it if it is still there, closes the pipes
            self._dead = (f"the engine core process (pid {self.proc.pid}) is gone "
                          f"({_exit_description(self.proc)}); its requests cannot complete"
                          + (f": {detail}" if detail else ""))
        return EngineDeadError(self._dead)

    def shutdown(self) -> None:
        if self._dead is None:
            self._dead = "the engine core was shut down"
        self._finalizer()


def _stop_process(proc: Any, to_core: Any, from_core: Any, owner_pid: int) -> None:
    """Stop the core process (EngineCoreShutdown, then SIGKILL: it ignores SIGTERM) and reap
    it."""
    if os.getpid() != owner_pid:  # a forked copy of the front half at exit: not its child
        return
    if proc.is_alive():
        try:
            to_core.send(EngineCoreShutdown())
        except (OSError, ValueError):
            pass
        proc.join(SHUTDOWN_TIMEOUT_S)
    if proc.is_alive():
        proc.kill()
        proc.join()
    proc.join(0)  # reap
    to_core.close()
    from_core.close()


def _exit_description(proc: Any) -> str:
    code = proc.exitcode
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class _RemoteTraceback(Exception):
    """The core process's traceback, attached as the cause of an error it sent back."""

    def __init__(self, tb: str) -> None:
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return f"\n\"\"\"\n{self.tb}\"\"\""


def client_factory(multiprocess: bool):
    """A `LLMEngine` ``core`` factory: `MPClient` or `InprocClient` over a new `EngineCore`."""

    def build(config: EngineConfig, registry: Registry, setup: ModelSetup) -> EngineCoreClient:
        if multiprocess:
            return MPClient(config)
        return InprocClient(EngineCore.from_config(config, registry, setup))

    return build
