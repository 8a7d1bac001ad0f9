"""Where a step's time goes (GPU machine): wall time per step, GPU kernel time over wall time
(torch.profiler), and the host functions that cost most (cProfile).

  python3 scripts/profile_engine.py examples/configs/llama-3.1-8b --num-prompts 256 \
      --input-len 512 --output-len 128 [--decode-only] [--steps 50] [--json OUT]

--decode-only measures steps after every request has its first token (issue 7's T6: GPU busy
time at batch 256 decode). Busy = kernel time of --steps profiled steps over the wall time of
--steps steps run just before without the profiler. With tensor or pipeline parallelism this
profiles the driver (rank 0); PAGEBATCH_TRACE_STEPS=FIRST:LAST and PAGEBATCH_TRACE_DIR in the
environment trace the other ranks (core/distributed/step_trace.py)."""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time

import torch


def engine_keys(extra: str) -> dict:
    """``--extra "k=v,k=v"`` as engine keys (values stay strings; empty items are skipped)."""
    keys = {}
    for kv in filter(None, extra.split(",")):
        k, v = kv.split("=")
        keys[k] = v
    return keys


def print_gaps(trace: str, top: int = 8) -> None:
    """From a Chrome trace: the GPU's idle time between kernels (all streams merged), the
    total and the largest gaps with the last kernel before each."""
    import gzip

    opener = gzip.open if trace.endswith(".gz") else open
    with opener(trace, "rt") as f:
        events = json.load(f)["traceEvents"]
    kernels = sorted((e["ts"], e["ts"] + e.get("dur", 0), e["name"]) for e in events
                     if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    if not kernels:
        print("trace: no GPU events")
        return
    gaps, end, last = [], kernels[0][1], kernels[0][2]
    for start, stop, name in kernels[1:]:
        if start > end:
            gaps.append((start - end, last[:70]))
        if stop > end:
            end, last = stop, name
    span = end - kernels[0][0]
    idle = sum(g for g, _ in gaps)
    print(f"trace: {len(kernels)} GPU events over {span / 1e3:.2f} ms, idle between them "
          f"{idle / 1e3:.2f} ms ({idle / span:.1%}) in {len(gaps)} gaps; "
          f"gaps > 20 us: {sum(g for g, _ in gaps if g > 20) / 1e3:.2f} ms")
    for g, name in sorted(gaps, reverse=True)[:top]:
        print(f"  gap {g:8.1f} us after {name}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--decode-only", action="store_true")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--extra", default="", help="engine keys k=v,k=v")
    ap.add_argument("--json")
    ap.add_argument("--trace", help="write the profiled steps' Chrome trace (timeline) here")
    a = ap.parse_args()
    from pagebatch.bench.workload import make_workload
    from pagebatch.config import EngineConfig
    from pagebatch.engine import LLMEngine
    from pagebatch.request import SamplingParams

    keys = dict(model=a.model, load_format="dummy", max_model_len=a.max_model_len)
    keys.update(engine_keys(a.extra))
    engine = LLMEngine(EngineConfig.from_sources(cli=keys))
    prompts, _ = make_workload(argparse.Namespace(
        num_prompts=a.num_prompts, input_len=a.input_len, input_len_min=None,
        output_len=a.output_len, output_len_min=None), 32000, 0)
    sp = SamplingParams(temperature=0.0, max_tokens=a.output_len, ignore_eos=True)

    def add_all():
        for p in prompts:
            engine.add_request({"prompt_token_ids": p}, sp)

    def drain():
        while engine.has_unfinished_requests:
            engine.step()

    add_all()
    drain()  # warm-up: compiles every kernel variant of the workload
    add_all()
    if a.decode_only:  # run until every request has its first token
        got = set()
        while len(got) < a.num_prompts:
            for o in engine.step():
                got.add(o.request_id)
        assert 2 * a.steps < a.output_len, "--steps: the batch must stay whole"
    torch.cuda.synchronize()
    t0 = time.perf_counter()  # wall time without the profiler (it slows the host down)
    for _ in range(a.steps):
        engine.step()
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    t0 = time.perf_counter()
    acts = [torch.profiler.ProfilerActivity.CUDA]
    if a.trace:
        acts.append(torch.profiler.ProfilerActivity.CPU)
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(a.steps):
            engine.step()
        torch.cuda.synchronize()
    wall_profiled = time.perf_counter() - t0
    if a.trace:  # host launches and GPU kernels on one timeline: where the GPU waits
        prof.export_chrome_trace(a.trace)  # (a name ending in .gz is written gzipped)
        print_gaps(a.trace)
    kernel_us = sum(e.self_device_time_total for e in prof.key_averages())
    rows = sorted(prof.key_averages(), key=lambda e: -e.self_device_time_total)[:12]
    print(f"{a.steps} steps: wall {wall * 1e3 / a.steps:.3f} ms/step (profiled: "
          f"{wall_profiled * 1e3 / a.steps:.3f}), GPU kernels "
          f"{kernel_us / 1e3 / a.steps:.3f} ms/step, busy {kernel_us / 1e6 / wall:.1%}")
    for e in rows:
        print(f"  {e.self_device_time_total / 1e3 / a.steps:8.3f} ms/step  {e.count // a.steps:4d}x"
              f"  {e.key[:90]}")
    drain()
    # host hot spots over a whole run (without the profiler)
    add_all()
    pr = cProfile.Profile()
    t0 = time.perf_counter()
    pr.enable()
    n = 0
    while engine.has_unfinished_requests:
        engine.step()
        n += 1
    pr.disable()
    total = time.perf_counter() - t0
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(22)
    print(f"whole run under cProfile: {n} steps, {total:.2f} s")
    print("\n".join(s.getvalue().splitlines()[:45]))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"ms_per_step": wall * 1e3 / a.steps,
                       "kernel_ms_per_step": kernel_us / 1e3 / a.steps,
                       "busy": kernel_us / 1e6 / wall}, f)


if __name__ == "__main__":
    main()
