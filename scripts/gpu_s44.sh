#!/usr/bin/env bash
# Session 44 (issue 23): `vllm serve` and two pagebatch configurations over the sweep of
# gpu_serve.sh, one after another on the same machine, in one call (after the eight staging
# calls of .vl/vllm-gpu, see its header; carry .whl .gpu .vl/vllm-gpu):
#   bash scripts/gpu_s44.sh fwd     vLLM, then A, then B
#   bash scripts/gpu_s44.sh rev     B, then A, then vLLM (the second run, order reversed so that
#                                   drift over the call does not favour one engine)
# A: --long-prefill-token-threshold 256 --max-mixed-prefill-tokens 8192, piecewise graphs to 512
#    as measured (serve's default is 2048 since session 45) (session 42's L = 256,
#    which led vLLM at every rate but TTFT at 8 req/s and ITL p99 at inf, plus a cap that the
#    step model says takes ITL p99 at saturation from 337 to 246 ms for 0.3 % of throughput)
# B: --max-mixed-prefill-tokens 4096 --piecewise-cuda-graph-max-tokens 2048 (session 43's best
#    light-load TTFT)
# ONLY=S (session 46): vLLM and `pagebatch serve` with no step flags (serve's own defaults,
#    B's pair since session 45), one pair per call: fwd vLLM then S, rev S then vLLM
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
bash scripts/gpu-run true || exit 1
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1
A="--long-prefill-token-threshold 256 --max-mixed-prefill-tokens 8192 --piecewise-cuda-graph-max-tokens 512"
B="--max-mixed-prefill-tokens 4096 --piecewise-cuda-graph-max-tokens 2048"
run=${1:?fwd|rev}
vl() {
    ( eval "$(bash .vl/vllm-gpu install | tail -1)" && export PYTHONPATH=/tmp/site:$PYTHONPATH &&
      env BENCH_S=${BENCH_S:-150} TAIL=8 bash scripts/gpu_serve.sh vllm "vllm-$run" --max-num-seqs 256 )
}
pb() { env BENCH_S=${BENCH_S:-150} TAIL=8 bash scripts/gpu_serve.sh pagebatch "$1-$run" --max-num-seqs 256 $2; }
# the client's own error first: a server whose ITL is exactly 30 ms at 256 streams, read
# from one client process and from four (SKIP_FAKE=1 leaves it out)
[ -n "${SKIP_FAKE:-}" ] || ( TICK=0.03 python3 -m uvicorn --app-dir scripts fake_sse_server:app --port 8799 \
      --log-level warning > "$OUT/fake-$run.log" 2>&1 & echo $! > /tmp/fake.pid; sleep 4
  for c in 1 4; do
    timeout 60 python3 -m pagebatch.cli bench serve --base-url http://127.0.0.1:8799 \
        --model m --num-prompts 256 --input-len 16 --output-len 128 --range-ratio 0 \
        --vocab-size 1000 --rates inf --client-processes $c --output "$OUT/fake$c-$run.json" \
        2>&1 | grep -E "ITL|TTFT" | sed "s/^/fake, $c client processes: /"
  done
  kill "$(cat /tmp/fake.pid)" )
# ONLY=A: configuration A alone beside vLLM (when the device time left is short)
if [ "${ONLY:-}" = A ]; then vl; pb A "$A"
elif [ "${ONLY:-}" = S ]; then if [ "$run" = fwd ]; then vl; pb S ""; else pb S ""; vl; fi
elif [ "$run" = fwd ]; then vl; pb A "$A"; pb B "$B"; else pb B "$B"; pb A "$A"; vl; fi
