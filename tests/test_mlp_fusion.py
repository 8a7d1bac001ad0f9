"""The MLP's fused activation (the gate/up product's epilogue applies SiLU-and-mul at decode
sizes): `LinearBase.forward_silu_mul` asks the quant method and the Llama MLP falls back to the
product and the activation where it declines. The kernels themselves: tests/test_dense_gemv.py
and tests/test_wna16_gemv_edges.py (gated cases)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagebatch.layers.activation import silu_and_mul_torch
from pagebatch.layers.linear import LinearBase
from pagebatch.quant.fp16 import UnquantizedMethod


class _Fused(UnquantizedMethod):
    """fp16 weights whose `apply_silu_mul` computes the fused result in torch and counts."""

    calls = 0

    def apply_silu_mul(self, layer, x):
        type(self).calls += 1
        return silu_and_mul_torch(F.linear(x, layer.weight))


def _layer(method, outs=(8, 8), parallel=None) -> LinearBase:
    layer = LinearBase(12, list(outs), False, method, torch.float32, torch.device("cpu"),
                       parallel=parallel)
    method.load_dummy_weights(layer, torch.Generator().manual_seed(0))
    return layer


def test_forward_silu_mul_only_for_two_equal_shards():
    x = torch.randn(3, 12)
    assert _layer(_Fused()).forward_silu_mul(x).shape == (3, 8)
    assert _layer(_Fused(), outs=(8, 4)).forward_silu_mul(x) is None
    assert _layer(_Fused(), outs=(16,)).forward_silu_mul(x) is None


def test_unquantized_declines_on_the_cpu():
    """No CUDA, no GEMV table: the 16-bit method declines, the MLP runs its two steps."""
    assert _layer(UnquantizedMethod()).forward_silu_mul(torch.randn(2, 12)) is None


def test_llama_mlp_uses_the_fused_path_and_falls_back():
    from types import SimpleNamespace

    from pagebatch.distributed.parallel_state import ParallelContext
    from pagebatch.plugins.models.llama import LlamaMLP

    cfg = SimpleNamespace(hidden_size=12, intermediate_size=8)
    x = torch.randn(2, 12)
    _Fused.calls = 0
    outs = []
    for method in (_Fused(), UnquantizedMethod()):
        ctx = SimpleNamespace(quant_method=method, dtype=torch.float32,
                              device=torch.device("cpu"), parallel=ParallelContext.single())
        torch.manual_seed(0)
        mlp = LlamaMLP(cfg, ctx)
        for lin in (mlp.gate_up_proj, mlp.down_proj):
            method.load_dummy_weights(lin, torch.Generator().manual_seed(1))
        outs.append(mlp(x))
    assert _Fused.calls == 1
    torch.testing.assert_close(outs[0], outs[1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the W4A16 GEMV on CUDA")
def test_awq_greedy_with_and_without_the_fused_activation(tmp_path, monkeypatch):
    """GPU: batch-1 greedy decode of a tiny model quantized to AWQ at load: the gated GEMV
    (gate/up product + SiLU-and-mul in one launch) gives the tokens of the product followed by
    the activation kernel (near-tie rule), and it is the path decode steps take."""
    from conftest import build_tiny_model
    from numerics import assert_greedy_match, greedy_one_by_one
    from pagebatch import LLM, SamplingParams
    from pagebatch.quant.wna16 import WNA16Method

    folder = build_tiny_model(tmp_path / "tiny", hidden_size=256, intermediate_size=512,
                              num_attention_heads=8, num_key_value_heads=2,
                              max_position_embeddings=512)
    fused = WNA16Method.apply_silu_mul
    calls = []

    def counted(self, layer, x):
        out = fused(self, layer, x)
        calls.append(out is not None)
        return out

    prompts = [[(5 * i + j) % 200 + 3 for j in range(4 + 11 * i)] for i in range(3)]
    sp = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    runs = {}
    for on in (False, True):
        monkeypatch.setattr(WNA16Method, "apply_silu_mul",
                            counted if on else (lambda self, layer, x: None))
        llm = LLM(str(folder), device="cuda", dtype="bfloat16", quantization="awq",
                  num_kv_blocks=256, block_size=16, max_num_seqs=1)
        runs[on] = greedy_one_by_one(llm, prompts, sp)
        del llm
        torch.cuda.empty_cache()
    assert any(calls), "no decode step took the gated GEMV"
    for ref, gaps, got in zip(runs[False][0], runs[False][1], runs[True][0]):
        assert_greedy_match(ref, gaps, got, what="AWQ gated GEMV vs product + activation")
