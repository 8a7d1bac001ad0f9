"""On the GPU machine: the W4A16 GEMV's fp16x2 fields (quant/kernels/wna16_half2.py) on a real
model's activations. SmolLM2-135M-Instruct (the packaged GGUF) in bf16, ``awq`` quantized at load
(groups 64 and 128), batch-1 greedy decode of the quality prompts (quant/calibrate/quality.py),
one at a time, 64 tokens each,
with the GEMV's fp32 fields and with ``half2``; every batch-1 product goes through the GEMV with a
config table written for SmolLM2's shapes (the packaged H200 table has none).

    bash scripts/gpu-run python3 scripts/gpu_half2_check.py PATH/TO/SmolLM2.gguf

Prints per prompt whether the greedy tokens are identical, where they part (and the fp32 run's
top-2 log-prob gap there: a near-tie when small), and the largest difference of the chosen
tokens' log-probs over the common prefix; then the same against a second fp32 run (the noise
floor: zero when the fp32 path is deterministic).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

# SmolLM2: hidden 576, 9 heads of 64 (3 KV heads), intermediate 1536. Quantized at load, the
# layers of 576 inputs take group 64 (8 packed rows per tile), down (1536 inputs) group 128
SHAPES = [(960, 576, 64), (576, 576, 64), (3072, 576, 64), (576, 1536, 128)]  # (N, K, group)


def _table() -> dict:
    """The batch-1 GEMV with ``half2`` for every SmolLM2 shape (PAGEBATCH_W4A16_HALF2=0 turns
    it off in a run)."""
    return {f"bits=4,n={n},k={k},group={g}": {"1": dict(
        kernel="gemv", block_n=64, block_kp=g // 8, sub_tiles=1, split_k=1, prefetch=0,
        num_warps=2, num_stages=3, half2=1)} for n, k, g in SHAPES}


def _child(gguf: str, out: str) -> None:
    import torch

    from pagebatch import LLM, SamplingParams
    from pagebatch.quant.calibrate.quality import PROMPTS
    from pagebatch.quant.kernels import wna16

    llm = LLM(gguf, dtype="bfloat16", quantization="awq", kv_cache_memory="2GiB",
              max_model_len=2048)
    sp = SamplingParams(temperature=0.0, max_tokens=64, logprobs=2, ignore_eos=True)
    res = []
    for p in PROMPTS:  # one at a time: batch-1 decode, the GEMV's rows
        c = llm.generate([p], sp, use_tqdm=False)[0].outputs[0]
        lps = [sorted((lp.logprob for lp in pos.values()), reverse=True) for pos in c.logprobs]
        chosen = [pos[t].logprob for pos, t in zip(c.logprobs, c.token_ids)]
        res.append(dict(tokens=list(c.token_ids), chosen=chosen,
                        gap=[v[0] - v[1] if len(v) > 1 else float("inf") for v in lps]))
    used = sorted({json.dumps(cfg, sort_keys=True) for key, cfg in wna16._chosen.items()
                   if key[0] == 1})
    Path(out).write_text(json.dumps(dict(results=res, configs=used,
                                         gpu=torch.cuda.get_device_name())))


def _run(gguf: str, half2: int, table_dir: str, out: str) -> dict:
    env = dict(os.environ, PAGEBATCH_KERNEL_CONFIG_DIR=table_dir,
               PAGEBATCH_W4A16_HALF2=str(half2))
    subprocess.run([sys.executable, __file__, "--child", gguf, out], env=env, check=True)
    return json.loads(Path(out).read_text())


def _compare(a: dict, b: dict, what: str) -> None:
    same = 0
    for i, (x, y) in enumerate(zip(a["results"], b["results"])):
        n = next((j for j, (s, t) in enumerate(zip(x["tokens"], y["tokens"])) if s != t),
                 len(x["tokens"]))
        same += n == len(x["tokens"])
        dl = max((abs(p - q) for p, q in zip(x["chosen"][:n], y["chosen"][:n])), default=0.0)
        part = "identical" if n == len(x["tokens"]) else (
            f"part at token {n} (fp32 top-2 gap there {x['gap'][n]:.3f})")
        print(f"  {what} prompt {i:2d}: {part}; max |d logprob| {dl:.4f}")
    print(f"{what}: {same}/{len(a['results'])} greedy sequences identical", flush=True)


def main(gguf: str) -> int:
    import torch

    with tempfile.TemporaryDirectory() as d:
        # one table (half2 on) for every run: PAGEBATCH_W4A16_HALF2 decides
        name = torch.cuda.get_device_name().replace(" ", "_")
        Path(d, f"wna16_{name}.json").write_text(json.dumps(_table()))
        fp32 = _run(gguf, 0, d, f"{d}/a.json")
        fp32b = _run(gguf, 0, d, f"{d}/b.json")
        half = _run(gguf, 1, d, f"{d}/c.json")
    print(fp32["gpu"], "configs at M=1 (fp32 run):", fp32["configs"])
    print("configs at M=1 (half2 run):", half["configs"])
    _compare(fp32, fp32b, "fp32 vs fp32")
    _compare(fp32, half, "fp32 vs half2")
    return 0


if __name__ == "__main__":
    if sys.argv[1] == "--child":
        _child(sys.argv[2], sys.argv[3])
        sys.exit(0)
    sys.exit(main(sys.argv[1]))
