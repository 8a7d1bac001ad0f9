#!/usr/bin/env python3
"""Instructions in the main loop of the W4A16 GEMV (quant/kernels/wna16_gemv.py) as compiled for
an H100/H200 (sm_90), on any machine: Triton compiles ahead of time with its bundled ptxas and
cuobjdump disassembles, no GPU needed. docs/benchmarks.md (session 5) quotes it:

  python3 scripts/sass_count.py --block-n 64 --block-kp 16 --split-k 8 --num-warps 2

prints the loop's instruction count, the words (int32 of 8 4-bit fields) each thread handles per
iteration, and the mix by opcode (``--half2``: the fp16x2 fields of quant/kernels/
wna16_half2.py; ``--dtype``, ``--masked``: other activation dtypes, the masked loads). Kernel
parameters are read from the kernel's own signature, so the same command measures an older
tree's kernel (``git checkout REV -- quant/kernels``)."""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

PTRS = {"x_ptr": "*bf16", "q_ptr": "*i32", "s_ptr": "*bf16", "z_ptr": "*bf16",
        "out_ptr": "*bf16", "ws_ptr": "*fp32", "cnt_ptr": "*i32"}
ALIGNED = {"N", "K", "group_size", "stride_xm", "stride_qk", "stride_qn", "stride_sg",
           "stride_om"}


def compile_sass(a: argparse.Namespace) -> str:
    ptrs = dict(PTRS)
    if a.mma:
        from pagebatch.quant.kernels.w4a16_mma import _w4a16_mma_kernel as kernel

        consts = dict(SPLIT_K=a.split_k, BLOCK_N=a.block_n, BLOCK_K=a.block_k,
                      BLOCK_M=a.block_m, EVEN=True, GATED=a.gated, DECODE=True, USE_ASM=True,
                      F16=False, PDL=False)
    else:
        from pagebatch.quant.kernels.wna16_gemv import _wna16_gemv_kernel as kernel

        ptrs.update({p: "*" + a.dtype for p in ("x_ptr", "s_ptr", "z_ptr", "out_ptr")})

        consts = dict(BITS=4, SPLIT_K=a.split_k, BLOCK_N=a.block_n, BLOCK_KP=a.block_kp,
                      SUB=a.sub_tiles, GROUP_SHIFT=0, EVEN=not a.masked, PREFETCH=a.prefetch,
                      GATED=a.gated, HALF2=a.half2, USE_ASM=True, PDL=False)
    names = [p.name for p in kernel.params]
    sig, attrs = {}, {}
    for i, name in enumerate(names):
        if name in consts:
            sig[name] = "constexpr"
        else:
            sig[name] = ptrs.get(name, "i32")
            if name in ptrs or name in ALIGNED:
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=kernel, signature=sig,
                    constexprs={k: v for k, v in consts.items() if k in names}, attrs=attrs)
    c = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": a.num_warps, "num_stages": a.num_stages})
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    cubin = Path("/tmp/pagebatch-sass-count.cubin")
    cubin.write_bytes(c.asm["cubin"])
    return subprocess.run([str(tool), "-sass", str(cubin)], capture_output=True, text=True,
                          check=True).stdout


def main_loop(sass: str) -> list[str]:
    """Opcodes between the target and the source of the longest backward branch."""
    ins = []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)(.*?);", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2), m.group(3)))
    best = None
    for addr, op, rest in ins:
        t = re.search(r"0x([0-9a-f]+)", rest) if op.startswith("BRA") else None
        if t and int(t.group(1), 16) < addr:
            lo = int(t.group(1), 16)
            if best is None or addr - lo > best[1] - best[0]:
                best = (lo, addr)
    if best is None:
        raise SystemExit("no loop found in the SASS")
    return [op for addr, op, _ in ins if best[0] <= addr <= best[1]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--block-n", type=int, default=64)
    ap.add_argument("--block-kp", type=int, default=16)
    ap.add_argument("--sub-tiles", type=int, default=1)
    ap.add_argument("--split-k", type=int, default=8)
    ap.add_argument("--num-warps", type=int, default=2)
    ap.add_argument("--prefetch", action="store_true")
    ap.add_argument("--num-stages", type=int, default=3)
    ap.add_argument("--mma", action="store_true",
                    help="the tensor-core kernel (quant/kernels/w4a16_mma.py) at batch 1: "
                    "--block-n, --block-k, --block-m, --split-k, --num-warps")
    ap.add_argument("--block-k", type=int, default=128)
    ap.add_argument("--block-m", type=int, default=16)
    ap.add_argument("--gated", action="store_true",
                    help="the gate/up product with SiLU-and-mul in its epilogue")
    ap.add_argument("--half2", action="store_true",
                    help="the GEMV's fp16x2 fields (wna16_gemv(half2=True))")
    ap.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16",
                    help="the GEMV's activations, scales, zeros and output")
    ap.add_argument("--masked", action="store_true",
                    help="the GEMV's masked loads (K or N not a multiple of the tile)")
    a = ap.parse_args()
    ops = main_loop(compile_sass(a))
    if a.mma:
        words = a.block_n * a.block_k // 8 // (32 * a.num_warps)
    else:
        words = a.block_n * a.block_kp * a.sub_tiles // (32 * a.num_warps)
    mix = collections.Counter(o if o.startswith(("IMAD.MOV", "IMAD.SHL", "IMAD.U32"))
                              else o.split(".")[0] for o in ops)
    print(f"main loop: {len(ops)} instructions for {words} words per thread "
          f"({len(ops) / words:.1f} per word)")
    print("  " + ", ".join(f"{k} {v}" for k, v in mix.most_common(14)))


if __name__ == "__main__":
    main()
