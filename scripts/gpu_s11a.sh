#!/usr/bin/env bash
# Session 11, call A (issue 22): GPU tests of the sampler and the prefill kernel, the sampler's
# microbenchmark, the prefill kernel sweep, T1 greedy / sampled, and T1's roofline account.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
bash scripts/gpu-run true
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
timeout 200 python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_sampler_gpu.py \
    tests/test_triton_prefill.py tests/test_triton_attention.py tests/test_step_copies.py \
    tests/test_cuda_graphs_gpu.py > "$OUT/tests.log" 2>&1; echo "tests rc=$?"
timeout 60 python3 scripts/bench_sampler.py > "$OUT/sampler.md" 2>&1
timeout 200 python3 scripts/bench_kernels.py --only prefill --sweep --json "$OUT/prefill.json" \
    > "$OUT/prefill.log" 2>&1; echo "prefill rc=$?"
C8="examples/configs/llama-3.1-8b --load-format dummy --max-model-len 4096"
T1="$C8 --max-num-batched-tokens 16384 --num-prompts 256 --input-len 512 --output-len 128"
S="--temperature 0.8 --top-p 0.95 --top-k 50"
for r in greedy sampled; do
    timeout 150 python3 -m pagebatch.cli bench throughput $T1 $([ $r = sampled ] && echo $S) \
        --output "$OUT/t1-$r.json" 2>&1 | grep -v "no tokenizer" | tail -1 | sed "s/^/t1 $r: /"
done
timeout 150 python3 scripts/roofline.py $T1 --json "$OUT/roofline-t1.json" \
    --trace "$OUT/roofline-t1-trace.json.gz" > "$OUT/roofline-t1.log" 2>&1; echo "roofline rc=$?"
grep -E "passed|failed" "$OUT/tests.log" | tail -3
grep -E "FAILED|Error" "$OUT/tests.log" | head -8
cat "$OUT/sampler.md"
grep -iE "prefill|mixed|chunk|SDPA" "$OUT/prefill.log" | cut -c1-150 | tail -30
tail -22 "$OUT/roofline-t1.log"
