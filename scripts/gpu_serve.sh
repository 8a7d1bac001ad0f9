#!/usr/bin/env bash
# Issue 23 on the H200: start one OpenAI-compatible server on the Llama-3.1-8B shape (dummy
# weights; the folder .gpu/llama8b-tok holds the 8B config.json with SmolLM2's 49,152-token
# vocabulary and its tokenizer, so both servers detokenize and stream text; built here by
# `.venv/bin/python scripts/make_llama8b_tok.py`), wait until it
# answers, run `pagebatch bench serve` over a rate sweep, stop it. The same flags for both:
#   bash scripts/gpu_serve.sh pagebatch TAG [engine flags...]
#   bash scripts/gpu_serve.sh vllm TAG [engine flags...]       (vLLM from .vl/vllm-gpu install)
# Env: RATES (default 8,16,32,64,inf), NUM (prompts per rate, 200), IN / OUT_LEN / RANGE (512 /
# 128 / 0.5: mixed lengths), PREFIX (shared prefix tokens, 0), MAXLEN (4096), CLIENTS (client
# processes of bench serve, 4 since session 44: one asyncio process reading 256 streams falls
# behind them; core/bench/serve_workers.py). Files in $OUT.
# Since session 45 `pagebatch serve` defaults to max_mixed_prefill_tokens 4096 and
# piecewise_cuda_graph_max_tokens 2048 (plugins/frontends/http/__init__.py); the pagebatch
# figures of sessions 38-44, and session 45's D, ran under 0 and 512: add
# `--max-mixed-prefill-tokens 0 --piecewise-cuda-graph-max-tokens 512` to reproduce them.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
engine=$1 tag=$2; shift 2
M=${MODEL:-.gpu/llama8b-tok} MAXLEN=${MAXLEN:-4096}
common=(--load-format dummy --max-model-len "$MAXLEN" --max-num-batched-tokens 16384)
if [ "$engine" = vllm ]; then
    port=8001
    python3 -m vllm.entrypoints.openai.api_server --model $M --port $port "${common[@]}" \
        --served-model-name m "$@" > "$OUT/server-$tag.log" 2>&1 &
else
    port=8000
    python3 -m pagebatch.cli serve $M --port $port "${common[@]}" --served-model-name m "$@" \
        > "$OUT/server-$tag.log" 2>&1 &
fi
pid=$!
t0=$(date +%s)
up() { python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$port/v1/models', timeout=2)" 2>/dev/null; }
until up; do
    sleep 1
    if ! kill -0 $pid 2>/dev/null || [ $(( $(date +%s) - t0 )) -gt 240 ]; then
        echo "$tag: server did not come up"; tail -20 "$OUT/server-$tag.log"; kill $pid 2>/dev/null
        exit 1
    fi
done
echo "$tag: ready after $(( $(date +%s) - t0 )) s"
timeout ${BENCH_S:-300} python3 -m pagebatch.cli bench serve --base-url "http://127.0.0.1:$port" \
    --model m --num-prompts "${NUM:-200}" --input-len "${IN:-512}" --output-len "${OUT_LEN:-128}" \
    --range-ratio "${RANGE:-0.5}" --shared-prefix-len "${PREFIX:-0}" --vocab-size 49152 \
    --rates "${RATES:-8,16,32,64,inf}" --client-processes "${CLIENTS:-4}" \
    --goodput ttft:500 itl:50 --output "$OUT/serve-$tag.json" \
    > "$OUT/serve-$tag.log" 2>&1; echo "$tag: bench rc=$?"
# the server's own histograms (its ITL as it emits, against the client's as it receives)
python3 -c "import urllib.request as u; print(u.urlopen('http://127.0.0.1:$port/metrics', timeout=5).read().decode())" \
    > "$OUT/metrics-$tag.txt" 2>&1
kill -INT $pid 2>/dev/null
for _ in $(seq 20); do kill -0 $pid 2>/dev/null || break; sleep 1; done
pkill -9 -f "api_server|pagebatch.cli serve|EngineCore|VLLM" 2>/dev/null
sleep 3
tail -${TAIL:-12} "$OUT/serve-$tag.log"
