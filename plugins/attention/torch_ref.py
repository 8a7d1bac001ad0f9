"""``torch_ref``: paged attention in plain torch, the reference every kernel is checked against.

Runs anywhere torch runs (CPU and GPU). Math in fp32 whatever the cache dtype. A decode-only
batch is computed in one gather through slot indices worked out once per step and one masked
SDPA (no per-layer block-table arithmetic); a batch with prefill chunks computes its decodes
that way too and loops over the prefill requests. An fp8
cache (float8_e4m3fn) is written by `quantize_fp8` and read back as ``entry.float() * scale``;
its entries are scattered and gathered as bytes (a uint8 view), since not every torch build has
fp8 indexing kernels. A sliding window (``sliding_window=W``: position i sees keys j with
i - W < j <= i, transformers' mask) is read from the first block inside the first query's
window on: blocks behind it are never gathered (the block manager may have given them away).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagebatch.attention import (FP8_E4M3_MAX, FP8_KV_DTYPE, AttentionBackend, AttentionMetadata,
                                 BatchPart)
from pagebatch.hookspecs import hookimpl


def quantize_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x / scale`` (in fp32) clamped to +-448, rounded to float8_e4m3fn (nearest even)."""
    return (x.float() / scale).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_KV_DTYPE)


def _dequantize(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """Gathered cache entries (``dtype``'s bits, maybe a uint8 view) as fp32 values:
    ``x.float() * scale`` (scale 1.0: no multiply)."""
    x = x.view(dtype).float()
    return x if scale == 1.0 else x * scale


def _gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int,
                    start: int = 0) -> torch.Tensor:
    """cache: [num_blocks, block_size, H, D]; block_table: [n] -> keys ``start .. length-1``
    [length - start, H, D] (``start`` a multiple of block_size)."""
    bs = cache.shape[1]
    nb = -(-length // bs)
    return cache[block_table[start // bs:nb].long()].flatten(0, 1)[:length - start]


class TorchRefBackend(AttentionBackend):
    name = "torch_ref"
    supports_fp8_kv_cache = True
    supports_sliding_window = True

    def write_kv(self, key, value, kv_cache, slot_mapping, k_scale=1.0, v_scale=1.0):
        if kv_cache.dtype == FP8_KV_DTYPE:
            kv_cache = kv_cache.view(torch.uint8)
            key = quantize_fp8(key, k_scale).view(torch.uint8)
            value = quantize_fp8(value, v_scale).view(torch.uint8)
        k_cache = kv_cache[0].flatten(0, 1)
        v_cache = kv_cache[1].flatten(0, 1)
        k_cache[slot_mapping] = key.to(k_cache.dtype)
        v_cache[slot_mapping] = value.to(v_cache.dtype)

    def forward(self, query, kv_cache, metadata: AttentionMetadata, scale, k_scale=1.0,
                v_scale=1.0, sliding_window=None):
        dtype = kv_cache.dtype
        if dtype == FP8_KV_DTYPE:
            kv_cache = kv_cache.view(torch.uint8)
        else:
            k_scale = v_scale = 1.0
        if metadata.max_query_len == 1:
            return self._decode(query, kv_cache, metadata, scale, dtype, k_scale, v_scale,
                                sliding_window)
        out = torch.empty_like(query)
        qsl, lens = metadata.query_start_loc_cpu, metadata.seq_lens_cpu
        bs = kv_cache.shape[2]
        rows = range(metadata.num_seqs)
        dec = _decode_part(metadata)
        if dec is not None:  # the step's decodes in one batched SDPA, its prefills one by one
            part, sub = dec
            out[part.tok_begin:part.tok_end] = self._decode(
                query[part.tok_begin:part.tok_end], kv_cache, sub, scale, dtype, k_scale,
                v_scale, sliding_window)
            rows = [i for i in rows if not part.seq_begin <= i < part.seq_end]
        for i in rows:
            s, e, length = qsl[i], qsl[i + 1], lens[i]
            start = 0  # the first block inside the first query's window
            if sliding_window is not None:
                start = max(0, length - (e - s) - sliding_window + 1) // bs * bs
            k = _gather_context(kv_cache[0], metadata.block_tables[i], length, start)
            v = _gather_context(kv_cache[1], metadata.block_tables[i], length, start)
            k, v = _dequantize(k, dtype, k_scale), _dequantize(v, dtype, v_scale)
            out[s:e] = self._attend(query[s:e], k, v, length, scale, start,
                                    sliding_window).to(query.dtype)
        return out

    @staticmethod
    def _attend(q, k, v, length, scale, start=0, window=None):
        """q: [n, Hq, D] for positions length-n .. length-1; k, v: [length - start, Hkv, D] fp32,
        the keys from position ``start`` on; ``window``: a sliding window (tokens) or None."""
        n, hq, d = q.shape
        hkv = k.shape[1]
        g = hq // hkv
        qf = q.float().view(n, hkv, g, d)
        scores = torch.einsum("nhgd,thd->hgnt", qf, k) * scale
        q_pos = torch.arange(length - n, length, device=q.device)
        k_pos = torch.arange(start, length, device=q.device)
        hidden = k_pos[None, :] > q_pos[:, None]
        if window is not None:
            hidden |= k_pos[None, :] <= q_pos[:, None] - window
        scores.masked_fill_(hidden, float("-inf"))
        probs = scores.softmax(dim=-1)
        return torch.einsum("hgnt,thd->nhgd", probs, v).reshape(n, hq, d)

    @staticmethod
    def _decode(query, kv_cache, metadata, scale, dtype, k_scale, v_scale, window=None):
        """One new token per request: each request's keys gathered through the step's flat
        slot indices (`_decode_slots`, worked out once per step and window, not per layer),
        then one masked SDPA over the batch. The g = Hq / Hkv query heads that share a KV head
        are its g query rows (one position each), so GQA needs no repeated K/V."""
        b, hq, d = query.shape
        hkv = kv_cache.shape[3]
        slots, valid = _decode_slots(metadata, kv_cache.shape[2], window)
        t = valid.shape[1]
        k = _dequantize(kv_cache[0].flatten(0, 1).index_select(0, slots), dtype, k_scale)
        v = _dequantize(kv_cache[1].flatten(0, 1).index_select(0, slots), dtype, v_scale)
        k = k.view(b, t, hkv, d).transpose(1, 2)  # [B, Hkv, T, D]
        v = v.view(b, t, hkv, d).transpose(1, 2)
        q = query.float().view(b, hkv, hq // hkv, d)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=valid[:, None, None, :],
                                             scale=scale)
        return out.reshape(b, hq, d).to(query.dtype)


def _decode_part(metadata: AttentionMetadata) -> tuple[BatchPart, AttentionMetadata] | None:
    """A mixed step's decodes as (their `BatchPart`, a decode-only metadata of those requests)
    when they are contiguous in the batch and more than one (the scheduler puts running
    requests first), else None. Worked out once per step, kept in ``metadata.backend_cache``
    (the sub-metadata's own cache then keeps its slot indices for the other layers)."""
    key = "torch_ref.decode_part"
    if key in metadata.backend_cache:
        return metadata.backend_cache[key]
    part = metadata.parts[0]
    found = None
    if part is not None and part.pure and part.seq_end - part.seq_begin > 1:
        a, b = part.seq_begin, part.seq_end
        qsl = metadata.query_start_loc_cpu
        sub = AttentionMetadata(
            slot_mapping=metadata.slot_mapping[part.tok_begin:part.tok_end],
            query_start_loc=metadata.query_start_loc[a:b + 1] - qsl[a],
            seq_lens=metadata.seq_lens[a:b], block_tables=metadata.block_tables[a:b],
            max_query_len=1, max_seq_len=part.max_seq_len,
            query_start_loc_cpu=[x - qsl[a] for x in qsl[a:b + 1]],
            seq_lens_cpu=metadata.seq_lens_cpu[a:b])
        found = (part, sub)
    metadata.backend_cache[key] = found
    return found


def _decode_slots(metadata: AttentionMetadata, bs: int,
                  window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(slots [B * T] int64, valid [B, T] bool) of a decode-only step: row i's T key positions
    (from 0, or with a ``window`` from the block holding position seq_len - window: at most
    cdiv(window, block_size) + 1 blocks, so no block behind the window is read) as cache
    slots through its block table, and which of them it attends to. A position it does not
    attend to reads an attended one's slot instead (positions clamped into the window), so
    every gathered entry is finite: masked keys get probability 0, and 0 * a finite value is
    0, where an unwritten slot could hold NaN. Computed once per step and window (every layer
    of the step shares it), kept in ``metadata.backend_cache``."""
    key = ("torch_ref.decode_slots", bs, window)
    cached = metadata.backend_cache.get(key)
    if cached is not None:
        return cached
    dev = metadata.block_tables.device
    nb = -(-metadata.max_seq_len // bs)
    lens = metadata.seq_lens.long()[:, None]  # [B, 1], each >= 1 (the new token)
    first = torch.zeros_like(lens)  # [B, 1] the first position read
    low = first
    if window is not None:
        nb = min(nb, -(-window // bs) + 1)
        low = (lens - window).clamp(min=0)  # the first position inside the window
        first = low // bs * bs
    t = first + torch.arange(nb * bs, device=dev)  # [B, T] positions
    valid = (t < lens) & (t >= low)
    t = torch.minimum(torch.maximum(t, low), lens - 1)
    tables = metadata.block_tables.long()
    slots = tables.gather(1, t // bs) * bs + t % bs
    cached = metadata.backend_cache[key] = (slots.view(-1), valid)
    return cached


@hookimpl
def register_attention_backends(register):
    register("torch_ref", TorchRefBackend)
