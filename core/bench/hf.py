"""The compare adapter for Hugging Face transformers: ``pagebatch bench --compare hf``.

`compare_hf` (in the bench process) runs `main` as its own process (``python -m
pagebatch.bench.hf``) so that each engine has the device to itself: it reads a JSON job on stdin
and prints one JSON line, the result in bench_pagebatch's keys (``engine: hf-generate``).
Static batches only: every prompt of one length, every output of one length.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from ..config import EngineConfig
from ..model_setup import ModelSetup
from .child import print_result, run_adapter
from .workload import bench_sampling


def compare_hf(args: argparse.Namespace, config: EngineConfig, setup: ModelSetup,
               prompts: list[list[int]], out_lens: list[int]) -> dict[str, Any] | int:
    """Run the workload (``prompts`` of token ids, ``out_lens`` tokens each) on transformers
    ``generate`` over the model of ``setup``, on ``config``'s device and dtype. Returns its
    result, or an exit status: 2 for a workload of mixed lengths, the process's own when it
    failed (the tail of its stderr printed)."""
    if bench_sampling(args) is not None:
        print("--compare hf runs greedy workloads only (no --temperature / --top-p / --top-k)",
              file=sys.stderr)
        return 2
    if len(set(out_lens)) > 1 or len({len(p) for p in prompts}) > 1:
        print("--compare hf runs fixed-length workloads only (static batches)", file=sys.stderr)
        return 2
    job = {"folder": str(setup.source.folder), "kind": args.bench_kind, "prompts": prompts,
           "output_len": args.output_len, "num_iters": args.num_iters,
           "batch_size": args.hf_batch_size or len(prompts), "device": config.device,
           "dtype": config.dtype, "load_format": config.load_format}
    return run_adapter("pagebatch.bench.hf", job)


def main() -> None:
    """The adapter's process: the job from stdin, one JSON result line on stdout."""
    import torch
    from transformers import AutoModelForCausalLM

    job = json.loads(sys.stdin.read())
    dev = job["device"]
    if dev == "auto":
        dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = job["dtype"]
    if dtype == "auto":
        dtype = "bfloat16" if dev == "cuda" else "float32"
    if job.get("load_format") == "dummy":  # random weights at the config's shapes, made on dev
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(job["folder"])
        with torch.device(dev):
            model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype))
    else:
        model = AutoModelForCausalLM.from_pretrained(job["folder"], dtype=getattr(torch, dtype))
    model.to(dev).eval()
    out_len = job["output_len"]

    def gen(batch: list[list[int]]) -> tuple[float, float]:
        ids = torch.tensor(batch, device=dev)
        kw = dict(do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(ids))
        if dev == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
        if dev == "cuda":
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        model.generate(ids, max_new_tokens=out_len, min_new_tokens=out_len, **kw)
        if dev == "cuda":
            torch.cuda.synchronize()
        return t1 - t0, time.perf_counter() - t1

    prompts = job["prompts"]
    with torch.inference_mode():
        gen(prompts[:1])  # warm-up
        if job["kind"] == "throughput":
            bs = job["batch_size"]
            best = None
            for _ in range(job["num_iters"]):
                t = sum(gen(prompts[i:i + bs])[1] for i in range(0, len(prompts), bs))
                best = t if best is None else min(best, t)
            n = len(prompts) * out_len
            res = {"engine": "hf-generate", "elapsed_s": best, "output_tokens": n,
                   "output_tok_s": n / best}
        else:
            runs = [gen([p]) for p in prompts for _ in range(job["num_iters"])]
            ttft = sorted(r[0] for r in runs)[len(runs) // 2]
            decode = sorted((out_len - 1) / (r[1] - r[0]) for r in runs)[len(runs) // 2]
            res = {"engine": "hf-generate", "ttft_s": ttft, "decode_tok_s": decode}
    print_result(res)


if __name__ == "__main__":
    main()
