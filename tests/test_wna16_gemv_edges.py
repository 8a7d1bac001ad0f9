"""Edge cases of the W4A16 / W8A16 decode paths: the CUDA-core GEMV (quant/kernels/wna16_gemv.py:
fp32 magic-number fields, split-K by the last-arriving program) — precision with activations of
non-zero mean, input checks — `pick_config` / `run_config` / `wna16_matmul` (quant/kernels/
wna16.py) and the tuned tables (quant/kernels/configs/, core/kernels/tuned.py). On the CPU the
kernels run under ``TRITON_INTERPRET=1`` in a child process (tests/interpreted.py).
"""

from __future__ import annotations

import json

import pytest
import torch

from interpreted import (DEVICE, IN_PROCESS, ON_GPU, kernels_run_here,  # noqa: F401
                         run_under_interpreter)


def test_kernels_under_interpreter():
    """CPU: this file in a fresh process under TRITON_INTERPRET=1; fails with its output."""
    run_under_interpreter(__file__, timeout=600)


def _counters():
    try:
        from pagebatch.kernels.splitk import counter_buffer
    except ImportError:  # before the split-K helper moved to core/kernels/splitk.py
        from pagebatch.quant.kernels.wna16_gemv import _counter_buffer as counter_buffer
    return counter_buffer(DEVICE)


def _problem(m, n, k, bits, gs, *, zeros="rand", x_scale=1.0, x_mean=0.0, centered=False,
             dtype=torch.float16, seed=0):
    """Canonical tensors (qweight [K*bits/32, N], scales/zeros [G, N]) from random fields, x, and
    the fp64 reference of x @ W^T from the exact stored values. ``centered``: fields around the
    zero point 2**(bits-1), as RTN / AWQ / GPTQ weights are (w has mean ~0)."""
    from pagebatch.quant.packing import pack_fields

    g = torch.Generator().manual_seed(seed)
    n_groups = k // gs
    if centered:
        q = (torch.randn(k, n, generator=g) * 2**bits / 6).round().add(2 ** (bits - 1))
        q = q.clamp(0, 2**bits - 1).int()
        z = torch.full((n_groups, n), float(2 ** (bits - 1)))
    else:
        q = torch.randint(0, 2**bits, (k, n), generator=g, dtype=torch.int32)
        z = {"zero": torch.zeros(n_groups, n), "max": torch.full((n_groups, n), 2.0**bits - 1),
             "rand": torch.randint(0, 2**bits, (n_groups, n), generator=g).float()}[zeros]
    s = torch.rand(n_groups, n, generator=g) * 0.05 + 0.005
    x = (torch.randn(m, k, generator=g) + x_mean) * x_scale
    x, s, z = x.to(dtype), s.to(dtype), z.to(dtype)
    rows = torch.arange(k) // gs
    wt = (q.double() - z.double()[rows]) * s.double()[rows]
    ref = x.double() @ wt
    return [t.to(DEVICE) for t in (x, pack_fields(q, bits, dim=0), s, z)] + [ref]


def _rel(out, ref):
    return ((out.double().cpu() - ref).norm() / ref.norm()).item()


# ---- what holds ---------------------------------------------------------------------------------

# m, n, k, bits, group (0: K), block_n, block_kp, split_k, zeros, x scale[, sub_tiles]
GEMV_CASES = [
    (1, 40, 256, 4, 32, 32, 4, 1, "zero", 1.0),
    (2, 33, 256, 4, 32, 32, 4, 16, "max", 1e3),      # split_k > k tiles (8)
    (5, 33, 384, 4, 64, 16, 8, 3, "rand", 1e-4),     # split_k not dividing the k tiles
    (3, 72, 512, 4, 0, 32, 16, 8, "max", 1.0),       # one group of K
    (1, 40, 256, 8, 32, 32, 8, 1, "max", 1e-4),
    (4, 33, 384, 8, 128, 64, 16, 5, "zero", 1e2),    # N < block_n, k tiles (6) % split != 0
    (2, 72, 512, 8, 0, 32, 4, 16, "rand", 1.0),
    # several sub-tiles per iteration, each with its own group: K = 384 leaves a partial
    # iteration (sub-tiles past K masked), splits that divide and do not divide the iterations
    (1, 40, 384, 4, 64, 32, 8, 1, "rand", 1.0, 4),
    (3, 33, 384, 4, 32, 16, 4, 2, "max", 1e2, 2),
    (2, 72, 512, 4, 0, 32, 16, 3, "rand", 1e-3, 2),  # one group of K
    (1, 40, 768, 8, 64, 32, 16, 5, "zero", 1.0, 4),
    (1, 40, 384, 4, 0, 32, 16, 2, "rand", 1.0),      # 3 tiles per group: the division path
    (2, 64, 1024, 4, 128, 32, 16, 3, "rand", 1.0, 2),  # K, N multiples of the tile: no masks
    (1, 64, 512, 8, 64, 64, 16, 2, "max", 1e2, 2),     # no masks at 8 bits
]


@pytest.mark.parametrize("m,n,k,bits,gs,block_n,block_kp,split_k,zeros,x_scale,sub_tiles",
                         [c if len(c) == 11 else (*c, 1) for c in GEMV_CASES])
@pytest.mark.parametrize("prefetch", [False, True], ids=["", "prefetch"])
def test_gemv_matches_fp64(m, n, k, bits, gs, block_n, block_kp, split_k, zeros, x_scale,
                           sub_tiles, prefetch):
    """Zero-mean activations of any magnitude: within the fp16 output rounding (~2.5e-4) of the
    fp64 product, twice in a row (the counters are reused), counters left at zero."""
    from pagebatch.quant.kernels.wna16_gemv import wna16_gemv

    gs = gs or k
    x, qw, s, z, ref = _problem(m, n, k, bits, gs, zeros=zeros, x_scale=x_scale, seed=m + n + k)
    for _ in range(2):
        out = wna16_gemv(x, qw, s, z, bits, gs, block_n=block_n, block_kp=block_kp,
                         split_k=split_k, sub_tiles=sub_tiles, prefetch=prefetch)
        assert out.shape == (m, n) and out.dtype == x.dtype
        assert _rel(out, ref) < 6e-4
        if split_k > 1:
            assert not _counters().any()


@pytest.mark.parametrize("m,n,k,bits,gs,block_n,block_kp,split_k", [
    (1, 64, 256, 4, 32, 32, 4, 1),     # 32 outputs, 16 per tile: unmasked
    (2, 66, 384, 4, 64, 16, 8, 3),     # 33 outputs: the last tile partly out of range
    (3, 80, 512, 8, 128, 64, 16, 4)])  # 8 bits, one tile wider than the 40 outputs
def test_gated_gemv_is_silu_mul_of_the_product(m, n, k, bits, gs, block_n, block_kp,
                                               split_k):
    """``gated=True``: columns N/2 gate then N/2 up, the epilogue stores silu(gate) * up."""
    from pagebatch.layers.activation import silu_and_mul_torch
    from pagebatch.quant.kernels.wna16_gemv import wna16_gemv

    x, qw, s, z, ref = _problem(m, n, k, bits, gs, centered=True, seed=n + k)
    f = 3 / ref.std().item()  # products of std ~3: SiLU far from linear, fp16 far from inf
    want = silu_and_mul_torch(ref * f)
    for _ in range(2):
        out = wna16_gemv(x, qw, s * f, z, bits, gs, block_n=block_n, block_kp=block_kp,
                         split_k=split_k, gated=True)
        assert out.shape == (m, n // 2) and out.dtype == x.dtype
        assert _rel(out, want) < 2e-3
    assert not _counters().any()


def test_gemv_bad_shapes_raise_value_error():
    from pagebatch.quant.kernels.wna16_gemv import wna16_gemv

    x, qw, s, z, _ = _problem(1, 32, 256, 4, 128)
    with pytest.raises(ValueError, match="does not match K"):
        wna16_gemv(x[:, :128], qw, s, z, 4, 128, block_n=32, block_kp=16)
    with pytest.raises(ValueError, match="group size 32"):
        wna16_gemv(x, qw, s, z, 4, 32, block_n=32, block_kp=16)
    with pytest.raises(ValueError, match="group size -1"):
        wna16_gemv(x, qw, s, z, 4, -1, block_n=32, block_kp=16)


def _pick_cases():
    # bits, group, n, k: groups no GEMV tile fits (16, 48), N < every block_n (24), one group
    for bits, gs, n, k in [(4, 16, 24, 256), (4, 48, 24, 384), (4, 128, 100, 256),
                           (4, 0, 24, 256), (8, 16, 24, 256), (8, 32, 100, 256),
                           (8, 0, 24, 384)]:
        for m in (1, 2, 17, 70):
            for g_idx in (False, True):
                yield bits, gs or k, n, k, m, g_idx


@pytest.mark.parametrize("sms", [8, 132])
def test_every_picked_config_runs(sms, monkeypatch):
    """Every heuristic config (as on an 8-SM device and on an H200's 132 SMs) runs and is right,
    including group sizes no GEMV tile divides, N below block_n and g_idx."""
    from pagebatch.quant.kernels import wna16 as W
    from pagebatch.quant.kernels import wna16_configs

    monkeypatch.setattr(wna16_configs, "_num_sms", lambda device: sms)
    for bits, gs, n, k, m, g_idx in _pick_cases():
        x, qw, s, z, ref = _problem(m, n, k, bits, gs, seed=m * 7 + n)
        gi = (torch.arange(k, device=DEVICE) // gs).int() if g_idx else None
        cfg = W.pick_config(m, n, k, gs, g_idx, DEVICE, bits)
        out = W.run_config(x, qw, s, z, bits, gs, gi, cfg)
        assert _rel(out, ref) < 1e-3, (bits, gs, n, k, m, g_idx, cfg)


def test_tuned_table_entries_are_runnable():
    """Every entry of the shipped wna16 tables is a valid launch for its shape key (GEMV tiles
    inside a group, power-of-two blocks, counters that fit), and runs on a narrowed copy of
    its shape (same bits, group and K tiling)."""
    from pathlib import Path

    from pagebatch.kernels import tuned
    from pagebatch.quant.kernels import CONFIG_DIR
    from pagebatch.quant.kernels import wna16 as W
    from pagebatch.quant.kernels.wna16_gemv import gemv_supported

    files = sorted(Path(CONFIG_DIR).glob("wna16_*.json"))
    assert files
    for path in files:
        for key, by_m in json.loads(path.read_text()).items():
            d = dict(kv.split("=") for kv in key.split(","))
            bits, n, k, gs = (int(d[f]) for f in ("bits", "n", "k", "group"))
            for m_max, cfg in by_m.items():
                m = int(m_max)
                assert tuned.select({int(a): b for a, b in by_m.items()}, m) == cfg
                if cfg["kernel"] == "gemv":
                    assert gemv_supported(bits, gs, cfg["block_kp"], False), (key, cfg)
                    assert m * -(-n // cfg["block_n"]) <= 1 << 16
                for b in ("block_n", "block_kp", "block_m", "block_k"):
                    if b in cfg:
                        assert cfg[b] & (cfg[b] - 1) == 0, (key, cfg)
                # narrowed: 2 groups of K (or K), N = 2 output tiles
                kk = min(k, 2 * gs)
                nn = 2 * cfg["block_n"]
                x, qw, s, z, ref = _problem(m, nn, kk, bits, gs, seed=m)
                out = W.run_config(x, qw, s, z, bits, gs, None, cfg)
                assert _rel(out, ref) < 1e-3, (key, m, cfg)
                assert not _counters().any()


# ---- precision with non-zero-mean activations, input checks ------------------------------------

def test_gemv_precision_with_nonzero_mean_activations():
    """Weights centered on their zero point (what RTN/AWQ/GPTQ produce) and x with a mean of
    2 std: the true product is small next to sum(x) * z and next to the fields' float bases, so
    those are taken off per row of each K tile (wna16_gemv.py), not once at the end; at K =
    14336 (Llama-3-8B down_proj), split_k = 1, the error stays at fp16 rounding. (Subtracting
    the bases 2**11 / 2**7 once per program gave 5e-3..7e-3, above bf16's ~4e-3.)"""
    from pagebatch.quant.kernels.wna16_gemv import wna16_gemv

    x, qw, s, z, ref = _problem(1, 32, 14336, 4, 128, centered=True, x_mean=2.0, seed=14340)
    out = wna16_gemv(x, qw, s, z, 4, 128, block_n=32, block_kp=16, split_k=1)
    assert _rel(out, ref) < 1e-3


def test_gemv_rejects_split_k_zero():
    """split_k=0 would launch an empty grid and return uninitialised memory."""
    from pagebatch.quant.kernels.wna16_gemv import wna16_gemv

    x, qw, s, z, _ = _problem(2, 64, 256, 4, 128)
    with pytest.raises(ValueError, match="split_k"):
        wna16_gemv(x, qw, s, z, 4, 128, block_n=32, block_kp=16, split_k=0)


def test_gemv_rejects_scales_with_too_few_groups():
    """scales / zeros [1, N] for K = 256 at group 128 (2 groups): refused, not read past the
    end."""
    from pagebatch.quant.kernels.wna16_gemv import wna16_gemv

    x, qw, s, z, _ = _problem(2, 64, 256, 4, 128)
    s1 = torch.cat([s[:1], torch.full_like(s[:1], float("nan"))])[:1]
    z1 = torch.cat([z[:1], torch.full_like(z[:1], float("nan"))])[:1]
    with pytest.raises(ValueError):
        wna16_gemv(x, qw, s1, z1, 4, 128, block_n=32, block_kp=16)


def test_gemv_zeros_in_another_layout_than_scales():
    """The kernel reads scales and zeros with one stride and unit column strides: column-major
    zeros (same values) are rejected (ValueError) or give the right product."""
    from pagebatch.quant.kernels.wna16_gemv import wna16_gemv

    x, qw, s, z, ref = _problem(2, 64, 256, 4, 128)
    zt = z.t().contiguous().t()
    try:
        out = wna16_gemv(x, qw, s, zt, 4, 128, block_n=32, block_kp=16)
    except ValueError:
        return
    assert _rel(out, ref) < 6e-4


def test_gemv_rejects_group_size_zero():
    """group_size=0 (0 % tile == 0 passed the tile check) is refused, not divided by."""
    from pagebatch.quant.kernels.wna16_gemv import wna16_gemv

    x, qw, s, z, _ = _problem(2, 64, 256, 4, 128)
    with pytest.raises(ValueError):
        wna16_gemv(x, qw, s, z, 4, 0, block_n=32, block_kp=16)


def test_matmul_zero_rows():
    """M = 0 gives an empty [0, N] (the split-K heuristic would divide by zero tiles)."""
    from pagebatch.quant.kernels.wna16 import wna16_matmul

    x, qw, s, z, _ = _problem(1, 64, 256, 4, 128)
    out = wna16_matmul(x[:0], qw, s, z, 4, 128)
    assert out.shape == (0, 64)


def test_matmul_group_size_minus_one():
    """-1 ("one group", the checkpoint convention) is rejected or treated as K, never read as
    a negative group index (the layers resolve -1 to K first)."""
    from pagebatch.quant.kernels.wna16 import wna16_matmul

    x, qw, s, z, ref = _problem(1, 64, 256, 4, 256)
    try:
        out = wna16_matmul(x, qw, s, z, 4, -1)
    except ValueError:
        return
    assert _rel(out, ref) < 1e-3


def test_counter_limit_only_with_split_k():
    """A launch without split-K uses no counters: a 16-row GEMV over a 152064-row LM head at
    block_n = 32 (4752 tiles, 76032 > 65536) is allowed."""
    from pagebatch.kernels.splitk import launch_buffers

    launch_buffers(torch.zeros(16, 8, device=DEVICE), 152064, 32, 1, "GEMV")
