"""Each quant method, one linear layer at a time on the CPU: checkpoint tensors loaded shard by
shard (fused QKV-like [64, 32, 32] and an unmerged layer) as a model loads them, then ``apply``
against ``x @ W^T`` with W dequantized from the same checkpoint tensors by quant/packing.py.
Also config errors (field and value named), 16-bit weights quantized at load, dummy weights and
the choice of method from a checkpoint folder."""

from __future__ import annotations

import json

import pytest
import torch

from pagebatch.errors import ConfigError
from pagebatch.layers.linear import LinearBase
from pagebatch.model_loader import select_quantization
from pagebatch.quant.awq import AWQMethod
from pagebatch.quant.fp8 import FP8Method
from pagebatch.quant.gptq import GPTQMethod
from pagebatch.quant.int8 import Int8Method, quantize_per_token
from pagebatch.quant.packing import (default_g_idx, dequantize, dequantize_awq, pack_awq,
                                     pack_gptq, quantize_fp8_per_channel,
                                     quantize_int8_per_channel)

from interpreted import rel_err

K = 128
LAYOUTS = {"merged": [64, 32, 32], "single": [64]}


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _layer(method, outs, bias=False, dtype=torch.float32):
    return LinearBase(K, outs, bias, method, dtype, torch.device("cpu"))


def _load(layer, shards: list[dict[str, torch.Tensor]]):
    """Load per-shard checkpoint tensors in the file's (alphabetical) order, as models do."""
    merged = len(shards) > 1
    for i, tensors in enumerate(shards):
        for name in sorted(tensors):
            layer.load(name, tensors[name], i if merged else None)
    layer.quant_method.process_weights_after_loading(layer)


def _convention(out, bits, group_size, seed, zero_min=0, sym=False):
    g = torch.Generator().manual_seed(seed)
    n_groups = 1 if group_size == -1 else K // group_size
    q = torch.randint(0, 2**bits, (out, K), generator=g, dtype=torch.int32)
    if sym:
        z = torch.full((out, n_groups), 2 ** (bits - 1), dtype=torch.int32)
    else:
        z = torch.randint(zero_min, 2**bits, (out, n_groups), generator=g, dtype=torch.int32)
    s = (torch.rand(out, n_groups, generator=g) * 0.05 + 0.005).half()
    return q, z, s


# ---- AWQ ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
@pytest.mark.parametrize("zero_point", [True, False])
def test_awq_apply_equals_dequantized(layout, group_size, zero_point):
    outs = LAYOUTS[layout]
    method = AWQMethod(None, {"quant_method": "awq", "bits": 4, "group_size": group_size,
                              "zero_point": zero_point, "version": "gemm"})
    layer = _layer(method, outs, bias=True)
    shards, ref_w = [], []
    for i, out in enumerate(outs):
        q, z, s = _convention(out, 4, group_size, seed=i, sym=not zero_point)
        d = pack_awq(q, z, s, group_size)
        if not zero_point:
            del d["qzeros"]
        d["bias"] = torch.randn(out)
        shards.append(d)
        ref_w.append(dequantize_awq(d["qweight"], d.get("qzeros"), d["scales"].float(),
                                    group_size))
    _load(layer, shards)
    x = torch.randn(7, K)
    ref = x @ torch.cat(ref_w).float().t() + torch.cat([d["bias"] for d in shards])
    assert rel_err(layer(x), ref) < 1e-6
    assert torch.allclose(method.dequantized_weight(layer).float(), torch.cat(ref_w).float())


# ---- GPTQ --------------------------------------------------------------------------------------

GPTQ_CASES = [  # bits, group_size, format, sym, act_order
    (4, 32, "gptq", True, False), (4, 32, "gptq", False, False), (4, -1, "gptq", True, False),
    (4, 32, "gptq_v2", False, False), (4, 64, "gptq", True, True), (4, 32, "gptq_v2", False, True),
    (8, 32, "gptq", True, False), (8, 64, "gptq_v2", False, True), (8, -1, "gptq_v2", False, False),
]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("bits,group_size,fmt,sym,act_order", GPTQ_CASES)
def test_gptq_apply_equals_dequantized(layout, bits, group_size, fmt, sym, act_order):
    outs = LAYOUTS[layout]
    method = GPTQMethod(None, {"quant_method": "gptq", "bits": bits, "group_size": group_size,
                               "desc_act": act_order, "sym": sym, "checkpoint_format": fmt})
    layer = _layer(method, outs)
    g_idx = default_g_idx(K, group_size)
    if act_order:  # GPTQ's act-order: groups of the permuted channels; one g_idx per input
        g_idx = g_idx[torch.randperm(K, generator=torch.Generator().manual_seed(9))]
    shards, ref_w = [], []
    for i, out in enumerate(outs):
        # v2 allows a zero point of 0: make sure some are
        q, z, s = _convention(out, bits, group_size, seed=10 + i, sym=sym,
                              zero_min=1 if fmt == "gptq" else 0)
        if fmt == "gptq_v2" and not sym:
            z[:, 0] = 0
        shards.append(pack_gptq(q, z, s, g_idx, bits, group_size, fmt))
        ref_w.append(dequantize(q, z, s.float(), g_idx))
    _load(layer, shards)
    assert (layer.perm is not None) == act_order and layer.g_idx is None
    x = torch.randn(5, K)
    assert rel_err(layer(x), x @ torch.cat(ref_w).float().t()) < 1e-6
    assert torch.allclose(method.dequantized_weight(layer).float(), torch.cat(ref_w).float())


def test_gptq_irregular_g_idx_reads_groups_per_row():
    """A g_idx whose sorted groups are not runs of group_size is kept per row."""
    method = GPTQMethod(None, {"quant_method": "gptq", "bits": 4, "group_size": 32,
                               "desc_act": True, "sym": False, "checkpoint_format": "gptq_v2"})
    layer = _layer(method, [64])
    g_idx = torch.randint(0, K // 32, (K,), generator=torch.Generator().manual_seed(3)).int()
    q, z, s = _convention(64, 4, 32, seed=5)
    _load(layer, [pack_gptq(q, z, s, g_idx, 4, 32, "gptq_v2")])
    assert layer.g_idx is not None
    x = torch.randn(3, K)
    assert rel_err(layer(x), x @ dequantize(q, z, s.float(), g_idx).t()) < 1e-6


@pytest.mark.parametrize("kinds", [("perm", "perm", "other"), ("none", "perm", "irregular")])
def test_gptq_shards_with_different_g_idx_load_per_shard(kinds):
    """Shards of a merged layer with their own act-order (calibrated apart: legal in the
    format) load through the per-shard fallback: each shard sorted by its own groups, one
    product per shard. The first shards may agree (one ``perm`` so far) before one differs."""
    method = GPTQMethod(None, {"quant_method": "gptq", "bits": 4, "group_size": 32,
                               "desc_act": True, "sym": False, "checkpoint_format": "gptq_v2"})
    outs = [64, 32, 32]
    layer = _layer(method, outs, bias=True)
    shard_g_idx = {"none": default_g_idx(K, 32),
                   "perm": default_g_idx(K, 32)[torch.randperm(
                       K, generator=torch.Generator().manual_seed(1))],
                   "other": default_g_idx(K, 32)[torch.randperm(
                       K, generator=torch.Generator().manual_seed(2))],
                   "irregular": torch.randint(0, K // 32, (K,),
                                              generator=torch.Generator().manual_seed(3)).int()}
    shards, ref_w = [], []
    for i, (out, kind) in enumerate(zip(outs, kinds)):
        q, z, s = _convention(out, 4, 32, seed=i)
        g_idx = shard_g_idx[kind]
        shards.append(dict(pack_gptq(q, z, s, g_idx, 4, 32, "gptq_v2"), bias=torch.randn(out)))
        ref_w.append(dequantize(q, z, s.float(), g_idx))
    _load(layer, shards)
    assert layer.perm is None and layer.g_idx is None
    assert [(start, size) for start, size, _, _ in layer.shard_orders] == [(0, 64), (64, 32),
                                                                          (96, 32)]
    assert [perm is None for _, _, perm, _ in layer.shard_orders] == [k == "none" for k in kinds]
    assert [g is not None for _, _, _, g in layer.shard_orders] == [k == "irregular"
                                                                    for k in kinds]
    x = torch.randn(5, K)
    ref = x @ torch.cat(ref_w).float().t() + torch.cat([d["bias"] for d in shards])
    assert rel_err(layer(x), ref) < 1e-6
    assert torch.allclose(method.dequantized_weight(layer).float(), torch.cat(ref_w).float())


# ---- int8 and fp8 ------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("source", ["int8", "float"])
def test_int8_apply_equals_w8a8_reference(layout, source):
    outs = LAYOUTS[layout]
    layer = _layer(Int8Method(None, None), outs)
    ws = [torch.randn(o, K) * 0.1 for o in outs]
    qs = [quantize_int8_per_channel(w) for w in ws]
    if source == "int8":  # compressed-tensors' [out, 1] scale
        _load(layer, [{"weight": q, "weight_scale": s[:, None]} for q, s in qs])
    else:
        _load(layer, [{"weight": w} for w in ws])
    x = torch.randn(9, K)
    xq, xs = quantize_per_token(x)
    wq = torch.cat([q for q, _ in qs]).double()
    ws_ = torch.cat([s for _, s in qs]).double()
    ref = (xq.double() @ wq.t()) * xs.double() * ws_
    assert rel_err(layer(x), ref) < 1e-6
    assert rel_err(layer(x), x @ torch.cat(ws).t()) < 0.02  # and close to the float layer


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("source", ["fp8", "float"])
def test_fp8_apply_equals_dequantized(layout, source):
    outs = LAYOUTS[layout]
    from_ckpt = source == "fp8"
    layer = _layer(FP8Method(None, {"quant_method": "fp8"} if from_ckpt else None), outs)
    ws = [torch.randn(o, K) * 0.1 for o in outs]
    if from_ckpt:  # per-tensor scales, one per shard, fp8 weights as stored
        shards = []
        for w in ws:
            scale = w.abs().max() / 448.0
            shards.append({"weight": (w / scale).to(torch.float8_e4m3fn),
                           "weight_scale": scale.reshape(())})
        ref_w = torch.cat([d["weight"].float() * d["weight_scale"] for d in shards])
        _load(layer, shards)
    else:
        qs = [quantize_fp8_per_channel(w) for w in ws]
        ref_w = torch.cat([q.float() * s[:, None] for q, s in qs])
        _load(layer, [{"weight": w} for w in ws])
    x = torch.randn(4, K)
    assert rel_err(layer(x), x @ ref_w.t()) < 1e-6


def test_unexpected_tensors_are_refused():
    layer = _layer(Int8Method(None, None), [64])
    with pytest.raises(ValueError, match="input_scale"):
        layer.load("input_scale", torch.ones(()), None)
    layer = _layer(AWQMethod(None, {"quant_method": "awq", "group_size": 32}), [64])
    with pytest.raises(ValueError, match="qweight.*shape"):
        layer.load("qweight", torch.zeros(K, 4, dtype=torch.int32), None)
        layer.load("qzeros", torch.zeros(K // 32, 8, dtype=torch.int32), None)
        layer.load("scales", torch.zeros(K // 32, 64), None)


# ---- 16-bit weights quantized at load, dummy weights -------------------------------------------

@pytest.mark.parametrize("method", [AWQMethod(None, None), GPTQMethod(None, None),
                                    Int8Method(None, None), FP8Method(None, None)],
                         ids=["awq", "gptq", "int8", "fp8"])
def test_float_checkpoint_quantized_at_load(method):
    layer = _layer(method, [64, 32, 32])
    ws = [torch.randn(o, K) * 0.05 for o in [64, 32, 32]]
    _load(layer, [{"weight": w} for w in ws])
    x = torch.randn(6, K)
    err = rel_err(layer(x), x @ torch.cat(ws).t())
    # 4 bits, group 128 on Gaussian weights: a step of ~0.35 sigma, rms error ~0.1 sigma
    assert err < {"awq": 0.13, "gptq": 0.18, "int8": 0.02, "fp8": 0.05}[method.name], err


@pytest.mark.parametrize("method", [AWQMethod(None, None), GPTQMethod(None, {"bits": 8}),
                                    Int8Method(None, None), FP8Method(None, None)],
                         ids=["awq", "gptq8", "int8", "fp8"])
def test_dummy_weights(method):
    layer = _layer(method, [64, 32, 32], bias=True)
    gen = torch.Generator().manual_seed(0)
    method.load_dummy_weights(layer, gen)
    method.process_weights_after_loading(layer)
    w = method.dequantized_weight(layer).float()
    assert w.shape == (128, K) and 0.01 < w.std().item() < 0.04
    assert torch.isfinite(layer(torch.randn(3, K))).all()


# ---- configs -----------------------------------------------------------------------------------

@pytest.mark.parametrize("cls,hf,field", [
    (AWQMethod, {"bits": 3}, "bits=3"),
    (AWQMethod, {"version": "gemv"}, "version='gemv'"),
    (AWQMethod, {"modules_to_not_convert": ["visual"]}, "modules_to_not_convert"),
    (GPTQMethod, {"bits": 3}, "bits=3"),
    (GPTQMethod, {"checkpoint_format": "marlin"}, "checkpoint_format='marlin'"),
    (GPTQMethod, {"format": "bitblas"}, "format='bitblas'"),
    (Int8Method, {"activation_scheme": "static"}, "activation_scheme='static'"),
    (FP8Method, {"activation_scheme": "static"}, "activation_scheme='static'"),
    (FP8Method, {"weight_block_size": [128, 128]}, "weight_block_size"),
])
def test_unsupported_config_names_field_and_value(cls, hf, field):
    with pytest.raises(ConfigError, match=f"quantization_config.{field}"):
        cls(None, {"quant_method": cls.name, **hf})


def test_group_size_must_divide_the_layer():
    with pytest.raises(ConfigError, match="group_size=48"):
        _layer(GPTQMethod(None, {"quant_method": "gptq", "group_size": 48}), [64])


class _Cfg:
    def __init__(self, quantization_config=None):
        if quantization_config is not None:
            self.quantization_config = quantization_config


def test_select_quantization(tmp_path):
    assert select_quantization(None, _Cfg(), tmp_path) == ("fp16", None)
    assert select_quantization("int8", _Cfg(), tmp_path) == ("int8", None)
    awq = {"quant_method": "awq", "bits": 4}
    assert select_quantization(None, _Cfg(awq), tmp_path) == ("awq", awq)
    with pytest.raises(ConfigError, match="quantization='gptq'.*quant_method='awq'"):
        select_quantization("gptq", _Cfg(awq), tmp_path)
    (tmp_path / "quantize_config.json").write_text(json.dumps({"bits": 8, "group_size": 128}))
    name, hf = select_quantization(None, _Cfg(), tmp_path)
    assert name == "gptq" and hf["bits"] == 8


# ---- tensor parallelism: each rank cuts its part of the full checkpoint tensors ----------------

def _tp_checkpoint(kind, outs, seed=0):
    """(per-shard checkpoint tensors, full dequantized W [sum(outs), K] fp32)."""
    shards, ws = [], []
    g_idx = default_g_idx(K, 32)[torch.randperm(K, generator=torch.Generator().manual_seed(7))]
    for i, out in enumerate(outs):
        if kind in ("int8", "fp8"):
            w = torch.randn(out, K, generator=torch.Generator().manual_seed(seed + i)) * 0.1
            q, s = (quantize_int8_per_channel if kind == "int8" else quantize_fp8_per_channel)(w)
            shards.append({"weight": q, "weight_scale": s})
            ws.append(q.float() * s[:, None])
            continue
        q, z, s = _convention(out, 4, 32, seed=seed + i, zero_min=1)
        if kind == "awq":
            shards.append(pack_awq(q, z, s, 32))
            ws.append(dequantize(q, z, s.float(), default_g_idx(K, 32)))
        else:
            shards.append(pack_gptq(q, z, s, g_idx, 4, 32, "gptq"))
            ws.append(dequantize(q, z, s.float(), g_idx))
    return shards, torch.cat(ws)


def _method(kind):
    return {"awq": lambda: AWQMethod(None, {"quant_method": "awq", "group_size": 32}),
            "gptq_act": lambda: GPTQMethod(None, {"quant_method": "gptq", "group_size": 32,
                                                  "desc_act": True}),
            "int8": lambda: Int8Method(None, {"quant_method": "int8"}),
            "fp8": lambda: FP8Method(None, {"quant_method": "fp8"}),
            "fp8_at_load": lambda: FP8Method(None, None)}[kind]()


@pytest.mark.parametrize("kind", ["awq", "gptq_act", "int8", "fp8"])
@pytest.mark.parametrize("parallel", ["column", "row"])
def test_tensor_parallel_ranks_cut_their_part(kind, parallel):
    """Two TP ranks load the full checkpoint tensors: column-parallel ranks each give their
    slice of every shard's outputs, row-parallel ranks partial sums that add up to the whole
    (the all-reduce is the layer's; here `apply` is called directly)."""
    from pagebatch.distributed.parallel_state import ParallelContext

    outs = [64, 32, 32] if parallel == "column" else [64]
    shards, w = _tp_checkpoint(kind, outs)
    x = torch.randn(5, K)
    if kind == "int8":  # the W8A8 product: activations quantized per token (per rank's slice)
        xs = [quantize_per_token(x[:, r * K // 2:(r + 1) * K // 2]) for r in range(2)]
    parts = []
    for rank in range(2):
        layer = LinearBase(K, outs, False, _method(kind), torch.float32, torch.device("cpu"),
                           parallel=parallel, tp=ParallelContext(rank=rank, tp_size=2))
        _load(layer, shards)
        if parallel == "row":
            x_r = x[:, rank * K // 2:(rank + 1) * K // 2]
            parts.append(layer.quant_method.apply(layer, x_r))
            if kind == "int8":
                xq, sc = xs[rank]
                w_r = w[:, rank * K // 2:(rank + 1) * K // 2].double()
                assert rel_err(parts[-1], (xq.double() * sc.double()) @ w_r.t()) < 1e-6
        else:
            parts.append(layer.quant_method.apply(layer, x))
    if parallel == "row":
        got = parts[0] + parts[1]
    else:  # of shard i, rank r holds outputs [r, r + 1) * size_i / 2 at its offset
        pieces = []
        for i, size in enumerate(outs):
            off = sum(outs[:i]) // 2
            pieces += [p[:, off:off + size // 2] for p in parts]
        got = torch.cat(pieces, dim=1)
    tol = 0.02 if kind == "int8" else 1e-6
    assert rel_err(got, x @ w.t()) < tol


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the torch._int_mm / _scaled_mm paths")
@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("k,n", [(256, 512), (200, 120)])  # the second: not a multiple of 16
@pytest.mark.parametrize("m", [1, 16, 17, 300])
def test_int8_fp8_cuda_paths(kind, k, n, m):
    dev = torch.device("cuda")
    method = _method("fp8_at_load" if kind == "fp8" else kind)
    layer = LinearBase(k, [n], False, method, torch.bfloat16, dev)
    w = torch.randn(n, k, device=dev) * 0.05
    layer.load("weight", w.bfloat16(), None)  # a 16-bit checkpoint, quantized at load
    method.process_weights_after_loading(layer)
    x = torch.randn(m, k, device=dev).bfloat16()
    if kind == "int8":
        xq, xs = quantize_per_token(x)
        ref = (xq.double() * xs.double()) @ method.dequantized_weight(layer).double().t()
    else:
        ref = x.double() @ method.dequantized_weight(layer).double().t()
    tol = 0.05 if kind == "fp8" and layer.use_scaled_mm else 0.01  # fp8 activations on sm89+
    assert rel_err(layer(x), ref) < tol


def test_half2_configs_only_for_16bit_activations(monkeypatch):
    """A tuned ``half2`` GEMV config is used as it is for bf16/fp16 activations; fp32
    activations, or ``PAGEBATCH_W4A16_HALF2=0``, keep the fp32 fields (no kernel runs here)."""
    pytest.importorskip("triton")
    from pagebatch.quant.kernels import wna16

    cfg = dict(kernel="gemv", block_n=64, block_kp=16, split_k=4, half2=1)
    monkeypatch.setattr(wna16, "pick_config", lambda *a, **k: dict(cfg))
    monkeypatch.setattr(wna16, "_chosen", {})
    q = torch.zeros(8, 64, dtype=torch.int32)
    for dtype, want in ((torch.bfloat16, 1), (torch.float16, 1), (torch.float32, 0)):
        assert wna16._config(torch.zeros(1, 64, dtype=dtype), q, 4, 64, None)["half2"] == want
    monkeypatch.setattr(wna16, "_chosen", {})
    monkeypatch.setenv(wna16.HALF2_ENV, "0")
    wna16.half2_allowed.cache_clear()
    try:
        assert wna16._config(torch.zeros(1, 64, dtype=torch.bfloat16), q, 4, 64, None)[
            "half2"] == 0
    finally:
        wna16.half2_allowed.cache_clear()
