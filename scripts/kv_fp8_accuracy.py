"""The fp8 KV cache against the model-dtype cache on one model (CPU by default): greedy
agreement of the first 8 tokens, and, teacher-forced on the reference's sequences, top-1
agreement and the KL divergence KL(ref || fp8) per position. docs/quantization.md quotes it:

  OMP_NUM_THREADS=2 python scripts/kv_fp8_accuracy.py smollm2-135m --device cpu
"""

from __future__ import annotations

import argparse

import torch

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at",
           "The three primary colors are", "Once upon a time, in a small village,",
           "import numpy as np\n"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default="smollm2-135m")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--max-tokens", type=int, default=32)
    a = ap.parse_args()
    from pagebatch import LLM, SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True)
    runs = {}
    for kv in ("auto", "fp8"):
        llm = LLM(a.model, device=a.device, kv_cache_dtype=kv, num_kv_blocks=256,
                  max_model_len=1024)
        outs = llm.generate(PROMPTS, sp, use_tqdm=False)
        runner = llm.engine.core.runner
        runs[kv] = (llm, runner, [o.outputs[0].token_ids for o in outs],
                    [o.prompt_token_ids for o in outs])
    ref_tokens, prompts = runs["auto"][2], runs["auto"][3]
    agree8 = [sum(x == y for x, y in zip(r[:8], g[:8])) / 8
              for r, g in zip(ref_tokens, runs["fp8"][2])]
    top1, kls = [], []
    for p, t in zip(prompts, ref_tokens):
        seq = p + t[:-1]
        rows = list(range(len(p) - 1, len(seq)))
        ref = torch.log_softmax(runs["auto"][1].forward_scratch(seq, rows).float(), -1)
        got = torch.log_softmax(runs["fp8"][1].forward_scratch(seq, rows).float(), -1)
        top1.append((ref.argmax(-1) == got.argmax(-1)).float().mean().item())
        kls.append((ref.exp() * (ref - got)).sum(-1).mean().item())
    print(f"{'prompt':<40}{'first-8 agree':>14}{'top-1':>8}{'KL':>9}")
    for q, a8, t1, kl in zip(PROMPTS, agree8, top1, kls):
        print(f"{q[:38]!r:<40}{a8:>14.2f}{t1:>8.2f}{kl:>9.4f}")
    n = len(PROMPTS)
    print(f"{'mean':<40}{sum(agree8) / n:>14.2f}{sum(top1) / n:>8.2f}{sum(kls) / n:>9.4f}")


if __name__ == "__main__":
    main()
