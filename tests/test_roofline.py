"""scripts/roofline.py's pure parts: kernel classes, step attribution, the time split
(core/bench/kernel_split.py) and the floors (core/bench/roofline.py), on synthetic data."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from pagebatch.bench.kernel_split import (STEP_MARK, Kernel, attribute, breakdown,
                                          exclusive_us, fill_forward, kernel_kind,
                                          kernels_from_events, outermost)
from pagebatch.bench.roofline import (ATTN_DECODE, ATTN_PREFILL, CATEGORIES, GEMM_DECODE,
                                      GEMM_PREFILL, HOST, OTHER, ModelShape, StepShape,
                                      run_floors, step_floors, step_totals, table)

ROOT = Path(__file__).resolve().parent.parent
# hidden 4, intermediate 8, 2 layers, 2 heads (1 KV head) of 2, vocabulary 10, all 2 bytes
TINY = ModelShape(hidden=4, intermediate=8, layers=2, heads=2, kv_heads=1, head_dim=2, vocab=10)
MIXED = StepShape(rows=((3, 0), (1, 5)), num_sampled=2)  # a 3-token prompt chunk + a decode
DECODE = StepShape(rows=((1, 7),), num_sampled=1)


@pytest.mark.parametrize("name,op,kind", [
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN", None, "gemm"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", None, "gemm"),
    ("void cublasLt::splitKreduce_kernel<32, 16, int>", None, "gemm"),
    ("_gemv_kernel", None, "gemm"),
    ("_wna16_gemv_kernel", None, "gemm"),
    ("_w4a16_mma_kernel", None, "gemm"),
    ("_per_token_quant_kernel", None, "gemm"),
    ("some_vendor_kernel", "aten::mm", "gemm"),
    ("paged_attention_kernel", None, "attention"),
    ("write_kv_kernel", None, "attention"),
    ("reduce_splits_kernel", None, "attention"),
    ("_rms_norm_kernel", None, "other"),
    ("_silu_and_mul_kernel", None, "other"),
    ("_argmax_kernel", None, "other"),
    ("Memcpy HtoD (Pinned -> Device)", None, "other"),
])
def test_kernel_kind(name, op, kind):
    assert kernel_kind(name, op) == kind


def test_exclusive_time_counts_overlap_once():
    ks = [Kernel("a", 0, 10), Kernel("b", 5, 10), Kernel("c", 2, 3), Kernel("d", 30, 5)]
    assert exclusive_us(ks) == [10, 5, 0, 5]  # b: 10..15 only; c: inside a


def test_breakdown_by_step_phase_and_host_gap():
    steps = [MIXED, DECODE]
    ks = [Kernel("nvjet_gemm", 0, 100, 0), Kernel("paged_attention_kernel", 100, 50, 0),
          Kernel("_rms_norm_kernel", 150, 10, 0), Kernel("_gemv_kernel", 200, 40, 1),
          Kernel("paged_attention_kernel", 240, 20, 1), Kernel("nvjet_gemm", 260, 5, None)]
    got = breakdown(ks, steps, wall_s=400e-6)
    assert got == pytest.approx({GEMM_PREFILL: 100e-6, ATTN_PREFILL: 50e-6, OTHER: 10e-6,
                                 GEMM_DECODE: 45e-6, ATTN_DECODE: 20e-6, HOST: 175e-6})
    assert breakdown(ks, steps, wall_s=100e-6)[HOST] == 0.0  # never below 0


def test_attribute_and_fill_forward():
    windows = [(0.0, 10.0), (20.0, 30.0)]
    assert attribute([5, 15, 25, None, 35, 0, 30], windows) == [0, None, 1, None, None, 0, 1]
    ks = fill_forward([Kernel("x", 3, 1, None), Kernel("y", 1, 1, 0), Kernel("z", 5, 1, 1),
                       Kernel("w", 7, 1, None)])
    assert [(k.name, k.step) for k in ks] == [("y", 0), ("x", 0), ("z", 1), ("w", 1)]


def test_outermost_drops_nested_ops():
    ops = [("aten::linear", 0, 10), ("aten::mm", 1, 8), ("aten::add", 12, 2)]
    assert outermost(ops) == [("aten::linear", 0, 10), ("aten::add", 12, 2)]


class _Ev:
    """A stand-in for torch's _KinetoEvent (times in ns)."""

    def __init__(self, name, act, start_us, dur_us, corr=0, linked=0):
        self._v = (name, act, start_us * 1000, dur_us * 1000, corr, linked)

    def name(self): return self._v[0]
    def activity_type(self): return self._v[1]
    def start_ns(self): return self._v[2]
    def duration_ns(self): return self._v[3]
    def correlation_id(self): return self._v[4]
    def linked_correlation_id(self): return self._v[5]


def test_kernels_from_gpu_events():
    evs = [
        _Ev(STEP_MARK, "user_annotation", 0, 10, corr=1),
        _Ev("aten::mm", "cpu_op", 1, 2, corr=2),
        _Ev("cudaLaunchKernel", "cuda_runtime", 2, 1, corr=900, linked=2),
        _Ev(STEP_MARK, "user_annotation", 20, 10, corr=3),
        _Ev("cudaGraphLaunch", "cuda_runtime", 21, 1, corr=901),
        # the GEMM launched in step 0 runs on the GPU during step 1's launches
        _Ev("vendor_kernel", "kernel", 22, 5, corr=900, linked=2),
        _Ev("paged_attention_kernel", "kernel", 28, 5, corr=901),  # a graph's: step 1
        _Ev("_rms_norm_kernel", "kernel", 34, 1, corr=777, linked=3),  # by its linked op
        _Ev("_argmax_kernel", "kernel", 36, 1, corr=778),  # nothing known: the one before
        _Ev(STEP_MARK, "gpu_user_annotation", 22, 20),  # not a kernel
    ]
    got = kernels_from_events(evs)
    ks = got.kernels
    assert got.gpu and got.num_windows == 2 and got.num_launch_attributed == 3
    assert got.num_acausal == 0
    assert [(k.name, k.step, k.op) for k in ks] == [
        ("vendor_kernel", 0, "aten::mm"), ("paged_attention_kernel", 1, None),
        ("_rms_norm_kernel", 1, STEP_MARK), ("_argmax_kernel", 1, None)]
    assert kernel_kind(ks[0].name, ks[0].op) == "gemm"


def test_kernels_from_cpu_events_degraded():
    evs = [_Ev(STEP_MARK, "user_annotation", 0, 100, corr=1),
           _Ev("aten::linear", "cpu_op", 1, 10, corr=2), _Ev("aten::mm", "cpu_op", 2, 8, corr=3),
           _Ev("aten::add", "cpu_op", 20, 5, corr=4), _Ev("aten::zeros", "cpu_op", 200, 5)]
    got = kernels_from_events(evs)
    ks = got.kernels
    assert not got.gpu and got.num_windows == 1
    assert [(k.name, k.step) for k in ks] == [("aten::linear", 0), ("aten::add", 0)]
    assert kernel_kind(ks[0].name, ks[0].op) == "gemm"


def test_llama_8b_parameter_count():
    c = SimpleNamespace(**json.loads(
        (ROOT / "examples/configs/llama-3.1-8b/config.json").read_text()))
    m = ModelShape.from_hf_config(c)
    assert m.linear_params == 6_979_321_856
    norms = (2 * 32 + 1) * 4096
    assert m.linear_params + 2 * m.lm_head_params + norms == 8_030_261_248  # Llama-3.1-8B


def test_step_shape_from_scheduler_output():
    so = SimpleNamespace(scheduled=[SimpleNamespace(token_ids=[5, 6, 7], start_pos=0, sample=True),
                                    SimpleNamespace(token_ids=[-1], start_pos=9, sample=True),
                                    SimpleNamespace(token_ids=[1, 2], start_pos=4, sample=False)])
    s = StepShape.from_scheduler_output(so)
    assert s == StepShape(((3, 0), (1, 9), (2, 4)), 2)
    assert s.has_prefill and s.num_tokens == 6 and s.num_prefill_tokens == 5
    assert not DECODE.has_prefill


def test_floors_by_hand():
    # linear params per token: 2 layers x (2*4*4 q,o + 2*4*2 k,v + 3*4*8 mlp) = 288; head 40
    assert (TINY.linear_params, TINY.lm_head_params) == (288, 40)
    f = step_floors(TINY, MIXED, peak_flops=1000.0, peak_bw=100.0)
    # GEMMs: 2 * (288 * 4 tokens + 40 * 2 sampled) = 2464 FLOPs (2.464 s) < (288 + 40) * 2
    # bytes = 656 (6.56 s)
    assert (f[GEMM_PREFILL].seconds, f[GEMM_PREFILL].bound) == (pytest.approx(6.56), "bytes")
    # attention: 4 * 2 heads * 2 * 2 layers * (3 * (0 + 2) + 1 * (5 + 1)) = 384 FLOPs;
    # bytes: K+V 16 per token, Q+O 32 per token: (0 + 6) * 16 + 3 * 32 + (5 + 2) * 16 + 32
    assert f[ATTN_PREFILL].seconds == pytest.approx(3.36)
    # other: ((8*4 + 3*8 + 2*3*2) * 2 layers + 4*4) * 2 bytes * 4 tokens + 4 * 10 * 2 sampled
    assert f[OTHER].seconds == pytest.approx(12.96)
    d = step_floors(TINY, DECODE, peak_flops=1000.0, peak_bw=100.0)
    assert set(d) == {GEMM_DECODE, ATTN_DECODE, OTHER}
    assert d[GEMM_DECODE].seconds == pytest.approx(6.56)
    # attention of one decode row at ctx 7: 32 * 8 = 256 FLOPs; bytes 16 * 9 + 32 = 176
    assert (d[ATTN_DECODE].seconds, d[ATTN_DECODE].bound) == (pytest.approx(1.76), "bytes")
    fast_bytes = step_floors(TINY, MIXED, peak_flops=1000.0, peak_bw=1e6)
    assert (fast_bytes[GEMM_PREFILL].seconds, fast_bytes[GEMM_PREFILL].bound) == (
        pytest.approx(2.464), "FLOPs")


def test_run_floors_totals_and_table():
    steps = [MIXED, DECODE, DECODE]
    floors = run_floors(TINY, steps, peak_flops=1000.0, peak_bw=100.0)
    assert floors[GEMM_DECODE] == {"seconds": pytest.approx(13.12), "FLOPs": 0, "bytes": 2}
    assert floors[HOST]["seconds"] == 0.0
    assert step_totals(steps) == dict(prefill_steps=1, decode_steps=2, prefill_tokens=3,
                                      decode_rows_in_prefill_steps=1,
                                      decode_rows_in_decode_steps=2, sampled_rows=4)
    measured = dict.fromkeys(CATEGORIES, 1.0)
    text = table(measured, floors, wall_s=6.0, output_tokens=4)
    lines = text.splitlines()
    assert [ln.split("  ")[0].strip() for ln in lines[1:7]] == list(CATEGORIES)
    assert lines[-2].startswith("total") and lines[-1].startswith("output tok/s: achieved 1,")


def test_a_launch_after_its_kernel_is_counted():
    evs = [_Ev(STEP_MARK, "user_annotation", 0, 1000, corr=1),
           _Ev("cudaLaunchKernel", "cuda_runtime", 500, 1, corr=900),
           _Ev("nvjet_gemm", "kernel", 100, 5, corr=900)]
    assert kernels_from_events(evs).num_acausal == 1


def test_the_script_runs_on_the_cpu(tiny_model_dir, tmp_path, capsys):
    """scripts/roofline.py end to end in its degraded mode (CPU ops for kernels): the steps as
    scheduled, the JSON, the trace of the asked steps, and the table printed last."""
    import gzip
    import runpy

    out, trace = tmp_path / "r.json", tmp_path / "t.json.gz"
    mod = runpy.run_path(str(ROOT / "scripts/roofline.py"))
    rc = mod["main"]([str(tiny_model_dir), "--device", "cpu", "--num-kv-blocks", "64",
                      "--max-num-batched-tokens", "16", "--num-prompts", "3",
                      "--input-len", "12", "--output-len", "3", "--json", str(out),
                      "--trace", str(trace), "--trace-steps", "1:3", "--session-steps", "2"])
    assert rc == 0
    r = json.loads(out.read_text())
    # 16 tokens a step: prompts 12 + 4 of 12; a decode + 8 + 7; 2 decodes + 5; then decode
    # steps of 2 rows and of 1 (each request samples at its prompt's end and twice more)
    assert r["steps"] == dict(prefill_steps=3, decode_steps=2, prefill_tokens=36,
                              decode_rows_in_prefill_steps=3, decode_rows_in_decode_steps=3,
                              sampled_rows=9)
    assert r["output_tokens"] == 9 and not r["gpu_kernels"] and r["num_kernels"] > 0
    assert r["unattributed_kernels"] == 0
    assert set(r["measured_s"]) == set(CATEGORIES)
    events = json.load(gzip.open(trace, "rt"))["traceEvents"]
    assert sum(e.get("name") == STEP_MARK for e in events) == 2
    assert capsys.readouterr().out.rstrip().splitlines()[-1].startswith("output tok/s")


def test_activity_without_activity_type():
    """torch 2.11's raw events have no activity_type(): the kind comes from device and name."""
    from pagebatch.bench.kernel_split import STEP_MARK, activity

    class Event:
        def __init__(self, name, device):
            self._n, self._d = name, device

        def name(self):
            return self._n

        def device_type(self):
            return self._d

        def is_python_function(self):
            return False

    kinds = [activity(Event(n, d)) for n, d in [
        ("void gemm", "DeviceType.CUDA"), ("cudaLaunchKernel", "DeviceType.CPU"),
        (STEP_MARK, "DeviceType.CPU"), ("aten::mm", "DeviceType.CPU"),
        (STEP_MARK, "DeviceType.CUDA")]]  # the GPU's mirror of the step mark: no kernel
    assert kinds == ["kernel", "cuda_runtime", "user_annotation", "cpu_op",
                     "gpu_user_annotation"]


def test_a_chrome_trace_replays_into_the_split(tmp_path):
    """An exported trace (two steps: a prefill GEMM, then a decode attention kernel, and the
    GPU's mirror of the step marks, which is no kernel) splits as the live run does."""
    import gzip

    from pagebatch.bench.kernel_split import kernels_from_events, trace_events

    ev = [{"ph": "X", "cat": "user_annotation", "name": STEP_MARK, "ts": 0, "dur": 10,
           "args": {"External id": 1}},
          {"ph": "X", "cat": "user_annotation", "name": STEP_MARK, "ts": 20, "dur": 10,
           "args": {"External id": 2}},
          {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 1, "dur": 1,
           "args": {"correlation": 7}},
          {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 21, "dur": 1,
           "args": {"correlation": 8}},
          {"ph": "X", "cat": "kernel", "name": "nvjet_sm90_gemm", "ts": 5, "dur": 30,
           "args": {"correlation": 7}},
          {"ph": "X", "cat": "kernel", "name": "paged_attention_kernel", "ts": 40, "dur": 5,
           "args": {"correlation": 8}},
          {"ph": "X", "cat": "gpu_user_annotation", "name": STEP_MARK, "ts": 5, "dur": 40,
           "args": {}}]
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": ev}, f)
    got = kernels_from_events(trace_events(str(path)))
    assert got.num_windows == 2 and got.num_launch_attributed == 2
    steps = [SimpleNamespace(has_prefill=True), SimpleNamespace(has_prefill=False)]
    m = breakdown(got.kernels, steps, wall_s=60e-6)
    assert m[GEMM_PREFILL] == pytest.approx(30e-6) and m[ATTN_DECODE] == pytest.approx(5e-6)
    assert m[OTHER] == 0.0 and m[HOST] == pytest.approx(25e-6)
