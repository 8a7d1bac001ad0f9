#!/usr/bin/env bash
# Batch-1 decode on shapes that appear in no packaged kernel table (issue 22, item 5): Qwen2.5-7B,
# Qwen3-4B and Mistral-Nemo-12B (examples/configs/), each bf16, awq and gptq (dummy weights,
# quantized at load), with the start-up autotuner on and an empty user cache, so every launch
# config comes from the autotuner or the rule (core/kernels/autotune.py), not a table. Then the
# table of scripts/gpu_shapes_table.py. One device call, on one GPU (~4-7 min; each run is cut
# at RUN_S seconds, and runs stop being started after TOTAL_S):
#
#   bash scripts/gpu-run bash scripts/gpu_shapes.sh            # results in $OUT/shapes/
#
# The awq run of a shape fills the user cache that its gptq run then reads (the same canonical
# W4A16 layout and table keys): gptq's autotune_s is a warm start's, awq's a cold one's. Needs
# nothing from the network. QUANT_EXTRA: more flags for the awq / gptq runs only (e.g.
# "--quantize-lm-head true"), with SUFFIX added to their file names (e.g. "-qhead").
set -uo pipefail
cd "$(dirname "$0")/.."
DEST=${OUT:-/tmp}/shapes
mkdir -p "$DEST"
RUN_S=${RUN_S:-130}
TOTAL_S=${TOTAL_S:-320}
SHAPES=${SHAPES:-"qwen2.5-7b qwen3-4b mistral-nemo-12b"}
METHODS=${METHODS:-"bf16 awq gptq"}
export PAGEBATCH_CACHE="$DEST/cache"  # empty: configs from the autotuner or the rule
rm -rf "$PAGEBATCH_CACHE"
export PAGEBATCH_AUTOTUNE=1
unset PAGEBATCH_KERNEL_CONFIG_DIR
start=$SECONDS
for shape in $SHAPES; do
    for method in $METHODS; do
        if (( SECONDS - start > TOTAL_S )); then
            echo "== skipped $shape $method: past ${TOTAL_S} s" | tee -a "$DEST/skipped.txt"
            continue
        fi
        quant=()
        name=$shape-$method
        if [ "$method" != bf16 ]; then
            quant=(--quantization "$method" ${QUANT_EXTRA:-}); name=$name${SUFFIX:-}
        fi
        echo "== $shape $method (t=$((SECONDS - start)) s)"
        timeout "$RUN_S" python3 -m pagebatch.cli bench latency "examples/configs/$shape" \
            --load-format dummy --max-model-len 4096 --max-num-seqs 16 --input-len 128 \
            --output-len 256 --num-iters 2 "${quant[@]}" --output "$DEST/$name.json" \
            > "$DEST/$name.log" 2>&1
        echo "   rc=$? $(grep -E 'pagebatch' "$DEST/$name.log" | tail -1)"
    done
done
ls "$DEST/cache/kernel_configs/v1" 2>/dev/null
python3 scripts/gpu_shapes_table.py "$DEST" | tee "$DEST/table.md"
