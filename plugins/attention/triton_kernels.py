"""Triton kernels of the ``triton`` attention backend: write K/V by slot mapping, and paged
attention over block tables for a mixed prefill/decode batch, with an optional split-KV
(flash-decoding) pass and its reduction.

Layout (the backend's ``kv_cache_shape``): ``k_cache``/``v_cache`` are the two halves of
``[2, num_blocks, block_size, num_kv_heads, head_dim]``, so slot ``s``, kv head ``h`` starts at
element ``s * num_kv_heads * head_dim + h * head_dim``.

The attention kernel follows FlashAttention-2 (Dao 2023: online softmax over key tiles, one pass)
with PagedAttention's block tables (Kwon et al. 2023); the grid walks "query blocks" the way vLLM's
Triton ``unified_attention`` does: each program owns ``BLOCK_Q`` consecutive new tokens of one
request times the ``G = num_heads / num_kv_heads`` query heads that share one kv head, so a
``BLOCK_M = BLOCK_Q * G`` row tile reads each K/V tile once for the whole GQA group. Program ``p``
of request ``i`` exists for ``query_start_loc[i] // BLOCK_Q + i <= p``; a binary search over
``query_start_loc`` finds ``i`` on the device (no host work per step). With ``NUM_SPLITS > 1``
the context is cut into that many ranges (Flash-Decoding, Dao et al. 2023) and each program
writes an unnormalised partial result; the last program of a query block to finish merges them
(or, where no counters can be had, ``reduce_splits_kernel`` in a second launch).

fp8 KV cache (float8_e4m3fn, core/attention.py): ``write_kv_kernel`` stores ``x / scale``
clamped to +-448 and rounded to e4m3; the attention kernel converts loaded K/V tiles to the
query's dtype (exact: every e4m3 value is a bf16 / fp16 value) and applies the scales outside the
tiles, ``k_scale`` folded into the softmax scale and ``v_scale`` into the accumulator once at the
end, so the inner loop does no extra multiply. Other caches pass scales of 1.0.

Masking: keys at positions ``>= seq_len`` are loaded as 0 (the cache there may hold NaN) and
scored ``-inf``; row maxima start at a finite ``-1e30`` so that a row with no key in a tile or a
split never computes ``inf - inf``.

Recompiles: Triton specializes integer arguments on their value (== 1, divisible by 16) and
compiles a variant per combination; the counts that change from step to step (``num_seqs``,
``num_q_blocks``, the block table's row stride) are marked ``do_not_specialize``, so a batch of
a new size does not stop the engine for a compile (the GEMM kernels' ``M`` likewise).

Import this module only where Triton is wanted: ``TRITON_INTERPRET=1`` is read when the kernels
are decorated, at import.
"""

from __future__ import annotations

import triton
import triton.language as tl

from pagebatch.kernels import pdl

# Pointer arguments that are views of the step's packed int32 buffer (core/step_layout.py) or
# slices of them (a batch part's requests): their 16-byte alignment changes with the batch's
# token and request counts, and Triton would compile a variant per alignment pattern in the
# middle of serving; they are read a scalar at a time, so alignment buys nothing.
STEP_VIEWS = ["block_tables_ptr", "seq_lens_ptr", "query_start_loc_ptr", "pos_ptr"]


@triton.jit
def _rope(x, x_ptrs, d, pos, cos_sin_ptr, mask, HEAD_DIM: tl.constexpr):
    """RoPE (rotate-half) of ``x`` (loaded from ``x_ptrs``; ``d`` each element's index within
    its head, ``pos`` its token's position, broadcastable): ``x1 cos - x2 sin`` in the first half
    of a head, ``x2 cos + x1 sin`` in the second, in fp32, rounded to x's dtype (as
    core/kernels/rotary.py rounds)."""
    HALF: tl.constexpr = HEAD_DIM // 2
    first = d < HALF
    c = tl.where(first, d, d - HALF)
    partner = tl.load(x_ptrs + tl.where(first, HALF, -HALF), mask=mask, other=0.0)
    cos = tl.load(cos_sin_ptr + pos * HEAD_DIM + c, mask=mask, other=0.0)
    sin = tl.load(cos_sin_ptr + pos * HEAD_DIM + HALF + c, mask=mask, other=0.0)
    xf, pf = x.to(tl.float32), partner.to(tl.float32)
    return tl.where(first, xf * cos - pf * sin, xf * cos + pf * sin).to(x.dtype)


@triton.jit(do_not_specialize_on_alignment=["slot_mapping_ptr", "pos_ptr"])  # STEP_VIEWS
def write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, pos_ptr, cos_sin_ptr,
    stride_kt, stride_vt, k_scale, v_scale,
    ROW: tl.constexpr,  # num_kv_heads * head_dim: elements of one token's K (or V)
    BLOCK: tl.constexpr,
    FP8: tl.constexpr,  # the cache is fp8: store clamp(x / scale, +-FP8_MAX)
    FP8_MAX: tl.constexpr,
    ROPE: tl.constexpr = False,  # rotate K first (positions, cos_sin table; see _rope)
    HEAD_DIM: tl.constexpr = 1,
    STORE_ROTATED: tl.constexpr = False,  # ROPE: also store the rotated K back into key
    PDL: tl.constexpr = False,
):
    """Grid (num_tokens, cdiv(ROW, BLOCK)). A negative slot (a padding token) is skipped.
    ``STORE_ROTATED`` needs one program per token (BLOCK >= ROW): the partner halves of RoPE
    are read before any thread of the program overwrites them."""
    t = tl.program_id(0)
    pdl.wait(PDL)
    pdl.launch_dependents(PDL)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if slot < 0:
        return
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < ROW
    k_ptrs = key_ptr + t.to(tl.int64) * stride_kt + offs
    k = tl.load(k_ptrs, mask=mask)
    if ROPE:
        k = _rope(k, k_ptrs, offs % HEAD_DIM, tl.load(pos_ptr + t), cos_sin_ptr, mask, HEAD_DIM)
        if STORE_ROTATED:
            tl.debug_barrier()  # every thread has read its partner element
            tl.store(k_ptrs, k, mask=mask)
    v = tl.load(value_ptr + t.to(tl.int64) * stride_vt + offs, mask=mask)
    if FP8:
        k = tl.minimum(tl.maximum(k.to(tl.float32) / k_scale, -FP8_MAX), FP8_MAX)
        v = tl.minimum(tl.maximum(v.to(tl.float32) / v_scale, -FP8_MAX), FP8_MAX)
    dst = slot * ROW + offs
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _find_seq(query_start_loc_ptr, num_seqs, pid, tok0, BLOCK_Q: tl.constexpr):
    """The request owning query block ``pid``: the last i with (qsl[i] - tok0) // BLOCK_Q + i
    <= pid (``tok0`` = qsl[0]: the launch covers a slice of the batch's requests)."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = (tl.load(query_start_loc_ptr + mid) - tok0) // BLOCK_Q + mid
        if start <= pid:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _softmax_update(acc, l_i, m_i, m_new, p, v, DOT_PRECISION: tl.constexpr):
    """One online-softmax step (FlashAttention-2, Dao 2023): rescale the running sum ``l_i``
    and accumulator ``acc`` from the old row maxima ``m_i`` to ``m_new`` (log2 units), add the
    tile's probabilities ``p`` [rows, keys] and ``p @ v``. Returns (acc, l_i, m_new)."""
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return acc, l_i, m_new


@triton.jit
def _attend_tiles(
    acc, l_i, m_i, q, k_base, v_base, bt_row, seq_len, q_pos, lo, hi, stride_slot, offs_d,
    qk_scale,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr, MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SLIDING: tl.constexpr = False, window=0, kv_lo=0,
):
    """Online softmax over keys lo .. hi-1 (lo a multiple of TILE_N). Unmasked tiles (every row
    sees every key, all keys < seq_len) skip the masks. ``SLIDING``: masked tiles also hide the
    keys j <= q_pos - window (transformers' sliding-window mask) and load no key below
    ``kv_lo`` (the first key any row sees: blocks below it may belong to another request)."""
    offs_n = tl.arange(0, TILE_N)
    d_ok = offs_d < HEAD_DIM
    for start_n in range(lo, hi, TILE_N):
        pos = start_n + offs_n
        if BLOCK_SIZE % TILE_N == 0:  # the tile lies inside one cache block
            blk = tl.load(bt_row + start_n // BLOCK_SIZE).to(tl.int64)
            slot = blk * BLOCK_SIZE + (start_n % BLOCK_SIZE) + offs_n
        else:
            if MASKED:
                blk = tl.load(bt_row + pos // BLOCK_SIZE, mask=pos < seq_len, other=0)
            else:
                blk = tl.load(bt_row + pos // BLOCK_SIZE)
            slot = blk.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
        kv_off = slot[:, None] * stride_slot + offs_d[None, :]
        if MASKED:
            kv_ok = pos < seq_len
            if SLIDING:
                kv_ok = kv_ok & (pos >= kv_lo)
            kv_mask = kv_ok[:, None] & d_ok[None, :]
            k = tl.load(k_base + kv_off, mask=kv_mask, other=0.0)
            v = tl.load(v_base + kv_off, mask=kv_mask, other=0.0)
        elif HEAD_DIM != HEAD_DIM_PAD:
            k = tl.load(k_base + kv_off, mask=d_ok[None, :], other=0.0)
            v = tl.load(v_base + kv_off, mask=d_ok[None, :], other=0.0)
        else:
            k = tl.load(k_base + kv_off)
            v = tl.load(v_base + kv_off)
        k = k.to(q.dtype)  # fp8 caches: exact widening; otherwise the same dtype, a no-op
        v = v.to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        if MASKED:
            ok = (pos[None, :] <= q_pos[:, None]) & (pos[None, :] < seq_len)
            if SLIDING:
                ok = ok & (pos[None, :] > q_pos[:, None] - window)
            s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        acc, l_i, m_i = _softmax_update(acc, l_i, m_i, m_new, p, v, DOT_PRECISION)
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["num_seqs", "num_q_blocks", "tok0", "stride_bt"],
            do_not_specialize_on_alignment=STEP_VIEWS)
def paged_attention_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    query_start_loc_ptr, part_acc_ptr, part_ml_ptr, cnt_ptr, pos_ptr, cos_sin_ptr,
    num_seqs, num_q_blocks, tok0, scale, k_scale, v_scale, window,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
    NUM_KV_HEADS: tl.constexpr, G: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr, FUSED_REDUCE: tl.constexpr = False,
    ROPE: tl.constexpr = False, KIND: tl.constexpr = 0, PDL: tl.constexpr = False,
    SLIDING: tl.constexpr = False,
):
    """Grid (num_q_blocks, num_kv_heads, NUM_SPLITS); num_q_blocks = num_tokens // BLOCK_Q +
    num_seqs (an upper bound: programs past a request's last query block return at once).
    The launch covers requests ``query_start_loc_ptr[0 .. num_seqs]`` (a slice of the batch's:
    their tokens start at ``tok0``; seq_lens / block tables sliced alike); ``KIND`` 1 skips
    requests with more than one new token, 2 those with one (a mixed step's decodes and
    prefills launch apart, each with its own tiles); 0 runs all.

    NUM_SPLITS == 1 writes out [num_tokens, num_heads, head_dim]; otherwise part_acc
    [n, num_heads, NUM_SPLITS, HEAD_DIM_PAD] fp32 (unnormalised) and part_ml
    [n, num_heads, NUM_SPLITS, 2] fp32 (running max in log2 units, sum of exps; n: the
    launch's tokens, token tok at row tok - tok0), which
    ``reduce_splits_kernel`` merges into out; with ``FUSED_REDUCE`` the last of a (query block,
    kv head)'s NUM_SPLITS programs to finish merges them itself (an atomic counter per pair in
    ``cnt_ptr`` [num_q_blocks * NUM_KV_HEADS] int32, zero before and left zero after; the
    split-K scheme of core/kernels/splitk.py), so no second launch is needed.
    ``k_scale`` / ``v_scale``: fp8 cache scales (1.0 otherwise), applied outside the tile loop.
    ``SLIDING``: position i attends to keys j with i - ``window`` < j <= i; key tiles wholly
    below the first row's window are skipped (the splits divide the rest), those that some row
    of the tile sees only in part are masked, and no key below the window is loaded.
    """
    # the heaviest query blocks (late in a long prompt) first: a shorter causal tail
    pid = num_q_blocks - 1 - tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    pdl.wait(PDL)
    seq = _find_seq(query_start_loc_ptr, num_seqs, pid, tok0, BLOCK_Q)
    q_begin = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_begin
    q_block = pid - ((q_begin - tok0) // BLOCK_Q + seq)
    q_first = q_block * BLOCK_Q  # first new token of this program, within the request
    if q_first >= q_len:
        return
    if (KIND == 1 and q_len > 1) or (KIND == 2 and q_len == 1):
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len  # tokens cached before this step

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    q_idx = q_first + offs_m // G
    head = kvh * G + offs_m % G
    row_ok = (offs_m < BLOCK_Q * G) & (q_idx < q_len)
    d_ok = offs_d < HEAD_DIM
    tok = (q_begin + q_idx).to(tl.int64)
    q_ptrs = q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
    q_ok = row_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptrs, mask=q_ok, other=0.0)
    if ROPE:  # the query rotated here, by its token's position (the KV write rotated K)
        pos = tl.load(pos_ptr + tok, mask=row_ok, other=0)
        q = _rope(q, q_ptrs, offs_d[None, :], pos[:, None], cos_sin_ptr, q_ok, HEAD_DIM)
    q_pos = ctx_len + q_idx

    # keys [kv_lo, kv_end) are needed; [band, first_pos] are visible to every row of the tile
    last = tl.minimum(q_first + BLOCK_Q, q_len) - 1
    kv_end = ctx_len + last + 1
    full_end = ctx_len + q_first + 1
    kv_lo = 0
    band = 0
    if SLIDING:
        kv_lo = tl.maximum(full_end - window, 0)  # the first row's first key
        band = tl.cdiv(tl.maximum(kv_end - window, 0), TILE_N) * TILE_N  # the last row's
    base = kv_lo // TILE_N * TILE_N
    if NUM_SPLITS == 1:
        lo = base
        hi = kv_end
    else:
        per_split = tl.cdiv(tl.cdiv(kv_end - base, NUM_SPLITS), TILE_N) * TILE_N
        lo = base + split * per_split
        hi = tl.minimum(lo + per_split, kv_end)
    mid = tl.maximum(lo, tl.minimum(hi, full_end) // TILE_N * TILE_N)

    stride_slot = NUM_KV_HEADS * HEAD_DIM
    k_base = k_cache_ptr + kvh * HEAD_DIM
    v_base = v_cache_ptr + kvh * HEAD_DIM
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    qk_scale = scale * k_scale * 1.4426950408889634  # softmax in base 2

    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    if SLIDING:  # the window's left edge: [lo, b) masked, then [b, mid) unmasked
        b = tl.maximum(lo, tl.minimum(band, hi))  # lo > hi: an empty split stays empty
        mid = tl.maximum(b, mid)
        acc, l_i, m_i = _attend_tiles(
            acc, l_i, m_i, q, k_base, v_base, bt_row, seq_len, q_pos, lo, b, stride_slot,
            offs_d, qk_scale, HEAD_DIM, HEAD_DIM_PAD, BLOCK_SIZE, TILE_N, True, DOT_PRECISION,
            True, window, kv_lo)
        lo = b
    acc, l_i, m_i = _attend_tiles(
        acc, l_i, m_i, q, k_base, v_base, bt_row, seq_len, q_pos, lo, mid, stride_slot, offs_d,
        qk_scale, HEAD_DIM, HEAD_DIM_PAD, BLOCK_SIZE, TILE_N, False, DOT_PRECISION)
    acc, l_i, m_i = _attend_tiles(
        acc, l_i, m_i, q, k_base, v_base, bt_row, seq_len, q_pos, mid, hi, stride_slot, offs_d,
        qk_scale, HEAD_DIM, HEAD_DIM_PAD, BLOCK_SIZE, TILE_N, True, DOT_PRECISION, SLIDING,
        window, kv_lo)
    acc = acc * v_scale
    pdl.launch_dependents(PDL)

    if NUM_SPLITS == 1:
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        out = acc / l_safe[:, None]
        o_ptrs = out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:
        row0 = ((tok - tok0) * (NUM_KV_HEADS * G) + head) * NUM_SPLITS  # split 0 of each row
        row = row0 + split
        tl.store(part_acc_ptr + row[:, None] * HEAD_DIM_PAD + offs_d[None, :], acc,
                 mask=row_ok[:, None])
        tl.store(part_ml_ptr + row * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=row_ok)
        if FUSED_REDUCE:
            tl.debug_barrier()  # every thread's partials are written before the counter moves
            cnt = cnt_ptr + pid * NUM_KV_HEADS + kvh
            arrived = tl.atomic_add(cnt, 1, sem="acq_rel")
            if arrived == NUM_SPLITS - 1:  # the last split of these rows: merge all of them
                m = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
                for s in tl.static_range(NUM_SPLITS):  # independent loads, issued together
                    m = tl.maximum(m, tl.load(part_ml_ptr + (row0 + s) * 2, mask=row_ok,
                                              other=-1.0e30, cache_modifier=".cg"))
                l_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
                a_sum = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
                for s in tl.static_range(NUM_SPLITS):
                    m_s = tl.load(part_ml_ptr + (row0 + s) * 2, mask=row_ok, other=-1.0e30,
                                  cache_modifier=".cg")
                    l_s = tl.load(part_ml_ptr + (row0 + s) * 2 + 1, mask=row_ok, other=0.0,
                                  cache_modifier=".cg")
                    a_s = tl.load(part_acc_ptr + (row0 + s)[:, None] * HEAD_DIM_PAD
                                  + offs_d[None, :], mask=row_ok[:, None], other=0.0,
                                  cache_modifier=".cg")
                    w = tl.math.exp2(m_s - m)  # empty splits: m_s = -1e30, l_s = 0, acc 0
                    l_sum += l_s * w
                    a_sum += a_s * w[:, None]
                out = a_sum / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
                o_ptrs = (out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh
                          + offs_d[None, :])
                tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty),
                         mask=row_ok[:, None] & d_ok[None, :])
                tl.atomic_xchg(cnt, 0)


@triton.jit
def reduce_splits_kernel(
    out_ptr, part_acc_ptr, part_ml_ptr, num_heads, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr, PDL: tl.constexpr = False,
):
    """Grid (num_tokens, num_heads): merges the NUM_SPLITS partial softmaxes of one head of one
    token, all splits loaded at once (no chain of dependent loads: a decode step's few tokens
    give few programs, each must finish quickly)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    pdl.wait(PDL)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    s_ok = offs_s < NUM_SPLITS
    row = (t * num_heads + h) * NUM_SPLITS + offs_s
    m_s = tl.load(part_ml_ptr + row * 2, mask=s_ok, other=-1.0e30)
    l_s = tl.load(part_ml_ptr + row * 2 + 1, mask=s_ok, other=0.0)
    a_s = tl.load(part_acc_ptr + row[:, None] * HEAD_DIM_PAD + offs_d[None, :],
                  mask=s_ok[:, None], other=0.0)
    pdl.launch_dependents(PDL)
    m = tl.max(m_s, 0)
    w = tl.math.exp2(m_s - m)  # empty splits: m_s = -1e30, l_s = 0, acc 0
    l = tl.sum(l_s * w, 0)
    acc = tl.sum(a_s * w[:, None], 0)
    out = acc / tl.where(l > 0, l, 1.0)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)
