"""The Triton kernel of the ``triton`` backend's prefill path: causal attention of a step's
prefill chunks over (1) their cached prefix, read through the block tables, then (2) the chunk's
own keys, read contiguously from the step's new K/V ([num_tokens, num_kv_heads, head_dim], the
tensors the layer has just written to the cache), with TMA tensor descriptors on Hopper.

Algorithm: FlashAttention-2's forward (Dao 2023): one pass of online softmax over key tiles, the
running max and sum in base 2 with the softmax scale folded into one multiply-add before
``exp2``; the ordering and splitting of FlashAttention-3 (Shah et al. 2024) and of Triton's
fused-attention tutorial (06): the heaviest query blocks start first, the key tiles that every
row of a query block may see run without masks and only the (one or two) tiles on the causal
diagonal are masked, K/V tiles arrive by TMA (``TMA`` 1: host-built descriptors, 2: built on the
device) into a ``num_stages`` pipeline, optionally warp-specialized (``WARP_SPECIALIZE``,
Triton's automatic producer/consumer split of the loop).

Rows: a program owns ``BLOCK_Q`` consecutive new tokens of one request times the ``G`` query
heads sharing one kv head (``BLOCK_M = BLOCK_Q * G`` rows, token-major), as
triton_kernels.paged_attention_kernel does, so each K/V tile is loaded once per GQA group.

Under ``TRITON_INTERPRET=1`` both the pointer path (``TMA`` 0) and host descriptors run (the
interpreter emulates descriptor loads); ``WARP_SPECIALIZE`` is a compile hint it ignores.
"""

from __future__ import annotations

import triton
import triton.language as tl

from pagebatch.kernels import pdl

from .triton_kernels import STEP_VIEWS, _attend_tiles, _find_seq, _rope, _softmax_update


@triton.jit
def _chunk_tiles(
    acc, l_i, m_i, q, k_src, v_src, kv_row0, kv_col, q_len, q_idx, lo, hi, stride_kt, stride_vt,
    qk_scale,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, TILE_N: tl.constexpr,
    MASKED: tl.constexpr, TMA: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
    DOT_PRECISION: tl.constexpr, SLIDING: tl.constexpr = False, window=0,
):
    """Online softmax over the chunk's keys ``lo .. hi-1`` (indices within the request's new
    tokens: row ``kv_row0 + j`` of the step's K/V, columns ``kv_col ..`` for this kv head).
    ``MASKED``: the diagonal tiles (key j visible to a row of chunk index q_idx iff j <= q_idx);
    otherwise every row sees every key and no mask is computed. ``SLIDING``: masked tiles also
    hide keys j <= q_idx - window (the window's left edge)."""
    offs_n = tl.arange(0, TILE_N)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    for start_n in tl.range(lo, hi, TILE_N, warp_specialize=WARP_SPECIALIZE):
        if TMA != 0:
            k = k_src.load([kv_row0 + start_n, kv_col])
            v = v_src.load([kv_row0 + start_n, kv_col])
        else:
            rows = (kv_row0 + start_n + offs_n).to(tl.int64)
            k_ptrs = k_src + rows[:, None] * stride_kt + kv_col + offs_d[None, :]
            v_ptrs = v_src + rows[:, None] * stride_vt + kv_col + offs_d[None, :]
            if MASKED or HEAD_DIM != HEAD_DIM_PAD:
                ok = ((start_n + offs_n) < q_len)[:, None] & (offs_d < HEAD_DIM)[None, :]
                k = tl.load(k_ptrs, mask=ok, other=0.0)
                v = tl.load(v_ptrs, mask=ok, other=0.0)
            else:
                k = tl.load(k_ptrs)
                v = tl.load(v_ptrs)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if MASKED:
            visible = (start_n + offs_n)[None, :] <= q_idx[:, None]
            if SLIDING:
                visible = visible & ((start_n + offs_n)[None, :] > q_idx[:, None] - window)
            qk = tl.where(visible, qk * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            p = tl.math.exp2(qk - m_new[:, None])
        else:
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            p = tl.math.exp2(qk * qk_scale - m_new[:, None])
        acc, l_i, m_i = _softmax_update(acc, l_i, m_i, m_new, p, v, DOT_PRECISION)
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["num_seqs", "num_q_blocks", "tok0", "num_tokens", "stride_bt"],
            do_not_specialize_on_alignment=STEP_VIEWS)
def prefill_attention_kernel(
    out_ptr, q_ptr, k_src, v_src, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    query_start_loc_ptr, pos_ptr, cos_sin_ptr,
    num_seqs, num_q_blocks, tok0, num_tokens, scale, window,
    stride_qt, stride_qh, stride_kt, stride_vt, stride_ot, stride_oh, stride_bt,
    NUM_KV_HEADS: tl.constexpr, G: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, TILE_N: tl.constexpr,
    TMA: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SKIP_DECODES: tl.constexpr = False, ROPE: tl.constexpr = False, PDL: tl.constexpr = False,
    SLIDING: tl.constexpr = False,
):
    """Grid (num_q_blocks * num_kv_heads,), kv heads varying fastest, so that the heaviest query
    blocks of every head are scheduled first; num_q_blocks = n // BLOCK_Q + num_seqs for the
    launch's n tokens (an upper bound, as in paged_attention_kernel).

    q_ptr: [num_tokens, num_heads, head_dim]; out_ptr alike (only the launch's rows written);
    k_src / v_src: the step's new K / V [num_tokens, num_kv_heads * head_dim] (row stride
    stride_kt / stride_vt), as pointers (TMA 0 and 2) or host TensorDescriptors of block
    [TILE_N, HEAD_DIM] (TMA 1); k_cache_ptr / v_cache_ptr, block tables, seq_lens,
    query_start_loc (sliced to the launch's requests, whose tokens start at ``tok0``): as in
    paged_attention_kernel. A request's keys are its ``seq_len - q_len`` cached tokens, then its
    new tokens (their rows in k_src / v_src). ``SKIP_DECODES``: requests with one new token
    return at once (a mixed step's decodes launch apart). ``ROPE``: q is rotated as it loads;
    k_src must already be rotated (the backend's write_kv stores its rotation back).
    ``SLIDING``: position i sees keys j with i - ``window`` < j <= i; tiles of the prefix or of
    the chunk wholly before the first row's window are skipped, the left-edge tiles masked, and
    no cached key below the window is loaded.
    """
    kvh = tl.program_id(0) % NUM_KV_HEADS
    pid = num_q_blocks - 1 - tl.program_id(0) // NUM_KV_HEADS  # the latest (heaviest) first
    pdl.wait(PDL)
    seq = _find_seq(query_start_loc_ptr, num_seqs, pid, tok0, BLOCK_Q)
    q_begin = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_begin
    q_first = (pid - ((q_begin - tok0) // BLOCK_Q + seq)) * BLOCK_Q  # within the request
    if q_first >= q_len:
        return
    if SKIP_DECODES and q_len == 1:
        return
    ctx_len = tl.load(seq_lens_ptr + seq) - q_len  # tokens cached before this step

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    q_idx = q_first + offs_m // G  # index within the request's new tokens
    head = kvh * G + offs_m % G
    row_ok = (offs_m < BLOCK_Q * G) & (q_idx < q_len)
    io_ok = row_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    tok = (q_begin + q_idx).to(tl.int64)
    q_ptrs = q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=io_ok, other=0.0)
    if ROPE:
        pos = tl.load(pos_ptr + tok, mask=row_ok, other=0)
        q = _rope(q, q_ptrs, offs_d[None, :], pos[:, None], cos_sin_ptr, io_ok, HEAD_DIM)
    qk_scale = scale * 1.4426950408889634  # softmax in base 2

    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    # (1) the cached prefix: every row sees every key; the last partial tile masks the end
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    stride_slot = NUM_KV_HEADS * HEAD_DIM
    q_pos = ctx_len + q_idx
    ctx_full = ctx_len // TILE_N * TILE_N
    q_last = tl.minimum(q_first + BLOCK_Q, q_len) - 1
    p_mid = 0  # prefix keys [p_mid, ctx_full) are seen by every row
    kv_lo = 0
    if SLIDING:  # the window's left edge in the prefix: [p_lo, p_mid) masked
        kv_lo = tl.maximum(ctx_len + q_first - window + 1, 0)
        p_lo = tl.minimum(kv_lo // TILE_N * TILE_N, ctx_len)
        band = tl.cdiv(tl.maximum(ctx_len + q_last - window + 1, 0), TILE_N) * TILE_N
        p_mid = tl.minimum(tl.maximum(band, p_lo), ctx_len)
        acc, l_i, m_i = _attend_tiles(
            acc, l_i, m_i, q, k_cache_ptr + kvh * HEAD_DIM, v_cache_ptr + kvh * HEAD_DIM,
            bt_row, ctx_len, q_pos, p_lo, p_mid, stride_slot, offs_d, qk_scale, HEAD_DIM,
            HEAD_DIM_PAD, BLOCK_SIZE, TILE_N, True, DOT_PRECISION, True, window, kv_lo)
    p_end = tl.maximum(p_mid, ctx_full)
    acc, l_i, m_i = _attend_tiles(
        acc, l_i, m_i, q, k_cache_ptr + kvh * HEAD_DIM, v_cache_ptr + kvh * HEAD_DIM, bt_row,
        ctx_len, q_pos, p_mid, p_end, stride_slot, offs_d, qk_scale, HEAD_DIM, HEAD_DIM_PAD,
        BLOCK_SIZE, TILE_N, False, DOT_PRECISION)
    acc, l_i, m_i = _attend_tiles(
        acc, l_i, m_i, q, k_cache_ptr + kvh * HEAD_DIM, v_cache_ptr + kvh * HEAD_DIM, bt_row,
        ctx_len, q_pos, p_end, ctx_len, stride_slot, offs_d, qk_scale, HEAD_DIM,
        HEAD_DIM_PAD, BLOCK_SIZE, TILE_N, True, DOT_PRECISION, SLIDING, window, kv_lo)

    # (2) the chunk's own keys: tiles before the first row's position unmasked, then the diagonal
    if TMA == 2:  # device-side descriptors (need triton.set_allocator for their workspace)
        k_src = tl.make_tensor_descriptor(k_src, shape=[num_tokens, NUM_KV_HEADS * HEAD_DIM],
                                          strides=[stride_kt, 1], block_shape=[TILE_N, HEAD_DIM])
        v_src = tl.make_tensor_descriptor(v_src, shape=[num_tokens, NUM_KV_HEADS * HEAD_DIM],
                                          strides=[stride_vt, 1], block_shape=[TILE_N, HEAD_DIM])
    full_end = (q_first + 1) // TILE_N * TILE_N  # keys [0, full_end) precede every row
    c_mid = 0  # chunk keys [c_mid, full_end) are seen by every row
    if SLIDING:  # the window's left edge in the chunk: [c_lo, c_mid) masked
        c_lo = tl.maximum(q_first - window + 1, 0) // TILE_N * TILE_N
        band = tl.cdiv(tl.maximum(q_last - window + 1, 0), TILE_N) * TILE_N
        c_mid = tl.minimum(tl.maximum(band, c_lo), q_last + 1)
        acc, l_i, m_i = _chunk_tiles(
            acc, l_i, m_i, q, k_src, v_src, q_begin, kvh * HEAD_DIM, q_len, q_idx, c_lo, c_mid,
            stride_kt, stride_vt, qk_scale, HEAD_DIM, HEAD_DIM_PAD, TILE_N, True, TMA,
            WARP_SPECIALIZE, DOT_PRECISION, True, window)
    c_end = tl.maximum(c_mid, full_end)
    acc, l_i, m_i = _chunk_tiles(
        acc, l_i, m_i, q, k_src, v_src, q_begin, kvh * HEAD_DIM, q_len, q_idx, c_mid, c_end,
        stride_kt, stride_vt, qk_scale, HEAD_DIM, HEAD_DIM_PAD, TILE_N, False, TMA,
        WARP_SPECIALIZE, DOT_PRECISION)
    acc, l_i, m_i = _chunk_tiles(
        acc, l_i, m_i, q, k_src, v_src, q_begin, kvh * HEAD_DIM, q_len, q_idx, c_end,
        q_last + 1, stride_kt, stride_vt, qk_scale, HEAD_DIM, HEAD_DIM_PAD, TILE_N, True, TMA,
        WARP_SPECIALIZE, DOT_PRECISION, SLIDING, window)
    pdl.launch_dependents(PDL)

    out = acc / l_i[:, None]  # every valid row saw its own key: l_i >= 1
    o_ptrs = out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=io_ok)
