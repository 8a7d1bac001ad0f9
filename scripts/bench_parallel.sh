#!/usr/bin/env bash
# Issue 9's TP/PP benchmarks on two H200s (device kind nvidia-h200-x2), through the device tool:
#   bash scripts/bench_parallel.sh [--only tp1,tp2,pp1,pp2,pp2mb3] [--eager]
# Installs pagebatch (scripts/gpu-run), checks two GPUs are visible, then runs
# scripts/bench_parallel.py (JSON in $OUT, a table last).
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-/tmp/out}
bash scripts/gpu-run true || exit 1
[ -d .whl ] && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
n=$(python3 -c "import torch; print(torch.cuda.device_count())")
[ "$n" -ge 2 ] || { echo "bench_parallel: needs 2 GPUs, torch sees $n"; exit 1; }
exec python3 scripts/bench_parallel.py "$@"
