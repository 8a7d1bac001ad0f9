#!/usr/bin/env python3
"""Roofline accounting of ``pagebatch bench throughput`` (issue 22): the wall time split into
prefill GEMMs, decode GEMMs, attention (prefill / decode steps), other kernels and host/idle,
each beside its floor (core/bench/roofline.py: FLOPs / 791 TFLOP/s, bytes / 4.28 TB/s).

  python3 scripts/roofline.py examples/configs/llama-3.1-8b --load-format dummy \\
      --max-model-len 4096 --max-num-batched-tokens 16384 --num-prompts 256 \\
      --input-len 512 --output-len 128 [--json OUT] [--trace OUT.json.gz]

Every argument but this script's own (below) is ``pagebatch bench throughput``'s, and the
engine, workload and sampling are built the way bench builds them (core/bench/). Three runs of
the workload on one engine: bench's warm-up; the timed one (no profiler: the true wall time);
one under torch.profiler (CPU + CUDA activities), each step's launches inside a
``roofline.step`` range and its `StepShape` recorded from the `SchedulerOutput`. The profiler
restarts every ``--session-steps`` steps (after a synchronize), which bounds its buffers on long
runs; kernels go to categories as core/bench/kernel_split.py says. GPU time is the profiled
run's, host/idle = the timed wall time less the GPU's busy time. On the CPU (no CUDA kernels)
the top-level CPU ops stand in for kernels: a smoke test, not a measurement.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import sys
import time
from dataclasses import replace
from types import SimpleNamespace

import torch

from pagebatch.bench.kernel_split import (STEP_MARK, breakdown, category, kernels_from_events,
                                          trace_events)
from pagebatch.bench.offline import run_workload, sampling_params_of
from pagebatch.bench.roofline import (H200_PEAK_BW, H200_PEAK_FLOPS, HOST, ModelShape,
                                      StepShape, run_floors, step_totals, table)
from pagebatch.bench.workload import bench_sampling, make_workload, shift_ids
from pagebatch.cli import _config_from_args, build_parser  # bench's own parser and config


def _own_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    ap.add_argument("--json", metavar="OUT", help="write the accounting as JSON")
    ap.add_argument("--trace", metavar="OUT.json.gz",
                    help="write the Chrome trace of the --trace-steps session (gzipped if .gz)")
    ap.add_argument("--trace-steps", metavar="A:B", default=None,
                    help="steps [A, B) of the profiled run to trace (default: the first "
                    "session); they are profiled as one session, with shapes recorded")
    ap.add_argument("--session-steps", type=int, default=200,
                    help="steps per profiler session (default 200)")
    ap.add_argument("--peak-tflops", type=float, default=H200_PEAK_FLOPS / 1e12)
    ap.add_argument("--peak-tbs", type=float, default=H200_PEAK_BW / 1e12,
                    help="memory bandwidth, TB/s")
    return ap.parse_known_args(argv)


class ProfiledSteps:
    """Wraps ``executor.execute_model`` while active: records each non-empty step's
    `StepShape`, runs its launches inside ``record_function(STEP_MARK)``, and rotates profiler
    sessions at ``boundaries`` (step indices), collecting each session's kernels
    (kernel_split.Kernel, steps numbered over the whole run)."""

    def __init__(self, executor, boundaries: set[int], trace: tuple[int, int] | None,
                 trace_path: str | None):
        self.executor, self.boundaries = executor, boundaries
        self.trace, self.trace_path = trace, trace_path
        self.steps: list[StepShape] = []
        self.kernels: list = []
        self.gpu = False
        self.launch_attributed = 0  # kernels whose own launch gave their step
        self.acausal = 0  # kernels launched after they started (kernel_split.Session)
        self.cuda = torch.cuda.is_available()
        self._prof, self._first = None, 0
        self._inner = executor.execute_model

    def _start(self) -> None:
        acts = [torch.profiler.ProfilerActivity.CPU]
        if self.cuda:
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        self._first = len(self.steps)
        shapes = self.trace is not None and self._first == self.trace[0]
        self._prof = torch.profiler.profile(activities=acts, record_shapes=shapes)
        self._prof.start()

    def _stop(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()  # every launched kernel is in this session
        self._prof.stop()
        got = kernels_from_events(self._prof.profiler.kineto_results.events())
        if got.num_windows != len(self.steps) - self._first:
            print(f"warning: {got.num_windows} step ranges in a session of "
                  f"{len(self.steps) - self._first} steps", file=sys.stderr)
        self.gpu |= got.gpu
        self.launch_attributed += got.num_launch_attributed
        self.acausal += got.num_acausal
        self.kernels += [k if k.step is None else replace(k, step=k.step + self._first)
                         for k in got.kernels]
        if self.trace_path and self.trace and self._first == self.trace[0]:
            self._prof.export_chrome_trace(self.trace_path)
        self._prof = None

    def _execute(self, so):
        if so.is_empty:
            return self._inner(so)
        if len(self.steps) in self.boundaries:
            self._stop()
            self._start()
        self.steps.append(StepShape.from_scheduler_output(so))
        with torch.profiler.record_function(STEP_MARK):
            return self._inner(so)

    def __enter__(self) -> "ProfiledSteps":
        self.executor.execute_model = self._execute
        self._start()
        return self

    def __exit__(self, *exc) -> None:
        self.executor.execute_model = self._inner
        self._stop()


def _top(kernels, steps, n: int = 5) -> dict[str, list]:
    """Category -> its n kernels of most time: [name, seconds, count]."""
    t, c = collections.defaultdict(collections.Counter), collections.defaultdict(
        collections.Counter)
    for k in kernels:
        cat = category(k, steps)
        t[cat][k.name[:90]] += k.dur_us / 1e6
        c[cat][k.name[:90]] += 1
    return {cat: [[name, round(s, 4), c[cat][name]] for name, s in v.most_common(n)]
            for cat, v in t.items()}


def _trace_bounds(own: argparse.Namespace) -> tuple[set[int], tuple[int, int] | None]:
    """The steps at which a new profiler session starts, and the traced steps [A, B) (None:
    no --trace), which get a session of their own."""
    every = max(1, own.session_steps)
    bounds = set(range(every, 1 << 20, every))
    if not own.trace:
        return bounds, None
    a, b = map(int, own.trace_steps.split(":")) if own.trace_steps else (0, every)
    return {x for x in bounds if not a < x < b} | ({a, b} - {0}), (a, b)


def _summary(r: dict) -> str:
    st = r["steps"]
    what = "GPU kernels" if r["gpu_kernels"] else "CPU ops (no GPU: degraded mode)"
    warn = (f"; {r['kernels_launched_after_start']} launched after they started: check the "
            "split" if r["kernels_launched_after_start"] else "")
    return (f"roofline: {r['output_tokens']} output tokens; wall {r['wall_s']:.3f} s "
            f"unprofiled ({r['wall_profiled_s']:.3f} s profiled), GPU busy "
            f"{r['gpu_busy_s']:.3f} s\n{st['prefill_steps']} steps with prefill "
            f"({st['prefill_tokens']} prefill tokens, {st['decode_rows_in_prefill_steps']} "
            f"decode rows), {st['decode_steps']} decode steps "
            f"({st['decode_rows_in_decode_steps']} rows); {r['num_kernels']} {what} "
            f"({r['kernels_attributed_by_launch']} to a step by their launch, "
            f"{r['unattributed_kernels']} to none{warn})")


def replay(trace: str, json_path: str, prefill_steps: int | None) -> int:
    """The split again from an exported trace of a whole run (--trace with no --trace-steps)
    and that run's --json: the wall, floors and step kinds from the JSON (``step_has_prefill``;
    for a JSON written before it, ``prefill_steps``: the run's first N steps had prefill)."""
    with open(json_path) as f:
        r = json.load(f)
    got = kernels_from_events(trace_events(trace))
    flags = r.get("step_has_prefill") or [i < (prefill_steps or 0)
                                          for i in range(got.num_windows)]
    steps = [SimpleNamespace(has_prefill=p) for p in flags]
    measured = breakdown(got.kernels, steps, r["wall_split_s"])
    print(f"replay of {trace}: {len(got.kernels)} kernels, {got.num_windows} steps "
          f"({sum(flags)} with prefill), {got.num_launch_attributed} tied to a step by their "
          f"launch, {got.num_acausal} launched after they started")
    print(json.dumps({"measured_s": measured, "top_kernels": _top(got.kernels, steps)},
                     indent=1)[:3000])
    print(table(measured, r["floors"], r["wall_split_s"], r["output_tokens"]))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--replay":  # --replay TRACE JSON [PREFILL_STEPS]
        return replay(argv[1], argv[2], int(argv[3]) if len(argv) > 3 else None)
    own, rest = _own_args(argv)
    args = build_parser().parse_args(["bench", "throughput", *rest])
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    config = _config_from_args(args)
    from pagebatch.engine import LLMEngine
    from pagebatch.engine_core import EngineCore

    engine = LLMEngine(config)
    core = engine.core
    if not isinstance(core, EngineCore):
        print("error: needs the engine core in this process", file=sys.stderr)
        return 2
    if config.quantization:
        print("warning: the GEMM floors assume 16-bit weights", file=sys.stderr)
    setup = core.setup
    shape = ModelShape.from_hf_config(setup.hf_config, setup.dtype.itemsize,
                                      core.runner.kv_cache_dtype.itemsize, setup.dtype.itemsize)
    prompts, out_lens = make_workload(args, int(setup.hf_config.vocab_size), config.seed)
    sp_of = sampling_params_of(config, out_lens, bench_sampling(args))
    hi = max(max(p, default=0) for p in prompts) + 1  # shifts as bench_pagebatch's (offline.py)
    t0 = time.perf_counter()
    run_workload(engine, "throughput", shift_ids(prompts, hi - 1, hi), sp_of)  # warm-up
    warmup = time.perf_counter() - t0
    wall, _, n_out = run_workload(engine, "throughput", prompts, sp_of)
    bounds, trace = _trace_bounds(own)
    t0 = time.perf_counter()
    with ProfiledSteps(core.executor, bounds, trace, own.trace) as rec:
        run_workload(engine, "throughput", shift_ids(prompts, 1, hi), sp_of)
    wall_profiled = time.perf_counter() - t0
    engine.shutdown()

    peak_f, peak_b = own.peak_tflops * 1e12, own.peak_tbs * 1e12
    # CPU ops' times are the profiled run's (degraded mode): so is the wall they split there
    split_wall = wall if rec.gpu else wall_profiled
    measured = breakdown(rec.kernels, rec.steps, split_wall)
    floors = run_floors(shape, rec.steps, peak_f, peak_b)
    result = {
        "args": rest, "config": config.to_dict(), "model_shape": vars(shape),
        "peak_flops": peak_f, "peak_bw": peak_b, "gpu_kernels": rec.gpu,
        "warmup_s": warmup, "wall_s": wall, "wall_profiled_s": wall_profiled,
        "wall_split_s": split_wall, "output_tokens": n_out, "output_tok_s": n_out / wall,
        "gpu_busy_s": sum(v for c, v in measured.items() if c != HOST),
        "measured_s": measured, "floors": floors, "steps": step_totals(rec.steps),
        "num_kernels": len(rec.kernels),
        "kernels_attributed_by_launch": rec.launch_attributed,
        "unattributed_kernels": sum(k.step is None for k in rec.kernels),
        "kernels_launched_after_start": rec.acausal,
        "top_kernels": _top(rec.kernels, rec.steps),
        "step_has_prefill": [s.has_prefill for s in rec.steps],
    }
    if own.json:
        with open(own.json, "w") as f:
            json.dump(result, f, indent=1)
    print("\n" + _summary(result))
    print(table(measured, floors, split_wall, n_out))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
