"""How close a quantized model stays to its 16-bit source: mean KL divergence
``KL(p_ref || p_quant)`` of the next-token distributions and top-1 agreement, over every position
of a fixed prompt set (none of it from the calibration text). The figures of docs/quantization.md.

    python -m pagebatch.quant.calibrate.quality smollm2-135m /tmp/q-awq /tmp/q-gptq ...

runs pagebatch (CPU, fp32) on the reference and on each folder and prints one line per folder.
"""

from __future__ import annotations

import argparse
import gc
import sys
from typing import Sequence

import torch

PROMPTS = [
    "The history of the printing press begins in the fifteenth century, when",
    "def merge_sorted(a, b):\n    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n",
    "Q: How many legs does a spider have?\nA:",
    "Dear hiring manager, I am writing to apply for the position of",
    "The mitochondria is often called the powerhouse of the cell because",
    "Here are three tips for staying productive while working from home: 1.",
    "In 1969, astronauts landed on the Moon for the first time. The mission",
    "<|im_start|>user\nWhat is the capital of Japan?<|im_end|>\n<|im_start|>assistant\n",
    "Glaciers move because ice, under its own weight, slowly deforms and slides over the rock "
    "beneath it. In summer, meltwater can reach the bed of the glacier and lubricate it, so that "
    "the ice speeds up for a few weeks before",
    "import json\n\ndef load_config(path):\n    with open(path) as f:\n        data = "
    "json.load(f)\n    if \"name\" not in data:\n        raise KeyError(\"config needs a "
    "name\")\n    return data\n\n\ndef save_config(path, data):\n",
    "The old woman opened the door only a crack and peered at the stranger on the step. He was "
    "soaked through, holding a lantern that had long since gone out, and he asked, very politely,",
    "To make bread, mix flour, water, salt and yeast into a dough, knead it for ten minutes, and "
    "let it rise in a warm place until it has doubled in size. Then shape the loaf,",
]


def compare(ref: Sequence[torch.Tensor], got: Sequence[torch.Tensor]) -> dict[str, float]:
    """ref, got: per prompt logits [positions, vocab] -> {"kl": mean KL(ref || got) in nats,
    "top1": fraction of positions with the same argmax}."""
    r = torch.cat([t.float() for t in ref])
    g = torch.cat([t.float() for t in got])
    lr, lg = torch.log_softmax(r, -1), torch.log_softmax(g, -1)
    kl = (lr.exp() * (lr - lg)).sum(-1).mean().item()
    return {"kl": kl, "top1": (r.argmax(-1) == g.argmax(-1)).float().mean().item()}


def engine_logits(model: str, prompts: Sequence[str] = PROMPTS,
                  **llm_kwargs) -> list[torch.Tensor]:
    """pagebatch's logits at every position of each prompt: [len(prompt ids), vocab] fp32."""
    from pagebatch import LLM

    kw = dict(device="cpu", dtype="float32", kv_cache_memory="64MiB", max_model_len=512)
    llm = LLM(model, **{**kw, **llm_kwargs})
    tok = llm.get_tokenizer()
    out = [llm.engine.core.runner.forward_scratch(tok(p)["input_ids"]).float() for p in prompts]
    del llm
    gc.collect()
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("reference", help="the 16-bit model (name or folder)")
    ap.add_argument("quantized", nargs="+", help="quantized checkpoint folders")
    ap.add_argument("--quantization", help="also a method quantizing the reference at load "
                    "(e.g. int8)", action="append", default=[])
    args = ap.parse_args(argv)
    ref = engine_logits(args.reference)
    runs = [(q, {}) for q in args.quantized]
    runs += [(f"{args.reference} --quantization {m}", {"quantization": m})
             for m in args.quantization]
    for name, kw in runs:
        model = args.reference if kw else name
        r = compare(ref, engine_logits(model, **kw))
        print(f"{name}\tKL {r['kl']:.4f}\ttop-1 {r['top1']:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
