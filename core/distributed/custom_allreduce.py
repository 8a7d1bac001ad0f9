"""Set-up of the one-shot all-reduce (core/kernels/allreduce.py) for a tensor-parallel group on
CUDA: each rank's buffer and signal array in torch symmetric memory
(``torch.distributed._symmetric_memory``: memory every rank of the group maps, with the peers'
addresses given by the rendezvous), sized for inputs of up to ``ONE_SHOT_MAX_BYTES`` per rank.
Larger inputs (prefill) go through NCCL. Anything that fails here (no peer access, a torch
without symmetric memory) leaves the engine on NCCL with a warning."""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

ONE_SHOT_MAX_BYTES = 512 * 1024  # per rank: 64 tokens of a 4096-wide bf16 model


def one_shot_rows(hidden: int, dtype: torch.dtype) -> int:
    """Rows (tokens) of ``hidden`` elements of ``dtype`` an input may have (at least 1)."""
    return max(1, ONE_SHOT_MAX_BYTES // (hidden * dtype.itemsize))


def create_one_shot(group: Any, hidden: int, dtype: torch.dtype, device: torch.device):
    """The one-shot all-reduce of this rank over ``group`` (a NCCL process group on CUDA
    devices) for ``[rows, hidden]`` inputs of ``dtype``, or None (with a logged reason) where
    it cannot be set up. Collective: every rank of the group calls it."""
    if device.type != "cuda":  # (before the import: the CPU set-up has no Triton)
        return None
    from ..kernels.allreduce import OneShotAllReduce

    rows = one_shot_rows(hidden, dtype)
    world = dist.get_world_size(group)
    try:
        import torch.distributed._symmetric_memory as symm_mem

        name = group.group_name
        buf = symm_mem.empty(2 * rows * hidden, dtype=dtype, device=device)
        buf_handle = symm_mem.rendezvous(buf, name)
        sig = symm_mem.empty(rows * world, dtype=torch.int64, device=device)
        sig.zero_()
        sig_handle = symm_mem.rendezvous(sig, name)
        torch.cuda.synchronize(device)
        dist.barrier(group=group)  # every rank's flags are zero before any rank sets one
        rank = buf_handle.rank
        return OneShotAllReduce(buf, list(buf_handle.buffer_ptrs),
                                list(sig_handle.buffer_ptrs), rank, world, rows, hidden,
                                keepalive=(buf_handle, sig, sig_handle))
    except Exception as e:  # noqa: BLE001 - fall back to NCCL, say why
        logger.warning("custom_all_reduce: the one-shot all-reduce could not be set up "
                       "(%s: %s); NCCL all-reduces, then the norm", type(e).__name__, e)
        return None
