"""Programmatic dependent launch (PDL; CUDA on Hopper and later): a kernel launched with it may
start while the kernel before it in the stream is still finishing, and waits on the device
(``griddepcontrol.wait``) before it reads what that kernel wrote. At batch 1 a decode step is
hundreds of short kernels; each boundary otherwise costs a drain and a launch ramp (~1-2 us,
docs/benchmarks.md "Session 5"), and a GEMV can start streaming its weights, which no kernel
writes, before the wait.

The rule every kernel here keeps when ``PDL`` is on: `wait` before its first load of data an
earlier kernel may write and before its first store (so it is transitively ordered after every
earlier kernel, not only the last one); reads of weights may come before. `launch_dependents`
lets the next kernel's programs be scheduled; kernels call it once their main loads are issued.

On by default on compute capability 9.0+ (measured on an H200, session 6: batch-1 decode of the
8B shape 213.8 -> 216.9 tok/s, AWQ 363.4 -> 373.2, the 1B shape 889.8 -> 905.0; the compiled
kernel tests pass with it); ``PAGEBATCH_PDL=0`` turns it off. Elsewhere, and under the Triton
interpreter, kernels launch as before.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

ENV = "PAGEBATCH_PDL"


def enabled(device: torch.device) -> bool:
    """Whether kernels on ``device`` launch with PDL (unless ``PAGEBATCH_PDL=0``, read once per
    process; CUDA 9.0+)."""
    if device.type != "cuda" or not _asked():
        return False
    idx = device.index if device.index is not None else torch.cuda.current_device()
    return _capable(idx)


@functools.cache
def _asked() -> bool:
    return os.environ.get(ENV, "1") != "0"


@functools.cache
def _capable(idx: int) -> bool:
    return torch.cuda.get_device_capability(idx)[0] >= 9


def launch_options(device: torch.device) -> dict:
    """Keyword arguments for a kernel launch: the kernel's ``PDL`` constexpr and, when on,
    Triton's ``launch_pdl``."""
    return {"PDL": True, "launch_pdl": True} if enabled(device) else {"PDL": False}


@triton.jit
def wait(PDL: tl.constexpr):
    """Wait for the previous kernel in the stream to finish and its writes to be visible."""
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def launch_dependents(PDL: tl.constexpr):
    """Let the next kernel start being scheduled (a hint; it still waits before its reads)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
