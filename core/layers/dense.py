"""``x @ W^T (+ bias)`` for 16-bit weights ``[N, K]``: torch's ``F.linear`` (cuBLAS), or at
decode sizes on a GPU (up to ``GEMV_MAX_M`` rows) the Triton GEMV of core/kernels/gemv.py where
the ``dense_gemv`` config of the shape and row count says so: a table's entry (core/kernels/
tuned.py), else the start-up autotuner's pick among the rule's candidates (core/kernels/
autotune.py, core/kernels/gemv_configs.py), else the rule (the GEMV at one row, cuBLAS above).
`dense_linear_silu_mul` is the gate/up variant whose GEMV applies SiLU-and-mul in its epilogue
(None where the config is cuBLAS).

On the CPU in fp32 a layer may carry `CPUWeights` (`cpu_weights`, made once after loading): at
one row the product reads a transposed copy ``[K, N]`` (MKL's ``x @ W^T`` GEMV over ``[N, K]``
ran at 1.4x its time for the LM head on the project's 2-core AMD machine), above one row
oneDNN's blocked copy (``torch.ops.mkldnn._linear_pointwise``, what inductor's CPU freezing
uses: 3x faster than MKL for 16 rows there, and faster for prefill's thousands). Each copy costs
the weight's bytes again; a linear layer's ``[N, K]`` weight is then a view of the transposed
copy (quant/fp16.py: twice the bytes in all), the LM head keeps its table whole (a tied
embedding reads its rows)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagebatch.kernels import precompile

GEMV_MAX_M = 16
CPU_PACK_ROWS = 16  # the row count oneDNN's blocked layout is chosen for (good for 2..2048)
_kernels: dict = {}  # the Triton GEMV and the tables' module, imported on first CUDA use
_choice: dict[tuple, dict | None] = {}  # (device, N, K, M) -> GEMV parameters or None


def _modules():
    if not _kernels:
        from pagebatch.kernels import autotune, gemv, gemv_configs, num_sms, tuned

        _kernels.update(gemv=gemv.gemv, choose=autotune.choose, rule=gemv_configs,
                        num_sms=num_sms, config_dir=tuned.CONFIG_DIR)
    return _kernels


def gemv_key(n: int, k: int) -> str:
    """The key of an [N, K] weight in the ``dense_gemv`` tables."""
    return f"n={n},k={k}"


@dataclass(frozen=True)
class CPUWeights:
    """CPU copies of an fp32 weight ``[N, K]`` for `dense_linear`: ``t`` ``[K, N]``
    contiguous (one row), ``packed`` oneDNN's blocked layout (None where torch has no oneDNN)."""

    t: torch.Tensor
    packed: torch.Tensor | None


def cpu_weights(weight: torch.Tensor) -> CPUWeights | None:
    """`CPUWeights` of a loaded fp32 CPU weight ``[N, K]``, None for any other (the product
    then is ``F.linear``). Make them again when the weight changes."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2:
        return None
    packed = None
    if torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn,
                                                        "_reorder_linear_weight"):
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(),
                                                         CPU_PACK_ROWS)
    return CPUWeights(weight.detach().t().contiguous(), packed)


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 cpu: CPUWeights | None = None) -> torch.Tensor:
    """x ``[M, K]`` -> ``[M, N]`` in x's dtype (what ``F.linear`` computes). ``cpu``: the
    weight's `CPUWeights`, used for fp32 CPU inputs."""
    if cpu is not None and x.dim() == 2 and x.dtype == torch.float32 and not x.is_cuda:
        if x.shape[0] == 1:
            y = torch.mm(x, cpu.t)
            return y if bias is None else y.add_(bias)
        if cpu.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, cpu.packed, bias, "none", [], "")
    cfg = _gemv_config(x, weight, bias, False)
    if cfg is not None:
        return _kernels["gemv"](x, weight, bias, **cfg)
    return F.linear(x, weight, bias)


def dense_linear_silu_mul(x: torch.Tensor, weight: torch.Tensor,
                          bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """SiLU-and-mul of ``x @ W^T (+ bias)`` for W ``[2 * D, K]`` (D gate rows, then D up rows)
    as one GEMV launch: x ``[M, K]`` -> ``[M, D]``, where the table chose the GEMV for W's shape
    and M rows; None elsewhere (the caller runs the product and the activation)."""
    cfg = _gemv_config(x, weight, bias, True)
    if cfg is not None:
        return _kernels["gemv"](x, weight, bias, gated=True, **cfg)
    return None


def _gemv_config(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 gated: bool) -> dict | None:
    """The GEMV's parameters for this product, or None (cuBLAS): chosen once per (device, N,
    K, M, gated), only for CUDA inputs of at most GEMV_MAX_M rows in W's dtype."""
    if not (x.is_cuda and x.dim() == 2 and 0 < x.shape[0] <= GEMV_MAX_M
            and x.dtype == weight.dtype):
        return None
    key = (x.device, weight.shape[0], weight.shape[1], x.shape[0], gated)
    cfg = _choice.get(key, False)
    if cfg is False:  # first call for this shape (not remembered from a record pass)
        cfg = _lookup(*key, weight=weight, bias=bias)
        precompile.remember(_choice, key, cfg)
    return cfg


def _lookup(device: torch.device, n: int, k: int, m: int, gated: bool = False, *,
            weight: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> dict | None:
    """The GEMV's launch parameters where the shape's config (autotune.choose: the tables,
    the autotuner over `weight`, the rule) is the GEMV, else None (cuBLAS). Without ``weight``
    nothing is timed (tables, then the rule)."""
    mods = _modules()
    rule = mods["rule"]
    sms = mods["num_sms"](device)

    def candidates(rows: int) -> list[dict]:
        return rule.candidates(rows, n, k, sms, gated) if weight is not None else [
            rule.rule_config(rows, n, k, sms, gated)]

    def bench(rows: int):
        x = torch.randn(rows, k, device=device, dtype=weight.dtype)
        ref = F.linear(x, weight, bias)
        ref = _silu_mul(ref) if gated else ref

        def run(cfg: dict) -> torch.Tensor:
            if cfg["kernel"] == "cublas":
                out = F.linear(x, weight, bias)
                return _silu_mul(out) if gated else out
            params = {p: v for p, v in cfg.items() if p != "kernel"}
            return mods["gemv"](x, weight, bias, gated=gated, **params)
        return run, ref

    cfg = mods["choose"]("dense_gemv", device, gemv_key(n, k), m, mods["config_dir"],
                         candidates, bench)
    if cfg.pop("kernel", None) != "gemv":
        return None
    return cfg


def _silu_mul(y: torch.Tensor) -> torch.Tensor:
    """SiLU-and-mul of ``[M, 2D]`` (what decode runs after cuBLAS on a gate/up product)."""
    from pagebatch.kernels.activation import silu_and_mul

    return silu_and_mul(y)
