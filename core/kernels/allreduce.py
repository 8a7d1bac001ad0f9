"""One-shot all-reduce for tensor-parallel decode, optionally fused with the residual add and
RMSNorm that follow a row-parallel layer: one Triton kernel per reduction, where NCCL takes a
kernel of its own (~7 us for the 8 KB of one token of the 8B shape on two H200s) plus a launch
gap, and the norm another kernel (docs/benchmarks.md, sessions 5 and 6).

Each rank owns a buffer that every rank of the group can address (CUDA symmetric memory, set up
by core/distributed/custom_allreduce.py) and a signal array in the same kind of memory. Program
``row`` of a launch:

1. waits for the previous kernel (PDL), loads its row of x and writes it into its own buffer,
   in slot ``epoch % 2`` (two slots: a rank may write launch t+1's row while a slower peer
   still reads launch t's; launch t+2 reuses the slot only after every peer has signalled
   t+1, which each does after finishing t);
2. sets its flag (``epoch``) in every rank's signal array (release, system scope) and spins
   until every rank's flag in its own array reaches ``epoch`` (acquire, system scope);
3. reads the W rows from the W buffers in rank order and sums them in fp32: every rank gets
   the same bits. The sum is rounded to x's dtype (what NCCL returns for two ranks), then,
   fused, added to the residual and normalized exactly as core/kernels/norm.py does.

``epoch`` is a per-row launch counter in device memory (int64, no wrap in practice): every rank
launches the same sequence of reductions, so the counters agree without the host, and CUDA
graphs replay the kernel as captured. The pattern is that of vLLM's and TensorRT-LLM's custom
all-reduce (one-shot, flags in peer memory); here in Triton so that it launches with PDL and
fuses the norm.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl
from .norm import add_residual, rms_norm_row, row_warps


@triton.jit
def _load(ptrs, mask, cache: tl.constexpr, EVEN: tl.constexpr):
    if EVEN:
        return tl.load(ptrs, cache_modifier=cache)
    return tl.load(ptrs, mask=mask, other=0.0, cache_modifier=cache)


@triton.jit
def _one_shot_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, buf_ptr, peer_offs_ptr,
                     sigs_ptr, epoch_ptr, rank, n_cols, slot_elems, eps,
                     WORLD: tl.constexpr, BLOCK: tl.constexpr, NORM: tl.constexpr,
                     EVEN: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    # EVEN: the row is the block, so no masks, and 16-byte accesses to the (aligned) buffers
    mask = offs < n_cols
    dtype = x_ptr.dtype.element_ty
    pdl.wait(PDL)  # x, the residual and the buffers are the earlier kernels'
    epoch = tl.load(epoch_ptr + row) + 1
    base = (epoch % 2) * slot_elems + row * n_cols
    x = _load(x_ptr + row * n_cols + offs, mask, "", EVEN)
    if EVEN:
        tl.store(buf_ptr + base + offs, x)
    else:
        tl.store(buf_ptr + base + offs, x, mask=mask)
    tl.debug_barrier()  # the whole row is written before the flag goes out
    for r in tl.static_range(WORLD):
        sig = tl.load(sigs_ptr + r).to(tl.pointer_type(tl.int64))
        tl.atomic_xchg(sig + row * WORLD + rank, epoch, sem="release", scope="sys")
    flags = tl.load(sigs_ptr + rank).to(tl.pointer_type(tl.int64)) + row * WORLD
    for r in tl.static_range(WORLD):
        while tl.atomic_add(flags + r, 0, sem="acquire", scope="sys") < epoch:
            pass
    tl.debug_barrier()
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for r in tl.static_range(WORLD):  # rank order: the same sum on every rank
        # rank r's buffer as an element offset from this rank's (16-byte aligned, so the
        # loads stay 16 bytes wide, which an address loaded as an integer would not allow)
        peer = buf_ptr + tl.multiple_of(tl.load(peer_offs_ptr + r), 16)
        acc += _load(peer + base + offs, mask, ".cv", EVEN).to(tl.float32)
    tl.store(epoch_ptr + row, epoch)
    pdl.launch_dependents(PDL)
    s = acc.to(dtype)
    if NORM:
        s = add_residual(s, res_ptr + row * n_cols, res_out_ptr + row * n_cols, offs, mask)
        tl.store(out_ptr + row * n_cols + offs,
                 rms_norm_row(s, w_ptr, offs, mask, n_cols, eps, dtype), mask=mask)
    else:
        tl.store(out_ptr + row * n_cols + offs, s, mask=mask)


class OneShotAllReduce:
    """The all-reduce of this rank over ``world`` ranks. ``buffer``: this rank's buffer, a
    tensor of ``2 * max_rows * hidden`` elements (two slots); ``buffer_ptrs``: every rank's
    buffer address as this process sees it (this rank's is ``buffer``'s), each 16-byte aligned;
    ``signal_ptrs``: every rank's signal array (``max_rows * world`` int64, zero at the start).
    ``keepalive``: objects that own that memory. Inputs: ``[rows, hidden]`` of the buffer's
    dtype on its device, rows <= ``max_rows`` (see `fits`). Every rank must call it the same
    number of times with the same row counts.

    Raises ValueError when the addresses do not match ``world`` or are not aligned."""

    def __init__(self, buffer: torch.Tensor, buffer_ptrs: list[int], signal_ptrs: list[int],
                 rank: int, world: int, max_rows: int, hidden: int, keepalive: tuple = ()):
        if len(buffer_ptrs) != world or len(signal_ptrs) != world:
            raise ValueError(f"one-shot all-reduce: {world} ranks need {world} buffer and "
                             f"signal addresses, got {len(buffer_ptrs)} and {len(signal_ptrs)}")
        if not 0 <= rank < world:
            raise ValueError(f"one-shot all-reduce: rank {rank} outside [0, {world})")
        if buffer.numel() < 2 * max_rows * hidden or buffer_ptrs[rank] != buffer.data_ptr():
            raise ValueError(f"one-shot all-reduce: rank {rank}'s buffer ({buffer.numel()} "
                             f"elements at {buffer.data_ptr():#x}) is not the one at "
                             f"{buffer_ptrs[rank]:#x} with 2 x {max_rows} x {hidden} elements")
        size = buffer.element_size()
        offs = [p - buffer.data_ptr() for p in buffer_ptrs]
        if any(o % (16 * size) for o in offs) or buffer.data_ptr() % 16:
            raise ValueError(f"one-shot all-reduce: buffer addresses "
                             f"{[hex(p) for p in buffer_ptrs]} are not 16-byte aligned and a "
                             f"multiple of 16 elements apart")
        self.buffer, self.device, self.dtype = buffer, buffer.device, buffer.dtype
        self.peer_offsets = torch.tensor([o // size for o in offs], dtype=torch.int64,
                                         device=buffer.device)
        self.signal_ptrs = torch.tensor(signal_ptrs, dtype=torch.int64, device=buffer.device)
        self.rank, self.world, self.max_rows, self.hidden = rank, world, max_rows, hidden
        self.epochs = torch.zeros(max_rows, dtype=torch.int64, device=buffer.device)
        self._keepalive = keepalive
        self._block = triton.next_power_of_2(hidden)
        self._warps = row_warps(self._block)
        # the row is the block: no masks, 16-byte accesses
        self._even = self._block == hidden and hidden % 8 == 0

    def fits(self, x: torch.Tensor) -> bool:
        """Whether ``x`` can go through this all-reduce (else the caller uses NCCL)."""
        return (x.dim() == 2 and 0 < x.shape[0] <= self.max_rows and x.shape[1] == self.hidden
                and x.dtype == self.dtype and x.device == self.device)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of ``x`` [rows, hidden] over the ranks, a new tensor in x's dtype."""
        x = x.contiguous()
        out = torch.empty_like(x)
        self._launch(x, None, None, out, None, 0.0)
        return out

    def all_reduce_add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor,
                                weight: torch.Tensor, eps: float):
        """(norm(sum + residual) * weight, sum + residual), sum the all-reduce of ``x``: what
        ``rms_norm(all_reduce(x), weight, eps, residual)`` returns (core/kernels/norm.py), in
        one launch."""
        x = x.contiguous()
        out = torch.empty_like(x)
        res_out = torch.empty_like(x)
        self._launch(x, residual.contiguous(), weight, out, res_out, eps)
        return out, res_out

    def _launch(self, x, residual, weight, out, res_out, eps: float) -> None:
        norm = residual is not None
        _one_shot_kernel[(x.shape[0],)](
            x, residual if norm else x, weight if norm else x, out, res_out if norm else out,
            self.buffer, self.peer_offsets, self.signal_ptrs, self.epochs, self.rank,
            self.hidden, self.max_rows * self.hidden, eps, WORLD=self.world, BLOCK=self._block,
            NORM=norm, EVEN=self._even, num_warps=self._warps,
            **pdl.launch_options(x.device))
