#!/usr/bin/env bash
# The front half's CPU time per streamed token (issue 23: "front-half detokenization and SSE
# cost at 256 streams"), on the CPU: `pagebatch serve` over a 2-layer random Llama with
# SmolLM2's tokenizer (real detokenization, a model step that costs little), 512 streamed chat
# requests of 32 words in / 128 tokens out at concurrency 256 from `pagebatch bench serve`, and
# the serving process's own CPU seconds (utime + stime of the frontend process: the event loop,
# the output thread, uvicorn; the engine core is a child process and is not counted) divided by
# the tokens streamed. Needs the README's set-up (`scripts/setup --test`: uvicorn, starlette).
#
#   bash scripts/frontend_cost.sh            # prints "frontend cpu ... us/token"
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
PORT=${PORT:-8765}
DIR=$(mktemp -d)
SP=
trap 'kill $SP 2>/dev/null || true; rm -rf "$DIR"' EXIT
export OMP_NUM_THREADS=1
"$PY" - "$DIR/model" <<'PYEOF'
import os, shutil, sys
from transformers import LlamaConfig, LlamaForCausalLM
from pagebatch.model_loader import resolve_model
src, dst = resolve_model("smollm2-135m").folder, sys.argv[1]
LlamaForCausalLM(LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=4096, bos_token_id=1, eos_token_id=2)
                 ).save_pretrained(dst)
for f in os.listdir(src):
    if "token" in f or f.endswith(".jinja"):
        shutil.copy(os.path.join(src, f), dst)
PYEOF
"$PY" -m pagebatch.cli --log-level WARNING serve --model "$DIR/model" --device cpu \
    --max-num-seqs 256 --max-model-len 512 --kv-cache-memory 512MiB --port "$PORT" \
    > "$DIR/serve.log" 2>&1 &
SP=$!
for _ in $(seq 240); do curl -sf "localhost:$PORT/health" > /dev/null && break; sleep 0.5; done
B=("$PY" -m pagebatch.cli bench serve --base-url "http://127.0.0.1:$PORT"
   --endpoint /v1/chat/completions --input-len 32 --request-rate inf --ignore-eos)
"${B[@]}" --num-prompts 64 --output-len 32 --max-concurrency 64 > /dev/null  # warm-up
read -r u0 s0 < <(awk '{print $14, $15}' "/proc/$SP/stat")
"${B[@]}" --num-prompts 512 --output-len 128 --max-concurrency 256 | grep -E "throughput|TPOT"
read -r u1 s1 < <(awk '{print $14, $15}' "/proc/$SP/stat")
tps=$(getconf CLK_TCK)
"$PY" -c "s = ($u1 - $u0 + $s1 - $s0) / $tps; print(f'frontend cpu {s:.2f} s = {s / (512 * 128) * 1e6:.1f} us/token')"
