"""A tensor/pipeline-parallel worker: one rank's `ModelRunner`, driven by the driver's step
messages (core/distributed/step_codec.py).

Two ways to start one:

- **Spawned by the engine core** (one host): `run_spawned_worker` is the target of a
  torch.multiprocessing "spawn" process; steps arrive through the shared-memory ring
  (core/distributed/shm_ring.py), control messages go back over a pipe. It exits when the
  engine core process is gone (its parent pid changes).
- **Started by hand or by torchrun** (several hosts): ``python -m pagebatch.distributed.worker
  --config FILE`` with MASTER_ADDR, MASTER_PORT, RANK (> 0) and WORLD_SIZE set, and the same
  engine keys as rank 0. Steps and control messages go over a TCP connection to the driver,
  whose address and a one-time key the driver leaves in the rendezvous store. It exits when
  that connection closes.

Start-up, on every rank in the same order (the driver's side is core/distributed/executor.py):
load plugins, say ``hello``; join the process groups; build the runner (load weights), say
``loaded``; wait for the driver's ``go`` (so a slow loader does not time out a collective); size
the KV cache and agree on the smallest block count (an all-reduce), allocate it, say ``ready``.
Then: read a step (new requests bring their sampling state in it), run it, and on the last pipeline
stage's TP rank 0 (when there are stages) send its `RunnerOutput` back. An exception is logged,
reported to the driver and ends the process with status 1: a rank that skips a step would leave the
others waiting in a collective.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import traceback
from multiprocessing.connection import Connection
from typing import Any, Callable

import torch

from ..config import EngineConfig
from ..model_runner import ModelRunner
from ..model_setup import resolve_model_setup
from ..registry import registry
from ..stall_log import watch_triton_compiles
from . import step_codec
from .comm import all_reduce_min
from .parallel_state import init_distributed, resolve_backend, torchrun_env
from .step_trace import StepTrace

logger = logging.getLogger(__name__)

STORE_DRIVER_KEY = "pagebatch/driver_address"
STORE_AUTH_KEY = "pagebatch/authkey"


class Worker:
    """One non-driver rank. ``recv_step()`` returns the next step message's bytes; ``conn``
    carries control messages (and results) to the driver."""

    def __init__(self, rank: int, config: EngineConfig, conn: Connection,
                 recv_step: Callable[[], bytes]) -> None:
        self.rank, self.config, self.conn, self.recv_step = rank, config, conn, recv_step

    def start(self, init_method: str, rendezvous_timeout_s: float, local_rank: int,
              after_init: Callable[[], None] | None = None) -> None:
        """Start-up (see the module docstring); ``local_rank``: this rank's GPU on its host."""
        cfg = self.config
        reg = registry()
        setup = resolve_model_setup(cfg, reg)
        self.conn.send(("hello", self.rank))
        tp, pp = cfg.tensor_parallel_size, cfg.pipeline_parallel_size
        device = torch.device(setup.device_type)
        if device.type == "cuda":
            torch.cuda.set_device(local_rank)
            device = torch.device("cuda", torch.cuda.current_device())
        par = init_distributed(resolve_backend(cfg.distributed_backend, device), init_method,
                               self.rank, tp, pp, cfg.distributed_timeout, device,
                               rendezvous_timeout_s)
        if after_init is not None:
            after_init()
        self.runner = ModelRunner(cfg, setup, reg, par)
        self.conn.send(("loaded", self.rank))
        if step_codec.decode(self.recv_step()).kind != step_codec.GO:
            raise RuntimeError("the driver sent a step before the start-up go")
        num_blocks = all_reduce_min(self.runner.determine_num_blocks(), device, par.world_group)
        self.runner.allocate_kv_cache(num_blocks)
        # the last stage's TP rank 0 reports each step's sampled tokens (pp > 1 only)
        self.sends_results = pp > 1 and par.is_last_stage and par.tp_rank == 0
        if device.type == "cuda":  # warmed up: a kernel compiled from now on stalls the step
            watch_triton_compiles(f"worker rank {self.rank}")
        self.conn.send(("ready", self.rank))

    def run(self) -> None:
        """Execute steps until the driver's shutdown message. A rank that reports no results
        only launches each step (its samples stay on the device, where the next step's
        placeholder tokens are filled from them); the last launched step is kept referenced."""
        runner = self.runner
        trace = StepTrace(self.rank)  # PAGEBATCH_TRACE_STEPS, _DIR: see step_trace.py
        while True:
            msg = step_codec.decode(self.recv_step())
            if msg.kind == step_codec.SHUTDOWN:
                trace.finish()
                return
            trace.before_step()
            if not self.sends_results:
                self.launched = runner.execute_async(msg.so, copy_back=False)
                continue
            out = runner.execute(msg.so)
            if not msg.so.is_empty:
                self.conn.send(("result", out))


def _report_failure(conn: Connection, rank: int, e: BaseException) -> None:
    tb = traceback.format_exc()
    logger.error("worker rank %d failed: %s: %s\n%s", rank, type(e).__name__, e, tb)
    try:
        conn.send(("error", rank, f"{type(e).__name__}: {e}", tb))
    except (OSError, ValueError):
        pass


def _setup_logging(rank: int, level: int) -> None:
    logging.basicConfig(format=f"%(asctime)s %(levelname)s [worker rank {rank}] %(name)s: "
                               f"%(message)s")
    logging.getLogger("pagebatch").setLevel(level)


def run_spawned_worker(rank: int, config: EngineConfig, init_method: str, ring_handle: Any,
                       conn: Connection, parent_pid: int, log_level: int,
                       rendezvous_timeout_s: float) -> None:
    """Main of a worker process the engine core spawned on its host."""
    from .shm_ring import ShmRingBuffer

    # Ctrl-C and a process-group SIGTERM are the front half's to handle (it drains first); the
    # engine core stops this process (shutdown message, else SIGKILL), or it exits when the
    # core is gone
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _setup_logging(rank, log_level)
    ring = ShmRingBuffer.attach(ring_handle, rank - 1)

    def parent_alive() -> None:
        if os.getppid() != parent_pid:
            logger.warning("the engine core (pid %d) is gone; worker rank %d exits",
                           parent_pid, rank)
            os._exit(0)

    worker = Worker(rank, config, conn, lambda: ring.read(parent_alive))
    try:
        worker.start(init_method, rendezvous_timeout_s, local_rank=rank)
        worker.run()
    except BaseException as e:
        _report_failure(conn, rank, e)
        os._exit(1)  # skip interpreter teardown: other ranks' collectives must see us gone
    ring.close()


def run_remote_worker(config: EngineConfig, rendezvous_timeout_s: float,
                      log_level: int = logging.INFO) -> int:
    """Main of a rank started with the torchrun environment; returns the exit status."""
    from multiprocessing.connection import answer_challenge

    import torch.distributed as dist

    env = torchrun_env()
    if env is None or env[0] == 0:
        raise SystemExit("pagebatch.distributed.worker runs ranks > 0: set MASTER_ADDR, "
                         "MASTER_PORT, WORLD_SIZE and RANK >= 1 (rank 0 runs the engine)")
    rank, world = env
    _setup_logging(rank, log_level)
    want = config.tensor_parallel_size * config.pipeline_parallel_size
    if world != want:
        raise SystemExit(f"WORLD_SIZE={world} but tensor_parallel_size x "
                         f"pipeline_parallel_size = {want}")
    holder: dict[str, Connection] = {}

    def connect_to_driver() -> None:
        import socket

        store = dist.distributed_c10d._get_default_store()
        host, port = store.get(STORE_DRIVER_KEY).decode().rsplit(":", 1)
        sock = socket.create_connection((host, int(port)), timeout=rendezvous_timeout_s)
        sock.settimeout(None)
        conn = Connection(sock.detach())
        answer_challenge(conn, store.get(STORE_AUTH_KEY))
        conn.send(("hello", rank))
        holder["conn"] = conn
        worker.conn = conn

    def recv_step() -> bytes:
        try:
            return holder["conn"].recv_bytes()
        except (EOFError, OSError):
            logger.warning("the driver closed its connection; worker rank %d exits", rank)
            os._exit(0)

    worker = Worker(rank, config, _Deferred(holder), recv_step)
    try:
        worker.start("env://", rendezvous_timeout_s, int(os.environ.get("LOCAL_RANK", 0)),
                     after_init=connect_to_driver)
        worker.run()
    except BaseException as e:
        if "conn" in holder:
            _report_failure(holder["conn"], rank, e)
        else:
            logger.exception("worker rank %d failed before reaching the driver", rank)
        os._exit(1)
    return 0


class _Deferred:
    """Control messages sent before the driver connection exists (the ``hello`` that precedes
    the process group) are dropped: over TCP the connection itself is the hello."""

    def __init__(self, holder: dict[str, Connection]) -> None:
        self.holder = holder

    def send(self, msg: Any) -> None:
        if "conn" in self.holder:
            self.holder["conn"].send(msg)


def main(argv: list[str] | None = None) -> int:
    """``python -m pagebatch.distributed.worker [SUBCOMMAND] [MODEL] [--config FILE]
    [--engine-key VALUE ...]``: a rank > 0. It takes rank 0's command line as it is (see
    core/distributed/launch.py), using the engine keys and ignoring the rest."""
    from ..config import add_cli_options, cli_values

    reg = registry()
    options = EngineConfig.core_options() + list(reg.config_options().values())
    parser = argparse.ArgumentParser(prog="python -m pagebatch.distributed.worker",
                                     description="Run one rank > 0 of a multi-host engine "
                                     "(torchrun environment); rank 0 runs pagebatch itself.")
    parser.add_argument("words", nargs="*", help="[SUBCOMMAND] [MODEL], as for pagebatch")
    parser.add_argument("--log-level", default="INFO",
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    parser.add_argument("--config", help="the same YAML config file as rank 0")
    parser.add_argument("--rendezvous-timeout", type=float, default=1800.0,
                        help="seconds to wait for the other ranks to start (default 1800)")
    add_cli_options(parser, options)
    args, _ = parser.parse_known_args(argv)  # rank 0's other options (--port, --prompt ...)
    cli = cli_values(args, options)
    model = _model_word(args.words)
    if model is not None:
        cli.setdefault("model", model)
    config = EngineConfig.from_sources(cli, args.config)
    return run_remote_worker(config, args.rendezvous_timeout, getattr(logging, args.log_level))


def _model_word(words: list[str]) -> str | None:
    """MODEL in ``[serve|generate] MODEL`` or ``bench KIND MODEL``."""
    skip = 2 if words[:1] == ["bench"] else 1 if words[:1] in (["serve"], ["generate"]) else 0
    return words[skip] if len(words) > skip else None


if __name__ == "__main__":
    sys.exit(main())
