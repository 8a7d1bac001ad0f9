"""Communication ops of tensor and pipeline parallelism, over torch.distributed (NCCL on GPU,
gloo on CPU). Layers call them through `ParallelContext` (core/distributed/parallel_state.py),
which skips them on a single rank.

On CUDA the all-reduce is an ordinary NCCL collective on the current stream, so a CUDA graph
captured after the communicator exists (the first collective creates it) replays it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def all_reduce(x: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Sum of ``x`` over ``group`` (None: the world), in place when ``x`` is contiguous, else
    in a contiguous copy (a backend may reduce a strided view's copy and leave the view as it
    was: a pipeline stage's received hidden states are such a view); returns the sum. Every
    rank gets the same bits (the reduced tensor is broadcast), so ranks that go on from it stay
    equal."""
    x = x.contiguous()
    dist.all_reduce(x, group=group)
    return x


def all_gather(x: torch.Tensor, world: int, dim: int = -1, group: Any = None) -> torch.Tensor:
    """The ``world`` ranks' ``x`` (same shape on each) concatenated along ``dim`` in rank
    order: [.., n, ..] -> [.., world * n, ..]."""
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=dim)


def send_tensor(x: torch.Tensor, dst: int, group: Any = None) -> Any:
    """Start sending ``x`` to global rank ``dst``; returns the work handle (keep ``x`` alive
    until ``wait()``)."""
    return dist.isend(x, dst, group=group)


def recv_tensor(buf: torch.Tensor, src: int, group: Any = None) -> torch.Tensor:
    """Receive into ``buf`` (its shape and dtype must match the sender's) from global rank
    ``src``."""
    dist.recv(buf, src, group=group)
    return buf


def all_reduce_min(value: int, device: torch.device, group: Any = None) -> int:
    """The smallest ``value`` over ``group`` (e.g. the KV block count every rank can hold)."""
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return int(t.item())
