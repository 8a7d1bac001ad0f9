#!/usr/bin/env bash
# Session 12, call A: the GPU tests of every kernel file and the GPU-only engine tests (several
# never run on a GPU before: prefill kernel, sliding window, sampler, CUDA graphs, step copies,
# GPTQ act-order), the sampler's microbenchmark with --parts, the prefill kernel, and the cost
# of a JSON schema on decode (issue 24) on the Llama-3.1-8B shape with SmolLM2's tokenizer.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
bash scripts/gpu-run true
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
timeout 330 python3 -m pytest -q -n 8 -p no:cacheprovider -k "not interpreter" \
    tests/test_triton_prefill.py tests/test_triton_attention.py tests/test_triton_swa.py \
    tests/test_sliding_window.py tests/test_sampler_gpu.py tests/test_cuda_graphs_gpu.py \
    tests/test_step_copies.py tests/test_gptq_act_order.py tests/test_kernel_rules.py \
    tests/test_dense_gemv.py tests/test_w4a16_mma.py tests/test_wna16_gemv_edges.py \
    tests/test_argmax.py tests/test_kv_fp8.py tests/test_mlp_fusion.py \
    > "$OUT/tests.log" 2>&1; echo "tests rc=$?"
timeout 60 python3 scripts/bench_sampler.py --parts > "$OUT/sampler.md" 2>&1
timeout 100 python3 scripts/bench_kernels.py --only prefill --json "$OUT/prefill.json" \
    > "$OUT/prefill.log" 2>&1; echo "prefill rc=$?"
timeout 150 python3 scripts/bench_structured.py .gpu/llama8b-tok --load-format dummy \
    --batch-sizes 1,64 --json "$OUT/structured.json" > "$OUT/structured.log" 2>&1
echo "structured rc=$?"
grep -E "passed|failed" "$OUT/tests.log" | tail -3
grep -E "^FAILED|^ERROR" "$OUT/tests.log" | cut -c1-200 | head -12
cat "$OUT/sampler.md" | tail -12
grep -iE "prefill|mixed|chunk|SDPA|TFLOP" "$OUT/prefill.log" | cut -c1-150 | tail -12
tail -4 "$OUT/structured.log"
