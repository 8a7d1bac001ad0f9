#!/usr/bin/env bash
# Session 40 (one GPU), in sections (PARTS, default "tests shapes"):
#   tests   the GPU suites with piecewise CUDA graphs on by default (a cold Triton cache takes
#           > 130 s: TESTS_S 300), with the fused Qwen3 q/k norm
#   shapes  batch-1 decode on the Qwen3-4B shape, bf16 / awq / gptq (gpu_shapes.sh)
#   mem     the gpu_memory_utilization claim (0.5 vs 0.9)
#   stalls  `pagebatch serve` at 32 req/s under PAGEBATCH_SLOW_STEP_MS=40, whose slow turns now
#           name the collector's time and the CUDA caching allocator's events in them
#           (session 39: two launches of ~50 ms, cause unknown)
#   mixed   scripts/mixed_step.py on the 8B shape, 48 decodes + one 700 / 1400-token prompt a
#           step (past the 512-token piecewise graphs: eager), with --sync-debug: the synchronizing
#           calls torch's sync debug mode flags in those steps, by file and line
#   PARTS="tests shapes" bash scripts/gpu-run bash scripts/gpu_s40a.sh   # carry .whl .gpu
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; export OUT
nvidia-smi --query-gpu=name --format=csv,noheader
PARTS=" ${PARTS:-tests shapes} "
if [[ $PARTS == *" tests "* ]]; then
    echo "== tests (t=$SECONDS s)"
    timeout ${TESTS_S:-300} python3 -m pytest -v -n 8 -rfE -p no:cacheprovider \
        tests/test_piecewise_graphs_gpu.py tests/test_cuda_graphs_gpu.py tests/test_step_copies.py \
        tests/test_sampler_gpu.py tests/test_triton_attention.py tests/test_kv_fp8.py \
        tests/test_pp_graph_replay.py tests/test_sliding_window.py tests/test_kv_hybrid.py \
        tests/test_stall_log.py tests/test_step_warmup.py tests/test_architectures.py \
        > "$OUT/tests.log" 2>&1
    echo "   rc=$?  PASSED lines: $(grep -c ' PASSED' "$OUT/tests.log")"
    grep -E " passed| failed| FAILED |^FAILED|^ERROR|^E  " "$OUT/tests.log" | tail -14 | cut -c1-300
fi
if [[ $PARTS == *" shapes "* ]]; then
    echo "== Qwen3-4B batch 1 (t=$SECONDS s)"
    SHAPES=qwen3-4b RUN_S=110 TOTAL_S=240 bash scripts/gpu_shapes.sh 2>&1 | tail -8
fi
if [[ $PARTS == *" mem "* ]]; then
    echo "== gpu_memory_utilization 0.5 / 0.9, T1 (t=$SECONDS s)"
    bash scripts/gpu_claims.sh mem
fi
if [[ $PARTS == *" mixed "* ]]; then
    echo "== eager mixed steps, host-device syncs (t=$SECONDS s)"
    timeout ${MIXED_S:-150} python3 scripts/mixed_step.py examples/configs/llama-3.1-8b \
        --decodes 48 --prefill-lens 700,1400 --steps 10 --sync-debug \
        --json "$OUT/mixed-sync.json" > "$OUT/mixed-sync.log" 2>&1
    echo "   rc=$?"; grep -E "^\||syncs/step" "$OUT/mixed-sync.log" | cut -c1-400
fi
[[ $PARTS == *" stalls "* ]] || { echo "== done (t=$SECONDS s)"; exit 0; }
echo "== serve at 32 req/s with the stall log (t=$SECONDS s)"
SKIP_TESTS=1 PWS=512 RATES=${RATES:-32} bash scripts/gpu_s39a.sh | grep -v "^== done"
python3 - "$OUT/serve-stalls-pw512.json" <<'PY'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except Exception as e:
    sys.exit(f"no serve JSON: {e}")
for r in d["runs"]:
    print(f"rate {r['request_rate']}: {r['request_throughput']:.2f} req/s, "
          f"{r['output_token_throughput']:.1f} out tok/s, TTFT p99 {r['ttft']['p99_ms']:.1f} ms, "
          f"ITL p99 {r['itl']['p99_ms']:.1f} ms, goodput {r['request_goodput']:.2f} req/s "
          f"({r['good_requests']} of {r['completed']} good)")
PY
echo "== done (t=$SECONDS s)"
