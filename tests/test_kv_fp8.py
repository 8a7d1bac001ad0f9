"""``kv_cache_dtype: fp8``: the paged KV cache in fp8 e4m3 with per-layer scales.

The format (core/attention.py): an entry is ``clamp(x / scale, -448, 448)`` rounded to e4m3 and
reads back as ``float(entry) * scale``. Checked here: the round trip's error bounds; ``torch_ref``
and ``triton`` attention over an fp8 cache against ``torch_ref`` over the dequantized cache (the
Triton kernels under ``TRITON_INTERPRET=1`` in a child process on the CPU, as in
test_triton_attention.py, compiled in bf16 on CUDA); the engine on the tiny model: capacity and
how close its tokens stay to an fp32 cache's.

The interpreter's fp32 -> fp8 cast rounds wrongly when rounding carries into the exponent (7.99
becomes 4; triton's interpreter ``_convert_float``), so on the CPU the Triton write kernel gets
values on the e4m3 grid (and out-of-range ones) with power-of-two scales: exact, whatever the
rounding. Compiled kernels round in hardware (``cvt.rn.satfinite``): the GPU test checks that
against torch's cast.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from pagebatch import LLM, SamplingParams
from pagebatch.attention import (FP8_E4M3_MAX, FP8_KV_DTYPE, AttentionBackend,
                                 resolve_kv_cache_dtype)
from pagebatch.config import EngineConfig
from pagebatch.errors import ConfigError
from pagebatch.plugins.attention.torch_ref import TorchRefBackend, quantize_fp8
from tiny import random_prompts

from interpreted import DEVICE, ON_GPU, REL_TOL, make_batch, rel_err, run_under_interpreter

IN_INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
FP8_GPU = ON_GPU and torch.cuda.get_device_capability() >= (8, 9)


def dequantize(cache: torch.Tensor, k_scale: float, v_scale: float) -> torch.Tensor:
    """An fp8 cache [2, ...] as fp32 values (NaN entries stay NaN)."""
    return torch.stack([cache[0].float() * k_scale, cache[1].float() * v_scale])


def fp8_batch(seed, query_lens, context_lens, hq, hkv, d, block_size, dtype, k_scale,
              v_scale, magnitude=3.0):
    """`make_batch` with an fp8 cache whose prefix torch_ref wrote with these scales."""
    def write(k, v, cache, slot):
        TorchRefBackend().write_kv(k, v, cache, slot, k_scale=k_scale, v_scale=v_scale)

    return make_batch(seed, query_lens, context_lens, hq, hkv, d, block_size, dtype,
                      cache_dtype=FP8_KV_DTYPE, magnitude=magnitude, write=write)


def ragged(seed: int, mode: str, n: int, max_ctx: int) -> tuple[list[int], list[int]]:
    """(query_lens, context_lens): decodes, whole prompts, or both mixed with chunks."""
    rng = random.Random(seed)
    q, c = [], []
    for i in range(n):
        length = rng.randint(2, max_ctx)
        kind = {"decode": "d", "prefill": "p"}.get(mode) or "dpc"[i % 3]
        q.append({"d": 1, "p": length}.get(kind) or rng.randint(1, length - 1))
        c.append(length)
    return q, c


# ---- config and the format (CPU) ---------------------------------------------------------------

def test_config_accepts_fp8_and_resolves_e4m3():
    for name in ("fp8", "fp8_e4m3"):
        cfg = EngineConfig.from_sources(cli={"model": "x", "kv_cache_dtype": name})
        assert resolve_kv_cache_dtype(cfg.kv_cache_dtype, torch.bfloat16) == torch.float8_e4m3fn
    assert resolve_kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        EngineConfig.from_sources(cli={"model": "x", "kv_cache_dtype": "int8"})


def test_backend_without_fp8_gives_a_reason():
    class Plain(AttentionBackend):
        name = "plain"

        def write_kv(self, key, value, kv_cache, slot_mapping):
            pass

        def forward(self, query, kv_cache, metadata, scale):
            return query

    cpu = torch.device("cpu")
    assert Plain().supports_kv_cache_dtype(cpu, torch.float32, torch.float32) is None
    reason = Plain().supports_kv_cache_dtype(cpu, torch.float32, FP8_KV_DTYPE)
    assert "'plain'" in reason and "float8_e4m3fn" in reason
    assert TorchRefBackend().supports_kv_cache_dtype(cpu, torch.float32, FP8_KV_DTYPE) is None


@pytest.mark.parametrize("scale", [1.0, 0.037, 4.0])
def test_write_read_round_trip_error_bounds(scale):
    """Normal e4m3 range: relative error <= 2^-4 (half a step of 3 mantissa bits); subnormals
    (|x / scale| < 2^-6): absolute error <= 2^-10 * scale; beyond 448 * scale: exactly
    +-448 * scale."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, generator=g) * scale * torch.logspace(-4, 3, 4096, base=2.0)
    x[:8] = torch.tensor([500.0, -1e4, 448.0, -449.0, 0.0, 2.0**-10, 1e-12, -3e3]) * scale
    cache = torch.full((2, 512, 8, 1, 1), float("nan")).to(FP8_KV_DTYPE)
    slots = torch.randperm(4096, generator=g)
    TorchRefBackend().write_kv(x[:, None, None], -x[:, None, None], cache, slots,
                               k_scale=scale, v_scale=scale)
    k = cache[0].flatten().float()[slots] * scale
    v = cache[1].flatten().float()[slots] * scale
    assert torch.equal(v, -k)
    q = (x / scale).abs()
    normal = (q >= 2.0**-6) & (q <= FP8_E4M3_MAX)
    assert ((k - x).abs() <= x.abs() * 2.0**-4)[normal].all()
    assert ((k - x).abs() <= 2.0**-10 * scale)[q < 2.0**-6].all()
    assert torch.equal(k[q > FP8_E4M3_MAX], (x.sign() * FP8_E4M3_MAX * scale)[q > FP8_E4M3_MAX])
    assert normal.sum() > 3000


@pytest.mark.parametrize("mode", ["decode", "mixed", "prefill"])
def test_torch_ref_fp8_equals_reference_on_dequantized_cache(mode):
    """The fp8 path of torch_ref (decode: one padded gather; otherwise per request) reads the
    cache exactly as its dequantized fp32 copy; and the whole fp8 error stays small."""
    k_scale, v_scale = 0.05, 1.7
    qlens, lens = ragged(1, mode, 6, 40)
    cache, meta, q, k, v = fp8_batch(1, qlens, lens, 8, 2, 32, 4, torch.float32, k_scale,
                                     v_scale)
    ref = TorchRefBackend()
    ref.write_kv(k, v, cache, meta.slot_mapping, k_scale=k_scale, v_scale=v_scale)
    out = ref.forward(q, cache, meta, 32**-0.5, k_scale=k_scale, v_scale=v_scale)
    expect = ref.forward(q, dequantize(cache, k_scale, v_scale), meta, 32**-0.5)
    torch.testing.assert_close(out, expect, rtol=1e-6, atol=1e-6)
    assert torch.isfinite(out).all()


# ---- Triton kernels (interpreter child on the CPU; compiled on an fp8 GPU) ---------------------

def _triton_here():
    pytest.importorskip("triton")
    if not (IN_INTERPRETER or FP8_GPU):
        pytest.skip("CPU: runs in the TRITON_INTERPRET=1 child of "
                    "test_triton_kernels_under_interpreter (GPU: needs sm89+)")


def test_triton_kernels_under_interpreter():
    """CPU: the test_triton_* tests of this file in a fresh process under TRITON_INTERPRET=1."""
    run_under_interpreter(__file__, select="test_triton_ and not under_interpreter")


@pytest.mark.parametrize("scale", [0.5, 4.0])
def test_triton_write_kv_stores_scaled_e4m3_bytes(scale):
    """Values on the e4m3 grid times a power-of-two scale, values past +-448 * scale (clamped)
    and a padding slot (-1): the same bytes as torch_ref's write."""
    from pagebatch.plugins.attention import triton_backend as tb

    _triton_here()
    dtype = torch.bfloat16 if ON_GPU else torch.float32
    grid = torch.arange(256, dtype=torch.uint8).view(FP8_KV_DTYPE).float()
    grid = grid[grid.isfinite()]  # 254 values
    g = torch.Generator().manual_seed(3)
    k = grid[torch.randint(0, grid.numel(), (6 * 2 * 32,), generator=g)].view(6, 2, 32) * scale
    k[0, 0, :4] = torch.tensor([1000.0, -1000.0, 449.0, -3e4]) * scale
    v = -k.flip(0)
    slots = torch.tensor([5, -1, 0, 11, 3, 7])
    caches = []
    for write in (tb.write_kv, TorchRefBackend().write_kv):
        cache = torch.full((2, 3, 4, 2, 32), float("nan")).to(FP8_KV_DTYPE).to(DEVICE)
        write(k.to(dtype).to(DEVICE), v.to(dtype).to(DEVICE), cache, slots.to(DEVICE),
              k_scale=scale, v_scale=scale)
        caches.append(cache.view(torch.uint8).cpu())
    assert torch.equal(caches[0], caches[1])
    assert caches[0].view(2, 12, 2, 32)[:, [1, 2, 4, 6, 8, 9, 10]].eq(0x7F).all()  # untouched


def test_triton_fused_rope_on_fp8_cache():
    """RoPE inside the fp8 KV write and attention (`supports_fused_rope`) == rotating first:
    the same cache bytes but for last-place rounding, the same attention output."""
    from pagebatch.layers.rotary import RotaryEmbedding
    from pagebatch.plugins.attention import triton_backend as tb

    _triton_here()
    dtype = torch.bfloat16 if ON_GPU else torch.float32
    ks, vs = 0.05, 1.7
    qlens, lens = ragged(3, "mixed", 3, 40)
    cache, meta, q, k, v = fp8_batch(3, qlens, lens, 8, 2, 64, 4, dtype, ks, vs)
    positions = torch.cat([torch.arange(n - ql, n) for ql, n in zip(qlens, lens)]).to(DEVICE)
    rot = RotaryEmbedding(64, 64, 10000.0, None, DEVICE)
    q_r, k_r = rot.forward_torch(positions, q, k)
    first, fused = cache.clone(), cache.clone()
    tb.write_kv(k_r, v, first, meta.slot_mapping, ks, vs)
    tb.write_kv(k, v, fused, meta.slot_mapping, ks, vs, rope=(positions, rot.cos_sin))
    a, b = dequantize(first, ks, vs), dequantize(fused, ks, vs)
    assert torch.equal(a.isnan(), b.isnan())
    assert ((a.nan_to_num(0.0) - b.nan_to_num(0.0)).norm() / a.nan_to_num(0.0).norm()) < 2e-2
    out_a = tb.paged_attention(q_r, first, meta, 0.125, None, ks, vs)
    out_b = tb.paged_attention(q, fused, meta, 0.125, None, ks, vs,
                               rope=(positions, rot.cos_sin))
    assert ((out_a.float() - out_b.float()).norm() / out_a.float().norm()) < 2e-2


def check_triton_fp8(hq, hkv, d, block_size, mode, dtype, seed=0, n=4, max_ctx=40,
                     config=None, k_scale=0.05, v_scale=1.7):
    """Triton attention over the fp8 cache against torch_ref over its dequantized fp32 copy.
    The new K/V are written by Triton's write_kv on the GPU, by torch_ref's under the
    interpreter (whose fp8 rounding is off: module docstring)."""
    from pagebatch.plugins.attention import triton_backend as tb

    qlens, lens = ragged(seed, mode, n, max_ctx)
    cache, meta, q, k, v = fp8_batch(seed, qlens, lens, hq, hkv, d, block_size, dtype,
                                     k_scale, v_scale)
    write = tb.write_kv if ON_GPU else TorchRefBackend().write_kv
    write(k, v, cache, meta.slot_mapping, k_scale=k_scale, v_scale=v_scale)
    scale = d ** -0.5
    expect = TorchRefBackend().forward(q, dequantize(cache, k_scale, v_scale), meta, scale)
    out = tb.paged_attention(q, cache, meta, scale, config, k_scale=k_scale, v_scale=v_scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.isfinite(out).all(), f"non-finite output (qlens {qlens}, lens {lens})"
    err = rel_err(out, expect)
    assert err < REL_TOL[dtype], f"rel err {err:.2e} (qlens {qlens}, lens {lens})"


# (hq, hkv, head_dim, block_size, mode): decode, prefill and mixed; GQA groups 1, 3, 4
CASES = [(9, 3, 64, 4, "mixed"), (8, 2, 32, 16, "decode"), (4, 4, 80, 8, "prefill")]


@pytest.mark.parametrize("dtype", [torch.bfloat16] if ON_GPU else [torch.float16,
                                                                    torch.float32], ids=str)
@pytest.mark.parametrize("hq,hkv,d,block_size,mode", CASES)
def test_triton_fp8_attention_matches_dequantized_reference(hq, hkv, d, block_size, mode,
                                                            dtype):
    _triton_here()
    if ON_GPU:
        check_triton_fp8(hq, hkv, d, block_size, mode, dtype, seed=d, n=16, max_ctx=600)
    else:
        check_triton_fp8(hq, hkv, d, block_size, mode, dtype, seed=d)


@pytest.mark.parametrize("mode", ["decode", "mixed"])
def test_triton_fp8_split_kv_matches_dequantized_reference(mode):
    """The flash-decoding path (forced): v_scale is applied to each split's partial sum."""
    from pagebatch.plugins.attention.triton_backend import LaunchConfig

    _triton_here()
    if ON_GPU:
        check_triton_fp8(8, 2, 128, 16, mode, torch.bfloat16, n=4, max_ctx=3000,
                         config=LaunchConfig(16, 64, 4, 3, 4))
    else:
        check_triton_fp8(8, 2, 64, 4, mode, torch.float16, n=3,
                         config=LaunchConfig(16, 16, 4, 1, 3))


def test_gpu_triton_fp8_write_rounds_like_torch():
    """Compiled write_kv (hardware e4m3 rounding, Triton's fp32 division) against torch's cast:
    the same bytes except, rarely, one e4m3 step where x / scale lies on a rounding boundary."""
    from pagebatch.plugins.attention import triton_backend as tb

    if not FP8_GPU:
        pytest.skip("needs a CUDA GPU of compute capability 8.9+")
    g = torch.Generator().manual_seed(0)
    k = (torch.randn(4096, 8, 128, generator=g) * 40).to(torch.bfloat16).cuda()
    v = (torch.randn(4096, 8, 128, generator=g) * 0.2).to(torch.bfloat16).cuda()
    slots = torch.randperm(4096, generator=g).cuda()
    caches = []
    for write in (tb.write_kv, TorchRefBackend().write_kv):
        cache = torch.empty((2, 256, 16, 8, 128), dtype=FP8_KV_DTYPE, device="cuda")
        write(k, v, cache, slots, k_scale=0.07, v_scale=0.003)
        caches.append(cache)
    a, b = (dequantize(c, 0.07, 0.003) for c in caches)
    assert (caches[0].view(torch.uint8) != caches[1].view(torch.uint8)).float().mean() < 1e-3
    torch.testing.assert_close(a, b, rtol=2.0**-3, atol=2.0**-9 * 0.07)


# ---- the engine (CPU, torch_ref, the tiny model) -----------------------------------------------

def _tiny(model_dir, **kw) -> LLM:
    return LLM(str(model_dir), device="cpu", kv_cache_memory="1MiB", block_size=4, **kw)


@pytest.fixture(scope="module")
def tiny_pair(tiny_model_dir):
    """(fp32 cache, fp8 cache) engines of the fp32 tiny model with the same 1 MiB budget."""
    return (_tiny(tiny_model_dir, dtype="float32"),
            _tiny(tiny_model_dir, dtype="float32", kv_cache_dtype="fp8"))


def test_fp8_cache_holds_4x_fp32_and_2x_bf16_tokens(tiny_model_dir, tiny_pair):
    fp32, fp8 = (llm.engine.core.runner for llm in tiny_pair)
    assert fp8.kv_caches[0].dtype == torch.float8_e4m3fn
    assert fp8.num_blocks == 4 * fp32.num_blocks == 4 * 512
    bf16 = _tiny(tiny_model_dir, dtype="bfloat16").engine.core.runner
    bf16_fp8 = _tiny(tiny_model_dir, dtype="bfloat16", kv_cache_dtype="fp8").engine.core.runner
    assert bf16_fp8.num_blocks == 2 * bf16.num_blocks == fp8.num_blocks
    assert bf16.kv_caches[0].dtype == torch.bfloat16


def test_fp8_engine_equals_fp32_engine_on_e4m3_rounded_kv(tiny_pair, monkeypatch):
    """The fp8 engine's logits are exactly those of the fp32-cache engine whose new K/V are
    rounded through e4m3 before they are written: the cache adds no other error."""
    fp32, fp8 = (llm.engine.core.runner for llm in tiny_pair)
    backend = fp32.attn_backend
    write = backend.write_kv

    def rounded_write(key, value, kv_cache, slot_mapping):
        write(quantize_fp8(key, 1.0).float(), quantize_fp8(value, 1.0).float(), kv_cache,
              slot_mapping)

    monkeypatch.setattr(backend, "write_kv", rounded_write)
    for p in random_prompts(4, seed=11):
        ids = p + list(range(3, 20))
        assert torch.equal(fp8.forward_scratch(ids), fp32.forward_scratch(ids))


def test_fp8_engine_stays_close_to_fp32_cache(tiny_pair):
    """fp8 is lossy and the tiny random model (weights N(0, 0.2), near-tied logits) magnifies
    it: an e4m3 cache moves its logits by up to ~1 on a scale of ~6 (a bf16-rounded one: 0.06).
    Measured on these 8 prompts: greedy runs of 8 tokens agree on 61% of positions (runs part
    after the first different token), teacher-forced top-1 on the fp32 run's sequences agrees
    at 89%, mean KL 0.006-0.011. SmolLM2 does better (docs/quantization.md). Bounds: every
    run's first token (decided by the prefill) agrees, top-1 >= 80%, each prompt's KL < 0.03."""
    fp32, fp8 = tiny_pair
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in random_prompts(8, seed=11)]
    ref = fp32.generate(prompts, sp, use_tqdm=False)
    got = fp8.generate(prompts, sp, use_tqdm=False)
    agree = total = 0
    for p, r, o in zip(prompts, ref, got):
        r_ids, o_ids = r.outputs[0].token_ids, o.outputs[0].token_ids
        assert len(o_ids) == 8 and o_ids[0] == r_ids[0]
        seq = p["prompt_token_ids"] + r_ids
        a = fp32.engine.core.runner.forward_scratch(seq).log_softmax(-1)
        b = fp8.engine.core.runner.forward_scratch(seq).log_softmax(-1)
        agree += (a.argmax(-1) == b.argmax(-1)).sum().item()
        total += len(seq)
        assert (a.exp() * (a - b)).sum(-1).mean() < 0.03
    assert agree / total >= 0.8, f"teacher-forced top-1 agreement {agree / total:.2f}"
    core = fp8.engine.core
    assert core.kv_cache.num_free_blocks == core.kv_cache.num_blocks


def test_gpu_engine_fp8_cache_close_to_bf16_cache(tiny_model_dir):
    """The whole path on the GPU: Triton write and attention, prefill and decode, decode steps
    replayed from CUDA graphs. A smoke bound, looser than the CPU test's measured one (not yet
    measured in bf16): teacher-forced top-1 >= 75% against the bf16 cache."""
    if not FP8_GPU:
        pytest.skip("needs a CUDA GPU of compute capability 8.9+")
    kw = dict(device="cuda", dtype="bfloat16", kv_cache_memory="1MiB", block_size=16,
              max_num_seqs=8)
    ref, fp8 = LLM(str(tiny_model_dir), **kw), LLM(str(tiny_model_dir), kv_cache_dtype="fp8", **kw)
    runner = fp8.engine.core.runner
    assert runner.attn_backend.name == "triton" and runner.graphs is not None
    assert runner.num_blocks == 2 * ref.engine.core.runner.num_blocks
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in random_prompts(8, seed=11)]
    agree = total = 0
    for p, r, o in zip(prompts, ref.generate(prompts, sp, use_tqdm=False),
                       fp8.generate(prompts, sp, use_tqdm=False)):
        assert len(o.outputs[0].token_ids) == 8
        seq = p["prompt_token_ids"] + r.outputs[0].token_ids
        a = ref.engine.core.runner.forward_scratch(seq).argmax(-1)
        agree += (a == runner.forward_scratch(seq).argmax(-1)).sum().item()
        total += len(seq)
    assert agree / total >= 0.75, f"teacher-forced top-1 agreement {agree / total:.2f}"
