"""``torch_ref``: paged attention in plain torch, the reference every kernel is checked against.

Runs anywhere torch runs (CPU and GPU). Math in fp32 whatever the cache dtype. A decode-only
batch is computed in one padded gather; a batch with prefill chunks loops over requests. An fp8
cache (float8_e4m3fn) is written by `quantize_fp8` and read back as ``entry.float() * scale``;
its entries are scattered and gathered as bytes (a uint8 view), since not every torch build has
fp8 indexing kernels. A sliding window (``sliding_window=W``: position i sees keys j with
i - W < j <= i, transformers' mask) is read from the first block inside the first query's
window on: blocks behind it are never gathered (the block manager may have given them away).
"""

from __future__ import annotations

import torch

from pagebatch.attention import FP8_E4M3_MAX, FP8_KV_DTYPE, AttentionBackend, AttentionMetadata
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
        for i in range(metadata.num_seqs):
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
        """One new token per request. With a ``window``, each request's keys are gathered from
        the block holding position seq_len - window on (cdiv(window, block_size) + 1 blocks,
        no more), not from its whole table."""
        b, hq, d = query.shape
        bs = kv_cache.shape[2]
        hkv = kv_cache.shape[3]
        g = hq // hkv
        nb = -(-metadata.max_seq_len // bs)
        lens = metadata.seq_lens.long()[:, None]
        if window is None:
            tables = metadata.block_tables[:, :nb].long()
            t = torch.arange(nb * bs, device=query.device)[None, :]
        else:
            nb = min(nb, -(-window // bs) + 1)
            first = (lens - window).clamp(min=0) // bs  # [B, 1]
            cols = (first + torch.arange(nb, device=query.device)).clamp(
                max=metadata.block_tables.shape[1] - 1)
            tables = metadata.block_tables.gather(1, cols).long()
            t = first * bs + torch.arange(nb * bs, device=query.device)  # [B, T] positions
        k = _dequantize(kv_cache[0][tables].flatten(1, 2), dtype, k_scale)  # [B, T, Hkv, D]
        v = _dequantize(kv_cache[1][tables].flatten(1, 2), dtype, v_scale)
        qf = query.float().view(b, hkv, g, d)
        scores = torch.einsum("bhgd,bthd->bhgt", qf, k) * scale
        mask = t >= lens
        if window is not None:
            mask |= t < lens - window
        scores.masked_fill_(mask[:, None, None, :], float("-inf"))
        probs = scores.softmax(dim=-1)
        v = v.masked_fill(mask[:, :, None, None], 0.0)  # unused slots may hold NaN/inf
        return torch.einsum("bhgt,bthd->bhgd", probs, v).reshape(b, hq, d).to(query.dtype)


@hookimpl
def register_attention_backends(register):
    register("torch_ref", TorchRefBackend)
