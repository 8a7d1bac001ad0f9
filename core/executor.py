"""The `Executor` interface: how the engine core runs a `SchedulerOutput` on the model's ranks.

`EngineCore` (core/engine_core.py) owns one executor. ``execute_model(so)`` starts a step and
returns a `StepHandle`, a future-like object whose ``result()`` is the step's `RunnerOutput`.
An executor that can run steps concurrently says so with ``max_concurrent_batches`` (> 1): the
engine core then keeps up to that many steps in flight (its batch queue, after vLLM v1's
``step_with_batch_queue``), scheduling the next step while earlier ones run -- the pipeline
stages of `MultiprocExecutor` (core/distributed/executor.py) work on different micro-batches at
once that way; an executor that overlaps the host's work with the GPU's would too.

Implementations: `UniprocExecutor` (here: one `ModelRunner` in this process, steps complete
before ``execute_model`` returns) and `MultiprocExecutor` (tensor/pipeline parallel workers).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from .config import EngineConfig
from .model_runner import LaunchedStep, ModelRunner, PendingStep, RunnerOutput
from .model_setup import ModelSetup
from .scheduler import SchedulerOutput
from .structured_output import StructuredOutputBatch


class StepHandle(ABC):
    """A step in flight (a future). ``result()`` blocks until it is done and returns its
    `RunnerOutput`; it raises what the step raised (`EngineDeadError` when the executor can no
    longer run steps)."""

    @abstractmethod
    def result(self) -> RunnerOutput: ...


class DoneStep(StepHandle):
    """A step that finished when it was started."""

    def __init__(self, output: RunnerOutput) -> None:
        self._output = output

    def result(self) -> RunnerOutput:
        return self._output


class Executor(ABC):
    """Runs steps on the model. ``driver_runner`` is the `ModelRunner` in this process (rank 0's
    under parallelism; tests reach into it as ``EngineCore.runner``)."""

    driver_runner: ModelRunner
    # how many steps the engine core may keep in flight (1: each step waits for the previous)
    max_concurrent_batches: int = 1
    # how many groups the scheduler splits the running requests into, one per step in flight
    # (pipeline stages: each works on its own group); 1 = every step may take them all
    num_micro_batches: int = 1
    # the scheduler may schedule a request's next decode while its previous token is still
    # being sampled (PLACEHOLDER_TOKEN inputs, which the runner fills in on the device)
    async_decode: bool = False

    @abstractmethod
    def initialize_kv_cache(self) -> int:
        """Size and allocate the KV cache on every rank; returns the number of blocks (the same
        on all ranks: the smallest any rank can hold). Raises CacheTooSmallError."""

    @abstractmethod
    def execute_model(self, so: SchedulerOutput) -> StepHandle:
        """Start step ``so`` (steps run in the order they are started)."""

    # `start_forward` is implemented: the engine core may launch a step's forward before the
    # structured output bitmask of its constrained rows exists (it needs the previous step's
    # tokens), and give the bitmask when they are in (`PendingForward.finish`)
    supports_deferred_sampling: bool = False

    def start_forward(self, so: SchedulerOutput) -> "PendingForward":
        """Launch step ``so``'s forward only; ``so.structured_output`` is not read (the
        returned `PendingForward` takes it). Only where `supports_deferred_sampling`."""
        raise NotImplementedError(f"{type(self).__name__} samples with the forward")

    def check_health(self) -> None:
        """Raises EngineDeadError when the executor can no longer run steps."""

    def shutdown(self) -> None:
        """Stop workers and free the KV cache; idempotent."""
        self.driver_runner.kv_caches = []


class PendingForward(ABC):
    """A step whose forward runs and whose sampling waits for its bitmask."""

    @abstractmethod
    def finish(self, structured: StructuredOutputBatch | None) -> StepHandle:
        """Sample the step with ``structured`` (its constrained rows' bitmask, or None) and
        return its handle."""


class _LaunchedStepHandle(StepHandle):
    """A step launched on the GPU; ``result`` waits for its copy back."""

    def __init__(self, runner: ModelRunner, launched: LaunchedStep) -> None:
        self._runner, self._launched = runner, launched

    def result(self) -> RunnerOutput:
        return self._runner.collect(self._launched)


class UniprocExecutor(Executor):
    """One `ModelRunner` in this process. A failed step raises in ``execute_model`` (the engine
    core finishes that step's requests with an error and goes on).

    With ``async_scheduling`` (vLLM's name), two steps are in flight: ``execute_model`` only
    launches the GPU work, the engine core schedules and launches the next step (its decodes'
    input tokens filled in on the device from this step's samples), and only then waits for
    this one's results -- the CPU work of step N+1 overlaps the GPU work of step N. Otherwise
    every step is done when ``execute_model`` returns."""

    def __init__(self, runner: ModelRunner, async_scheduling: bool = False) -> None:
        self.driver_runner = runner
        self.max_concurrent_batches = 2 if async_scheduling else 1
        self.async_decode = async_scheduling

    def initialize_kv_cache(self) -> int:
        num_blocks = self.driver_runner.determine_num_blocks()
        self.driver_runner.allocate_kv_cache(num_blocks)
        return num_blocks

    def execute_model(self, so: SchedulerOutput) -> StepHandle:
        if self.async_decode:
            return _LaunchedStepHandle(self.driver_runner, self.driver_runner.execute_async(so))
        return DoneStep(self.driver_runner.execute(so))

    @property
    def supports_deferred_sampling(self) -> bool:  # with two steps in flight
        return self.async_decode

    def start_forward(self, so: SchedulerOutput) -> PendingForward:
        return _UniprocPending(self.driver_runner, self.driver_runner.launch_forward(so))


class _UniprocPending(PendingForward):
    def __init__(self, runner: ModelRunner, pending: PendingStep) -> None:
        self._runner, self._pending = runner, pending

    def finish(self, structured: StructuredOutputBatch | None) -> StepHandle:
        return _LaunchedStepHandle(self._runner, self._runner.finish_step(self._pending,
                                                                          structured))


def async_scheduling(config: EngineConfig, setup: ModelSetup) -> bool:
    """``async_scheduling``, its default resolved: on with CUDA, where the GPU runs ahead of the
    host; off on the CPU."""
    if config.async_scheduling is not None:
        return bool(config.async_scheduling)
    return setup.device_type == "cuda"
