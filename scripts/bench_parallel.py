"""Issue 9's parallel benchmarks on two GPUs (kind nvidia-h200-x2), Llama-3.1-8B shape with dummy
weights (examples/configs/llama-3.1-8b):

- decode: ``pagebatch bench latency`` (batch 1, 128 in / 256 out), tensor_parallel_size 1 vs 2;
  target TP=2 >= 1.5x TP=1 decode tokens/s;
- throughput: ``pagebatch bench throughput`` (256 prompts x 512 in / 128 out), one GPU vs
  pipeline_parallel_size 2; target PP=2 >= 1.5x. Two timed runs each (the faster reported,
  both in the JSON's ``elapsed_each_s``).

Each configuration runs in its own process (``python3 -m pagebatch.cli bench ... --output``);
JSON results go to $OUT (default /tmp/out) and a table is printed last.

    python3 scripts/bench_parallel.py [--only tp1,tp2,tp2nccl,pp1,pp2,pp2mb3] [--eager]
        [--timeout S]

tp2 runs with the default ``custom_all_reduce: true`` (the one-shot all-reduce fused with the
norms); tp2nccl with ``--no-custom-all-reduce`` (NCCL after each row-parallel layer).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

MODEL = ["examples/configs/llama-3.1-8b", "--load-format", "dummy", "--max-model-len", "4096"]
PP_WORKLOAD = ["--num-prompts", "256", "--input-len", "512", "--output-len", "128",
               "--max-num-batched-tokens", "16384", "--num-iters", "2"]
TP_WORKLOAD = ["--max-num-seqs", "8", "--input-len", "128", "--output-len", "256",
               "--num-iters", "3"]
RUNS = {  # name: (bench kind, engine and workload arguments)
    "tp1": ("latency", TP_WORKLOAD),
    "tp2": ("latency", TP_WORKLOAD + ["--tensor-parallel-size", "2"]),
    "tp2nccl": ("latency", TP_WORKLOAD + ["--tensor-parallel-size", "2",
                                          "--no-custom-all-reduce"]),
    "pp1": ("throughput", PP_WORKLOAD),
    "pp2": ("throughput", PP_WORKLOAD + ["--pipeline-parallel-size", "2"]),
    "pp2mb3": ("throughput", PP_WORKLOAD + ["--pipeline-parallel-size", "2",
                                            "--pipeline-micro-batches", "3"]),
}


def run(name: str, out_dir: str, eager: bool, timeout: float) -> dict | None:
    kind, extra = RUNS[name]
    path = os.path.join(out_dir, f"parallel-{name}.json")
    cmd = [sys.executable, "-m", "pagebatch.cli", "--log-level", "WARNING", "bench", kind,
           *MODEL, *extra, "--output", path] + (["--enforce-eager"] if eager else [])
    print(f"=== {name}: {' '.join(cmd[1:])}", flush=True)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        print(f"{name}: timed out after {timeout:.0f} s\n{(e.stderr or '')[-3000:]}", flush=True)
        return None
    print(proc.stdout[-1500:], proc.stderr[-3000:] if proc.returncode else "", flush=True)
    if proc.returncode != 0:
        print(f"{name}: exit status {proc.returncode}", flush=True)
        return None
    with open(path) as f:
        res = json.load(f)["results"][0]
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="tp1,tp2,pp1,pp2")
    ap.add_argument("--eager", action="store_true", help="--enforce-eager (no CUDA graphs)")
    ap.add_argument("--timeout", type=float, default=280.0, help="seconds per run")
    args = ap.parse_args()
    out_dir = os.environ.get("OUT", "/tmp/out")
    os.makedirs(out_dir, exist_ok=True)
    os.environ.setdefault("TRITON_CACHE_DIR", "/tmp/triton-parallel")  # compile once for all
    results = {n: run(n, out_dir, args.eager, args.timeout) for n in args.only.split(",")}

    def val(name: str, key: str) -> float | None:
        r = results.get(name)
        return r.get(key) if r else None

    print("\nLlama-3.1-8B shape, dummy weights, bf16" + (" (eager)" if args.eager else ""))
    print(f"{'run':<6}{'what':<34}{'value':>12}{'startup s':>11}{'wall s':>9}")
    rows = [("tp1", "decode tok/s, batch 1, 1 GPU", "decode_tok_s"),
            ("tp2", "decode tok/s, batch 1, TP=2", "decode_tok_s"),
            ("tp2nccl", "same, NCCL all-reduces", "decode_tok_s"),
            ("pp1", "output tok/s, 256x512/128, 1 GPU", "output_tok_s"),
            ("pp2", "output tok/s, 256x512/128, PP=2", "output_tok_s"),
            ("pp2mb3", "same, PP=2, 3 micro-batches", "output_tok_s")]
    for name, what, key in rows:
        if name in results:
            v = val(name, key)
            r = results[name] or {}
            print(f"{name:<6}{what:<34}{(f'{v:.1f}' if v else 'failed'):>12}"
                  f"{r.get('startup_s', float('nan')):>11.1f}{r.get('wall_s', float('nan')):>9.1f}")
    for a, b, key, label in (("tp2", "tp1", "decode_tok_s", "TP=2 / TP=1 decode"),
                             ("tp2nccl", "tp1", "decode_tok_s", "TP=2 with NCCL / TP=1"),
                             ("pp2", "pp1", "output_tok_s", "PP=2 / 1 GPU throughput"),
                             ("pp2mb3", "pp1", "output_tok_s", "PP=2 (3 micro-batches) / 1 GPU")):
        if val(a, key) and val(b, key):
            ratio = val(a, key) / val(b, key)
            print(f"{label}: {ratio:.2f}x (target >= 1.5x: {'met' if ratio >= 1.5 else 'NOT met'})")
    return 0 if all(results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
