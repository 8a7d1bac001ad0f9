"""Programmatic dependent launch (core/kernels/pdl.py): off unless asked for and on CUDA 9.0+;
each kernel that takes it, compiled for sm_90 on this CPU machine (Triton's own ptxas), waits
(``griddepcontrol.wait``) before its first store and, the GEMVs aside, before its first load; a
W4A16 GEMV with prefetch issues its first weight loads before the wait. Off, no such
instruction is emitted. The overlap itself can only be measured on a GPU (docs/gpu.md)."""

from __future__ import annotations

import re

import pytest
import torch

from pagebatch.kernels import pdl

P16, F32, I32, I64 = "*fp16", "*fp32", "*i32", "*i64"


def _cases():
    from pagebatch.kernels import activation, allreduce, gemv, norm, rotary
    from pagebatch.plugins.attention import prefill_kernel
    from pagebatch.plugins.attention import triton_kernels as attn
    from pagebatch.quant.kernels import wna16_gemv

    cases = {  # name: (kernel, pointer types, float scalars, constexprs, loads may precede wait)
        "rms_norm": (norm._rms_norm_kernel, dict(x_ptr=P16, res_ptr=P16, w_ptr=P16,
                                                 out_ptr=P16, res_out_ptr=P16), {"eps"},
                     dict(HAS_RESIDUAL=True, BLOCK=1024), False),
        "silu_and_mul": (activation._silu_and_mul_kernel, dict(x_ptr=P16, out_ptr=P16), set(),
                         dict(BLOCK=1024), False),
        "rotary": (rotary._rotary_kernel, dict(pos_ptr=I64, cos_sin_ptr=F32, q_ptr=P16,
                                               k_ptr=P16, q_out_ptr=P16, k_out_ptr=P16), set(),
                   dict(HALF=64, HALF_PAD=64, QH_PAD=32, KH_PAD=8), False),
        "write_kv": (attn.write_kv_kernel, dict(key_ptr=P16, value_ptr=P16, k_cache_ptr=P16,
                                                v_cache_ptr=P16, slot_mapping_ptr=I64,
                                                pos_ptr=I64, cos_sin_ptr=F32),
                     {"k_scale", "v_scale"}, dict(ROW=1024, BLOCK=1024, FP8=False,
                                                  FP8_MAX=448.0, ROPE=True, HEAD_DIM=128),
                     False),
        "paged_attention": (
            attn.paged_attention_kernel,
            dict(out_ptr=P16, q_ptr=P16, k_cache_ptr=P16, v_cache_ptr=P16, block_tables_ptr=I32,
                 seq_lens_ptr=I32, query_start_loc_ptr=I32, part_acc_ptr=F32, part_ml_ptr=F32,
                 cnt_ptr=I32, pos_ptr=I64, cos_sin_ptr=F32), {"scale", "k_scale", "v_scale"},
            dict(NUM_KV_HEADS=8, G=4, HEAD_DIM=128, HEAD_DIM_PAD=128, BLOCK_SIZE=16, BLOCK_M=16,
                 BLOCK_Q=4, TILE_N=64, NUM_SPLITS=4, DOT_PRECISION="tf32", FUSED_REDUCE=True,
                 ROPE=True),
            False),
        "prefill_attention": (
            prefill_kernel.prefill_attention_kernel,
            dict(out_ptr=P16, q_ptr=P16, k_src=P16, v_src=P16, k_cache_ptr=P16, v_cache_ptr=P16,
                 block_tables_ptr=I32, seq_lens_ptr=I32, query_start_loc_ptr=I32, pos_ptr=I64,
                 cos_sin_ptr=F32), {"scale"},
            dict(NUM_KV_HEADS=8, G=4, HEAD_DIM=128, HEAD_DIM_PAD=128, BLOCK_SIZE=16, BLOCK_M=64,
                 BLOCK_Q=16, TILE_N=64, TMA=0, WARP_SPECIALIZE=False, DOT_PRECISION="tf32",
                 SKIP_DECODES=True, ROPE=True),
            False),
        "reduce_splits": (attn.reduce_splits_kernel, dict(out_ptr=P16, part_acc_ptr=F32,
                                                          part_ml_ptr=F32), set(),
                          dict(HEAD_DIM=128, HEAD_DIM_PAD=128, NUM_SPLITS=4, SPLITS_PAD=4),
                          False),
        "gemv": (gemv._gemv_kernel, dict(x_ptr=P16, w_ptr=P16, b_ptr=P16, out_ptr=P16,
                                         ws_ptr=F32, cnt_ptr=I32), set(),
                 dict(HAS_BIAS=False, SPLIT_K=4, BLOCK_N=16, BLOCK_K=256, EVEN=True,
                      PREFETCH=True, GATED=False), True),
        "wna16_gemv": (wna16_gemv._wna16_gemv_kernel,
                       dict(x_ptr=P16, q_ptr=I32, s_ptr=P16, z_ptr=P16, out_ptr=P16, ws_ptr=F32,
                            cnt_ptr=I32), set(),
                       dict(BITS=4, SPLIT_K=4, BLOCK_N=64, BLOCK_KP=16, SUB=1, GROUP_SHIFT=0,
                            EVEN=True, PREFETCH=True, GATED=False, HALF2=False, USE_ASM=True),
                       True),
    }
    kernel, ptrs, floats, consts, first = cases["wna16_gemv"]  # the fp16x2 fields
    cases["wna16_gemv_half2"] = (kernel, ptrs, floats, {**consts, "HALF2": True}, first)
    cases["one_shot_all_reduce"] = (
        allreduce._one_shot_kernel,
        dict(x_ptr=P16, res_ptr=P16, w_ptr=P16, out_ptr=P16, res_out_ptr=P16, buf_ptr=P16,
             peer_offs_ptr=I64, sigs_ptr=I64, epoch_ptr=I64), {"eps"},
        dict(WORLD=2, BLOCK=4096, NORM=True, EVEN=True), False)
    # the gate/up products with SiLU-and-mul in the split-K epilogue (and without split-K)
    for name, split in (("gemv", 4), ("wna16_gemv", 1)):
        kernel, ptrs, floats, consts, first = cases[name]
        cases[name + "_gated"] = (kernel, ptrs, floats, {**consts, "GATED": True,
                                                         "SPLIT_K": split}, first)
    return cases


def _ptx(kernel, ptrs, floats, consts, on: bool) -> str:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig, attrs = {}, {}
    for i, p in enumerate(kernel.params):
        if p.name in consts or p.name == "PDL":
            sig[p.name] = "constexpr"
        elif p.name in ptrs:
            sig[p.name] = ptrs[p.name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[p.name] = "fp32" if p.name in floats else "i32"
    src = ASTSource(fn=kernel, signature=sig, constexprs={**consts, "PDL": on}, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": 4, "num_stages": 2}).asm["ptx"]


def _first(ptx: str, pattern: str) -> int:
    m = re.search(pattern, ptx)
    return m.start() if m else len(ptx)


@pytest.mark.parametrize("name", list(_cases()))
def test_kernel_waits_before_touching_what_earlier_kernels_wrote(name):
    kernel, ptrs, floats, consts, loads_first = _cases()[name]
    try:
        on = _ptx(kernel, ptrs, floats, consts, True)
    except Exception as e:  # noqa: BLE001 - a Triton without sm_90 codegen here
        if "ptxas" in str(e).lower() and "not found" in str(e).lower():
            pytest.skip(f"no ptxas: {e}")
        raise
    off = _ptx(kernel, ptrs, floats, consts, False)
    assert "griddepcontrol" not in off
    wait = _first(on, r"griddepcontrol\.wait")
    assert wait < len(on) and "griddepcontrol.launch_dependents" in on
    assert wait < _first(on, r"\b(st|atom|red)\.global")
    first_load = _first(on, r"\bld\.global")
    assert (first_load < wait) == loads_first  # only the GEMV's weight prefetch may come first
    # and no loop before the wait: what may precede it is a straight-line prologue (a GEMV's
    # main loop reads x, which the previous kernel writes)
    labels = {m.group(1): m.start() for m in re.finditer(r"^(\$L__\w+):", on, re.M)}
    back = [m.group(1) for m in re.finditer(r"\bbra(?:\.uni)?\s+(\$L__\w+);", on[:wait])
            if labels.get(m.group(1), len(on)) < m.start()]
    assert not back, f"a loop ({back[0]}) runs before griddepcontrol.wait"


def test_on_by_default_off_when_asked(monkeypatch):
    """Asked for unless PAGEBATCH_PDL=0; never on a CPU device whatever the environment."""
    monkeypatch.delenv(pdl.ENV, raising=False)
    pdl._asked.cache_clear()
    try:
        assert pdl._asked()
        assert not pdl.enabled(torch.device("cpu"))  # CUDA only
        assert pdl.launch_options(torch.device("cpu")) == {"PDL": False}
        monkeypatch.setenv(pdl.ENV, "0")
        pdl._asked.cache_clear()
        assert not pdl._asked()
        monkeypatch.setenv(pdl.ENV, "1")
        pdl._asked.cache_clear()
        assert pdl._asked()
    finally:
        pdl._asked.cache_clear()
