#!/usr/bin/env bash
# Issue 7's engine benchmarks on the GPU machine (through the device tool):
#   bash scripts/gpu_engine_bench.sh MODE
# MODE: quick|8b|rest|targets|tests|quant|dense|quant-lat|quant-tput|pdl
# quick: the CUDA-graph GPU tests and the 1B-shape runs; 8b: T1 (with --compare hf), T2 and T5
# (cold and warm Triton cache); rest: T1, T4 (nano-vllm workload), T6 (GPU busy time), T3 with
# --compare hf; targets: T1-T6 in one go (8b, then rest without its T1). Writes JSON to $OUT
# (or /tmp/out) and prints a table last.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
MODE=${1:-quick}
bash scripts/gpu-run true || exit 1
[ -d .whl ] && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
B="python3 -m pagebatch.cli bench"
C8="examples/configs/llama-3.1-8b --load-format dummy --max-model-len 4096"
C1="examples/configs/llama-3.2-1b --load-format dummy --max-model-len 4096"
run() {  # name, timeout, command...
    local name=$1 t=$2; shift 2
    echo "=== $name: $*"
    timeout "$t" "$@" 2>&1 | grep -v "^INFO pagebatch.model_loader\|no tokenizer" | tail -14
}
t1() {  # T1 with transformers side by side
    run tput-8b 300 $B throughput $C8 --max-num-batched-tokens 16384 \
        --num-prompts 256 --input-len 512 --output-len 128 --compare hf --hf-batch-size 64 \
        --output "$OUT/tput-8b.json"
}
t2_t5() {  # T2 and T5, cold then warm Triton cache
    rm -rf /tmp/tc8
    TRITON_CACHE_DIR=/tmp/tc8 run lat-8b-cold 200 $B latency $C8 --input-len 128 \
        --output-len 256 --output "$OUT/lat-8b-cold.json"
    TRITON_CACHE_DIR=/tmp/tc8 run lat-8b-warm 200 $B latency $C8 --input-len 128 \
        --output-len 256 --output "$OUT/lat-8b-warm.json"
}
t4_t6_t3() {
    run nano 300 $B throughput examples/configs/qwen3-0.6b --load-format dummy \
        --max-model-len 4096 --max-num-batched-tokens 16384 --preset nanovllm \
        --output "$OUT/nano.json"
    run busy-8b 200 python3 scripts/profile_engine.py examples/configs/llama-3.1-8b \
        --decode-only --steps 30 --extra max_num_batched_tokens=16384 --json "$OUT/busy-8b.jsonl"
    run lat-1b 200 $B latency $C1 --input-len 128 --output-len 256 --compare hf \
        --output "$OUT/lat-1b.json"
}
case "$MODE" in
tests)
    run gpu-tests 300 python3 -m pytest -q -x tests/test_cuda_graphs_gpu.py \
        "tests/test_triton_attention.py::test_engine_greedy_triton_equals_torch_ref" ;;
quick)
    run gpu-tests 300 python3 -m pytest -q -x tests/test_cuda_graphs_gpu.py \
        "tests/test_triton_attention.py::test_engine_greedy_triton_equals_torch_ref"
    run lat-1b 200 $B latency $C1 --input-len 128 --output-len 256 --output "$OUT/lat-1b.json"
    run tput-1b 200 $B throughput $C1 --num-prompts 256 --input-len 512 --output-len 128 \
        --output "$OUT/tput-1b.json" ;;
8b)
    t2_t5
    TRITON_CACHE_DIR=/tmp/tc8 t1 ;;
rest)
    t1
    t4_t6_t3 ;;
targets)  # T1-T6 on one tree in one call
    t2_t5
    TRITON_CACHE_DIR=/tmp/tc8 t1
    t4_t6_t3 ;;
quant-lat)  # issue 8: int4 batch-1 decode vs bf16, side by side; the quant GPU tests
    run quant-tests 300 python3 -m pytest -q -x tests/test_quant_kernels.py \
        tests/test_quant_methods.py
    for q in bf16 awq gptq; do
        extra=""; [ $q != bf16 ] && extra="--quantization $q"
        run lat-8b-$q 200 $B latency $C8 $extra --input-len 128 --output-len 256 \
            --output "$OUT/lat-8b-$q.json"
    done ;;
quant)  # issue 8 in one go: the quant kernel GPU tests, a fresh W4A16 tuning at batch 1 (into
    # $OUT/configs, starting from the packaged table; the runs below use it), int4 batch-1 decode
    # vs bf16, W8A8 / fp8 on the prefill-heavy workload vs bf16
    run quant-kernel-tests 150 python3 -m pytest -q -x -p no:cacheprovider \
        tests/test_quant_kernels.py tests/test_int8_fp8_kernels.py
    mkdir -p "$OUT/configs" && cp core/kernels/configs/*.json "$OUT/configs/"
    run tune-m1 120 python3 scripts/bench_quant.py --only tune --tune "$OUT/configs" --tune-m 1
    export PAGEBATCH_KERNEL_CONFIG_DIR=$OUT/configs
    for q in bf16 awq gptq; do
        extra=""; [ $q != bf16 ] && extra="--quantization $q"
        run lat-8b-$q 75 $B latency $C8 $extra --input-len 128 --output-len 256 \
            --output "$OUT/lat-8b-$q.json"
    done
    for q in bf16 int8 fp8; do
        extra=""; [ $q != bf16 ] && extra="--quantization $q"
        run tput-8b-$q 90 $B throughput $C8 $extra --max-num-batched-tokens 16384 \
            --num-prompts 256 --input-len 2048 --output-len 128 --output "$OUT/tput2k-8b-$q.json"
    done ;;
dense)  # issue 7, T2/T3: the 16-bit GEMV against cuBLAS (tuned into $OUT/configs), then batch-1
    # decode of the 8B and 1B shapes without the table (cuBLAS) and with it, side by side
    mkdir -p "$OUT/configs" && cp core/kernels/configs/*.json "$OUT/configs/"
    run tune-dense 200 python3 scripts/bench_quant.py --only tune-dense --tune "$OUT/configs" \
        --tune-m 1,2
    for shape in 8b 1b; do
        C=$C8; [ $shape = 1b ] && C=$C1
        run lat-$shape-cublas 75 $B latency $C --input-len 128 --output-len 256 \
            --output "$OUT/lat-$shape-cublas.json"
        PAGEBATCH_KERNEL_CONFIG_DIR=$OUT/configs run lat-$shape-gemv 75 $B latency $C \
            --input-len 128 --output-len 256 --output "$OUT/lat-$shape-gemv.json"
    done ;;
pdl)  # issues 7, 8: programmatic dependent launch (core/kernels/pdl.py) — the compiled kernel
    # tests with it on (and the fused split-KV reduction), then batch-1 decode without / with it
    PAGEBATCH_PDL=1 run pdl-tests 240 python3 -m pytest -q -x -p no:cacheprovider \
        tests/test_triton_attention.py tests/test_dense_gemv.py tests/test_wna16_gemv_edges.py \
        tests/test_argmax.py tests/test_cuda_graphs_gpu.py
    for case in 8b-bf16 8b-awq 1b-bf16; do
        C=$C8; [ ${case%%-*} = 1b ] && C=$C1
        extra=""; [ ${case#*-} = awq ] && extra="--quantization awq"
        for p in 0 1; do
            PAGEBATCH_PDL=$p run lat-$case-pdl$p 75 $B latency $C $extra --input-len 128 \
                --output-len 256 --output "$OUT/lat-$case-pdl$p.json"
        done
    done ;;
quant-tput)  # issue 8: W8A8 and fp8 on a prefill-heavy workload vs bf16
    for q in bf16 int8 fp8; do
        extra=""; [ $q != bf16 ] && extra="--quantization $q"
        run tput-8b-$q 200 $B throughput $C8 $extra --max-num-batched-tokens 16384 \
            --num-prompts 256 --input-len 2048 --output-len 128 --output "$OUT/tput2k-8b-$q.json"
    done ;;
esac
python3 - "$OUT" <<'PY'
import json, pathlib, sys
print(f"\n{'run':<13}{'pagebatch':>12}{'hf':>10}{'startup s':>11}{'warmup s':>10}")
for f in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    rs = json.loads(f.read_text())["results"]
    key = "output_tok_s" if "output_tok_s" in rs[0] else "decode_tok_s"
    hf = f"{rs[1][key]:.1f}" if len(rs) > 1 else "-"
    print(f"{f.stem:<13}{rs[0][key]:>12.1f}{hf:>10}{rs[0]['startup_s']:>11.1f}"
          f"{rs[0].get('warmup_s', 0):>10.1f}")
PY
