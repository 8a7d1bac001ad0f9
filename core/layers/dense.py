"""``x @ W^T (+ bias)`` for 16-bit weights ``[N, K]``: torch's ``F.linear`` (cuBLAS), except at
decode sizes on a GPU whose tuned table (core/kernels/tuned.py, kernel ``dense_gemv``) measured
the Triton GEMV of core/kernels/gemv.py faster for this shape and row count. Without a table
entry nothing changes; the lookup is skipped for more than ``GEMV_MAX_M`` rows (prefill).
`dense_linear_silu_mul` is the gate/up variant whose GEMV applies SiLU-and-mul in its epilogue
(None where the table did not choose the GEMV)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

GEMV_MAX_M = 16
_kernels: dict = {}  # the Triton GEMV and the tables' module, imported on first CUDA use
_choice: dict[tuple, dict | None] = {}  # (device, N, K, M) -> GEMV parameters or None


def _modules():
    if not _kernels:
        from pagebatch.kernels import gemv, tuned

        _kernels.update(gemv=gemv.gemv, lookup=tuned.lookup)
    return _kernels


def gemv_key(n: int, k: int) -> str:
    """The key of an [N, K] weight in the ``dense_gemv`` tables."""
    return f"n={n},k={k}"


def dense_linear(x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """x ``[M, K]`` -> ``[M, N]`` in x's dtype (what ``F.linear`` computes)."""
    cfg = _gemv_config(x, weight)
    if cfg is not None:
        return _kernels["gemv"](x, weight, bias, **cfg)
    return F.linear(x, weight, bias)


def dense_linear_silu_mul(x: torch.Tensor, weight: torch.Tensor,
                          bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """SiLU-and-mul of ``x @ W^T (+ bias)`` for W ``[2 * D, K]`` (D gate rows, then D up rows)
    as one GEMV launch: x ``[M, K]`` -> ``[M, D]``, where the table chose the GEMV for W's shape
    and M rows; None elsewhere (the caller runs the product and the activation)."""
    cfg = _gemv_config(x, weight)
    if cfg is not None:
        return _kernels["gemv"](x, weight, bias, gated=True, **cfg)
    return None


def _gemv_config(x: torch.Tensor, weight: torch.Tensor) -> dict | None:
    """The GEMV's parameters for this product, or None (cuBLAS): the table is asked once per
    (device, N, K, M), only for CUDA inputs of at most GEMV_MAX_M rows in W's dtype."""
    if not (x.is_cuda and x.dim() == 2 and x.shape[0] <= GEMV_MAX_M
            and x.dtype == weight.dtype):
        return None
    key = (x.device, weight.shape[0], weight.shape[1], x.shape[0])
    cfg = _choice.get(key, False)
    if cfg is False:  # first call for this shape
        cfg = _choice[key] = _lookup(*key)
    return cfg


def _lookup(device: torch.device, n: int, k: int, m: int) -> dict | None:
    """The GEMV's launch parameters where the table chose it, else None (cuBLAS)."""
    cfg = _modules()["lookup"]("dense_gemv", device, gemv_key(n, k), m)
    if cfg is None or cfg.pop("kernel", None) != "gemv":
        return None
    return cfg
