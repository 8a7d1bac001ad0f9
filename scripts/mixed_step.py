#!/usr/bin/env python3
"""What a mixed step costs against a decode-only step (issue 23: serving at moderate rates):
wall time and GPU kernel time per step, on a GPU machine.

  python3 scripts/mixed_step.py examples/configs/llama-3.1-8b --decodes 32 \\
      --prefill-lens 128,512 [--extra enforce_eager=true] [--json OUT]

``--decodes`` requests (16 prompt tokens, long outputs) decode throughout. Phase "decode": the
steps of that batch alone (CUDA graphs unless eager). Phase "mixed L": before every step a new
request of L prompt tokens and ``max_tokens`` 1 is added, so each step carries the decodes plus
one L-token prefill (the scheduler's chunk, as in a served run at a request rate). Each phase:
``--steps`` steps timed without the profiler (wall ms / step), then the same under
torch.profiler (the sum of GPU kernel times / step). ``busy`` = kernel time / wall: well under
100 % means the host (launches, input preparation) sets the step's time, not the GPU.
``--sync-debug`` (CUDA): one more pass of each phase under ``torch.cuda.set_sync_debug_mode
("warn")``, counting per step the synchronizing calls that mode flags (an ``.item()``, a copy to
pageable memory, ...) by the file and line the warning names: the innermost Python frame, which
may be inside torch rather than its caller. Waits the mode does not flag (an allocator's
``cudaMalloc``, an event wait) are not counted.
"""

from __future__ import annotations

import argparse
import json
import random
import time
import warnings
from collections import Counter

import torch
from profile_engine import engine_keys


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _activity():  # the CPU's ops stand in for kernels there: a smoke test only
    a = torch.profiler.ProfilerActivity
    return a.CUDA if torch.cuda.is_available() else a.CPU


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--decodes", type=int, default=32)
    ap.add_argument("--prefill-lens", default="128,512")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--extra", default="", help="engine keys k=v,k=v")
    ap.add_argument("--json")
    ap.add_argument("--sync-debug", action="store_true",
                    help="list the host-device synchronizations of each phase (CUDA)")
    a = ap.parse_args()
    from pagebatch.config import EngineConfig
    from pagebatch.engine import LLMEngine
    from pagebatch.request import SamplingParams

    keys = dict(model=a.model, load_format="dummy", max_model_len=a.max_model_len)
    keys.update(engine_keys(a.extra))
    engine = LLMEngine(EngineConfig.from_sources(cli=keys))
    rng = random.Random(0)
    lens = [int(x) for x in a.prefill_lens.split(",")]

    def ids(n: int) -> dict:
        return {"prompt_token_ids": [rng.randrange(100, 30000) for _ in range(n)]}

    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    per_phase = 2 * a.steps + 4
    long = SamplingParams(temperature=0.0, ignore_eos=True,
                          max_tokens=per_phase * (len(lens) + 1) * 2 + 64)

    def steps(n: int, prefill: int | None) -> float:
        _sync()
        t0 = time.perf_counter()
        for _ in range(n):
            if prefill:
                engine.add_request(ids(prefill), one)
            engine.step()
        _sync()
        return (time.perf_counter() - t0) * 1e3 / n

    def phase(prefill: int | None) -> dict:
        steps(4, prefill)  # settle (the first prefill of a length compiles nothing new: warm-up)
        wall = steps(a.steps, prefill)
        with torch.profiler.profile(activities=[_activity()]) as prof:
            steps(a.steps, prefill)
        kernel = sum(e.self_device_time_total for e in prof.key_averages()) / 1e3 / a.steps
        top = sorted(prof.key_averages(), key=lambda e: -e.self_device_time_total)[:6]
        row = dict(wall_ms=wall, kernel_ms=kernel, busy=kernel / wall,
                   top=[(e.key[:70], e.self_device_time_total / 1e3 / a.steps) for e in top])
        if a.sync_debug and torch.cuda.is_available():
            row["syncs"] = synced(prefill)
        return row

    def synced(prefill: int | None) -> list:
        """(where, count per step) of every synchronizing CUDA call in ``a.steps`` steps."""
        where: Counter = Counter()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                steps(a.steps, prefill)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        for w in seen:
            if "synchroniz" in str(w.message):
                where[f"{w.filename}:{w.lineno}"] += 1
        return [(k, n / a.steps) for k, n in where.most_common(8)]

    for _ in range(a.decodes):
        engine.add_request(ids(16), long)
    got = set()
    while len(got) < a.decodes:  # every decode has its first token
        got |= {o.request_id for o in engine.step()}
    rows = {"decode": phase(None)}
    for n in lens:
        rows[f"mixed {n}"] = phase(n)
    print(f"{a.model} {a.extra or '(defaults)'}: {a.decodes} decodes")
    print("| phase | wall ms/step | GPU kernels ms/step | busy |")
    print("|---|---|---|---|")
    for k, r in rows.items():
        print(f"| {k} | {r['wall_ms']:.2f} | {r['kernel_ms']:.2f} | {r['busy']:.0%} |")
    for k, r in rows.items():
        print(f"{k}: " + "; ".join(f"{t:.3f} {name}" for name, t in r["top"]))
    for k, r in rows.items():
        if "syncs" in r:
            print(f"{k} syncs/step: " + ("; ".join(f"{n:.2f} {w}" for w, n in r["syncs"])
                                         or "none"))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    engine.shutdown()


if __name__ == "__main__":
    main()
