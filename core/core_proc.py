"""The engine core's busy loop, and the main of the engine core's own process.

`CoreBusyLoop` owns one `EngineCore` and an inbox of plain-data messages (`EngineCoreRequest`,
`EngineCoreAbort`, `EngineCoreShutdown`). Each turn applies every waiting message, runs one step
when there is work and returns the outputs of both; with no work it blocks on the inbox. The same
loop runs in the front half's process (`InprocClient`, stepped by `AsyncEngine`'s output thread)
and in a process of its own (`run_engine_core`), as vLLM v1's EngineCoreProc does.

The process talks to `MPClient` (core/core_client.py) over two one-way pipes of pickled objects:

- front -> core: `EngineCoreRequest` | `EngineCoreAbort` | `EngineCoreShutdown`, read by a
  thread into the inbox (so the front half's sends never wait for a step);
- core -> front: ``("ready", info)`` once, or ``("startup_error", exc, traceback)`` and exit;
  then ``("outputs", [EngineCoreOutput, ...], EngineCoreStats)`` per turn (every turn runs a
  step or applies messages; a step that finished no token, such as a prefill chunk, sends an
  empty list, so the front half's stats, e.g. the step counter, never lag a step behind), and
  ``("error", exc, traceback)`` before exiting on an unexpected error.

The process exits on `EngineCoreShutdown`, and when the front half dies or closes its end: the
input thread sees EOF on its pipe (or the parent pid change) and shuts the loop down.
"""

from __future__ import annotations

import logging
import os
import pickle
import queue
import signal
import threading
import traceback
from typing import Any

import torch

from .config import EngineConfig
from .engine_core import (EngineCore, EngineCoreAbort, EngineCoreOutput, EngineCoreRequest,
                          EngineCoreShutdown)
from .errors import SamplingParamsError
from .registry import registry
from .request import FinishReason
from .stall_log import NullClock, cuda_allocator_counters, watch_triton_compiles

logger = logging.getLogger(__name__)

_PARENT_CHECK_S = 1.0  # how often the input thread checks that the front half still lives


class CoreBusyLoop:
    """An `EngineCore` driven by messages; only the thread calling `run_once` touches the core.

    ``inbox`` is thread-safe: any thread may put messages into it.
    """

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        # PAGEBATCH_SLOW_STEP_MS (core/stall_log.py): the core marks its step's phases on it
        self.clock = getattr(core, "clock", None) or NullClock()
        self.inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.stopped = False

    def run_once(self, timeout: float | None = None) -> list[EngineCoreOutput]:
        """Apply the waiting messages, waiting up to ``timeout`` seconds (None: forever) for one
        while the core has no work; then run one step if there is work. Returns the outputs of
        the aborts and of the step."""
        outputs: list[EngineCoreOutput] = []
        try:
            msg = (self.inbox.get_nowait() if self.core.has_work
                   else self.inbox.get(timeout=timeout))
        except queue.Empty:
            msg = None
        self.clock.start()  # the wait for a message is idle time, not the turn's
        while msg is not None:
            outputs.extend(self._apply(msg))
            try:
                msg = self.inbox.get_nowait()
            except queue.Empty:
                msg = None
        self.clock.mark("messages")
        if not self.stopped and self.core.has_work:
            outputs.extend(self.core.step())
        return outputs

    def log_if_slow(self) -> None:
        """Log the turn just run (WARNING) when it took longer than PAGEBATCH_SLOW_STEP_MS;
        the caller marks its own phases (sending the outputs) before."""
        clock = self.clock
        if clock.slow:
            logger.warning("slow engine core turn: %s", clock.describe())

    def _apply(self, msg: Any) -> list[EngineCoreOutput]:
        if isinstance(msg, EngineCoreRequest):
            try:
                self.core.add_request(msg)
            except Exception as e:  # one bad request must not stop the loop
                logger.exception("adding request %r failed", msg.request_id)
                # a constraint that cannot compile names its field (answered as a 400)
                param = e.param if isinstance(e, SamplingParamsError) else None
                return [EngineCoreOutput(msg.request_id, [], FinishReason.ERROR.value,
                                         f"{type(e).__name__}: {e}", param)]
            return []
        if isinstance(msg, EngineCoreAbort):
            return self.core.abort_requests(msg.request_ids)
        if isinstance(msg, EngineCoreShutdown):
            self.stopped = True
            return []
        raise TypeError(f"the engine core got a {type(msg).__name__}; it takes "
                        f"EngineCoreRequest, EngineCoreAbort or EngineCoreShutdown")


def run_engine_core(config: EngineConfig, input_conn: Any, output_conn: Any,
                    parent_pid: int, log_level: int = logging.WARNING) -> None:
    """Main of the engine core process (started by `MPClient` with the "spawn" context).

    Loads plugins (the process-wide registry, from entry points), builds the core, reports
    ``ready`` or the startup error, then runs the busy loop until shut down. ``log_level`` is
    the front half's level for the ``pagebatch`` loggers.
    """
    # Ctrl-C, and a SIGTERM sent to the whole process group (systemd, `kill -- -PGID`), are
    # the front half's to handle: it drains, then stops this process (EngineCoreShutdown, else
    # SIGKILL); this process also exits when the front half is gone
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(format="%(asctime)s %(levelname)s [engine core] %(name)s: %(message)s")
    logging.getLogger("pagebatch").setLevel(log_level)
    try:
        from .distributed.executor import MultiprocExecutor

        # a dead worker stops this process even when a collective never returns (NCCL)
        MultiprocExecutor.hard_exit_on_worker_death = True
        core = EngineCore.from_config(config, registry())
    except BaseException as e:  # typed errors go back to the front half as they are
        _send_error(output_conn, "startup_error", e)
        return
    # start-up's warm-up and captures are done: a kernel compiled from now on stalls every
    # stream, so say so (core/stall_log.py)
    if torch.cuda.is_initialized():  # this process runs the model on a GPU
        watch_triton_compiles("engine core")
        if core.clock.enabled:  # a slow turn names the caching allocator's events in it
            core.clock.counters = cuda_allocator_counters()
    loop = CoreBusyLoop(core)
    threading.Thread(target=_read_inputs, args=(input_conn, loop.inbox, parent_pid),
                     name="pagebatch-core-input", daemon=True).start()
    try:
        output_conn.send(("ready", {"pid": os.getpid(), "num_kv_blocks": core.kv_cache.num_blocks,
                                    "max_model_len": core.setup.max_model_len}))
        while not loop.stopped:
            outputs = loop.run_once()
            if outputs or not loop.stopped:  # a prefill chunk's step has no outputs, but its
                output_conn.send(("outputs", outputs, core.stats()))  # stats are news
            loop.clock.mark("send")
            loop.log_if_slow()
    except (BrokenPipeError, ConnectionResetError, EOFError):
        pass  # the front half is gone: nobody to report to
    except BaseException as e:
        logger.exception("the engine core loop failed")
        _send_error(output_conn, "error", e)
        raise SystemExit(1) from None
    finally:
        core.shutdown()


def _read_inputs(conn: Any, inbox: queue.SimpleQueue[Any], parent_pid: int) -> None:
    """Move messages from the pipe to the inbox; on EOF or when the parent is gone (this process
    was re-parented), tell the loop to shut down."""
    try:
        while True:
            if not conn.poll(_PARENT_CHECK_S):
                if os.getppid() != parent_pid:
                    break
                continue
            msg = conn.recv()
            inbox.put(msg)
            if isinstance(msg, EngineCoreShutdown):
                return
    except (EOFError, OSError):
        pass
    inbox.put(EngineCoreShutdown())


def _send_error(conn: Any, kind: str, e: BaseException) -> None:
    tb = traceback.format_exc()
    try:  # the front half re-raises the same type; make sure it survives the trip
        pickle.loads(pickle.dumps(e))
    except Exception:
        e = RuntimeError(f"{type(e).__name__}: {e}")
    try:
        conn.send((kind, e, tb))
    except OSError:
        pass
