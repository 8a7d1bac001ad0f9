#!/usr/bin/env python3
"""Kernel benchmarks on one CUDA GPU: the triton backend's paged attention and the fused layer
kernels, against their ceilings and their torch versions. Prints a table last; ``--json FILE``
keeps every number.

  decode   paged decode attention, Llama-3.1-8B shapes (32 q / 8 kv heads, head_dim 128, bf16):
           batch 64 x 2048 context, and long contexts at small batch (split-KV vs none);
           achieved bandwidth = K+V bytes read / time, against the measured copy ceiling
  prefill  causal prefill of 4096 tokens (same heads), TFLOP/s counting the causal half only:
           4 * heads * head_dim * T(T+1)/2, and a 512-token chunk after 3584 cached: the
           prefill kernel (in-chunk keys from the step's new K/V) and the paged kernel; torch
           SDPA (flash, dense) alongside; a mixed step (63 decodes + a 512 chunk) split into
           a decode launch and a prefill launch, against one launch and 64 decodes alone
  fused    RMSNorm+residual, SiLU-and-mul, rotary: Triton kernel vs torch eager vs torch.compile

``--sweep`` also times alternative tile configurations (to choose the defaults in
plugins/attention/triton_backend.py and prefill.py; for prefill: tiles, warps, stages, TMA
off / host / device descriptors, warp specialization on / off). Run on the GPU machine
through scripts/gpu-run (docs/gpu.md). Times are medians of triton.testing.do_bench (L2
flushed between runs).
"""

from __future__ import annotations

import argparse
import json
import random
import sys

import torch
import triton
from triton.testing import do_bench, do_bench_cudagraph

from pagebatch.attention import AttentionMetadata
from pagebatch.plugins.attention import prefill as pb
from pagebatch.plugins.attention import triton_backend as tb
from pagebatch.plugins.attention.torch_ref import TorchRefBackend

DEV = torch.device("cuda")
HQ, HKV, D = 32, 8, 128  # Llama-3.1-8B attention
ROWS: list[dict] = []


def bench(fn, warmup: int = 50, rep: int = 300) -> float:
    """Median milliseconds, launched eagerly (Python launch overhead included where it exceeds
    the GPU time)."""
    return do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def bench_graph(fn, rep: int = 200) -> float:
    """Median milliseconds of CUDA-graph replays (GPU time, as a decode step under CUDA graphs
    sees it); NaN when fn cannot be captured."""
    try:
        return do_bench_cudagraph(fn, rep=rep, return_mode="median")
    except Exception as e:  # noqa: BLE001 - a compiled function may refuse capture
        print(f"  graph capture failed: {type(e).__name__}: {str(e)[:100]}", flush=True)
        return float("nan")


def row(group: str, name: str, ms: float, **figures) -> None:
    ROWS.append({"group": group, "name": name, "us": ms * 1e3, **figures})
    extra = "  ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                      for k, v in figures.items())
    print(f"[{group}] {name}: {ms * 1e3:.1f} us  {extra}", flush=True)


def ceilings() -> tuple[float, float]:
    n = 2 * 2**30  # 2 GiB each way
    a = torch.empty(n, dtype=torch.uint8, device=DEV).random_()
    b = torch.empty_like(a)
    ms = bench(lambda: b.copy_(a), 10, 100)  # noqa: F821 (called before the del below)
    bw = 2 * n / ms / 1e9  # TB/s, bytes read + written
    del a, b
    x = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    y = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    ms_mm = bench(lambda: x @ y, 10, 100)
    tflops = 2 * 8192**3 / ms_mm / 1e9
    row("ceiling", "device-to-device copy", ms, TBps=bw)
    row("ceiling", "bf16 matmul 8192^3", ms_mm, TFLOPs=tflops)
    return bw, tflops


def paged_batch(query_lens: list[int], seq_lens: list[int], block_size: int,
                dtype=torch.bfloat16, seed: int = 0):
    """Random query and a random (randn, never zero) paged cache; blocks shuffled."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    per = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(per)
    perm = list(range(num_blocks))
    random.Random(seed).shuffle(perm)
    tables, at = [], 0
    for n in per:
        tables.append(perm[at:at + n])
        at += n
    width = max(per)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    cache = torch.randn((2, num_blocks, block_size, HKV, D), generator=g, device=DEV,
                        dtype=dtype)
    t = sum(query_lens)
    q = torch.randn((t, HQ, D), generator=g, device=DEV, dtype=dtype)
    qsl = [0]
    for n in query_lens:
        qsl.append(qsl[-1] + n)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(t, dtype=torch.int64, device=DEV),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=DEV),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEV),
        block_tables=bt.to(DEV), max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        query_start_loc_cpu=qsl, seq_lens_cpu=list(seq_lens))
    return q, cache, meta


def check(out: torch.Tensor, ref: torch.Tensor, what: str) -> float:
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    ok = torch.isfinite(out).all().item() and err < 2e-2
    print(f"  check {what}: rel err {err:.2e} {'ok' if ok else 'FAILED'}", flush=True)
    if not ok:
        raise SystemExit(f"{what}: wrong result (rel err {err})")
    return err


def decode(copy_bw: float, sweep: bool) -> None:
    scale = D ** -0.5
    for batch, ctx, bs in [(64, 2048, 16), (64, 2048, 128), (4, 32768, 16), (1, 131072, 16)]:
        q, cache, meta = paged_batch([1] * batch, [ctx] * batch, bs)
        kv_bytes = 2 * batch * ctx * HKV * D * cache.element_size()
        default = tb.choose_config(batch, batch, 1, ctx, HKV, HQ // HKV, D, q.dtype, DEV)
        if batch * ctx <= 64 * 2048:
            check(tb.paged_attention(q, cache, meta, scale),
                  TorchRefBackend().forward(q, cache, meta, scale), f"decode b{batch} c{ctx}")
        configs = [("default", default)]
        if default.num_splits > 1:
            configs.append(("no split", tb.LaunchConfig(default.block_m, default.tile_n,
                                                        default.num_warps, default.num_stages)))
        if sweep and batch == 64 and bs == 16:
            for tile_n in (32, 64, 128):
                for warps, stages in ((4, 2), (4, 3), (4, 4), (8, 3)):
                    for splits in (1, 2):
                        configs.append((f"tile{tile_n} w{warps} s{stages} split{splits}",
                                        tb.LaunchConfig(16, tile_n, warps, stages, splits)))
        for name, cfg in configs:
            try:
                ms = bench(lambda: tb.paged_attention(q, cache, meta, scale, cfg))  # noqa: F821
            except Exception as e:  # a sweep config may not fit in shared memory
                print(f"  {name}: {type(e).__name__}: {str(e)[:100]}")
                continue
            tbps = kv_bytes / ms / 1e9
            row("decode", f"b{batch} ctx{ctx} bs{bs} {name} ({cfg.tile_n}/{cfg.num_warps}/"
                f"{cfg.num_stages}/x{cfg.num_splits})", ms, TBps=tbps,
                pct_copy=100 * tbps / copy_bw)
        if batch == 64 and bs == 16:
            ms = bench(lambda: TorchRefBackend().forward(q, cache, meta, scale), 5, 50)  # noqa: F821
            row("decode", f"b{batch} ctx{ctx} bs{bs} torch_ref", ms,
                TBps=kv_bytes / ms / 1e9)
        del q, cache, meta
        torch.cuda.empty_cache()


def new_kv(cache: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's new K/V [num_tokens, HKV, D] (contiguous, as the model hands them to the
    backend) gathered from the cache positions the batch's new tokens occupy."""
    bs = cache.shape[2]
    qsl, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
    slots = []
    for i, n in enumerate(lens):
        pos = torch.arange(n - (qsl[i + 1] - qsl[i]), n, device=DEV)
        slots.append(meta.block_tables[i].long()[pos // bs] * bs + pos % bs)
    s = torch.cat(slots)
    return cache[0].flatten(0, 1)[s].contiguous(), cache[1].flatten(0, 1)[s].contiguous()


def prefill_sweep_configs() -> list[tuple[str, pb.PrefillConfig]]:
    """Alternatives to the prefill kernel's default: TMA off / host / device descriptors, warp
    specialization on / off, tile sizes, warps, stages (one compile each, ~2-4 s)."""
    cfgs = [(128, 128, 8, 3, t, ws) for t in (pb.TMA_OFF, pb.TMA_HOST, pb.TMA_DEVICE)
            for ws in (False, True)]
    cfgs += [(128, 128, 8, 2, pb.TMA_HOST, False), (128, 128, 8, 2, pb.TMA_HOST, True),
             (128, 64, 8, 3, pb.TMA_HOST, False), (128, 64, 8, 4, pb.TMA_HOST, False),
             (128, 64, 8, 3, pb.TMA_HOST, True), (128, 64, 4, 3, pb.TMA_HOST, False),
             (128, 128, 4, 2, pb.TMA_HOST, False), (64, 64, 4, 3, pb.TMA_HOST, False),
             (64, 128, 4, 3, pb.TMA_HOST, False), (128, 128, 8, 3, pb.TMA_DEVICE, True)]
    out, seen = [], set()
    for c in cfgs:
        if c not in seen:
            seen.add(c)
            out.append((f"m{c[0]} n{c[1]} w{c[2]} s{c[3]} tma{c[4]} ws{int(c[5])}",
                        pb.PrefillConfig(*c)))
    return out


def _tiles(cfg) -> str:
    if isinstance(cfg, pb.PrefillConfig):
        return (f"{cfg.block_m}/{cfg.tile_n}/{cfg.num_warps}/{cfg.num_stages}/tma{cfg.tma}/"
                f"ws{int(cfg.warp_specialize)}")
    return f"{cfg.block_m}/{cfg.tile_n}/{cfg.num_warps}/{cfg.num_stages}/x{cfg.num_splits}"


def _time_checked(group: str, name: str, fn, ref: torch.Tensor, **figures_per_ms) -> None:
    """Check fn() against ref, then time it; a config that fails to compile or run (shared
    memory, an unsupported feature) is reported and skipped."""
    try:
        check(fn(), ref, name)
        ms = bench(fn, 10, 100) if "sweep" in name else bench(fn)
    except SystemExit:
        raise
    except Exception as e:  # noqa: BLE001 - a sweep config may not compile here
        print(f"  {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
        return
    row(group, name, ms, **{k: f(ms) for k, f in figures_per_ms.items()})


def prefill(sweep: bool) -> None:
    """Causal prefill 4096, a 512 chunk after 3584 cached, and a mixed step: the prefill kernel
    (default, and the sweep), the paged kernel as before (one launch, its own tiles), torch
    SDPA; every output checked against torch_ref."""
    t = 4096
    prefill_case("T4096 causal", [t], [t], 4 * HQ * D * t * (t + 1) / 2, sweep)
    sdpa(t)
    prefill_case("chunk 512 after 3584 cached", [512], [4096],
                 4 * HQ * D * sum(3584 + i + 1 for i in range(512)), sweep)
    mixed()


def prefill_case(label: str, qlens: list[int], lens: list[int], flops: float,
                 sweep: bool) -> None:
    scale = D ** -0.5
    q, cache, meta = paged_batch(qlens, lens, 16)
    kv = new_kv(cache, meta)
    ref = TorchRefBackend().forward(q, cache, meta, scale)
    tf = {"TFLOPs": lambda ms: flops / ms / 1e9}
    dflt = pb.choose_prefill_config(max(qlens), HQ // HKV, D, q.dtype, DEV)
    _time_checked("prefill", f"{label} prefill kernel default ({_tiles(dflt)})",
                  lambda: tb.paged_attention(q, cache, meta, scale, new_kv=kv), ref, **tf)
    old = tb.choose_config(sum(qlens), 1, max(qlens), max(lens), HKV, HQ // HKV, D, q.dtype,
                           DEV)
    _time_checked("prefill", f"{label} paged kernel ({_tiles(old)})",
                  lambda: tb.paged_attention(q, cache, meta, scale, old), ref, **tf)
    if sweep:
        for name, cfg in prefill_sweep_configs():
            _time_checked("prefill", f"{label} sweep {name}",
                          lambda cfg=cfg: tb.paged_attention(q, cache, meta, scale, new_kv=kv,
                                                             prefill_config=cfg), ref, **tf)


def sdpa(t: int) -> None:
    """The dense reference: torch SDPA (FlashAttention backend) on contiguous [1, H, T, D]."""
    g = torch.Generator(device=DEV).manual_seed(0)
    q, k, v = (torch.randn((1, HQ, t, D), generator=g, device=DEV, dtype=torch.bfloat16)
               for _ in range(3))
    ms = bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v,
                                                                        is_causal=True))
    row("prefill", f"T{t} causal torch SDPA (dense, not paged)", ms,
        TFLOPs=4 * HQ * D * t * (t + 1) / 2 / ms / 1e9)


def mixed() -> None:
    """A mixed step: 63 decodes at 2048 context plus one 512-token chunk after 1536 cached,
    split (the default) and in one launch as before; 64 decodes alone for comparison."""
    scale = D ** -0.5
    q, cache, meta = paged_batch([1] * 63 + [512], [2048] * 64, 16)
    kv = new_kv(cache, meta)
    ref = TorchRefBackend().forward(q, cache, meta, scale)
    bw = {"TBps": lambda ms: 2 * 64 * 2048 * HKV * D * 2 / ms / 1e9}
    _time_checked("mixed", "63 decodes ctx2048 + chunk 512 after 1536: split, prefill kernel",
                  lambda: tb.paged_attention(q, cache, meta, scale, new_kv=kv), ref, **bw)
    _time_checked("mixed", "same, split, paged kernel for the chunk",
                  lambda: tb.paged_attention(q, cache, meta, scale), ref, **bw)
    one = tb.choose_config(575, 64, 512, 2048, HKV, HQ // HKV, D, q.dtype, DEV)
    _time_checked("mixed", f"same, one launch as before ({_tiles(one)})",
                  lambda: tb.paged_attention(q, cache, meta, scale, one), ref, **bw)
    q4, cache4, meta4 = paged_batch([1] * 64, [2048] * 64, 16)
    _time_checked("mixed", "64 decodes ctx2048 alone",
                  lambda: tb.paged_attention(q4, cache4, meta4, scale),
                  TorchRefBackend().forward(q4, cache4, meta4, scale), **bw)


def fused() -> None:
    from pagebatch.kernels.activation import silu_and_mul
    from pagebatch.kernels.norm import rms_norm
    from pagebatch.kernels.rotary import apply_rotary
    from pagebatch.layers.activation import silu_and_mul_torch
    from pagebatch.layers.norm import rms_norm_torch
    from pagebatch.layers.rotary import RotaryEmbedding

    hidden, inter = 4096, 14336
    dt = torch.bfloat16
    rope = RotaryEmbedding(D, 8192, 500000.0, {"rope_type": "llama3", "factor": 8.0,
                                               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                               "original_max_position_embeddings": 8192}, DEV)
    rope_torch = rope.forward_torch
    compiled = {
        "rms": torch.compile(rms_norm_torch, dynamic=True),
        "silu": torch.compile(silu_and_mul_torch, dynamic=True),
        "rope": torch.compile(rope_torch, dynamic=True),
    }
    for t in (64, 4096):
        x = torch.randn(t, hidden, device=DEV, dtype=dt)
        r = torch.randn(t, hidden, device=DEV, dtype=dt)
        w = torch.randn(hidden, device=DEV, dtype=dt)
        nbytes = 4 * t * hidden * 2
        impls = {"triton": lambda: rms_norm(x, w, 1e-5, r),
                 "torch": lambda: rms_norm_torch(x, w, 1e-5, r),
                 "torch.compile": lambda: compiled["rms"](x, w, 1e-5, r)}
        for name, fn in impls.items():
            ms, gms = bench(fn), bench_graph(fn)
            row("fused", f"rmsnorm+residual T{t} h{hidden} {name}", ms, graph_us=gms * 1e3,
                TBps_graph=nbytes / gms / 1e9)
        g = torch.randn(t, 2 * inter, device=DEV, dtype=dt)
        nbytes = 3 * t * inter * 2
        for name, fn in {"triton": lambda: silu_and_mul(g),
                         "torch": lambda: silu_and_mul_torch(g),
                         "torch.compile": lambda: compiled["silu"](g)}.items():
            ms, gms = bench(fn), bench_graph(fn)
            row("fused", f"silu_and_mul T{t} d{inter} {name}", ms, graph_us=gms * 1e3,
                TBps_graph=nbytes / gms / 1e9)
        qkv = torch.randn(t, (HQ + 2 * HKV) * D, device=DEV, dtype=dt)
        qv = qkv[:, :HQ * D].view(t, HQ, D)
        kv = qkv[:, HQ * D:(HQ + HKV) * D].view(t, HKV, D)
        pos = torch.randint(0, 8192, (t,), device=DEV)
        nbytes = 2 * t * (HQ + HKV) * D * 2
        for name, fn in {"triton": lambda: apply_rotary(pos, qv, kv, rope.cos_sin),
                         "torch": lambda: rope_torch(pos, qv, kv),
                         "torch.compile": lambda: compiled["rope"](pos, qv, kv)}.items():
            ms, gms = bench(fn), bench_graph(fn)
            row("fused", f"rotary T{t} {HQ}/{HKV}x{D} {name}", ms, graph_us=gms * 1e3,
                TBps_graph=nbytes / gms / 1e9)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", choices=["decode", "prefill", "fused"], action="append")
    ap.add_argument("--sweep", action="store_true", help="also time other tile configs")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args(argv)
    parts = args.only or ["decode", "prefill", "fused"]
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}  "
          f"triton {triton.__version__}", flush=True)
    copy_bw, _ = ceilings()
    if "decode" in parts:
        decode(copy_bw, args.sweep)
    if "prefill" in parts:
        prefill(args.sweep)
    if "fused" in parts:
        fused()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": ROWS}, f, indent=1)
    print("\n| group | what | us (eager) | figures |\n| --- | --- | --- | --- |")
    for r in ROWS:
        fig = "  ".join(f"{k} {v:.3g}" for k, v in r.items()
                        if k not in ("group", "name", "us"))
        print(f"| {r['group']} | {r['name']} | {r['us']:.1f} | {fig} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
