#!/usr/bin/env python3
"""Per-step breakdown of a Chrome trace of decode steps (torch.profiler: scripts/profile_engine.py
--trace, or a worker rank's PAGEBATCH_TRACE_STEPS trace, core/distributed/step_trace.py): the
longest burst of GPU activity (no gap over 1 ms), its steps counted by a kernel that runs a known
number of times per step, then per step: wall, GPU busy, the kernels by total time, the idle
time between kernels by gap size, and the kernel pairs with the most idle between them.
docs/benchmarks.md (session 5) quotes it for the TP=2 worker:

  python3 scripts/trace_summary.py docs/benchmarks/h200x2-s5-tp2-rank1-trace.json.gz \
      --marker AllReduce --per-step 65
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json


def gpu_events(path: str) -> list[tuple[float, float, str]]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    return sorted((e["ts"], e.get("dur", 0), e["name"]) for e in events
                  if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))


def longest_burst(ks, max_gap_us: float = 1000.0):
    bursts = [[ks[0]]]
    for k in ks[1:]:
        last = bursts[-1][-1]
        if k[0] - (last[0] + last[1]) > max_gap_us:
            bursts.append([])
        bursts[-1].append(k)
    return max(bursts, key=len)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--marker", required=True, help="a kernel name substring ...")
    ap.add_argument("--per-step", type=int, required=True, help="... launched this often a step")
    ap.add_argument("--top", type=int, default=10)
    a = ap.parse_args()
    b = longest_burst(gpu_events(a.trace))
    steps = sum(a.marker in n for _, _, n in b) / a.per_step
    span = b[-1][0] + b[-1][1] - b[0][0]
    total, count = collections.Counter(), collections.Counter()
    for _, d, n in b:
        total[n[:100]] += d
        count[n[:100]] += 1
    print(f"{len(b)} GPU events, {steps:.1f} steps: {span / steps / 1e3:.3f} ms per step, "
          f"GPU busy {sum(total.values()) / span:.1%}")
    for n, t in total.most_common(a.top):
        print(f"  {t / steps:8.1f} us/step {count[n] / steps:6.1f}x {t / count[n]:7.2f} us  {n}")
    sizes, pairs, pair_n = collections.Counter(), collections.Counter(), collections.Counter()
    end, prev = b[0][0] + b[0][1], b[0][2]
    for t, d, n in b[1:]:
        if t > end:
            g = t - end
            sizes["<2 us" if g < 2 else "2-5 us" if g < 5 else "5-20 us" if g < 20
                  else "20-100 us" if g < 100 else ">=100 us"] += g
            pairs[f"{prev[:38]} -> {n[:38]}"] += g
            pair_n[f"{prev[:38]} -> {n[:38]}"] += 1
        if t + d > end:
            end, prev = t + d, n
    print("idle between kernels, us per step: " + ", ".join(
        f"{k} {v / steps:.1f}" for k, v in sorted(sizes.items())))
    for p, g in pairs.most_common(a.top):
        print(f"  {g / steps:7.1f} us/step {pair_n[p] / steps:5.1f}x  {p}")


if __name__ == "__main__":
    main()
