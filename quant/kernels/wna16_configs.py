"""Launch configs of the W4A16 / W8A16 product (quant/kernels/wna16.py): `pick_config` (a
table's entry, else the rule), the rule itself (`rule_config`) and the candidates the start-up
autotuner (core/kernels/autotune.py) times around it (`candidates`). A config is a ``wna16``
table entry: ``kernel`` ``gemv`` (wna16_gemv.py, CUDA cores), ``mma`` (w4a16_mma.py, tensor
cores) or ``gemm`` (wna16.py's split-K / tiled GEMM), plus that kernel's keywords.

The rule, from the H200 table (quant/kernels/configs/wna16_NVIDIA_H200.json; sessions 5-9 of
docs/benchmarks.md tuned it on the 8B shapes, AWQ g128):

- one row: the GEMV with the largest packed-row tile inside a group (16 rows = 128 inputs at 4
  bits), 64 columns, prefetch, and the fp16x2 fields (``half2``) for 4 bits and 16-bit
  activations (session 9: every shape 6-22 % faster with them). Split-K such that there are
  ~8 programs per SM (tiles x splits: qkv 96 x 12, o 64 x 16, down 64 x 16 won) and no split
  runs more than 8 K tiles (gate/up: 448 tiles x 4, the LM head 1002 x 3), snapped to the
  sweep's values 1, 2, 3, 4, 6, 8, 12, 16, 24, 32; 4 warps, 2 where the tiles alone give each
  SM more than 2 (gate/up and the LM head took 2);
- 2-16 rows, 4 bits and 16-bit activations: the tensor-core kernel (it won every 8B shape
  there but one, by 2-3x over the split-K GEMM: session 8) with 128-column tiles on 8 warps,
  split-K for ~2 programs per SM, a power of two up to 16 (o and down: 32 tiles x 8; gate/up
  224 x 1);
- else (g_idx, 8 bits, fp32 activations, prefill sizes) the Triton GEMM of wna16.py: split-K
  at decode sizes, larger tiles for more rows.
"""

from __future__ import annotations

import torch
import triton

from pagebatch.kernels import num_sms, tuned
from pagebatch.kernels.splitk import MAX_COUNTERS

from . import CONFIG_DIR
from .wna16_gemv import gemv_supported

DECODE_MAX_M = 16
GEMV_SPLITS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
MMA_SPLITS = (1, 2, 4, 8, 16)


def _num_sms(device: torch.device) -> int:
    return num_sms(device) if device.type == "cuda" else 8  # the interpreter: any small number


def shape_key(bits: int, n: int, k: int, group_size: int) -> str:
    """The key of a layer shape in the tuned-config tables (quant/kernels/configs/, read by
    core/kernels/tuned.py)."""
    return f"bits={bits},n={n},k={k},group={group_size}"


def pick_config(m: int, n: int, k: int, group_size: int, has_g_idx: bool,
                device: torch.device, bits: int = 4, tuned_table: bool = True,
                act16: bool = False) -> dict:
    """Path and launch parameters for an [m, k] x [k, n] product: a measured config (the
    tables of core/kernels/tuned.py: a sweep's, the autotuner's user cache, the packaged one)
    unless ``tuned_table`` is False; otherwise `rule_config`. ``act16``: the activations are
    bf16/fp16 (the rule may then take the tensor-core kernel and the fp16x2 fields)."""
    if tuned_table and not has_g_idx and m <= DECODE_MAX_M:
        cfg = tuned.lookup("wna16", device, shape_key(bits, n, k, group_size), m, CONFIG_DIR)
        if cfg is not None:
            return cfg
    return rule_config(m, n, k, group_size, has_g_idx, _num_sms(device), bits, act16)


def _snap(v: float, allowed: tuple[int, ...]) -> int:
    return min(allowed, key=lambda a: abs(a - v) / a)


def _gemv_kp(bits: int, group_size: int) -> int | None:
    for kp in (16, 8, 4):
        if gemv_supported(bits, group_size, kp, False):
            return kp
    return None


def _gemv(m: int, n: int, k: int, bits: int, sms: int, act16: bool, kp: int, block_n: int = 64,
          num_warps: int | None = None, prefetch: int = 1, split_k: int | None = None) -> dict:
    tiles = triton.cdiv(n, block_n)
    k_tiles = triton.cdiv(k, kp * (32 // bits))
    if split_k is None:
        split_k = _snap(max(8 * sms / tiles, k_tiles / 8, 1), GEMV_SPLITS)
    split_k = _balanced(split_k, k_tiles)
    if m * tiles > MAX_COUNTERS:
        split_k = 1
    if num_warps is None:
        num_warps = 2 if tiles > 2 * sms else 4
    return dict(kernel="gemv", block_n=block_n, block_kp=kp, sub_tiles=1, split_k=split_k,
                prefetch=prefetch, num_warps=num_warps, num_stages=3,
                half2=int(act16 and bits == 4 and kp >= 2))


def _mma_block_k(k: int, group_size: int) -> int | None:
    for bk in (128, 64, 32):
        if group_size % bk == 0 and k % bk == 0:
            return bk
    return None


def _mma(m: int, n: int, k: int, sms: int, bk: int, block_n: int = 128, num_warps: int = 8,
         split_k: int | None = None) -> dict:
    tiles = triton.cdiv(n, block_n)
    if split_k is None:
        split_k = _snap(max(2 * sms / tiles, 1), MMA_SPLITS)
    split_k = _balanced(min(split_k, 16), k // bk)
    if m * tiles > MAX_COUNTERS:
        split_k = 1
    return dict(kernel="mma", block_m=16, block_n=block_n, block_k=bk, split_k=split_k,
                num_warps=num_warps, num_stages=3)


def rule_config(m: int, n: int, k: int, group_size: int, has_g_idx: bool, sms: int,
                bits: int = 4, act16: bool = False) -> dict:
    """The rule's config (module docstring) for ``m`` rows of x ``[m, K]`` times the packed W
    ``[K, N]`` of ``bits`` bits in groups of ``group_size`` on ``sms`` SMs."""
    kp = None if has_g_idx else _gemv_kp(bits, group_size)
    if m == 1 and kp is not None:
        return _gemv(m, n, k, bits, sms, act16, kp)
    bk = _mma_block_k(k, group_size)
    if 1 < m <= DECODE_MAX_M and act16 and bits == 4 and not has_g_idx and bk is not None:
        return _mma(m, n, k, sms, bk)
    return _gemm(m, n, k, group_size, has_g_idx, sms)


def _gemm(m: int, n: int, k: int, group_size: int, has_g_idx: bool, sms: int) -> dict:
    """The Triton GEMM's heuristics (split-K to fill the GPU at decode sizes)."""
    if m <= DECODE_MAX_M:
        cfg = dict(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=4)
    elif m <= 64:
        cfg = dict(block_m=max(16, triton.next_power_of_2(m)), block_n=128, block_k=64,
                   num_warps=4, num_stages=4)
    else:
        cfg = dict(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3)
    if not has_g_idx and group_size % cfg["block_k"] and group_size >= 16 and (
            group_size & (group_size - 1)) == 0:
        cfg["block_k"] = min(cfg["block_k"], group_size)  # keep one group per K tile
    split = 1
    if m <= DECODE_MAX_M:
        tiles = triton.cdiv(n, cfg["block_n"]) * triton.cdiv(m, cfg["block_m"])
        k_tiles = triton.cdiv(k, cfg["block_k"])
        want = max(1, 2 * sms // tiles)
        split = min(triton.next_power_of_2(want), k_tiles, 16)
    cfg["split_k"] = split
    cfg["kernel"] = "gemm"
    return cfg


def candidates(m: int, n: int, k: int, group_size: int, has_g_idx: bool, sms: int,
               bits: int = 4, act16: bool = False) -> list[dict]:
    """What the autotuner times at ``m`` rows (the rule's config first, each a valid launch):
    one row, the GEMV rule and its neighbours (split-K x2 / /2, the other warp count, no
    prefetch, 128 columns on 2 warps); 2-16 rows with the tensor-core kernel, its rule, split-K
    x2 and /2, and 256 columns on 4 warps (the table's choice for o and down); else the rule
    alone (nothing is timed)."""
    rule = rule_config(m, n, k, group_size, has_g_idx, sms, bits, act16)
    out = [rule]
    if rule["kernel"] == "gemv":
        kp, sk, w = rule["block_kp"], rule["split_k"], rule["num_warps"]
        variants = [dict(split_k=_up(sk, GEMV_SPLITS)), dict(split_k=_down(sk, GEMV_SPLITS)),
                    dict(num_warps=6 - w, split_k=sk), dict(prefetch=0, split_k=sk),
                    dict(block_n=128, num_warps=2, prefetch=0)]
        out += [_gemv(m, n, k, bits, sms, act16, kp, **v) for v in variants]
    elif rule["kernel"] == "mma":
        bk, sk = rule["block_k"], rule["split_k"]
        out += [_mma(m, n, k, sms, bk, split_k=_up(sk, MMA_SPLITS)),
                _mma(m, n, k, sms, bk, split_k=_down(sk, MMA_SPLITS)),
                _mma(m, n, k, sms, bk, block_n=256, num_warps=4)]
    unique = []
    for cfg in out:
        if cfg not in unique:
            unique.append(cfg)
    return unique


def _balanced(split_k: int, k_tiles: int) -> int:
    """``split_k`` clamped to 1..k_tiles and lowered to the fewest splits with the same K
    tiles per split (the kernels give each split ceil(k_tiles / split_k) tiles: no split left
    empty)."""
    split_k = max(1, min(split_k, k_tiles))
    return triton.cdiv(k_tiles, triton.cdiv(k_tiles, split_k))


def _up(v: int, allowed: tuple[int, ...]) -> int:
    return next((a for a in allowed if a > v), v)


def _down(v: int, allowed: tuple[int, ...]) -> int:
    return next((a for a in reversed(allowed) if a < v), v)
