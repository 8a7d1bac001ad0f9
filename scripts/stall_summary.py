"""Summarize the stall lines a server logged under PAGEBATCH_SLOW_STEP_MS (core/stall_log.py):
how many slow engine-core turns, output-thread turns and event-loop holds, the phase that took
most of each slow core turn, what those turns scheduled, and Triton compiles after start-up.
    python3 scripts/stall_summary.py server.log [--top 12]
"""

from __future__ import annotations

import argparse
import collections
import re

TURN = re.compile(r"slow (engine core|output thread) turn: ([\d.]+) ms \(([^)]*) ms\)(.*)")
GC = re.compile(r"gc ([\d.]+) ms \(generation \d\)")
ALLOC = re.compile(r"allocator ([^;]+)")
HELD = re.compile(r"the event loop was held ([\d.]+) ms")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("log")
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args()
    turns = collections.defaultdict(list)  # kind -> [(ms, phases, rest, line)]
    held, compiles = [], []
    for line in open(args.log, errors="replace"):
        if m := TURN.search(line):
            phases = {k: float(v) for k, v in (p.rsplit(" ", 1) for p in m.group(3).split(", "))}
            turns[m.group(1)].append((float(m.group(2)), phases, m.group(4).strip("; \n")))
        elif m := HELD.search(line):
            held.append(float(m.group(1)))
        elif "Triton compiled or loaded" in line:
            compiles.append(line.strip()[:300])
    for kind, rows in turns.items():
        by_phase = collections.Counter(max(p, key=p.get) for _, p, _ in rows)
        ms = sorted(r[0] for r in rows)
        print(f"{kind}: {len(rows)} slow turns, median {ms[len(ms) // 2]:.1f} ms, max {ms[-1]:.1f}"
              f" ms; longest phase: {dict(by_phase.most_common())}")
        gcs = [float(m.group(1)) for *_, rest in rows if (m := GC.search(rest))]
        allocs = sum(1 for *_, rest in rows if ALLOC.search(rest))
        print(f"  of them with a collection: {len(gcs)} ({sum(gcs):.1f} ms in all); with "
              f"allocator events: {allocs}")
        for t, p, rest in sorted(rows, key=lambda r: -r[0])[:args.top]:
            # the gc / allocator notes come last and would be cut off: shown whole after the rest
            notes = rest.split("; ")
            extra = [n for n in notes if GC.match(n) or ALLOC.match(n)]
            steps = "; ".join(n for n in notes if n not in extra)
            tail = f" [{'; '.join(extra)}]" if extra else ""
            print(f"  {t:7.1f} ms  {p}  {steps[:220]}{tail}")
    if held:
        held.sort()
        print(f"event loop held: {len(held)} times, median {held[len(held) // 2]:.1f} ms, "
              f"max {held[-1]:.1f} ms")
    print(f"Triton compiles after start-up: {len(compiles)}")
    for c in compiles[:args.top]:
        print("  " + c)


if __name__ == "__main__":
    main()
