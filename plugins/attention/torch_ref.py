"""``torch_ref``: paged attention in plain torch, the reference every kernel is checked against.

Runs anywhere torch runs (CPU and GPU). Math in fp32 whatever the cache dtype. A decode-only
batch is computed in one padded gather; a batch with prefill chunks loops over requests. An fp8
cache (float8_e4m3fn) is written by `quantize_fp8` and read back as ``entry.float() * scale``;
its entries are scattered and gathered as bytes (a uint8 view), since not every torch build has
fp8 indexing kernels.
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


def _gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """cache: [num_blocks, block_size, H, D]; block_table: [n] -> [length, H, D]."""
    bs = cache.shape[1]
    nb = -(-length // bs)
    return cache[block_table[:nb].long()].flatten(0, 1)[:length]


class TorchRefBackend(AttentionBackend):
    name = "torch_ref"
    supports_fp8_kv_cache = True

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
                v_scale=1.0):
        dtype = kv_cache.dtype
        if dtype == FP8_KV_DTYPE:
            kv_cache = kv_cache.view(torch.uint8)
        else:
            k_scale = v_scale = 1.0
        if metadata.max_query_len == 1:
            return self._decode(query, kv_cache, metadata, scale, dtype, k_scale, v_scale)
        out = torch.empty_like(query)
        qsl, lens = metadata.query_start_loc_cpu, metadata.seq_lens_cpu
        for i in range(metadata.num_seqs):
            s, e, length = qsl[i], qsl[i + 1], lens[i]
            k = _gather_context(kv_cache[0], metadata.block_tables[i], length)
            v = _gather_context(kv_cache[1], metadata.block_tables[i], length)
            k, v = _dequantize(k, dtype, k_scale), _dequantize(v, dtype, v_scale)
            out[s:e] = self._attend(query[s:e], k, v, length, scale).to(query.dtype)
        return out

    @staticmethod
    def _attend(q, k, v, length, scale):
        """q: [n, Hq, D] for positions length-n .. length-1; k, v: [length, Hkv, D] fp32."""
        n, hq, d = q.shape
        hkv = k.shape[1]
        g = hq // hkv
        qf = q.float().view(n, hkv, g, d)
        scores = torch.einsum("nhgd,thd->hgnt", qf, k) * scale
        q_pos = torch.arange(length - n, length, device=q.device)
        k_pos = torch.arange(length, device=q.device)
        scores.masked_fill_(k_pos[None, :] > q_pos[:, None], float("-inf"))
        probs = scores.softmax(dim=-1)
        return torch.einsum("hgnt,thd->nhgd", probs, v).reshape(n, hq, d)

    @staticmethod
    def _decode(query, kv_cache, metadata, scale, dtype, k_scale, v_scale):
        b, hq, d = query.shape
        bs = kv_cache.shape[2]
        hkv = kv_cache.shape[3]
        g = hq // hkv
        nb = -(-metadata.max_seq_len // bs)
        tables = metadata.block_tables[:, :nb].long()
        k = _dequantize(kv_cache[0][tables].flatten(1, 2), dtype, k_scale)  # [B, T, Hkv, D]
        v = _dequantize(kv_cache[1][tables].flatten(1, 2), dtype, v_scale)
        qf = query.float().view(b, hkv, g, d)
        scores = torch.einsum("bhgd,bthd->bhgt", qf, k) * scale
        t = torch.arange(k.shape[1], device=query.device)
        mask = t[None, :] >= metadata.seq_lens[:, None]
        scores.masked_fill_(mask[:, None, None, :], float("-inf"))
        probs = scores.softmax(dim=-1)
        v = v.masked_fill(mask[:, :, None, None], 0.0)  # unused slots may hold NaN/inf
        return torch.einsum("bhgt,bthd->bhgd", probs, v).reshape(b, hq, d).to(query.dtype)


@hookimpl
def register_attention_backends(register):
    register("torch_ref", TorchRefBackend)
