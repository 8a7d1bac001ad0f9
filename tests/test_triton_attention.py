"""The ``triton`` attention backend and the fused layer kernels against their torch versions.

With CUDA the kernels run compiled, in bf16 and fp16, and an engine check compares greedy tokens
with ``torch_ref`` (fp32). On CPU they run under ``TRITON_INTERPRET=1`` (fp16/fp32, tiny
shapes), which must be set before Triton itself is imported (its own ``tl.sum`` etc. are decorated
then) and must not reach other test modules: so on CPU `test_kernels_under_interpreter` runs this
file again in a child process with the variable set, and the parent skips the rest.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from pagebatch.plugins.attention.torch_ref import TorchRefBackend

from interpreted import (DEVICE, DTYPES, IN_PROCESS, ON_GPU, REL_TOL,  # noqa: F401
                         kernels_run_here, make_batch, rel_err, run_under_interpreter)


def test_kernels_under_interpreter():
    """CPU: this file in a fresh process under TRITON_INTERPRET=1; fails with its output."""
    run_under_interpreter(__file__, timeout=900)


def _backend():
    from pagebatch.plugins.attention.triton_backend import TritonBackend

    return TritonBackend()


def ragged_batch(seed: int, mode: str, n: int, max_ctx: int) -> tuple[list[int], list[int]]:
    """(query_lens, context_lens): ``decode`` (1 new token each), ``prefill`` (whole prompts) or
    ``mixed`` (decodes, full prompts and chunks over a cached prefix)."""
    rng = random.Random(seed)
    q, c = [], []
    for i in range(n):
        kind = {"decode": "d", "prefill": "p"}.get(mode) or "dpc"[i % 3]
        length = rng.randint(1, max_ctx)
        if kind == "d":
            q.append(1)
        elif kind == "p":
            q.append(length)
        else:  # a chunk after a prefix-cache hit or an earlier chunk
            length = max(length, 2)
            q.append(rng.randint(1, length - 1))
        c.append(length)
    return q, c


def check_attention(hq, hkv, d, block_size, mode, dtype, seed=0, n=5, max_ctx=40, config=None):
    from pagebatch.plugins.attention import triton_backend as tb

    qlens, lens = ragged_batch(seed, mode, n, max_ctx)
    cache, meta, q, k, v = make_batch(seed, qlens, lens, hq, hkv, d, block_size, dtype)
    ref_backend = TorchRefBackend()
    ref_cache = cache.clone()
    ref_backend.write_kv(k, v, ref_cache, meta.slot_mapping)
    tb.write_kv(k, v, cache, meta.slot_mapping)
    assert torch.equal(cache.isnan(), ref_cache.isnan())
    assert torch.equal(cache.nan_to_num(0.0), ref_cache.nan_to_num(0.0))
    scale = d ** -0.5
    ref = ref_backend.forward(q, ref_cache, meta, scale)
    out = tb.paged_attention(q, cache, meta, scale, config)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.isfinite(out).all(), f"non-finite output (qlens {qlens}, lens {lens})"
    err = rel_err(out, ref)
    assert err < REL_TOL[dtype], f"rel err {err:.2e} (qlens {qlens}, lens {lens})"


# (hq, hkv, head_dim, block_size, mode): every GQA group (1, 3, 4, 8), head_dim, block size and
# batch kind appears at least once; the CPU interpreter runs this list, the GPU more (below)
CASES = [
    (9, 3, 64, 4, "mixed"),
    (9, 3, 64, 16, "decode"),
    (8, 2, 128, 8, "mixed"),
    (8, 2, 128, 1, "prefill"),
    (32, 8, 128, 16, "mixed"),
    (8, 1, 32, 32, "mixed"),
    (4, 4, 80, 4, "prefill"),
    (4, 4, 96, 2, "decode"),
    (2, 1, 256, 128, "mixed"),
    (6, 2, 64, 64, "mixed"),
]
GPU_CASES = [(hq, hkv, d, bs, mode)
             for hq, hkv in [(9, 3), (32, 8), (8, 1), (4, 4)]
             for d in [64, 128] for bs in [4, 16, 128] for mode in ["mixed", "decode"]] + [
    (8, 2, d, bs, "mixed") for d in [32, 80, 96, 256] for bs in [1, 8, 32]]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hq,hkv,d,block_size,mode", GPU_CASES if ON_GPU else CASES)
def test_paged_attention_matches_torch_ref(hq, hkv, d, block_size, mode, dtype):
    if ON_GPU:
        check_attention(hq, hkv, d, block_size, mode, dtype, seed=d + block_size, n=24,
                        max_ctx=700)
    else:
        check_attention(hq, hkv, d, block_size, mode, dtype, seed=d + block_size)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "second-launch"])
@pytest.mark.parametrize("splits", [2, 5])
@pytest.mark.parametrize("mode", ["decode", "mixed"])
def test_split_kv_matches_torch_ref(splits, mode, fused, monkeypatch):
    """The flash-decoding path (forced), including splits that get no keys; the partials merged
    by the last split's program (counters left at zero, twice in a row) or, without counters,
    by the second kernel."""
    from pagebatch.kernels.splitk import counter_buffer
    from pagebatch.plugins.attention import triton_backend as tb
    from pagebatch.plugins.attention import triton_kernels as tk

    if not fused:
        monkeypatch.setattr(tb, "_counters", lambda device, needed: None)
    second = _LaunchCounter(tk.reduce_splits_kernel)
    monkeypatch.setattr(tk, "reduce_splits_kernel", second)
    dtype = DTYPES[0]
    cfg = (tb.LaunchConfig(16, 64, 4, 3, splits) if ON_GPU
           else tb.LaunchConfig(16, 16, 4, 1, splits))
    for seed in (splits, splits + 10):
        check_attention(8, 2, 64, 4, mode, dtype, seed=seed, n=6 if ON_GPU else 3,
                        max_ctx=3000 if ON_GPU else 40, config=cfg)
        assert not counter_buffer(DEVICE).any()
    assert (second.launches == 0) == fused  # the fused merge needs no second kernel


class _LaunchCounter:
    """A Triton kernel stand-in that counts its launches (``kernel[grid](...)``)."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


@pytest.mark.parametrize("mode,splits", [("mixed", 1), ("decode", 3), ("prefill", 1)])
def test_fused_rope_equals_rotating_first(mode, splits):
    """RoPE inside the KV write (K) and the attention kernel (Q) == the rotary layer's torch
    rotation applied first: the same cache bits up to a last-place rounding, the same output."""
    from pagebatch.layers.rotary import RotaryEmbedding
    from pagebatch.plugins.attention import triton_backend as tb

    dtype, hq, hkv, d = DTYPES[0], 8, 2, 64
    qlens, lens = ragged_batch(7, mode, 3, 40)
    cache, meta, q, k, v = make_batch(7, qlens, lens, hq, hkv, d, 4, dtype)
    positions = torch.cat([torch.arange(n - ql, n) for ql, n in zip(qlens, lens)]).to(DEVICE)
    rot = RotaryEmbedding(d, 64, 10000.0, None, DEVICE)
    cfg = tb.LaunchConfig(16, 16, 4, 1, splits) if not ON_GPU else None
    q_r, k_r = rot.forward_torch(positions, q, k)
    first = cache.clone()
    tb.write_kv(k_r, v, first, meta.slot_mapping)
    out_first = tb.paged_attention(q_r, first, meta, d ** -0.5, cfg)
    fused = cache.clone()
    rope = (positions, rot.cos_sin)
    tb.write_kv(k, v, fused, meta.slot_mapping, rope=rope)
    out_fused = tb.paged_attention(q, fused, meta, d ** -0.5, cfg, rope=rope)
    assert torch.equal(fused.isnan(), first.isnan())
    assert rel_err(fused.nan_to_num(0.0), first.nan_to_num(0.0)) < REL_TOL[dtype]
    assert rel_err(out_fused, out_first) < REL_TOL[dtype]
    # and not the unrotated attention (the check can fail)
    plain = cache.clone()
    tb.write_kv(k, v, plain, meta.slot_mapping)
    assert rel_err(tb.paged_attention(q, plain, meta, d ** -0.5, cfg), out_first) > 0.05


def _greedy_by_backend(folder, prompts, sp, device, extra=None, **keys):
    """{backend: (greedy tokens per prompt, the top-2 logit gaps where each was chosen,
    ``extra(runner)``)} for ``torch_ref`` and ``triton``, fp32, one engine at a time."""
    from numerics import top2_gaps
    from pagebatch import LLM

    runs = {}
    for name in ("torch_ref", "triton"):
        llm = LLM(str(folder), device=device, dtype="float32", attention_backend=name, **keys)
        runner = llm.engine.core.runner
        assert runner.attn_backend.name == name
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        tokens = [o.outputs[0].token_ids for o in outs]
        # the top-2 gap where each generated token was chosen, from one forward over it all
        gaps = [top2_gaps(runner.forward_scratch(p + t[:-1])[len(p) - 1:])
                for p, t in zip(prompts, tokens)]
        runs[name] = (tokens, gaps, extra(runner) if extra else None)
        del llm, runner
    return runs


@pytest.mark.skipif(ON_GPU, reason="the GPU runs test_engine_greedy_triton_equals_torch_ref")
def test_engine_with_fused_rope_matches_torch_ref_on_cpu(tmp_path, monkeypatch):
    """CPU, interpreter: a tiny Llama (Qwen3's q/k norms too) through the engine with the triton
    backend, whose attention layers hand it the rotary (KV write and attention rotate K and Q),
    gives torch_ref's greedy tokens (near-tie rule)."""
    from conftest import build_tiny_model
    from numerics import assert_greedy_match
    from pagebatch import SamplingParams
    from pagebatch.plugins.attention.triton_backend import TritonBackend

    handed = []  # whether each triton KV write got the rotary (the layer did not rotate)
    write_kv = TritonBackend.write_kv

    def spy(self, *args, rope=None, **kw):
        handed.append(rope is not None)
        return write_kv(self, *args, rope=rope, **kw)

    monkeypatch.setattr(TritonBackend, "write_kv", spy)
    rng = random.Random(1)
    prompts = [[rng.randint(3, 250) for _ in range(n)] for n in (5, 17, 30)]
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for model_type in ("llama", "qwen3"):
        folder = build_tiny_model(tmp_path / model_type, model_type=model_type)
        runs = _greedy_by_backend(folder, prompts, sp, "cpu", num_kv_blocks=64, block_size=4,
                                  max_num_batched_tokens=64)
        for ref, gaps, got in zip(runs["torch_ref"][0], runs["torch_ref"][1],
                                  runs["triton"][0]):
            assert_greedy_match(ref, gaps, got, what=f"{model_type}: triton vs torch_ref")
    assert handed and all(handed)


def test_chosen_config_uses_split_kv_for_long_small_batches():
    from pagebatch.plugins.attention.triton_backend import choose_config

    if not ON_GPU:
        pytest.skip("split-KV is chosen from the GPU's multiprocessor count")
    one = choose_config(1, 1, 1, 32768, 8, 4, 128, torch.bfloat16, DEVICE)
    many = choose_config(256, 256, 1, 2048, 8, 4, 128, torch.bfloat16, DEVICE)
    assert one.num_splits > 1 and many.num_splits == 1
    check_attention(32, 8, 128, 16, "decode", torch.bfloat16, n=2, max_ctx=20000)


def test_write_kv_skips_negative_slots():
    from pagebatch.plugins.attention import triton_backend as tb

    cache = torch.full((2, 3, 4, 2, 16), float("nan"), dtype=DTYPES[0], device=DEVICE)
    k = torch.randn(3, 2, 16, device=DEVICE).to(DTYPES[0])
    v = torch.randn(3, 2, 16, device=DEVICE).to(DTYPES[0])
    tb.write_kv(k, v, cache, torch.tensor([5, -1, 0], device=DEVICE))
    flat = cache.view(2, 12, 2, 16)
    assert torch.equal(flat[0, 5], k[0]) and torch.equal(flat[1, 0], v[2])
    assert flat[:, [1, 2, 3, 4, 6, 7, 8, 9, 10, 11]].isnan().all()


def test_supports():
    backend = _backend()
    assert backend.supports(DEVICE, DTYPES[0]) is None
    assert "dtype" in backend.supports(DEVICE, torch.int8)
    os.environ.pop("TRITON_INTERPRET", None)
    try:
        reason = backend.supports(torch.device("cpu"), torch.float32)
    finally:
        if not ON_GPU:
            os.environ["TRITON_INTERPRET"] = "1"
    assert "CUDA" in reason and "TRITON_INTERPRET" in reason


# ---- fused layer kernels against the layers' torch paths ------------------------------------
# They round where torch rounds; fp32 sums in another order can still move a result by one ulp
# of the output dtype (seen on the H200: 3 of 105000 fp16 elements).
FUSED_TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5),
             torch.float16: dict(atol=1e-3, rtol=2e-3),
             torch.bfloat16: dict(atol=1e-2, rtol=1.6e-2)}

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [64, 96] if not ON_GPU else [576, 4096, 5000])
def test_rms_norm(dtype, hidden):
    from pagebatch.kernels.norm import rms_norm
    from pagebatch.layers.norm import rms_norm_torch

    x = torch.randn(7, hidden, device=DEVICE).to(dtype)
    r = torch.randn(7, hidden, device=DEVICE).to(dtype)
    w = (1 + 0.1 * torch.randn(hidden, device=DEVICE)).to(dtype)
    tol = FUSED_TOL[dtype]
    torch.testing.assert_close(rms_norm(x, w, 1e-5), rms_norm_torch(x, w, 1e-5), **tol)
    out, res = rms_norm(x, w, 1e-5, r)
    ref_out, ref_res = rms_norm_torch(x, w, 1e-5, r)
    assert torch.equal(res, ref_res)
    torch.testing.assert_close(out, ref_out, **tol)
    x3 = x.view(7, 1, hidden).expand(7, 3, hidden)  # [T, heads, D] as a q/k norm sees it
    torch.testing.assert_close(rms_norm(x3, w, 1e-6), rms_norm_torch(x3, w, 1e-6), **tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("t, hq, hkv, d", [(1, 4, 2, 16), (5, 6, 2, 24), (3, 8, 1, 64)]
                         if not ON_GPU else [(1, 32, 8, 128), (37, 16, 8, 128), (9, 40, 8, 64)])
def test_qk_head_norm_in_place_on_the_qkv_views(dtype, t, hq, hkv, d):
    """Qwen3's per-head q/k norm in one kernel, in place on the strided views of a QKV output,
    against the plain-torch norm of each head; v untouched."""
    from pagebatch.kernels.norm import qk_head_norm_
    from pagebatch.layers.norm import rms_norm_torch

    qkv = (3 * torch.randn(t, (hq + 2 * hkv) * d, device=DEVICE)).to(dtype)
    before = qkv.clone()
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k = q.view(t, hq, d), k.view(t, hkv, d)
    qw = (1 + 0.1 * torch.randn(d, device=DEVICE)).to(dtype)
    kw = (1 + 0.1 * torch.randn(d, device=DEVICE)).to(dtype)
    ref_q, ref_k = rms_norm_torch(q.clone(), qw, 1e-6), rms_norm_torch(k.clone(), kw, 1e-6)
    out_q, out_k = qk_head_norm_(q, k, qw, kw, 1e-6)
    assert out_q.data_ptr() == qkv.data_ptr()  # in place
    tol = FUSED_TOL[dtype]
    torch.testing.assert_close(out_q, ref_q, **tol)
    torch.testing.assert_close(out_k, ref_k, **tol)
    assert torch.equal(v, before[:, (hq + hkv) * d:])


def test_qk_head_norm_names_mismatched_shapes():
    from pagebatch.kernels.norm import qk_head_norm_

    q = torch.randn(3, 4, 16, device=DEVICE)
    w = torch.ones(16, device=DEVICE)
    with pytest.raises(ValueError, match=r"q \(3, 4, 16\) and k \(2, 2, 16\)"):
        qk_head_norm_(q, torch.randn(2, 2, 16, device=DEVICE), w, w, 1e-6)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_and_mul(dtype):
    from pagebatch.kernels.activation import silu_and_mul
    from pagebatch.layers.activation import silu_and_mul_torch

    d = 1536 if ON_GPU else 80
    x = (3 * torch.randn(9, 2 * d, device=DEVICE)).to(dtype)
    tol = FUSED_TOL[dtype]
    torch.testing.assert_close(silu_and_mul(x), silu_and_mul_torch(x), **tol)
    torch.testing.assert_close(silu_and_mul(x[:, :2 * d - 2]), silu_and_mul_torch(
        x[:, :2 * d - 2]), **tol)  # a strided view


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (8, 2, 128), (4, 4, 80)])
def test_rotary(dtype, hq, hkv, d):
    from pagebatch.kernels.rotary import apply_rotary
    from pagebatch.layers.rotary import RotaryEmbedding

    rope = RotaryEmbedding(d, 512, 500000.0, {"rope_type": "llama3", "factor": 8.0,
                                              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                              "original_max_position_embeddings": 64}, DEVICE)
    t = 11
    qkv = torch.randn(t, (hq + 2 * hkv) * d, device=DEVICE).to(dtype)
    q = qkv[:, :hq * d].view(t, hq, d)  # strided views of a fused qkv, as the model has them
    k = qkv[:, hq * d:(hq + hkv) * d].view(t, hkv, d)
    pos = torch.randint(0, 512, (t,), device=DEVICE)
    got_q, got_k = apply_rotary(pos, q, k, rope.cos_sin)
    ref_q, ref_k = rope.forward_torch(pos, q, k)
    tol = FUSED_TOL[dtype]
    torch.testing.assert_close(got_q, ref_q, **tol)
    torch.testing.assert_close(got_k, ref_k, **tol)


# ---- the engine on CUDA: triton against torch_ref, fp32 ------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
def test_engine_greedy_triton_equals_torch_ref(tmp_path):
    """A tiny random Llama with SmolLM2's head geometry (9 q / 3 kv heads, head_dim 64): greedy
    tokens with the triton backend (and the fused kernels) equal torch_ref's, fp32, near-tie
    rule; logits on the same tokens agree."""
    from conftest import build_tiny_model
    from numerics import LOGITS_ATOL, LOGITS_RTOL, assert_greedy_match
    from pagebatch import SamplingParams

    folder = build_tiny_model(tmp_path / "tiny", hidden_size=576, intermediate_size=1536,
                              num_attention_heads=9, num_key_value_heads=3,
                              max_position_embeddings=1024)
    rng = random.Random(0)
    prompts = [[rng.randint(3, 255) for _ in range(rng.randint(1, 300))] for _ in range(12)]
    prompts += [prompts[0][:200] + [7, 8, 9]]  # a prefix-cache hit
    sp = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    runs = _greedy_by_backend(
        folder, prompts, sp, "cuda",
        lambda runner: runner.forward_scratch(prompts[1] + list(range(3, 40))),
        num_kv_blocks=512, block_size=16, max_num_batched_tokens=256)
    torch.testing.assert_close(runs["triton"][2], runs["torch_ref"][2], atol=LOGITS_ATOL,
                               rtol=LOGITS_RTOL)
    for ref, gaps, got in zip(runs["torch_ref"][0], runs["torch_ref"][1], runs["triton"][0]):
        assert_greedy_match(ref, gaps, got, what="triton vs torch_ref")
