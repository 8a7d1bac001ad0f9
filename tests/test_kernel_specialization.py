"""Triton compiles a kernel variant per combination of its integer arguments' properties (== 1,
divisible by 16). Counts that change from step to step must be ``do_not_specialize``: on the
H200 a pipeline-parallel throughput run spent seconds compiling such variants inside the timed
run (docs/benchmarks.md, session 4)."""

from __future__ import annotations

import pytest


def _kernels():
    from pagebatch.kernels import gemv
    from pagebatch.plugins.attention import prefill_kernel
    from pagebatch.plugins.attention import triton_kernels as attn
    from pagebatch.quant.kernels import int8_gemm, wna16, wna16_gemv

    return [
        (attn.paged_attention_kernel, {"num_seqs", "num_q_blocks", "tok0", "stride_bt"}),
        (prefill_kernel.prefill_attention_kernel,
         {"num_seqs", "num_q_blocks", "tok0", "num_tokens", "stride_bt"}),
        (gemv._gemv_kernel, {"M"}),
        (int8_gemm._int8_gemm_kernel, {"M"}),
        (wna16._wna16_gemm_kernel, {"M"}),
        (wna16_gemv._wna16_gemv_kernel, {"M"}),
    ]


@pytest.mark.parametrize("index", range(6))
def test_step_varying_counts_are_not_specialized(index):
    kernel, names = _kernels()[index]
    flagged = {p.name for p in kernel.params if p.do_not_specialize}
    assert names <= flagged, f"{kernel.fn.__name__}: {sorted(names - flagged)} specialized"


def test_step_buffer_views_are_not_specialized_on_alignment():
    """Pointers into the step's packed int32 buffer (and slices of them for a batch part) are
    16-byte aligned or not depending on the batch's token and request counts: a kernel that
    specialized on their alignment would compile a variant per pattern while serving."""
    from pagebatch.kernels import rotary
    from pagebatch.plugins.attention import prefill_kernel
    from pagebatch.plugins.attention import triton_kernels as attn

    views = {"block_tables_ptr", "seq_lens_ptr", "query_start_loc_ptr", "pos_ptr"}
    for kernel, names in ((attn.paged_attention_kernel, views),
                          (prefill_kernel.prefill_attention_kernel, views),
                          (attn.write_kv_kernel, {"slot_mapping_ptr", "pos_ptr"}),
                          (rotary._rotary_kernel, {"pos_ptr"})):
        flagged = {p.name for p in kernel.params if p.do_not_specialize_on_alignment}
        assert names <= flagged, f"{kernel.fn.__name__}: {sorted(names - flagged)} specialized"
