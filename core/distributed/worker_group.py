"""`WorkerGroup`: the driver's handles on the other ranks -- starting them, their control
messages, watching them, stopping them. `MultiprocExecutor` (core/distributed/executor.py)
decides what a failure means; this module only reports it through ``on_failure(reason)``, which
returns the exception to raise.

- **Spawned** (one host): one torch.multiprocessing "spawn" process per rank, a one-way pipe
  back from each (its EOF is the worker's death), steps through one shared-memory ring.
- **Remote** (the torchrun environment): each rank connects back over TCP to a server whose
  address and a one-time key the driver leaves in the rendezvous store; the connection carries
  steps one way and control messages the other.

Control messages from a worker: ``("hello", rank)``, ``("loaded", rank)``, ``("ready", rank)``,
``("result", RunnerOutput)`` (the last stage's TP rank 0), ``("error", rank, text,
traceback)`` just before it exits.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection, deliver_challenge, wait
from typing import Any, Callable

import torch

from ..config import EngineConfig
from ..errors import ConfigError, EngineDeadError
from .parallel_state import free_port
from .worker import STORE_AUTH_KEY, STORE_DRIVER_KEY, run_spawned_worker

SPAWN_RENDEZVOUS_S = 300.0  # workers on this host: start-up to process group
REMOTE_RENDEZVOUS_S = 1800.0  # other hosts may be started by hand, minutes apart
POLL_S = 0.1


@dataclass
class WorkerHandle:
    rank: int
    conn: Connection  # worker -> driver: control messages and results (and, over TCP, steps)
    proc: Any = None  # the process, when this host spawned it


class WorkerError(RuntimeError):
    """A worker's failure, re-raised on the driver with the worker's traceback."""


class WorkerGroup:
    def __init__(self, world: int, on_failure: Callable[[str], BaseException]) -> None:
        self.world = world
        self.on_failure = on_failure
        self.workers: dict[int, WorkerHandle] = {}
        self.ring = None  # spawned workers: the shared-memory ring of step messages
        self.remote = False
        self._stop_watch = threading.Event()

    # ---- start --------------------------------------------------------------------------------

    def spawn(self, config: EngineConfig, device: torch.device,
              check: Callable[[], None]) -> str:
        """Start ranks 1 .. world-1 on this host and wait for their hello (plugins loaded);
        returns the process group's init method."""
        from .shm_ring import ShmRingBuffer

        if device.type == "cuda" and torch.cuda.device_count() < self.world:
            raise ConfigError(f"tensor_parallel_size x pipeline_parallel_size = {self.world} "
                              f"GPUs, but torch sees {torch.cuda.device_count()}")
        self.ring = ShmRingBuffer(self.world - 1)
        init_method = f"tcp://127.0.0.1:{free_port()}"
        ctx = torch.multiprocessing.get_context("spawn")
        level = logging.getLogger("pagebatch").getEffectiveLevel()
        for rank in range(1, self.world):
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=run_spawned_worker, name=f"pagebatch-worker-{rank}",
                               args=(rank, config, init_method, self.ring.handle(), writer,
                                     os.getpid(), level, SPAWN_RENDEZVOUS_S), daemon=True)
            proc.start()
            writer.close()  # the worker holds the only copy: its death is EOF here
            self.workers[rank] = WorkerHandle(rank, reader, proc)
        self.wait_all("hello", SPAWN_RENDEZVOUS_S, check)
        return init_method

    def accept_remote(self) -> None:
        """Ranks started outside (torchrun environment) connect back; the process group must
        exist (its store carries the address and the key)."""
        import torch.distributed as dist

        self.remote = True
        store = dist.distributed_c10d._get_default_store()
        authkey = os.urandom(32)
        with socket.create_server(("", 0)) as srv:
            srv.settimeout(REMOTE_RENDEZVOUS_S)
            store.set(STORE_AUTH_KEY, authkey)
            store.set(STORE_DRIVER_KEY, f"{os.environ['MASTER_ADDR']}:{srv.getsockname()[1]}")
            while len(self.workers) < self.world - 1:
                try:
                    sock, _ = srv.accept()
                except socket.timeout:
                    raise EngineDeadError(f"only {len(self.workers)} of {self.world - 1} worker "
                                          f"ranks connected within {REMOTE_RENDEZVOUS_S:.0f} "
                                          f"s") from None
                sock.settimeout(None)
                conn = Connection(sock.detach())
                deliver_challenge(conn, authkey)
                _, rank = conn.recv()  # ("hello", rank)
                self.workers[rank] = WorkerHandle(rank, conn)

    def wait_all(self, kind: str, timeout_s: float, check: Callable[[], None]) -> None:
        """Wait for control message ``kind`` from every worker, calling ``check()`` between
        polls. Raises the error a worker reports (WorkerError), and what ``on_failure`` gives
        when one dies or the time runs out."""
        pending = set(self.workers)
        deadline = time.monotonic() + timeout_s
        by_conn = {w.conn: w.rank for w in self.workers.values()}
        while pending:
            check()
            for conn in wait([self.workers[r].conn for r in pending], POLL_S):
                rank = by_conn[conn]
                msg = self.recv(rank)
                if msg[0] != kind:
                    raise worker_error(msg)
                pending.discard(rank)
            if time.monotonic() > deadline:
                raise self.on_failure(f"worker ranks {sorted(pending)} did not report {kind!r} "
                                      f"within {timeout_s:.0f} s")

    def recv(self, rank: int) -> Any:
        try:
            return self.workers[rank].conn.recv()
        except (EOFError, OSError):
            raise self.on_failure(f"worker rank {rank} closed its connection "
                                  f"({self.exit_description(rank)})") from None

    def reported_error(self) -> WorkerError | None:
        """An error message a worker sent and nobody read yet (after a failed start)."""
        for w in self.workers.values():
            try:
                if w.conn.poll(0):
                    msg = w.conn.recv()
                    if msg[0] == "error":
                        return worker_error(msg)
            except (EOFError, OSError):
                continue
        return None

    # ---- steps --------------------------------------------------------------------------------

    def broadcast(self, payload: bytes, check: Callable[[], None]) -> None:
        """One step message to every worker (the ring, or each TCP connection)."""
        if self.ring is not None:
            self.ring.write(payload, check)
        if self.remote:
            for w in self.workers.values():
                try:
                    w.conn.send_bytes(payload)
                except OSError:
                    raise self.on_failure(f"worker rank {w.rank} closed its connection") from None

    # ---- watching and stopping ----------------------------------------------------------------

    def start_watcher(self, result_rank: int | None) -> None:
        """A thread that reports the first worker death through ``on_failure``: a spawned
        worker's process sentinel; over TCP, a connection that becomes readable (only the
        result rank, which the executor reads itself, sends anything after start-up)."""
        objs: dict[Any, int] = {}
        for w in self.workers.values():
            if w.proc is not None:
                objs[w.proc.sentinel] = w.rank
            elif w.rank != result_rank:
                objs[w.conn] = w.rank
        threading.Thread(target=self._watch, args=(objs,), name="pagebatch-worker-watcher",
                         daemon=True).start()

    def _watch(self, objs: dict[Any, int]) -> None:
        while objs and not self._stop_watch.is_set():
            ready = wait(list(objs), timeout=0.5)
            if ready and not self._stop_watch.is_set():
                rank = objs[ready[0]]
                self.on_failure(f"worker rank {rank} died ({self.exit_description(rank)})")
                return

    def exit_description(self, rank: int) -> str:
        proc = self.workers[rank].proc
        if proc is None:
            return "on another host: see its log"
        proc.join(0.5)
        code = proc.exitcode
        if code is None:
            return f"pid {proc.pid}, still running"
        if code < 0:
            try:
                return f"pid {proc.pid}, killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"pid {proc.pid}, killed by signal {-code}"
        return f"pid {proc.pid}, exit code {code}"

    def kill(self) -> None:
        """Stop every worker now: SIGKILL a spawned one, close a remote one's connection (it
        exits when that closes)."""
        for w in self.workers.values():
            if w.proc is None:
                w.conn.close()
            elif w.proc.is_alive():
                w.proc.kill()  # (spawned workers ignore SIGTERM: the front half's to handle)

    def stop(self, shutdown_message: bytes | None) -> None:
        """Send ``shutdown_message`` (when given), then join or kill the spawned workers (they
        ignore SIGTERM), close the connections and unlink the ring."""
        self._stop_watch.set()
        if shutdown_message is not None and self.workers:
            deadline = time.monotonic() + 5.0

            def check() -> None:
                if time.monotonic() > deadline:
                    raise TimeoutError("a worker does not read its messages")

            try:
                self.broadcast(shutdown_message, check)
            except Exception:  # a worker that cannot take it is stopped below
                pass
        for w in self.workers.values():
            if w.proc is not None:
                w.proc.join(5.0)
                if w.proc.is_alive():
                    w.proc.kill()
                    w.proc.join()
            w.conn.close()
        if self.ring is not None:
            self.ring.close(unlink=True)
            self.ring = None


def worker_error(msg: tuple) -> BaseException:
    if msg[0] != "error":
        return EngineDeadError(f"unexpected message from a worker: {msg[0]!r}")
    _, rank, text, tb = msg
    return WorkerError(f"worker rank {rank} failed: {text}\n{tb}")
