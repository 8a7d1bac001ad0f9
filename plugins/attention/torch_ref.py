"""``torch_ref``: paged attention in plain torch, the reference every kernel is checked against.

Runs anywhere torch runs (CPU and GPU). Math in fp32 whatever the cache dtype. A decode-only
batch is computed in one padded gather; a batch with prefill chunks loops over requests.
"""

from __future__ import annotations

import torch

from pagebatch.attention import AttentionBackend, AttentionMetadata
from pagebatch.hookspecs import hookimpl


def _gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """cache: [num_blocks, block_size, H, D]; block_table: [n] -> [length, H, D]."""
    bs = cache.shape[1]
    nb = -(-length // bs)
    return cache[block_table[:nb].long()].flatten(0, 1)[:length]


class TorchRefBackend(AttentionBackend):
    name = "torch_ref"

    def write_kv(self, key, value, kv_cache, slot_mapping):
        k_cache = kv_cache[0].flatten(0, 1)
        v_cache = kv_cache[1].flatten(0, 1)
        k_cache[slot_mapping] = key.to(k_cache.dtype)
        v_cache[slot_mapping] = value.to(v_cache.dtype)

    def forward(self, query, kv_cache, metadata: AttentionMetadata, scale):
        if metadata.max_query_len == 1:
            return self._decode(query, kv_cache, metadata, scale)
        out = torch.empty_like(query)
        qsl, lens = metadata.query_start_loc_cpu, metadata.seq_lens_cpu
        for i in range(metadata.num_seqs):
            s, e, length = qsl[i], qsl[i + 1], lens[i]
            k = _gather_context(kv_cache[0], metadata.block_tables[i], length)
            v = _gather_context(kv_cache[1], metadata.block_tables[i], length)
            out[s:e] = self._attend(query[s:e], k, v, length, scale).to(query.dtype)
        return out

    @staticmethod
    def _attend(q, k, v, length, scale):
        """q: [n, Hq, D] for positions length-n .. length-1; k, v: [length, Hkv, D]."""
        n, hq, d = q.shape
        hkv = k.shape[1]
        g = hq // hkv
        qf = q.float().view(n, hkv, g, d)
        scores = torch.einsum("nhgd,thd->hgnt", qf, k.float()) * scale
        q_pos = torch.arange(length - n, length, device=q.device)
        k_pos = torch.arange(length, device=q.device)
        scores.masked_fill_(k_pos[None, :] > q_pos[:, None], float("-inf"))
        probs = scores.softmax(dim=-1)
        return torch.einsum("hgnt,thd->nhgd", probs, v.float()).reshape(n, hq, d)

    @staticmethod
    def _decode(query, kv_cache, metadata, scale):
        b, hq, d = query.shape
        bs = kv_cache.shape[2]
        hkv = kv_cache.shape[3]
        g = hq // hkv
        nb = -(-metadata.max_seq_len // bs)
        tables = metadata.block_tables[:, :nb].long()
        k = kv_cache[0][tables].flatten(1, 2).float()  # [B, T, Hkv, D]
        v = kv_cache[1][tables].flatten(1, 2).float()
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
