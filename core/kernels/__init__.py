"""Fused Triton kernels for the layers in core/layers/, used there on CUDA only (the CPU keeps
the plain torch path). Each module imports Triton, so import one only where it will run:
``TRITON_INTERPRET=1`` (tests on the CPU) is read when its kernels are decorated, at import.

- norm.py: RMSNorm with the residual add fused in (one read of x and residual, one write each).
- activation.py: SiLU-and-mul (SwiGLU's gate).
- rotary.py: rotary embedding of q and k in one launch, from the layer's cos/sin table.
- gemv.py: the 16-bit batch-1 GEMV (where a tuned table says it beats cuBLAS); splitk.py: the
  split-K reduction by the last-arriving program that it, the W4A16 GEMV, the split-KV
  attention merge and argmax.py (the sampler's argmax) share; tuned.py: the lookup of per-GPU
  config tables (configs/ holds the shared kernels' tables; quant/kernels/configs/ the quant
  kernels'; the user cache the autotuner's); autotune.py: the start-up autotuner for shapes no
  table has, shared by the 16-bit GEMV and the W4A16 kernels; gemv_configs.py: the 16-bit
  GEMV's launch rule and candidates.
- pdl.py: programmatic dependent launch for these kernels (on; ``PAGEBATCH_PDL=0`` turns it off).

What lives here: kernels that core layers, the sampler or distributed code use, and primitives
several owners share (split-K, PDL, the tuned-table lookup). A kernel or table only one plugin
family uses lives with it (quant/kernels/, plugins/attention/triton_kernels.py).

Each rounds where its torch version in core/layers/ rounds, so the two agree to fp32 rounding
(e.g. ``x + residual`` is rounded to x's dtype before it is normalised).

`num_sms` (here, no Triton import) is what the launch heuristics of every kernel family size
their grids by.
"""

from __future__ import annotations

import functools

import torch


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA ``device`` (looked up once per device)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    return _sm_count(idx)


@functools.cache
def _sm_count(idx: int) -> int:
    return torch.cuda.get_device_properties(idx).multi_processor_count
