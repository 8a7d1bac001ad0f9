#!/usr/bin/env python3
"""The sampler's GPU time per step on Llama-3's vocabulary (128256), CUDA events, median of
``--reps``: greedy, sampled over the whole vocabulary (a sort), and sampled over top-k
candidates (temperature 0.8, top-p 0.95, top-k 50, per-row seeds: issue 22's sampled workload).

  bash scripts/gpu-run python3 scripts/bench_sampler.py [--rows 1 64 256]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

import torch

from pagebatch.sampler import Sampler, SamplingBatch


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
    args = ap.parse_args()
    dev = torch.device("cuda")
    sampler = Sampler()
    greedy = SamplingBatch(None, None, None, None, None, True, False, False)
    print("| rows | greedy ms | sampled, full sort ms | sampled, top-k candidates ms | same tokens |")
    print("|---|---|---|---|---|")
    for n in args.rows:
        logits = torch.randn(n, 128256, device=dev) * 3
        fast = batch_of(n, dev, 64)
        full = dataclasses.replace(fast, top_k_width=0)
        same = torch.equal(sampler(logits, fast).token_ids, sampler(logits, full).token_ids)
        t = [time_ms(lambda b=b: sampler(logits, b), args.reps) for b in (greedy, full, fast)]
        print(f"| {n} | {t[0]:.3f} | {t[1]:.3f} | {t[2]:.3f} | {same} |", flush=True)


if __name__ == "__main__":
    main()
