#!/usr/bin/env bash
# Session 13, call A, on the tree that holds session 12's GPU-facing changes (start-up warm-up,
# power-of-two split-KV counts, no alignment specialization on step-buffer views, the
# launch_forward / finish_step split, deferred sampling of constrained steps): the GPU tests
# of the files those changes touch, T1 greedy and sampled in one call (issue 22 item 4), the
# cost of a JSON schema (issue 24), and the start-up time (warm-up included) at 4k and 128k.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
bash scripts/gpu-run true
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
timeout 190 python3 -m pytest -q -n 8 -p no:cacheprovider -k "not interpreter" \
    tests/test_triton_prefill.py tests/test_triton_attention.py tests/test_triton_swa.py \
    tests/test_sliding_window.py tests/test_sampler_gpu.py tests/test_cuda_graphs_gpu.py \
    tests/test_step_copies.py tests/test_step_warmup.py tests/test_structured_output.py \
    tests/test_kernel_specialization.py > "$OUT/tests.log" 2>&1; echo "tests rc=$?"
B="python3 -m pagebatch.cli bench"
C8="examples/configs/llama-3.1-8b --load-format dummy --max-model-len 4096"
T1="$C8 --max-num-batched-tokens 16384 --num-prompts 256 --input-len 512 --output-len 128"
timeout 75 $B throughput $T1 --output "$OUT/t1-greedy.json" > "$OUT/t1-greedy.log" 2>&1
echo "t1 greedy rc=$?"
timeout 75 $B throughput $T1 --temperature 0.8 --top-p 0.95 --top-k 50 \
    --output "$OUT/t1-sampled.json" > "$OUT/t1-sampled.log" 2>&1; echo "t1 sampled rc=$?"
timeout 60 $B latency examples/configs/llama-3.1-8b --load-format dummy --max-model-len 131072 \
    --input-len 128 --output-len 32 --num-iters 1 --output "$OUT/lat-128k.json" \
    > "$OUT/lat-128k.log" 2>&1; echo "lat 128k rc=$?"
timeout 140 python3 scripts/bench_structured.py .gpu/llama8b-tok --load-format dummy \
    --batch-sizes 1,64 --json "$OUT/structured.json" > "$OUT/structured.log" 2>&1
echo "structured rc=$?"
grep -E "passed|failed" "$OUT/tests.log" | tail -2
grep -E "^FAILED|^ERROR" "$OUT/tests.log" | cut -c1-200 | head -10
python3 - "$OUT" <<'PY'
import json, sys, os
o = sys.argv[1]
for n in ("t1-greedy", "t1-sampled", "lat-128k"):
    p = f"{o}/{n}.json"
    if not os.path.exists(p):
        print(n, "no json"); continue
    r = json.load(open(p))["results"][0]
    keys = ("startup_s", "warmup_s", "output_tok_s", "decode_tok_s", "ttft_s", "kv_cache_tokens")
    print(n, {k: (round(r[k], 2) if isinstance(r.get(k), float) else r.get(k)) for k in keys if k in r})
PY
tail -n 3 "$OUT/t1-greedy.log" "$OUT/lat-128k.log" | cut -c1-200
tail -n 4 "$OUT/structured.log"
