"""The ``triton`` backend's prefill path (plugins/attention/prefill.py: in-chunk keys read from
the step's new K/V, TMA descriptors) and the split of mixed steps into a decode launch and a
prefill launch, against ``torch_ref``.

Like test_triton_attention.py: compiled on a GPU (bf16/fp16, bigger batches), under
``TRITON_INTERPRET=1`` in a child process on the CPU (fp16/fp32, tiny shapes).
"""

from __future__ import annotations

import pytest
import torch

from pagebatch.plugins.attention.torch_ref import TorchRefBackend

from interpreted import (DEVICE, DTYPES, ON_GPU, REL_TOL,  # noqa: F401
                         kernels_run_here, make_batch, rel_err, run_under_interpreter)


def test_kernels_under_interpreter():
    """CPU: this file in a fresh process under TRITON_INTERPRET=1; fails with its output."""
    run_under_interpreter(__file__, timeout=600)


# (query_lens, context_lens) per batch kind: a fresh prompt, a chunk after a cached prefix, and
# a mixed step whose decodes sit before, between and after its prefill chunks
BATCHES = {
    "fresh": ([37], [37]),
    "prefix": ([21], [50]),
    "mixed": ([1, 1, 19, 1, 6, 1, 2], [9, 30, 19, 1, 40, 17, 2]),
}
if ON_GPU:
    BATCHES = {
        "fresh": ([1000, 300], [1000, 300]),
        "prefix": ([513, 77], [1500, 700]),
        "mixed": ([1] * 20 + [700] + [1] * 20 + [129, 3], [900] * 20 + [2000] + [50] * 20
                  + [129, 500]),
    }


def _check(kind, hq, hkv, d, block_size, dtype, config=None, rope=False, seed=0):
    from pagebatch.layers.rotary import RotaryEmbedding
    from pagebatch.plugins.attention.triton_backend import TritonBackend

    qlens, lens = BATCHES[kind]
    cache, meta, q, k, v = make_batch(seed, qlens, lens, hq, hkv, d, block_size, dtype)
    ref_backend, backend = TorchRefBackend(), TritonBackend()
    ref_cache = cache.clone()
    scale = d ** -0.5
    kw = {}
    q_ref, k_ref = q, k
    if rope:
        positions = torch.cat([torch.arange(n - ql, n) for ql, n in zip(qlens, lens)])
        rot = RotaryEmbedding(d, max(lens), 10000.0, None, DEVICE)
        q_ref, k_ref = rot.forward_torch(positions.to(DEVICE), q, k)
        kw["rope"] = (positions.to(DEVICE), rot.cos_sin)
    ref_backend.write_kv(k_ref, v, ref_cache, meta.slot_mapping)
    ref = ref_backend.forward(q_ref, ref_cache, meta, scale)
    k = k.clone()
    backend.write_kv(k, v, cache, meta.slot_mapping, **kw)  # with rope: rotates k in place
    from pagebatch.plugins.attention import triton_backend as tb

    out = tb.paged_attention(q, cache, meta, scale, None, rope=kw.get("rope"), new_kv=(k, v),
                             prefill_config=config)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.isfinite(out).all()
    err = rel_err(out, ref)
    assert err < REL_TOL[dtype], f"{kind}: rel err {err:.2e}"


# (hq, hkv, head_dim, block_size): GQA groups 1, 4, 8 (and 3), head_dim 64, 128, 80, 96
SHAPES = [(4, 4, 64, 16), (8, 2, 128, 32), (8, 1, 80, 16), (6, 2, 96, 32)]
if ON_GPU:
    SHAPES = [(hq, hkv, d, bs) for hq, hkv in [(32, 8), (8, 8), (8, 1), (9, 3)]
              for d in [64, 128, 80] for bs in [16, 32]]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", sorted(BATCHES))
@pytest.mark.parametrize("hq,hkv,d,block_size", SHAPES)
def test_prefill_path_matches_torch_ref(hq, hkv, d, block_size, kind, dtype):
    if not ON_GPU and dtype == torch.float32 and (d, kind) != (64, "mixed"):
        pytest.skip("the interpreter: fp32 on one shape (fp16 covers the rest)")
    _check(kind, hq, hkv, d, block_size, dtype, seed=d + block_size)


def _tiles():
    """Prefill configs to force: pointer loads, host and device TMA descriptors, odd tiles."""
    from pagebatch.plugins.attention.prefill import (TMA_DEVICE, TMA_HOST, TMA_OFF,
                                                      PrefillConfig)

    if not ON_GPU:
        return [PrefillConfig(16, 16, 4, 1, TMA_OFF), PrefillConfig(32, 16, 4, 1, TMA_HOST),
                PrefillConfig(16, 32, 4, 1, TMA_DEVICE)]
    return [PrefillConfig(128, 128, 8, 3, t, ws) for t in (TMA_OFF, TMA_HOST, TMA_DEVICE)
            for ws in (False, True)] + [PrefillConfig(64, 64, 4, 2, TMA_HOST),
                                        PrefillConfig(128, 64, 8, 3, TMA_HOST)]


@pytest.mark.parametrize("kind", sorted(BATCHES))
@pytest.mark.parametrize("config", _tiles(), ids=lambda c: (
    f"m{c.block_m}n{c.tile_n}w{c.num_warps}s{c.num_stages}tma{c.tma}ws{int(c.warp_specialize)}"))
def test_forced_prefill_configs(config, kind):
    """Every config computes the same; one with warp specialization may not compile on this
    Triton (then it skips, naming the error: the defaults never turn it on)."""
    try:
        _check(kind, 8, 2, 64, 16, DTYPES[0], config=config, seed=3)
    except AssertionError:
        raise
    except Exception as e:  # noqa: BLE001 - a compile error of the optional feature
        if not config.warp_specialize:
            raise
        pytest.skip(f"warp_specialize does not compile here: {type(e).__name__}: {e}"[:300])


@pytest.mark.parametrize("kind", ["prefix", "mixed"])
def test_fused_rope_reads_rotated_new_keys(kind):
    """With RoPE in the kernels, the backend's KV write rotates the layer's key in place, so
    the prefill kernel's in-chunk keys equal the cache's."""
    _check(kind, 8, 2, 64, 16, DTYPES[0], rope=True, seed=5)


class _Spy:
    """Stands in for a Triton kernel; records each launch's constexprs (``kernel[grid](...)``)."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.launches.append(kw)
            return self.kernel[grid](*args, **kw)
        return launch


def test_mixed_step_launches_decodes_in_decode_tiles(monkeypatch):
    """A mixed step: one launch of the paged kernel for its decodes (16-row tiles, skipping the
    prefills between them), one of the prefill kernel for its chunks; a decode-only step one
    launch over everything (the CUDA-graph case)."""
    from pagebatch.plugins.attention import prefill_kernel as pk
    from pagebatch.plugins.attention import triton_kernels as tk

    paged, prefill = _Spy(tk.paged_attention_kernel), _Spy(pk.prefill_attention_kernel)
    monkeypatch.setattr(tk, "paged_attention_kernel", paged)
    monkeypatch.setattr(pk, "prefill_attention_kernel", prefill)
    _check("mixed", 8, 2, 64, 16, DTYPES[0])
    assert [(kw["BLOCK_M"], kw["KIND"]) for kw in paged.launches] == [(16, 1)]
    assert [kw["SKIP_DECODES"] for kw in prefill.launches] == [True]
    paged.launches.clear()
    prefill.launches.clear()
    _check("fresh", 8, 2, 64, 16, DTYPES[0])
    assert not paged.launches and len(prefill.launches) == 1


def test_chunks_over_a_long_cached_prefix_take_the_paged_kernel(monkeypatch):
    """Past PREFILL_KERNEL_MAX_CONTEXT x the chunk, a prefill reads mostly cached keys: the
    paged kernel takes it (it reads the cache faster); a forced prefill config still runs the
    prefill kernel."""
    from pagebatch.plugins.attention import prefill_kernel as pk
    from pagebatch.plugins.attention import triton_backend as tb
    from pagebatch.plugins.attention import triton_kernels as tk

    paged, prefill = _Spy(tk.paged_attention_kernel), _Spy(pk.prefill_attention_kernel)
    monkeypatch.setattr(tk, "paged_attention_kernel", paged)
    monkeypatch.setattr(pk, "prefill_attention_kernel", prefill)
    monkeypatch.setitem(BATCHES, "long", ([5], [5 * tb.PREFILL_KERNEL_MAX_CONTEXT + 1]))
    _check("long", 8, 2, 64, 16, DTYPES[0])
    assert len(paged.launches) == 1 and not prefill.launches
    monkeypatch.setitem(BATCHES, "long", ([5], [5 * tb.PREFILL_KERNEL_MAX_CONTEXT]))
    _check("long", 8, 2, 64, 16, DTYPES[0])
    assert len(paged.launches) == 1 and len(prefill.launches) == 1


def test_batch_parts():
    from pagebatch.attention import AttentionMetadata, BatchPart

    def parts(qlens, lens):
        qsl = [0]
        for n in qlens:
            qsl.append(qsl[-1] + n)
        t = torch.zeros(1)
        return AttentionMetadata(t, t, t, t, max(qlens), max(lens), qsl, lens).parts

    assert parts([1, 1], [5, 6]) == (BatchPart(0, 2, 0, 2, 1, 6, True), None)
    assert parts([1, 4, 1, 0, 3], [5, 9, 7, 2, 3]) == (
        BatchPart(0, 3, 0, 6, 1, 7, False), BatchPart(1, 5, 1, 9, 4, 9, False))
    assert parts([2, 1, 1], [8, 3, 4]) == (BatchPart(1, 3, 2, 4, 1, 4, True),
                                           BatchPart(0, 1, 0, 2, 2, 8, True))
