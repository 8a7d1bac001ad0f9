#!/usr/bin/env bash
# T1-T4 on the GPU machine for two trees side by side in one call (issue 21: "no slower than
# before"): the working tree and an older one unpacked (here, with .gpu/ ignored) by
#   rm -rf .gpu/old && mkdir -p .gpu/old && git archive REV | tar -x -C .gpu/old
# and carried (carry=[".gpu/old"]):
#   bash scripts/gpu_ab.sh [.gpu/old]
# Each tree is installed (not editable) into its own folder and put on PYTHONPATH for its runs;
# the runs alternate per workload, in the order ORDER (default "old new"; "new old" gives the
# first, cold-cache run of each workload to the new tree) so that drift of the machine hits
# both. JSON into $OUT (or /tmp/out); a table last.
set -uo pipefail
cd "$(dirname "$0")/.."
OLD=${1:-.gpu/old}
OUT=${OUT:-/tmp/out}
ORDER=${ORDER:-old new}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TRITON_CACHE_DIR=/tmp/tc-ab
python3 -m pip uninstall -y -q pagebatch >/dev/null 2>&1  # an editable install would be seen too
for t in old new; do
    src=$([ $t = old ] && echo "$OLD" || echo .)
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/pb_$t \
        "$src" >/tmp/pb_$t.log 2>&1 || { cat /tmp/pb_$t.log; exit 1; }
done
B="-m pagebatch.cli bench"
C8="examples/configs/llama-3.1-8b --load-format dummy --max-model-len 4096"
run() {  # tree, name, command...
    local tree=$1 name=$2; shift 2
    local dir=$([ $tree = old ] && echo "$OLD" || echo .)
    echo "=== $name ($tree): $*"
    (cd "$dir" && PYTHONPATH=/tmp/pb_$tree timeout 300 python3 $B "$@" \
        --output "$OUT/$name-$tree.json") 2>&1 | grep -v "no tokenizer" | tail -6
}
for tree in $ORDER; do
    run $tree t1 throughput $C8 --max-num-batched-tokens 16384 --num-prompts 256 \
        --input-len 512 --output-len 128
done
for tree in $ORDER; do run $tree t2 latency $C8 --input-len 128 --output-len 256; done
for tree in $ORDER; do
    run $tree t3 latency examples/configs/llama-3.2-1b --load-format dummy --max-model-len 4096 \
        --input-len 128 --output-len 256
done
for tree in $ORDER; do
    run $tree t4 throughput examples/configs/qwen3-0.6b --load-format dummy --max-model-len 4096 \
        --max-num-batched-tokens 16384 --preset nanovllm
done
python3 - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
def tps(p):
    try:
        d = json.loads(p.read_text())
    except (OSError, ValueError):
        return None
    r = d["results"][0]
    return round(r.get("output_tok_s") or r["decode_tok_s"], 1)
print(f"{'run':4} {'old':>10} {'new':>10} {'new/old':>8}")
for name in ("t1", "t2", "t3", "t4"):
    a, b = tps(out / f"{name}-old.json"), tps(out / f"{name}-new.json")
    r = f"{b / a:.3f}" if a and b else "-"
    print(f"{name:4} {a or '-':>10} {b or '-':>10} {r:>8}")
PY
