"""Where a profiled run's GPU time went (scripts/roofline.py): every kernel into one of the
roofline categories of roofline.py, and the host/idle rest of the wall time.

A kernel belongs to the engine step whose ``execute_model`` call launched it: its launch (the
CUDA runtime or driver call with the kernel's CUPTI correlation id; else the CPU op the
profiler linked it to) falls in that step's host window. A kernel with neither takes the step
of the kernel before it on the GPU timeline (the steps run in launch order). A GEMM or
attention kernel is a prefill one when its step has prefill (`StepShape.has_prefill`), a decode
one otherwise; the decode rows of a mixed step ride along in its prefill GEMMs. This tells
phases apart without the GEMMs' shapes, which CUDA-graph replays do not record.

Times are microseconds (the profiler's) unless a name says seconds.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, replace
from typing import Any, Iterable, Sequence

from .roofline import (ATTN_DECODE, ATTN_PREFILL, CATEGORIES, GEMM_DECODE, GEMM_PREFILL, HOST,
                       OTHER, StepShape)

# kernel-name fragments (lower case). GEMM: cuBLAS / cuBLASLt (nvjet, sm90_xmma, gemv2T, the
# split-K reduce), CUTLASS, Triton matmuls; ours: core/kernels/gemv.py, quant/kernels/*
# (the W8A8 activation quantizer and the WNA16 dequantizer feed a GEMM: counted with it).
GEMM_NAMES = ("gemm", "gemv", "nvjet", "xmma", "cutlass", "cublas", "splitkreduce", "matmul",
              "_mma_kernel", "wna16_dequant", "per_token_quant")
# attention: plugins/attention/triton_kernels.py (write-KV, paged attention, the split-KV
# reduction); FlashAttention / SDPA names for other backends
ATTENTION_NAMES = ("paged_attention", "write_kv", "reduce_splits", "flash", "fmha", "attention")
# the aten ops whose kernels are GEMMs whatever their names
GEMM_OPS = frozenset({"aten::mm", "aten::addmm", "aten::linear", "aten::matmul", "aten::bmm",
                      "aten::_scaled_mm", "aten::baddbmm"})
GPU_ACTIVITIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
LAUNCH_ACTIVITIES = frozenset({"cuda_runtime", "cuda_driver"})
STEP_MARK = "roofline.step"  # the record_function name around each step's launches


@dataclass(frozen=True)
class Kernel:
    """One GPU kernel (or copy, or in the CPU's degraded mode one top-level CPU op).
    ``step``: index of the step that launched it (None: unknown); ``op``: the aten op that
    launched it, when known."""

    name: str
    start_us: float
    dur_us: float
    step: int | None = None
    op: str | None = None


def kernel_kind(name: str, op: str | None = None) -> str:
    """``"attention"``, ``"gemm"`` or ``"other"`` by name, then by launching op."""
    n = name.lower()
    if any(k in n for k in ATTENTION_NAMES):
        return "attention"
    if any(k in n for k in GEMM_NAMES) or op in GEMM_OPS:
        return "gemm"
    return "other"


def category(k: Kernel, steps: Sequence[StepShape]) -> str:
    """The kernel's category (roofline.CATEGORIES); a GEMM or attention kernel of an unknown
    step counts as decode."""
    kind = kernel_kind(k.name, k.op)
    if kind == "other":
        return OTHER
    prefill = k.step is not None and k.step < len(steps) and steps[k.step].has_prefill
    if kind == "gemm":
        return GEMM_PREFILL if prefill else GEMM_DECODE
    return ATTN_PREFILL if prefill else ATTN_DECODE


def exclusive_us(kernels: Sequence[Kernel]) -> list[float]:
    """Each kernel's time not already covered by a kernel that started before it (ties: the
    earlier in the list), in input order: the values add up to the union of the intervals, so
    overlapping streams are counted once."""
    order = sorted(range(len(kernels)), key=lambda i: kernels[i].start_us)
    out = [0.0] * len(kernels)
    frontier = float("-inf")
    for i in order:
        k = kernels[i]
        end = k.start_us + k.dur_us
        out[i] = max(0.0, end - max(k.start_us, frontier))
        frontier = max(frontier, end)
    return out


def breakdown(kernels: Sequence[Kernel], steps: Sequence[StepShape],
              wall_s: float) -> dict[str, float]:
    """Category -> seconds: each kernel's exclusive time (`exclusive_us`) into its category;
    host/idle = ``wall_s`` less the GPU's busy time (the union), at least 0."""
    out = dict.fromkeys(CATEGORIES, 0.0)
    for k, t in zip(kernels, exclusive_us(kernels)):
        out[category(k, steps)] += t / 1e6
    out[HOST] = max(0.0, wall_s - sum(out.values()))
    return out


def attribute(launch_us: Sequence[float | None],
              windows: Sequence[tuple[float, float]]) -> list[int | None]:
    """The index of the window (start, end), sorted and disjoint, that holds each launch
    time; None for a time outside all of them or None."""
    starts = [w[0] for w in windows]
    out: list[int | None] = []
    for t in launch_us:
        i = bisect.bisect_right(starts, t) - 1 if t is not None else -1
        out.append(i if i >= 0 and t <= windows[i][1] else None)
    return out


def fill_forward(kernels: Sequence[Kernel]) -> list[Kernel]:
    """The kernels in GPU start order, one with no step given the step of the one before it."""
    out, last = [], None
    for k in sorted(kernels, key=lambda k: k.start_us):
        if k.step is None and last is not None:
            k = replace(k, step=last)
        last = k.step
        out.append(k)
    return out


def outermost(ops: Iterable[tuple[str, float, float]]) -> list[tuple[str, float, float]]:
    """(name, start, dur) of the ops not inside an earlier one (one thread's nesting)."""
    out, end = [], float("-inf")
    for op in sorted(ops, key=lambda o: (o[1], -o[2])):
        if op[1] >= end:
            out.append(op)
            end = op[1] + op[2]
    return out


@dataclass
class Session:
    """One profiler session's kernels (steps numbered from the session's first), its number
    of step windows, whether the kernels are GPU ones, and how many had their step from their
    own launch (the others: `fill_forward`'s); ``num_acausal``: kernels whose launch time is
    more than ``ACAUSAL_US`` after their start on the GPU (a sign that the launches were
    matched wrongly, or of clock skew: should be 0)."""

    kernels: list[Kernel]
    num_windows: int
    gpu: bool
    num_launch_attributed: int
    num_acausal: int = 0


ACAUSAL_US = 20.0


def activity(e: Any) -> str | None:
    """A raw profiler event's kind: ``activity_type()`` where torch has it (2.13); torch 2.11's
    events have none, so there it is told from the device (CUDA: a kernel, copy or set) and
    the name (``cuda*`` / ``cu*`` runtime and driver calls; the step mark); None for Python
    function events."""
    try:
        return e.activity_type()
    except AttributeError:
        pass
    if getattr(e, "is_python_function", lambda: False)():
        return None
    name = e.name()
    if str(e.device_type()).endswith("CUDA"):  # the GPU's mirror of a step mark is no kernel
        return "gpu_user_annotation" if name == STEP_MARK else "kernel"
    if name.startswith("cu"):
        return "cuda_runtime"
    return "user_annotation" if name == STEP_MARK else "cpu_op"


class TraceEvent:
    """One event of an exported Chrome trace (``prof.export_chrome_trace``) with the raw
    events' interface that `kernels_from_events` reads: times in us, ``cat`` the activity."""

    def __init__(self, e: dict):
        self._e, self._a = e, e.get("args", {})

    def name(self) -> str:
        return self._e.get("name", "")

    def activity_type(self) -> str:
        return self._e.get("cat", "")

    def start_ns(self) -> float:
        return float(self._e.get("ts", 0.0)) * 1e3

    def duration_ns(self) -> float:
        return float(self._e.get("dur", 0.0)) * 1e3

    def correlation_id(self) -> int:
        if self._e.get("cat") in ("cpu_op", "user_annotation"):
            return self._a.get("External id", 0)
        return self._a.get("correlation", 0)

    def linked_correlation_id(self) -> int:
        return self._a.get("External id", 0)


def trace_events(path: str) -> list[TraceEvent]:
    """The complete ("X") events of a Chrome trace file (.json or .json.gz)."""
    import gzip
    import json

    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return [TraceEvent(e) for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]


def kernels_from_events(events: Iterable[Any]) -> Session:
    """The `Session` of a profiler session's raw events
    (``prof.profiler.kineto_results.events()``: objects with ``name()``, ``activity_type()``,
    ``start_ns()``, ``duration_ns()``, ``correlation_id()``, ``linked_correlation_id()``).
    Without GPU kernels (the CPU) the kernels are the top-level CPU ops inside the step
    windows (the degraded mode: only names tell GEMMs apart there)."""
    windows, gpu, ops, launches, op_names = [], [], [], {}, {}
    for e in events:
        act = activity(e)
        if act is None:
            continue
        start, dur = e.start_ns() / 1e3, e.duration_ns() / 1e3
        if act in GPU_ACTIVITIES:
            gpu.append((e.name(), start, dur, e.correlation_id(), e.linked_correlation_id()))
        elif act in LAUNCH_ACTIVITIES:  # CUPTI correlation id -> launch time
            launches[e.correlation_id()] = start
        elif act in ("cpu_op", "user_annotation"):  # op id (External id) -> name, start
            op_names[e.correlation_id()] = (e.name(), start)
            if act == "cpu_op":
                ops.append((e.name(), start, dur))
            elif e.name() == STEP_MARK:
                windows.append((start, start + dur))
    windows.sort()
    if gpu:
        return _gpu_session(gpu, launches, op_names, windows)
    return _cpu_session(ops, windows)


def _gpu_session(gpu: list[tuple], launches: dict, op_names: dict,
                 windows: list[tuple[float, float]]) -> Session:
    """gpu: (name, start, dur, correlation id, linked op id) per kernel."""
    linked = [op_names.get(g[4]) for g in gpu]
    times = [launches.get(g[3], op[1] if op else None) for g, op in zip(gpu, linked)]
    steps = attribute(times, windows)
    kernels = [Kernel(g[0], g[1], g[2], st, op[0] if op else None)
               for g, st, op in zip(gpu, steps, linked)]
    acausal = sum(t is not None and t > g[1] + ACAUSAL_US for t, g in zip(times, gpu))
    return Session(fill_forward(kernels), len(windows), True,
                   sum(st is not None for st in steps), acausal)


def _cpu_session(ops: list[tuple[str, float, float]],
                 windows: list[tuple[float, float]]) -> Session:
    inside = [o for o, st in zip(ops, attribute([o[1] for o in ops], windows)) if st is not None]
    top = outermost(inside)
    steps = attribute([o[1] for o in top], windows)
    return Session([Kernel(n, s, d, st, n) for (n, s, d), st in zip(top, steps)], len(windows),
                   False, len(top))
