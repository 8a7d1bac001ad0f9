"""torch_ref paged attention against dense causal attention, on random mixed batches."""

from __future__ import annotations

import random

import pytest
import torch

from pagebatch.attention import AttentionMetadata
from pagebatch.plugins.attention.torch_ref import TorchRefBackend


def dense_reference(q, k, v, scale):
    """q: [n, Hq, D] for the last n positions of k/v: [L, Hkv, D]; fp64 math."""
    n, hq, d = q.shape
    length, hkv, _ = k.shape
    g = hq // hkv
    k = k.double().repeat_interleave(g, dim=1)
    v = v.double().repeat_interleave(g, dim=1)
    s = torch.einsum("nhd,thd->hnt", q.double(), k) * scale
    qpos = torch.arange(length - n, length)[:, None]
    s = s.masked_fill(torch.arange(length)[None, :] > qpos, float("-inf"))
    return torch.einsum("hnt,thd->nhd", s.softmax(-1), v)


def make_batch(seed, query_lens, context_lens, hq, hkv, d, block_size):
    """A poisoned (NaN) paged cache holding each request's context at random blocks."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    backend = TorchRefBackend()
    num_blocks = sum(-(-n // block_size) for n in context_lens) + 8
    cache = torch.full(backend.kv_cache_shape(num_blocks, block_size, hkv, d), float("nan"))
    free = list(range(num_blocks))
    rng.shuffle(free)
    qs, refs, slots, tables, qsl = [], [], [], [], [0]
    for n, length in zip(query_lens, context_lens):
        nb = -(-length // block_size)
        table = [free.pop() for _ in range(nb)]
        k = torch.randn(length, hkv, d)
        v = torch.randn(length, hkv, d)
        q = torch.randn(n, hq, d)
        pos = torch.arange(length)
        slot = torch.tensor(table)[pos // block_size] * block_size + pos % block_size
        # the prefix is already cached; the last n tokens are written by this step
        backend.write_kv(k[:length - n], v[:length - n], cache, slot[:length - n])
        qs.append(q)
        refs.append(dense_reference(q, k, v, d ** -0.5))
        slots.append((slot[length - n:], k[length - n:], v[length - n:]))
        tables.append(table)
        qsl.append(qsl[-1] + n)
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.cat([s[0] for s in slots]),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(context_lens, dtype=torch.int32), block_tables=bt,
        max_query_len=max(query_lens), max_seq_len=max(context_lens),
        query_start_loc_cpu=qsl, seq_lens_cpu=list(context_lens))
    new_k = torch.cat([s[1] for s in slots])
    new_v = torch.cat([s[2] for s in slots])
    return backend, cache, meta, torch.cat(qs), new_k, new_v, torch.cat(refs)


@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (8, 2, 32), (4, 4, 16), (8, 1, 128)])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("mixed", [True, False])
def test_paged_equals_dense(hq, hkv, d, block_size, mixed):
    rng = random.Random(hq * 100 + block_size)
    b = 5
    if mixed:  # prefill chunks over a cached prefix, mixed with decodes
        qlens = [rng.choice([1, 1, rng.randint(2, 20)]) for _ in range(b)]
    else:  # decode only
        qlens = [1] * b
    lens = [q + rng.randint(0, 40) for q in qlens]
    backend, cache, meta, q, k, v, ref = make_batch(7, qlens, lens, hq, hkv, d, block_size)
    backend.write_kv(k, v, cache, meta.slot_mapping)
    out = backend.forward(q, cache, meta, d ** -0.5)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (8, 1, 128)])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("qlens", [[1, 1, 1, 1, 13, 7], [17, 1, 1, 1], [1, 1, 2, 1, 1]])
def test_mixed_step_decodes_batched_equal_dense(hq, hkv, d, block_size, qlens):
    """A mixed step whose decodes sit side by side (the scheduler's order: running requests
    first) computes them in one batched SDPA; they and the prefills still match dense
    attention. [1, 1, 2, 1, 1]: decodes on both sides of a prefill (not contiguous) take the
    per-request loop."""
    from pagebatch.plugins.attention.torch_ref import _decode_part

    rng = random.Random(len(qlens) * 10 + block_size)
    lens = [q + rng.randint(0, 40) for q in qlens]
    backend, cache, meta, q, k, v, ref = make_batch(11, qlens, lens, hq, hkv, d, block_size)
    backend.write_kv(k, v, cache, meta.slot_mapping)
    out = backend.forward(q, cache, meta, d ** -0.5)
    part = _decode_part(meta)
    ones = [i for i, n in enumerate(qlens) if n == 1]
    contiguous = ones == list(range(ones[0], ones[-1] + 1))
    assert (part is not None) == contiguous
    if part is not None:
        assert (part[0].seq_begin, part[0].seq_end) == (ones[0], ones[-1] + 1)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
