"""Sliding-window attention in the ``triton`` backend's kernels (paged kernel: decodes, prefill
chunks, split-KV; the prefill kernel over the step's new keys) against ``torch_ref`` with the
same window, and ``torch_ref`` against a dense masked softmax written from transformers' rule
(position i sees keys j with i - W < j <= i).

The blocks wholly behind each request's first query's window are what the block manager gives
back: here they are poisoned (NaN K/V) and their table entries point at a NaN block, so a kernel
that reads any of them returns NaN. On CPU the kernels run under ``TRITON_INTERPRET=1`` in a
child process (tests/interpreted.py), on tiny shapes.
"""

from __future__ import annotations

import pytest
import torch

from pagebatch.plugins.attention.torch_ref import TorchRefBackend

from interpreted import (DEVICE, DTYPES, ON_GPU, REL_TOL,  # noqa: F401
                         kernels_run_here, make_batch, rel_err, run_under_interpreter)

# (query_lens, context_lens): decodes, fresh prompts, chunks after a cached prefix, mixed
BATCHES = {
    "decode": ([1, 1, 1, 1], [5, 33, 70, 47]),
    "fresh": ([45, 9], [45, 9]),
    "prefix": ([21, 6], [77, 40]),
    "mixed": ([1, 19, 1, 6, 2], [61, 19, 30, 58, 2]),
}


def test_kernels_under_interpreter():
    """CPU: this file in a fresh process under TRITON_INTERPRET=1; fails with its output."""
    run_under_interpreter(__file__, timeout=600)


def windowed_batch(kind, window, hq=4, hkv=2, d=16, block_size=8, dtype=torch.float32, seed=0):
    """make_batch, then the blocks behind each request's window given away: filled with NaN,
    and their table entries pointed at a NaN block (as stale ids or the null block would be)."""
    qlens, lens = BATCHES[kind]
    cache, meta, q, k, v = make_batch(seed, qlens, lens, hq, hkv, d, block_size, dtype)
    clean = cache.clone()
    used = {int(b) for row, n in zip(meta.block_tables.tolist(), lens)
            for b in row[:-(-n // block_size)]}
    spare = next(b for b in range(cache.shape[1]) if b not in used)  # NaN: never written
    for i, (ql, n) in enumerate(zip(qlens, lens)):
        skipped = max(0, n - ql - window + 1) // block_size  # core/kv_window.py's rule
        for j in range(skipped):
            cache[:, meta.block_tables[i, j]] = float("nan")
            meta.block_tables[i, j] = spare
    return cache, clean, meta, q, k, v


def dense_reference(q, k_all, v_all, lens, qlens, window, scale):
    """Per request: softmax over keys i - window < j <= i from the whole K/V [len, Hkv, D]."""
    outs = []
    for qi, k, v, n, ql in zip(q, k_all, v_all, lens, qlens):
        hq, hkv = qi.shape[1], k.shape[1]
        kk = k.float().repeat_interleave(hq // hkv, 1)
        vv = v.float().repeat_interleave(hq // hkv, 1)
        s = torch.einsum("qhd,khd->hqk", qi.float(), kk) * scale
        i = torch.arange(n - ql, n, device=k.device)[:, None]
        j = torch.arange(n, device=k.device)[None, :]
        s = s.masked_fill(~((j <= i) & (j > i - window)), float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), vv))
    return torch.cat(outs)


def _check(kind, window, path, dtype=None, block_size=8, seed=0, splits=1):
    from pagebatch.plugins.attention import triton_backend as tb
    from pagebatch.plugins.attention.prefill import PrefillConfig

    dtype = dtype or DTYPES[0]
    cache, clean, meta, q, k, v = windowed_batch(kind, window, block_size=block_size,
                                                 dtype=dtype, seed=seed)
    ref_backend = TorchRefBackend()
    ref_cache = clean.clone()
    ref_backend.write_kv(k, v, ref_cache, meta.slot_mapping)
    scale = 16 ** -0.5
    ref = ref_backend.forward(q, ref_cache, meta, scale, sliding_window=window)
    tb.write_kv(k, v, cache, meta.slot_mapping)
    config = prefill = None
    if path == "paged":  # every request in one launch of the paged kernel
        config = tb.LaunchConfig(16, 16, 4, 1, splits)
    elif path == "prefill":
        prefill = PrefillConfig(16, 16, 4, 1)
    out = tb.paged_attention(q, cache, meta, scale, config, new_kv=(k, v),
                             prefill_config=prefill, sliding_window=window)
    assert torch.isfinite(out).all(), f"{kind} W={window} {path}: read a skipped block"
    err = rel_err(out, ref)
    assert err < REL_TOL[dtype], f"{kind} W={window} {path} splits={splits}: rel err {err:.2e}"


@pytest.mark.parametrize("window", [1, 12, 16, 33])
@pytest.mark.parametrize("kind", sorted(BATCHES))
def test_paged_kernel_window(kind, window):
    _check(kind, window, "paged", seed=window)


@pytest.mark.parametrize("splits", [2, 3])
@pytest.mark.parametrize("kind", ["decode", "mixed"])
def test_split_kv_window(kind, splits):
    _check(kind, 20, "paged", seed=splits, splits=splits)


@pytest.mark.parametrize("window", [5, 16, 30])
@pytest.mark.parametrize("kind", ["fresh", "prefix", "mixed"])
def test_prefill_kernel_window(kind, window):
    _check(kind, window, "prefill", seed=window)


@pytest.mark.parametrize("kind", sorted(BATCHES))
def test_default_launches_window(kind):
    """The backend's own choice of kernels and tiles (decodes and prefills apart)."""
    _check(kind, 24, None, block_size=16, seed=7)


@pytest.mark.parametrize("window", [1, 10, 24])
@pytest.mark.parametrize("kind", sorted(BATCHES))
def test_torch_ref_window_is_transformers_rule(kind, window):
    """torch_ref with a window (skipped blocks poisoned) equals the dense masked softmax."""
    qlens, lens = BATCHES[kind]
    cache, clean, meta, q, k, v = windowed_batch(kind, window, dtype=torch.float32, seed=1)
    backend = TorchRefBackend()
    backend.write_kv(k, v, cache, meta.slot_mapping)
    backend.write_kv(k, v, clean, meta.slot_mapping)
    out = backend.forward(q, cache, meta, 16 ** -0.5, sliding_window=window)
    assert torch.isfinite(out).all()
    bs = clean.shape[2]
    ks, vs, qs = [], [], []
    qsl = meta.query_start_loc_cpu
    table = make_batch(1, qlens, lens, 4, 2, 16, bs, torch.float32)[1].block_tables
    for i, n in enumerate(lens):
        pos = torch.arange(n, device=table.device)
        slot = table[i][pos // bs].long() * bs + pos % bs
        ks.append(clean[0].flatten(0, 1)[slot])
        vs.append(clean[1].flatten(0, 1)[slot])
        qs.append(q[qsl[i]:qsl[i + 1]])
    ref = dense_reference(qs, ks, vs, lens, qlens, window, 16 ** -0.5)
    assert rel_err(out, ref) < 1e-5
