#!/usr/bin/env python3
"""The table of scripts/gpu_shapes.sh from its ``<shape>-<method>.json`` files (``pagebatch bench
latency --output``): per shape bf16 batch-1 decode tok/s, the bytes it reads per token, its share
of the weight-read floor, awq and gptq tok/s and their ratio to bf16, and each run's start-up
autotuning seconds (bf16 / awq / gptq). Also checks that no linear shape of these models has
an entry in a packaged kernel table (else the run would not test the autotuner and rule).

Weight-read floor: ``COPY_TBS`` (the H200's device-to-device copy, docs/benchmarks.md ANCHORS)
over the bytes read per token. Two columns: ``floor % (all)`` divides by every weight byte
(ANCHORS' definition: 8B = 16.06 GB / 4.28 TB/s = 267 tok/s); ``floor % (read)`` by the bytes
a decode step reads, i.e. less the token-embedding table where it is not tied to the LM head
(one row of it is read per token): 8B = 15.01 GB -> 285 tok/s. KV-cache reads (<= 384 tokens
of context here: < 1 % of the weights) are left out of both.

  python3 scripts/gpu_shapes_table.py DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

COPY_TBS = 4.28e12
ROOT = Path(__file__).resolve().parents[1]


def linear_shapes(cfg: dict) -> list[tuple[int, int]]:
    """(N, K) of the decoder's linear layers and the LM head at TP=1."""
    h, heads, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or h // heads
    inter = cfg["intermediate_size"]
    return [((heads + 2 * kv) * d, h), (h, heads * d), (2 * inter, h), (h, inter),
            (cfg["vocab_size"], h)]


def packaged_hits(shapes: list[tuple[int, int]]) -> list[str]:
    keys = set()
    for path in [*(ROOT / "core/kernels/configs").glob("*.json"),
                 *(ROOT / "quant/kernels/configs").glob("*.json")]:
        keys |= set(json.loads(path.read_text()))
    hits = []
    for n, k in shapes:
        for key in (f"n={n},k={k}", f"bits=4,n={n},k={k},group=128"):
            if key in keys:
                hits.append(key)
    return hits


def main(dest: Path) -> int:
    rows = []
    for shape in ("qwen2.5-7b", "qwen3-4b", "mistral-nemo-12b"):
        cfg = json.loads((ROOT / "examples/configs" / shape / "config.json").read_text())
        hits = packaged_hits(linear_shapes(cfg))
        res = {}
        for method in ("bf16", "awq", "gptq"):
            path = dest / f"{shape}-{method}.json"
            if path.is_file():
                res[method] = json.loads(path.read_text())["results"][0]
        if "bf16" not in res:
            rows.append(f"| {shape} | (no bf16 result) |")
            continue
        b = res["bf16"]
        weights = b["weights_gb"] * 1e9
        embed = 0 if cfg.get("tie_word_embeddings") else cfg["vocab_size"] * cfg["hidden_size"] * 2
        read = weights - embed
        tok = b["decode_tok_s"]
        cells = [shape, f"{tok:.1f}", f"{weights / 1e9:.2f}", f"{read / 1e9:.2f}",
                 f"{100 * tok * weights / COPY_TBS:.1f}", f"{100 * tok * read / COPY_TBS:.1f}"]
        for method in ("awq", "gptq"):
            r = res.get(method)
            cells += [f"{r['decode_tok_s']:.1f}", f"{r['decode_tok_s'] / tok:.2f}x"] if r else [
                "-", "-"]
        cells.append(" / ".join(f"{res[m].get('autotune_s', '?')}" if m in res else "-"
                                for m in ("bf16", "awq", "gptq")))
        cells.append(", ".join(hits) if hits else "none")
        rows.append("| " + " | ".join(cells) + " |")
    print("| shape | bf16 tok/s | weights GB | read GB/token | floor % (all) | floor % (read) "
          "| awq tok/s | awq / bf16 | gptq tok/s | gptq / bf16 | autotune s (bf16 / awq / gptq) "
          "| packaged-table keys |")
    print("|" + "---|" * 12)
    print("\n".join(rows))
    print(f"\nfloor: {COPY_TBS / 1e12} TB/s; targets (issue 22 item 5): awq and gptq >= 1.80x bf16,"
          f" bf16 >= 83 % of the floor")
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/shapes")))
