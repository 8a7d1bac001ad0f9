"""`MultiprocExecutor`: the driver's side of tensor/pipeline parallelism.

The driver is rank 0 and runs inside the engine core: it schedules, runs the first pipeline
stage's TP rank 0 itself, and sends every step to the other ranks before running its own part:

- **one host** (default): it spawns one worker process per other rank (torch.multiprocessing
  "spawn", one GPU each) and writes each step message once into a shared-memory ring
  (core/distributed/shm_ring.py) that all of them read; workers answer over a pipe each.
- **several hosts** (the torchrun environment is set: MASTER_ADDR, MASTER_PORT, RANK=0,
  WORLD_SIZE): the other ranks were started outside (``python -m pagebatch.distributed.worker``
  on each host); they connect back over TCP, authenticated with a key left in the rendezvous
  store, and steps go to each of them over its connection.

Results: with one stage the driver samples (every TP rank samples the same tokens from the same
all-gathered logits), so a step is done when its own part returns; with ``async_scheduling``
(default on CUDA) the driver only launches it and the engine core schedules the next step
meanwhile, each rank filling in the decodes' input tokens from its own samples (they are the
same on every rank). With pipeline stages the last stage's TP rank 0 sends each step's
`RunnerOutput` back; `execute_model` returns as soon as the driver's stage has run and the
engine core's batch queue keeps ``pipeline_parallel_size`` steps in flight, so the stages work
on different micro-batches at once.

Failure: a watcher thread (core/distributed/worker_group.py, which also starts and stops the
workers) waits on the workers' process sentinels (and, over TCP, on their connections). When a
worker dies, the executor records why, logs it, stops the other workers and every call raises
`EngineDeadError`; a step that fails on any rank does the same (the ranks would be out of
step). Collectives time out after ``distributed_timeout``. In the engine core's own process
(``hard_exit_on_worker_death``) the process also exits with status 1 after `EXIT_GRACE_S` if
the main thread is stuck in a collective that never returns (NCCL), or idle.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref
from typing import Any

import torch

from ..config import EngineConfig
from ..errors import ConfigError, EngineDeadError
from ..executor import DoneStep, Executor, StepHandle, async_scheduling
from ..model_runner import ModelRunner, RunnerOutput
from ..model_setup import ModelSetup
from ..registry import Registry
from ..scheduler import SchedulerOutput
from . import step_codec
from .comm import all_reduce_min
from .parallel_state import (check_model_parallel, destroy_distributed, init_distributed,
                             resolve_backend, torchrun_env)
from .worker_group import (POLL_S, REMOTE_RENDEZVOUS_S, SPAWN_RENDEZVOUS_S, WorkerError,
                           WorkerGroup, worker_error)

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 1800.0  # a worker's weight loading
EXIT_GRACE_S = 5.0


class MultiprocExecutor(Executor):
    # set by the engine core's own process (core/core_proc.py): exit when a worker dies and the
    # main thread cannot be reached (a stuck NCCL collective)
    hard_exit_on_worker_death = False

    def __init__(self, config: EngineConfig, setup: ModelSetup, registry: Registry) -> None:
        tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
        check_model_parallel(setup.hf_config, tp, pp)
        self.world = tp * pp
        self.config = config
        device = torch.device(setup.device_type)
        # placeholders for tokens still being sampled need the sampled ids on every rank: one
        # stage only (pipeline stages before the last never see them)
        self.async_decode = async_scheduling(config, setup) and pp == 1
        if pp > 1:
            self.num_micro_batches = config.pipeline_micro_batches or pp
        self.max_concurrent_batches = (self.num_micro_batches if pp > 1
                                       else 2 if self.async_decode else 1)
        self.group = WorkerGroup(self.world, self._fail)
        self._dead: str | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._result_rank = (pp - 1) * tp if pp > 1 else None
        self._results: dict[int, RunnerOutput] = {}
        self._sent = self._received = 0  # steps expecting a result / results received
        backend = resolve_backend(config.distributed_backend, device)
        env = torchrun_env()
        try:
            if env is not None:
                self._check_torchrun(env)
                init_method, rendezvous = "env://", REMOTE_RENDEZVOUS_S
            else:
                init_method = self.group.spawn(config, device, self.check_health)
                rendezvous = SPAWN_RENDEZVOUS_S
            if device.type == "cuda":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) if env else 0)
                device = torch.device("cuda", torch.cuda.current_device())
            self.parallel = init_distributed(backend, init_method, 0, tp, pp,
                                             config.distributed_timeout, device, rendezvous)
            self.device = device
            if env is not None:
                self.group.accept_remote()
            else:
                self.group.start_watcher(self._result_rank)
            self.driver_runner = ModelRunner(config, setup, registry, self.parallel)
            self.group.wait_all("loaded", STARTUP_TIMEOUT_S, self.check_health)
        except BaseException as e:
            err = self._startup_error(e)
            self.shutdown()
            raise err from None
        ref = weakref.ref(self)
        atexit.register(lambda: (ex := ref()) is not None and ex.shutdown())
        logger.info("%d ranks (tensor_parallel_size=%d x pipeline_parallel_size=%d, %s%s) up",
                    self.world, tp, pp, backend, ", torchrun" if env else "")

    @property
    def workers(self):
        return self.group.workers

    def _check_torchrun(self, env: tuple[int, int]) -> None:
        rank, world = env
        if world != self.world:
            raise ConfigError(f"WORLD_SIZE={world} but tensor_parallel_size x "
                              f"pipeline_parallel_size = {self.world}")
        if rank != 0:
            raise ConfigError(f"RANK={rank}: only rank 0 runs the engine; start ranks > 0 with "
                              f"`python -m pagebatch.distributed.worker` (docs/parallel.md)")

    def _startup_error(self, e: BaseException) -> BaseException:
        """The most useful error after a failed start: a worker's own, when one reported it."""
        if isinstance(e, (WorkerError, ConfigError, KeyboardInterrupt)):
            return e
        return self.group.reported_error() or e

    def initialize_kv_cache(self) -> int:
        """Every rank sizes its cache (sharded KV heads, its stage's layers); all take the
        smallest block count so that block ids mean the same everywhere."""
        runner = self.driver_runner
        try:
            self.group.broadcast(step_codec.encode_control(step_codec.GO), self.check_health)
            num_blocks = all_reduce_min(runner.determine_num_blocks(), self.device,
                                        self.parallel.world_group)
            runner.allocate_kv_cache(num_blocks)
            self.group.wait_all("ready", STARTUP_TIMEOUT_S, self.check_health)
        except BaseException as e:
            err = self._startup_error(e)
            self.shutdown()
            raise err from None
        if self.group.remote:
            self.group.start_watcher(self._result_rank)
        return num_blocks

    # ---- steps --------------------------------------------------------------------------------

    def execute_model(self, so: SchedulerOutput) -> StepHandle:
        self.check_health()
        payload = step_codec.encode_step(so)
        runner = self.driver_runner
        try:
            self.group.broadcast(payload, self.check_health)
            if self.async_decode:
                return _AsyncResult(self, runner.execute_async(so))
            out = runner.execute(so)
        except EngineDeadError:
            raise
        except Exception as e:
            raise self._step_failed(e) from e
        if self._result_rank is None or so.is_empty:
            return DoneStep(out)
        self._sent += 1
        return _PipelineResult(self, self._sent)

    def wait_result(self, seq: int) -> RunnerOutput:
        """The `RunnerOutput` of the ``seq``-th step that expects one (in order)."""
        timeout = self.config.distributed_timeout
        deadline = time.monotonic() + timeout
        conn = self.workers[self._result_rank].conn
        while seq not in self._results:
            self.check_health()
            if conn.poll(POLL_S):
                msg = self.group.recv(self._result_rank)
                if msg[0] != "result":
                    raise self._fail(str(worker_error(msg)))
                self._received += 1
                self._results[self._received] = msg[1]
                deadline = time.monotonic() + timeout
            elif time.monotonic() > deadline:
                raise self._fail(f"no result from the last pipeline stage (rank "
                                 f"{self._result_rank}) within distributed_timeout={timeout:g} s")
        return self._results.pop(seq)

    # ---- failure ------------------------------------------------------------------------------

    def check_health(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)

    def _step_failed(self, e: Exception) -> EngineDeadError:
        """A step failed on the driver: the ranks are out of step, the engine cannot go on.
        When a worker died, that (found by the watcher within a moment) is the reason."""
        # a collective can fail (connection reset) a moment before the dead worker can be
        # reaped, so wait for the watcher a little even when no worker looks dead yet
        deadline = time.monotonic() + 2.0
        while self._dead is None and time.monotonic() < deadline:
            time.sleep(POLL_S)  # let the watcher name it
        return self._fail(f"a model step failed on rank 0: {type(e).__name__}: {e}")

    def _fail(self, reason: str) -> EngineDeadError:
        """Record the engine's death (the first reason wins), log it, stop every worker."""
        with self._lock:
            first = self._dead is None
            if first:
                self._dead = (f"{reason}; the engine cannot go on (tensor_parallel_size="
                              f"{self.config.tensor_parallel_size}, pipeline_parallel_size="
                              f"{self.config.pipeline_parallel_size})")
        if first:
            logger.error("%s", self._dead)
            self.group.kill()
            if self.hard_exit_on_worker_death:
                timer = threading.Timer(EXIT_GRACE_S, os._exit, (1,))
                timer.daemon = True  # a normal exit (the error reached the loop) goes first
                timer.start()
        return EngineDeadError(self._dead)

    # ---- shutdown -----------------------------------------------------------------------------

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        healthy = self._dead is None
        self.group.stop(step_codec.encode_control(step_codec.SHUTDOWN) if healthy else None)
        parallel = getattr(self, "parallel", None)
        if parallel is not None and (healthy or parallel.device.type != "cuda"):
            try:
                parallel.wait_sends()
            except Exception:
                pass
            if hasattr(self, "driver_runner") and parallel.device.type == "cuda":
                self.driver_runner.release_graphs()  # before the NCCL group goes
            destroy_distributed()  # (after a worker's death NCCL could hang here: skipped)
        if hasattr(self, "driver_runner"):
            self.driver_runner.kv_caches = []


class _AsyncResult(StepHandle):
    """A step the driver launched (``async_scheduling``); ``result`` waits for its copy back."""

    def __init__(self, executor: MultiprocExecutor, launched: Any) -> None:
        self.executor, self.launched = executor, launched

    def result(self) -> RunnerOutput:
        try:
            return self.executor.driver_runner.collect(self.launched)
        except EngineDeadError:
            raise
        except Exception as e:
            raise self.executor._step_failed(e) from e


class _PipelineResult(StepHandle):
    def __init__(self, executor: MultiprocExecutor, seq: int) -> None:
        self.executor, self.seq = executor, seq

    def result(self) -> RunnerOutput:
        return self.executor.wait_result(self.seq)
