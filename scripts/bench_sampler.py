#!/usr/bin/env python3
"""The sampler's GPU time per step on Llama-3's vocabulary (128256), CUDA events, median of
``--reps``: greedy, sampled over the whole vocabulary (a sort), and sampled over top-k
candidates (temperature 0.8, top-p 0.95, top-k 50, per-row seeds: issue 22's sampled workload).

  bash scripts/gpu-run python3 scripts/bench_sampler.py [--rows 1 64 256] [--parts]

``--parts`` adds two columns: the candidate search alone (`top_k_ids`, width 64) and the
candidate draw replayed from a CUDA graph (its GPU work without the host's launch gaps).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

import torch

from pagebatch.sampler import Sampler, SamplingBatch, top_k_ids


def batch_of(n: int, dev: torch.device, width: int) -> SamplingBatch:
    i = torch.arange(n, device=dev)
    return SamplingBatch(torch.full((n,), 0.8, device=dev), torch.full((n,), 50, device=dev),
                         torch.full((n,), 0.95, device=dev), i * 7 + 1, i + 100, False, True,
                         True, top_k_width=width)


def time_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps + 3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times[3:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--parts", action="store_true", help="also the top-k search alone and the "
                    "candidate draw from a CUDA graph")
    args = ap.parse_args()
    dev = torch.device("cuda")
    sampler = Sampler()
    greedy = SamplingBatch(None, None, None, None, None, True, False, False)
    extra = " top_k_ids ms | candidates, graph replay ms |" if args.parts else ""
    print("| rows | greedy ms | sampled, full sort ms | sampled, top-k candidates ms | same "
          f"tokens |{extra}")
    print("|---|---|---|---|---|" + ("---|---|" if args.parts else ""))
    for n in args.rows:
        logits = torch.randn(n, 128256, device=dev) * 3
        fast = batch_of(n, dev, 64)
        full = dataclasses.replace(fast, top_k_width=0)
        same = torch.equal(sampler(logits, fast).token_ids, sampler(logits, full).token_ids)
        t = [time_ms(lambda b=b: sampler(logits, b), args.reps) for b in (greedy, full, fast)]
        cols = ""
        if args.parts:
            search = time_ms(lambda: top_k_ids(logits, 64), args.reps)
            sampler(logits, fast)  # warm before capture
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                sampler(logits, fast)
            cols = f" {search:.3f} | {time_ms(g.replay, args.reps):.3f} |"
        print(f"| {n} | {t[0]:.3f} | {t[1]:.3f} | {t[2]:.3f} | {same} |{cols}", flush=True)


if __name__ == "__main__":
    main()
