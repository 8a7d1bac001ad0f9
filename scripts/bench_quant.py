#!/usr/bin/env python3
"""Quantized GEMM microbenchmarks on one CUDA GPU, Llama-3.1-8B linear shapes (bf16
activations): each quant method's ``apply`` against the bf16 matmul (``F.linear``).

  layers   every method (fp16/bf16, awq = W4A16 g128, gptq 4-bit act-order and 8-bit, int8 W8A8,
           fp8) on qkv (4096 -> 6144), o (4096 -> 4096), gate_up (4096 -> 28672) and down
           (14336 -> 4096) at M = 1, 16 (decode) and 256, 2048 (prefill) tokens; decode figures
           as weight bandwidth (weight bytes / time), prefill as TFLOP/s; plus the sum over one
           decoder layer and its ratio to bf16 (the batch-1 decode target is >= 1.8x)
  paths    W4A16 at each M: the Triton split-K/GEMM kernel vs dequantize + cuBLAS, to place
           quant/kernels/wna16.py's DENSE_MIN_M
  --only tune-dense --tune DIR  the 16-bit GEMV of core/kernels/gemv.py against cuBLAS at
           the 8B / 1B decode shapes (LM heads included); the faster per shape and M written as
           DIR/dense_gemv_<GPU>.json (core/layers/dense.py uses the GEMV only where it won);
           --dense-shapes 8b-tp2. tunes only the shapes whose names start so
  --only tune-mma [--tune DIR]  the tensor-core W4A16 kernel (quant/kernels/w4a16_mma.py) at
           decode sizes against the path configured now; where it is faster it becomes the
           entry of the ``wna16`` table written to DIR (from the packaged one)
  --only tinygemm  torch's int4 kernel (aten._weight_int4pack_mm) at the 8B decode shapes,
           timed as the tuner times (session 6: slower than the W4A16 GEMV on every shape)
  --tune DIR  every W4A16 config at decode sizes (the CUDA-core GEMV and the split-K GEMM),
           the fastest per shape and M written to DIR as the tuned table that pick_config reads
           (core/kernels/tuned.py; commit it under quant/kernels/configs/). Both tunings time
           the gate/up shapes as decode runs them: the GEMV with SiLU-and-mul in its epilogue
           against the other paths followed by the activation kernel (GATED_SHAPES)

Every case first checks its result against the dequantized reference. Times are medians of CUDA
graph replays (triton.testing.do_bench_cudagraph), as decode steps run under CUDA graphs.
Run on the GPU machine through scripts/gpu-run (docs/gpu.md):

  bash scripts/gpu-run python3 scripts/bench_quant.py --json $OUT/bench_quant.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch
import torch.nn.functional as F
from triton.testing import do_bench, do_bench_cudagraph

from pagebatch.kernels.activation import silu_and_mul
from pagebatch.layers.activation import silu_and_mul_torch
from pagebatch.layers.linear import LinearBase
from pagebatch.quant.awq import AWQMethod
from pagebatch.quant.fp8 import FP8Method
from pagebatch.quant.fp16 import UnquantizedMethod
from pagebatch.quant.gptq import GPTQMethod
from pagebatch.quant.int8 import Int8Method
from pagebatch.quant.kernels import wna16 as kern

DEV = torch.device("cuda")
DT = torch.bfloat16
SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
TUNE_EXTRA_SHAPES = {"lm_head": (4096, 128256)}  # quantize_lm_head; tuned when named (--shapes)
DECODE_M, PREFILL_M = (1, 16), (256, 2048)
ROWS: list[dict] = []


def methods() -> dict:
    return {
        "bf16": lambda: UnquantizedMethod(None, None),
        "awq": lambda: AWQMethod(None, {"quant_method": "awq", "group_size": 128}),
        "gptq4_act": lambda: GPTQMethod(None, {"quant_method": "gptq", "bits": 4,
                                               "group_size": 128, "desc_act": True}),
        "gptq8": lambda: GPTQMethod(None, {"quant_method": "gptq", "bits": 8,
                                           "group_size": 128}),
        "int8": lambda: Int8Method(None, None),
        "fp8": lambda: FP8Method(None, None),
    }


def time_ms(fn, rep: int = 100) -> float:
    try:
        return do_bench_cudagraph(fn, rep=rep, return_mode="median")
    except Exception as e:  # noqa: BLE001 - report and fall back to eager timing
        print(f"  (graph capture failed: {type(e).__name__}: {str(e)[:80]}; eager timing)")
        return do_bench(fn, warmup=25, rep=rep, return_mode="median")


def make_layer(name: str, k: int, n: int) -> LinearBase:
    """A layer of method ``name`` with random weights made on the GPU (as load_format: dummy);
    act-order GPTQ gets a shuffled channel order."""
    method = methods()[name]()
    layer = LinearBase(k, [n], False, method, DT, DEV)
    gen = torch.Generator(device=DEV).manual_seed(0)
    method.load_dummy_weights(layer, gen)
    method.process_weights_after_loading(layer)
    if name == "gptq4_act":
        layer.perm = torch.randperm(k, device=DEV, generator=gen)
    return layer


def weight_bytes(layer: LinearBase) -> int:
    return sum(b.numel() * b.element_size() for b in [*layer.buffers(), *layer.parameters()]
               if b is not None and b.dim() == 2)


def reference(layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
    qm = layer.quant_method
    if isinstance(qm, UnquantizedMethod):
        return x.float() @ layer.weight.float().t()
    if isinstance(qm, Int8Method):
        from pagebatch.quant.int8 import quantize_per_token

        xq, xs = quantize_per_token(x)
        return (xq.float() @ layer.weight.float().t()) * xs * layer.weight_scale
    return x.float() @ qm.dequantized_weight(layer).float().t()


def bench_layers() -> None:
    print("== layers (us; decode GB/s of weights, prefill TFLOP/s) ==", flush=True)
    per_layer: dict[tuple[str, int], float] = {}
    for (shape, (k, n)), name in itertools.product(SHAPES.items(), methods()):
        layer = make_layer(name, k, n)
        wb = weight_bytes(layer)
        for m in DECODE_M + PREFILL_M:
            x = torch.randn(m, k, device=DEV, dtype=DT)
            try:
                with torch.no_grad():
                    err = ((layer(x).float() - reference(layer, x)).norm()
                           / reference(layer, x).norm()).item()
                ms = time_ms(lambda: layer(x))
            except Exception as e:  # noqa: BLE001 - report the case, go on with the others
                print(f"  {shape:8s} {name:10s} M={m:5d} FAILED {type(e).__name__}: {e}")
                per_layer[(name, m)] = float("nan")
                continue
            per_layer[(name, m)] = per_layer.get((name, m), 0.0) + ms
            fig = (f"{wb / ms / 1e6:.0f} GB/s" if m in DECODE_M
                   else f"{2 * m * k * n / ms / 1e9:.0f} TFLOP/s")
            ROWS.append(dict(group="layers", shape=shape, method=name, m=m, us=ms * 1e3,
                             weight_mb=wb / 2**20, rel_err=err))
            print(f"  {shape:8s} {name:10s} M={m:5d} {ms * 1e3:9.1f} us  {fig:>14s}  "
                  f"weights {wb / 2**20:7.1f} MiB  rel.err {err:.1e}", flush=True)
        layer = None  # free it before the next one
        torch.cuda.empty_cache()
    print("== one decoder layer (qkv + o + gate_up + down), speed-up over bf16 ==")
    for m in DECODE_M + PREFILL_M:
        base = per_layer[("bf16", m)]
        line = "  ".join(f"{name} {base / per_layer[(name, m)]:.2f}x" for name in methods())
        print(f"  M={m:5d}: {line}")
        ROWS.append(dict(group="decoder_layer", m=m,
                         **{name: base / per_layer[(name, m)] for name in methods()}))


def bench_paths() -> None:
    print("== W4A16 paths: Triton kernel vs dequantize + cuBLAS (us) ==", flush=True)
    for shape, (k, n) in SHAPES.items():
        layer = make_layer("awq", k, n)
        args = (layer.qweight, layer.scales, layer.zeros, 4, layer.wgroup_size)
        for m in (1, 16, 64, 256, 512, 1024, 2048, 4096):
            x = torch.randn(m, k, device=DEV, dtype=DT)
            cfg = kern.pick_config(m, n, k, layer.wgroup_size, False, DEV)
            t_kernel = time_ms(lambda: kern.run_config(x, *args, None, cfg))
            t_dense = time_ms(lambda: x @ kern.wna16_dequantize(*args, dtype=DT))
            w = torch.randn(n, k, device=DEV, dtype=DT)
            t_bf16 = time_ms(lambda: F.linear(x, w))
            ROWS.append(dict(group="paths", shape=shape, m=m, kernel_us=t_kernel * 1e3,
                             dense_us=t_dense * 1e3, bf16_us=t_bf16 * 1e3, **cfg))
            print(f"  {shape:8s} M={m:5d} kernel {t_kernel * 1e3:8.1f}  dequant+mm "
                  f"{t_dense * 1e3:8.1f}  bf16 {t_bf16 * 1e3:8.1f}   {cfg}", flush=True)


def _candidates(m: int, bits: int, group_size: int) -> list[dict]:
    """The W4A16 configs the sweep tries at ``m`` rows: the CUDA-core GEMV (up to 2 rows) and
    the tensor-core split-K GEMM (from 2 rows)."""
    pf = 32 // bits
    out = []
    kp = 16  # packed rows per sub-tile: the largest power of two up to 16 inside one group
    while kp > 1 and group_size % (kp * pf):
        kp //= 2
    if m <= 2 and group_size % (kp * pf) == 0:
        # 1-8K weight words per iteration (sub_tiles group-aligned tiles loaded at once), 8-32
        # per thread: enough bytes in flight to stream from HBM without spilling registers
        # (prefetch: the next iteration's words loaded before this one's are used; splits that
        # are not powers of two to fit the grid to the SMs' program slots)
        # (half2: the fp16x2 fields of quant/kernels/wna16_half2.py, 4 bits at one row)
        halves = (0, 1) if m == 1 and bits == 4 and kp >= 2 else (0,)
        for bn, sub, sk, warps, pre, h2 in itertools.product(
                (32, 64, 128), (1, 2), (2, 3, 4, 6, 8, 12, 16), (2, 4), (0, 1), halves):
            words = bn * kp * sub
            if (1024 <= words <= 8192 and 8 <= words // (32 * warps) <= 32 - 16 * pre):
                out.append(dict(kernel="gemv", block_n=bn, block_kp=kp, sub_tiles=sub,
                                split_k=sk, prefetch=pre, num_warps=warps, num_stages=3,
                                **({"half2": h2} if len(halves) > 1 else {})))
    if m == 1 and out:  # the tensor-core GEMM never won at one row (session-3 to -5 tunings)
        return out
    for bn, bk, sk, stages in itertools.product((32, 64, 128), (64, 128), (1, 2, 4, 8, 16),
                                                (4,)):
        if group_size % bk == 0:
            out.append(dict(kernel="gemm", block_m=16, block_n=bn, block_k=bk, split_k=sk,
                            num_warps=4, num_stages=stages))
    return out


L2_FLUSH_BYTES = 256 * 2**20  # five times the H200's 50 MB L2
# the gate/up projections: at decode sizes the GEMV applies SiLU-and-mul in its epilogue
# (gated=True), the other paths are followed by the activation kernel; tuned that way (session
# 6: a W4A16 table tuned on the plain product was slower end to end, 362.3 vs 377.1 tok/s)
GATED_SHAPES = {"gate_up", "8b.gate_up", "1b.gate_up", "8b-tp2.gate_up"}


def _rotating(make, nbytes: int):
    """A callable that returns the next of ``n`` copies ``make(i)`` (``nbytes`` each), enough
    that together they exceed L2_FLUSH_BYTES: timed back to back, each call then reads its
    weights from HBM, as a layer does inside a model step. (One copy timed over and over stays
    in L2 when it is smaller than L2, and shapes up to ~50 MB looked faster than HBM allows.)"""
    copies = [make(i) for i in range(max(1, -(-L2_FLUSH_BYTES // max(nbytes, 1))))]
    it = itertools.cycle(copies)
    return lambda: next(it)


def _time_candidates(candidates, run, ok) -> list[tuple[float, dict]]:
    """[(ms, cfg)] fastest first for the configs whose result ``ok(run(cfg))`` accepts both
    before and after the timed graph replays (which catches split-K counters left non-zero);
    the others are printed and dropped."""
    results = []
    for cfg in candidates:
        try:
            if not ok(run(cfg)):
                print(f"      WRONG {cfg}")
                continue
            ms = time_ms(lambda: run(cfg), rep=20)
            if not ok(run(cfg)):
                print(f"      WRONG after replays {cfg}")
                continue
        except Exception as e:  # noqa: BLE001 - e.g. out of shared memory
            print(f"      failed {type(e).__name__} {cfg}")
            continue
        results.append((ms, cfg))
    return sorted(results, key=lambda r: r[0])


def _tuned_table(kernel: str, tune_dir: str | None):
    """(path, table): the table of ``kernel`` for this GPU in ``tune_dir`` as it stands (the
    entries of row counts not tuned now are kept), or (None, {}) without a directory."""
    from pagebatch.kernels import tuned

    if not tune_dir:
        return None, {}
    path = tuned.config_path(kernel, tuned.device_name(DEV), tune_dir)
    return path, json.loads(path.read_text()) if path.is_file() else {}


def _write_table(path, table) -> None:
    """After each case: a run cut short still leaves what it measured."""
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
        print(f"tuned table written to {path}", flush=True)


def _rel_ok(ref, tol):
    return lambda out: ((out.float() - ref).norm() / ref.norm()).item() < tol


def _awq_problem(m: int, k: int, n: int):
    """An AWQ g128 layer with random weights, x ``[m, k]``, and a callable returning the next
    of enough copies of its (qweight, scales, zeros) to read them from HBM (`_rotating`)."""
    layer = make_layer("awq", k, n)
    x = torch.randn(m, k, device=DEV, dtype=DT)
    tensors = (layer.qweight, layer.scales, layer.zeros)
    next_args = _rotating(lambda i: tuple(t if i == 0 else t.clone() for t in tensors),
                          sum(t.numel() * t.element_size() for t in tensors))
    return layer, x, next_args


def _run_w4a16(x, args, bits: int, gs: int, cfg: dict, gated: bool):
    """A W4A16 config as decode runs it: gate/up products through the kernel's gated epilogue
    where it has one, else the product followed by the SiLU-and-mul kernel."""
    out = kern.run_config(x, *args, bits, gs, None, cfg, gated=gated)
    if out is None:
        return silu_and_mul(kern.run_config(x, *args, bits, gs, None, cfg))
    return out


def _tune_shapes(names: tuple[str, ...]) -> dict[str, tuple[int, int]]:
    """(K, N) by name from SHAPES and TUNE_EXTRA_SHAPES; all of SHAPES when ``names`` is
    empty. Raises SystemExit naming an unknown shape."""
    known = {**SHAPES, **TUNE_EXTRA_SHAPES}
    bad = [n for n in names if n not in known]
    if bad:
        raise SystemExit(f"--shapes {','.join(bad)}: choose from {', '.join(known)}")
    return {n: known[n] for n in names} if names else SHAPES


def bench_tune(tune_dir: str | None, rows: tuple[int, ...] = (1, 2, 4, 8, 16),
               shapes: tuple[str, ...] = (), half2_only: bool = False) -> None:
    """Every candidate config of the W4A16 kernels at the decode sizes of the 8B shapes (AWQ
    g128, 4 bits): each checked against the reference (also after its timed replays, which
    catches split-K counters left non-zero), the fastest kept per shape and M; written as the
    tuned table of core/kernels/tuned.py when ``tune_dir`` is given. ``shapes``: names of
    SHAPES / TUNE_EXTRA_SHAPES (default: SHAPES). ``half2_only``: only the GEMV's fp16x2
    candidates, timed against the configured path ("default")."""
    print("== W4A16 tuning (us; default = heuristics) ==", flush=True)
    path, table = _tuned_table("wna16", tune_dir)
    bits = 4
    for m, (shape, (k, n)) in itertools.product(rows, _tune_shapes(shapes).items()):
        layer, x, next_args = _awq_problem(m, k, n)
        gs = layer.wgroup_size
        gated = shape in GATED_SHAPES  # decode runs it through the gated GEMV (or + SiLU)

        def run(cfg, gated=gated):
            return _run_w4a16(x, next_args(), bits, gs, cfg, gated)

        ref = reference(layer, x)
        cands = _candidates(m, bits, gs)
        if half2_only:
            cands = [c for c in cands if c.get("half2")]
        results = _time_candidates(cands, run,
                                   _rel_ok(silu_and_mul_torch(ref) if gated else ref, 2e-2))
        if not results:
            print(f"  {shape:8s} M={m:3d} no config ran")
            continue
        default = kern.pick_config(m, n, k, gs, False, DEV, bits)
        t_default = time_ms(lambda: run(default))
        best = results[0][1]
        t_best = time_ms(lambda: run(best))  # at the default rep
        wb = layer.qweight.numel() * 4 + 2 * layer.scales.numel() * 2
        print(f"  {shape:8s} M={m:3d} default {t_default * 1e3:7.1f}  best {t_best * 1e3:7.1f}"
              f" ({wb / t_best / 1e6:.0f} GB/s)  {best}", flush=True)
        for ms, cfg in results[1:3]:
            print(f"      {ms * 1e3:7.1f} {cfg}")
        table.setdefault(kern.shape_key(bits, n, k, gs), {})[str(m)] = best
        ROWS.append(dict(group="tune", shape=shape, m=m, default_us=t_default * 1e3,
                         default=default, best_us=t_best * 1e3,
                         top=[dict(us=ms * 1e3, **c) for ms, c in results[:5]]))
        layer = next_args = None
        torch.cuda.empty_cache()
        _write_table(path, table)


DENSE_SHAPES = {  # (K, N) of the 16-bit linear layers and LM heads at batch-1 decode
    "8b.qkv": (4096, 6144), "8b.o": (4096, 4096), "8b.gate_up": (4096, 28672),
    "8b.down": (14336, 4096), "8b.lm_head": (4096, 128256),
    "1b.qkv": (2048, 3072), "1b.o": (2048, 2048), "1b.gate_up": (2048, 16384),
    "1b.down": (8192, 2048), "1b.lm_head": (2048, 128256),
    # one rank's shards of the 8B shape under tensor_parallel_size=2
    "8b-tp2.qkv": (4096, 3072), "8b-tp2.o": (2048, 4096), "8b-tp2.gate_up": (4096, 14336),
    "8b-tp2.down": (7168, 4096), "8b-tp2.lm_head": (4096, 64128),
}


def bench_tune_dense(tune_dir: str | None, rows: tuple[int, ...],
                     only: tuple[str, ...] = ()) -> None:
    """The 16-bit GEMV (core/kernels/gemv.py) against cuBLAS (``F.linear``) at decode sizes of
    the 8B and 1B shapes: every candidate checked against the reference before and after its
    timed replays; the fastest of all (cuBLAS included) kept per shape and M, written as the
    ``dense_gemv`` table that core/layers/dense.py reads. The gate/up shapes are timed as decode
    runs them: the gated GEMV against cuBLAS + the SiLU-and-mul kernel. ``only``: prefixes to
    tune (e.g. ``8b-tp2.``; default all)."""
    from pagebatch.kernels.gemv import gemv
    from pagebatch.layers.dense import gemv_key

    print("== 16-bit GEMV vs cuBLAS (us) ==", flush=True)
    path, table = _tuned_table("dense_gemv", tune_dir)
    candidates = [dict(kernel="gemv", block_n=bn, block_k=bk, split_k=sk, prefetch=pre,
                       num_warps=warps, num_stages=3)
                  for bn, bk, sk, warps, pre in itertools.product(
                      (8, 16, 32, 64), (128, 256, 512), (1, 2, 4, 8), (4, 8), (0, 1))
                  if bn * bk <= 16384 >> pre]  # prefetch holds two tiles
    shapes = {s: kn for s, kn in DENSE_SHAPES.items() if not only or s.startswith(only)}
    for m, (shape, (k, n)) in itertools.product(rows, shapes.items()):
        w = torch.randn(n, k, device=DEV, dtype=DT) * 0.02
        x = torch.randn(m, k, device=DEV, dtype=DT)
        next_w = _rotating(lambda i: w if i == 0 else w.clone(), w.numel() * 2)
        gated = shape in GATED_SHAPES

        def run(cfg, gated=gated):
            if cfg["kernel"] == "cublas":
                out = F.linear(x, next_w())
                return silu_and_mul(out) if gated else out
            return gemv(x, next_w(), None, gated=gated,
                        **{key: v for key, v in cfg.items() if key != "kernel"})

        ref = x.float() @ w.float().t()
        results = _time_candidates([{"kernel": "cublas"}, *candidates], run,
                                   _rel_ok(silu_and_mul_torch(ref) if gated else ref, 1e-2))
        t_cublas = next(ms for ms, cfg in results if cfg["kernel"] == "cublas")
        best_ms, best = results[0]
        wb = w.numel() * 2
        print(f"  {shape:11s} M={m:3d} cuBLAS {t_cublas * 1e3:7.1f} "
              f"({wb / t_cublas / 1e6:.0f} GB/s)  best {best_ms * 1e3:7.1f} "
              f"({wb / best_ms / 1e6:.0f} GB/s) {best}", flush=True)
        table.setdefault(gemv_key(n, k), {})[str(m)] = best
        ROWS.append(dict(group="tune_dense", shape=shape, m=m, cublas_us=t_cublas * 1e3,
                         best_us=best_ms * 1e3, best=best))
        w = x = next_w = None
        torch.cuda.empty_cache()
        _write_table(path, table)


def _mma_candidates(m: int, group_size: int) -> list[dict]:
    """Configs of the tensor-core kernel (quant/kernels/w4a16_mma.py) the sweep tries: those
    that came first or second at some 8B shape at 1 or 16 rows in the first full sweep
    (session 8), plus their neighbours in split-K."""
    bk = 128 if group_size % 128 == 0 else 64 if group_size % 64 == 0 else 32
    shapes = [(64, 1, 4, 3), (64, 1, 4, 4), (128, 1, 8, 3), (128, 2, 8, 3), (128, 4, 8, 3),
              (128, 8, 8, 3), (128, 8, 8, 4), (256, 8, 4, 3), (256, 16, 4, 3)]
    return [dict(kernel="mma", block_n=bn, block_k=bk, block_m=16, split_k=sk,
                 num_warps=warps, num_stages=stages)
            for bn, sk, warps, stages in shapes if not (m == 1 and bn == 64)]


def bench_tune_mma(tune_dir: str | None, rows: tuple[int, ...],
                   shapes: tuple[str, ...] = ()) -> None:
    """The tensor-core W4A16 kernel against the path configured now (`pick_config`: the
    packaged table, else heuristics) at decode sizes of the 8B shapes (AWQ g128), the gate/up
    shapes gated as decode runs them: every candidate checked before and after its timed
    replays. Where the kernel's best is faster, it becomes that shape and M's entry of the
    ``wna16`` table, written to ``tune_dir`` (starting from the packaged table, whose other
    entries are kept). ``shapes``: as `bench_tune`'s."""
    from pagebatch.kernels import tuned
    from pagebatch.quant.kernels import CONFIG_DIR

    print("== W4A16 tensor-core kernel vs the path configured now (us) ==", flush=True)
    path, table = _tuned_table("wna16", tune_dir)
    packaged = tuned.config_path("wna16", tuned.device_name(DEV), CONFIG_DIR)
    if path is not None and not table and packaged.is_file():
        table = json.loads(packaged.read_text())
    bits = 4
    for m, (shape, (k, n)) in itertools.product(rows, _tune_shapes(shapes).items()):
        layer, x, next_args = _awq_problem(m, k, n)
        gs = layer.wgroup_size
        nb = sum(b.numel() * b.element_size() for b in (layer.qweight, layer.scales, layer.zeros))
        gated = shape in GATED_SHAPES

        def run(cfg, gated=gated):
            return _run_w4a16(x, next_args(), bits, gs, cfg, gated)

        ref = reference(layer, x)
        ok = _rel_ok(silu_and_mul_torch(ref) if gated else ref, 2e-2)
        old = kern.pick_config(m, n, k, gs, False, DEV, bits)
        if old["kernel"] == "mma":  # a table from an earlier sweep: compare with the rest
            old = kern.pick_config(m, n, k, gs, False, DEV, bits, tuned_table=False)
        t_old = time_ms(lambda: run(old)) if ok(run(old)) else float("inf")
        results = _time_candidates(_mma_candidates(m, gs), run, ok)
        if not results:
            print(f"  {shape:8s} M={m:3d} no config ran")
            continue
        best = results[0][1]
        t_best = time_ms(lambda: run(best))
        won = t_best < t_old
        print(f"  {shape:8s} M={m:3d} now {t_old * 1e3:7.1f} ({nb / t_old / 1e6:.0f} GB/s)  mma "
              f"{t_best * 1e3:7.1f} ({nb / t_best / 1e6:.0f} GB/s) {'KEPT' if won else ''} "
              f"{best}", flush=True)
        for ms, cfg in results[1:3]:
            print(f"      {ms * 1e3:7.1f} {cfg}")
        if won:
            table.setdefault(kern.shape_key(bits, n, k, gs), {})[str(m)] = best
        ROWS.append(dict(group="tune_mma", shape=shape, m=m, now_us=t_old * 1e3, now=old,
                         mma_us=t_best * 1e3, kept=won,
                         top=[dict(us=ms * 1e3, **c) for ms, c in results[:5]]))
        layer = next_args = None
        torch.cuda.empty_cache()
        _write_table(path, table)


def bench_tinygemm(rows: tuple[int, ...]) -> None:
    """torch's int4 kernel (``aten._weight_int4pack_mm``, "tinygemm", the one gpt-fast's int4
    figures used) at the 8B decode shapes, g128, timed like the tuner (rotated weight copies,
    CUDA-graph replays), against cuBLAS bf16: whether a library kernel beats the W4A16 GEMV.
    Its format: w = (q - 8) * scale + zero, scale and zero bf16 ``[K/g, N, 2]``."""
    print("== tinygemm int4 (us) ==", flush=True)
    g = 128
    for m, (shape, (k, n)) in itertools.product(rows, SHAPES.items()):
        gen = torch.Generator(device=DEV).manual_seed(0)
        q = torch.randint(0, 16, (n, k), device=DEV, dtype=torch.int32, generator=gen)
        s = torch.rand(k // g, n, device=DEV, generator=gen) * 0.01 + 0.001
        z = (torch.rand(k // g, n, device=DEV, generator=gen) - 0.5) * 0.02
        sz = torch.stack([s, z], dim=-1).to(DT).contiguous()
        w_ref = ((q.float() - 8).view(n, k // g, g) * sz[..., 0].float().t()[..., None]
                 + sz[..., 1].float().t()[..., None]).view(n, k)
        x = torch.randn(m, k, device=DEV, dtype=DT)
        ref = x.float() @ w_ref.t()
        u8 = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)
        for tiles in (2, 4, 8):
            try:
                packed = torch._convert_weight_to_int4pack(u8, tiles)
                nb = packed.numel() * packed.element_size() + sz.numel() * 2
                nxt = _rotating(lambda i, p=packed: p if i == 0 else p.clone(), nb)

                def run(nxt=nxt):
                    return torch._weight_int4pack_mm(x, nxt(), g, sz)

                err = ((run().float() - ref).norm() / ref.norm()).item()
                ms = time_ms(run)
            except Exception as e:  # noqa: BLE001 - report, go on
                print(f"  {shape:8s} M={m} tiles={tiles} failed {type(e).__name__}: {e}")
                continue
            print(f"  {shape:8s} M={m} inner_k_tiles={tiles} {ms * 1e3:7.1f} us "
                  f"({nb / ms / 1e6:.0f} GB/s) rel.err {err:.1e}", flush=True)
            ROWS.append(dict(group="tinygemm", shape=shape, m=m, inner_k_tiles=tiles,
                             us=ms * 1e3, rel_err=err))
        q = packed = nxt = None
        torch.cuda.empty_cache()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", action="append",
                    choices=["layers", "paths", "tune", "tune-dense", "tune-mma", "tinygemm"],
                    help="run only these parts (default: layers and paths)")
    ap.add_argument("--tune", metavar="DIR", help="also tune the W4A16 kernels at decode sizes "
                    "and write the table (core/kernels/tuned.py) into DIR")
    ap.add_argument("--tune-m", default="1,2,4,8,16",
                    help="row counts to tune at (comma-separated; default %(default)s)")
    ap.add_argument("--dense-shapes", default="",
                    help="tune-dense: only shapes whose names start with these prefixes "
                    "(comma-separated, e.g. 8b-tp2.)")
    ap.add_argument("--shapes", default="",
                    help="tune, tune-mma: only these 8B shapes (comma-separated names: qkv, "
                    "o, gate_up, down, lm_head; default the first four)")
    ap.add_argument("--half2-only", action="store_true",
                    help="tune: only the GEMV's fp16x2 (half2) candidates at one row")
    ap.add_argument("--json", help="write every number to this file")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_quant.py needs a CUDA GPU", file=sys.stderr)
        return 2
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    parts = args.only or ["layers", "paths"] + (["tune"] if args.tune else [])
    for part in parts:
        rows = tuple(int(v) for v in args.tune_m.split(","))
        if part == "tune":
            bench_tune(args.tune, rows, tuple(filter(None, args.shapes.split(","))),
                       args.half2_only)
        elif part == "tune-dense":
            bench_tune_dense(args.tune, rows, tuple(filter(None, args.dense_shapes.split(","))))
        elif part == "tune-mma":
            bench_tune_mma(args.tune, rows, tuple(filter(None, args.shapes.split(","))))
        elif part == "tinygemm":
            bench_tinygemm(rows)
        else:
            {"layers": bench_layers, "paths": bench_paths}[part]()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(ROWS, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
