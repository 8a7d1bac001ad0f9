"""Piecewise CUDA graphs, the parts that run on the CPU: the captured token counts, and the cut
of the forward at each attention call (core/layers/attention.py `set_split`), which is how
core/piecewise_graphs.py splits the model into pieces. The capture and replay themselves are
CUDA's: tests/test_piecewise_graphs_gpu.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pagebatch.layers import attention as attention_layer
from pagebatch.piecewise_graphs import piecewise_sizes


@pytest.mark.parametrize("limit", [1, 8, 9, 96, 100, 512, 1000])
def test_sizes_cover_every_step_with_bounded_padding(limit):
    sizes = piecewise_sizes(limit)
    assert sizes == sorted(set(sizes)) and sizes[-1] == limit
    for t in range(1, limit + 1):
        b = next(s for s in sizes if s >= t)
        assert b - t < max(8, 0.25 * t + 1e-9) or b == sizes[0]


def test_no_sizes_when_off():
    assert piecewise_sizes(0) == []


def test_the_split_hook_cuts_the_forward_at_every_attention_in_order(tmp_path):
    from conftest import build_tiny_model
    from pagebatch import LLM

    folder = build_tiny_model(tmp_path / "tiny", num_hidden_layers=3)
    llm = LLM(str(folder), device="cpu", dtype="float32", num_kv_blocks=64, block_size=16)
    runner = llm.engine.core.runner
    assert runner.piecewise is None  # CUDA only
    model = runner.model
    n = 12
    # the dummy metadata writes no KV (its slots are padding); here the keys are written to
    # block 0 so that both forwards read what they wrote, not the uninitialized cache
    meta = dataclasses.replace(runner._prefill_meta(n), slot_mapping=torch.arange(n))
    ids = torch.arange(3, 3 + n)
    pos = torch.arange(n)
    ref = model(ids, pos, runner.kv_caches, meta)
    seen = []

    def split(layer, q, k, v, kv_cache, rope):
        seen.append((layer, q.shape, k.shape, v.shape, kv_cache.data_ptr(), rope[0]))
        return layer.attend(q, k, v, kv_cache, meta, rope)  # attend, so the output is checked

    attention_layer.set_split(split)
    try:
        out = model(ids, pos, runner.kv_caches, meta)
    finally:
        attention_layer.set_split(None)
    layers = [m for m in model.modules() if isinstance(m, attention_layer.Attention)]
    assert [s[0] for s in seen] == layers and len(layers) == 3
    for (layer, qs, ks, vs, ptr, p), cache in zip(seen, runner.kv_caches):
        assert qs == (n, layer.num_heads, layer.head_dim)
        assert ks == vs == (n, layer.num_kv_heads, layer.head_dim)
        assert ptr == cache.data_ptr() and p is pos
    torch.testing.assert_close(out, ref)
    model(ids, pos, runner.kv_caches, meta)  # the hook is gone again
    assert len(seen) == 3
