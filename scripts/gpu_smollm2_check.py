"""On the GPU machine: SmolLM2 greedy outputs with the triton backend equal torch_ref's (fp32,
near-tie rule of tests/numerics.py), and the Paris prompt answers Paris (bf16, triton).

    bash scripts/gpu-run python3 scripts/gpu_smollm2_check.py PATH/TO/SmolLM2.gguf
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from numerics import assert_greedy_match, top2_gaps  # noqa: E402

from pagebatch import LLM, SamplingParams  # noqa: E402

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land",
           "List three colors:", "The mitochondria is", "import numpy as np\n"]


def main(gguf: str) -> int:
    rows = []
    sp = SamplingParams(temperature=0.0, max_tokens=48)
    ref = LLM(gguf, dtype="float32", attention_backend="torch_ref", kv_cache_memory="2GiB",
              max_model_len=2048)
    ref_out = ref.generate(PROMPTS, sp, use_tqdm=False)
    tri = LLM(gguf, dtype="float32", attention_backend="triton", kv_cache_memory="2GiB",
              max_model_len=2048)
    tri_out = tri.generate(PROMPTS, sp, use_tqdm=False)
    runner = ref.engine.core.runner
    for r, t in zip(ref_out, tri_out):
        ids, toks = r.prompt_token_ids, r.outputs[0].token_ids
        gaps = top2_gaps(runner.forward_scratch(ids + toks)[len(ids) - 1:-1])
        assert_greedy_match(toks, gaps, t.outputs[0].token_ids, what=r.prompt)
        same = toks == t.outputs[0].token_ids
        rows.append(("fp32 triton == torch_ref", r.prompt[:24], "identical" if same else
                     "parted at a near-tie"))
    del ref, tri
    llm = LLM(gguf)  # defaults on CUDA: bfloat16, triton
    t0 = time.perf_counter()
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False)[0]
    text = out.outputs[0].text
    rows.append(("bf16 triton chat", "capital of France?", repr(text)))
    print(f"chat took {time.perf_counter() - t0:.2f} s; backend "
          f"{llm.engine.core.runner.attn_backend.name}, dtype {llm.engine.core.runner.dtype}")
    for row in rows:
        print(" | ".join(row))
    ok = "Paris" in text
    print("PARIS:", "yes" if ok else "NO")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
