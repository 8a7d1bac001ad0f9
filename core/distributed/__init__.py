"""Tensor and pipeline parallelism over torch.distributed: ranks and groups
(`parallel_state`), communication ops (`comm`), the step messages sent to the workers
(`step_codec`, over the shared-memory ring of `shm_ring` or a socket), the driver's
`MultiprocExecutor` (`executor`) and the worker process (`worker`). See docs/parallel.md."""

from .parallel_state import ParallelContext

__all__ = ["ParallelContext"]
