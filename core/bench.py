"""``pagebatch bench throughput|latency``: offline benchmarks, optionally side by side with
Hugging Face transformers (``--compare hf``, run in a separate process on the same workload).

throughput: N prompts of random token ids (fixed lengths), EOS ignored, greedy; reports output
tokens per second over the whole run. latency: one request at a time; reports decode tokens per
second (output tokens after the first, over the time after the first) and TTFT.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from typing import Any

from .config import EngineConfig


def add_bench_parser(sub, add_engine_args, func) -> None:
    b = sub.add_parser("bench", help="offline throughput / latency benchmarks; serve: "
                       "load-test a server")
    bsub = b.add_subparsers(dest="bench_kind", required=True)
    for kind in ("throughput", "latency"):
        p = bsub.add_parser(kind)
        add_engine_args(p)
        p.add_argument("--num-prompts", type=int, default=16 if kind == "throughput" else 1)
        p.add_argument("--input-len", type=int, default=128)
        p.add_argument("--output-len", type=int, default=64)
        p.add_argument("--num-iters", type=int, default=1 if kind == "throughput" else 3)
        p.add_argument("--compare", choices=["hf"], default=None,
                       help="also run transformers generate on the same workload")
        p.add_argument("--hf-batch-size", type=int, default=None,
                       help="transformers static batch size (default: all prompts at once)")
        p.add_argument("--output", metavar="JSON", help="write results as JSON")
        p.set_defaults(func=func)
    from .bench_prefix import add_prefix_bench_args

    p = bsub.add_parser("prefix", help="prefix caching on/off and fcfs vs lpm")
    add_engine_args(p)
    add_prefix_bench_args(p)
    p.set_defaults(func=func)
    from .bench_serve import add_serve_bench_parser

    add_serve_bench_parser(bsub)  # no engine keys: it drives a server at --base-url


def make_prompts(num: int, input_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    hi = min(vocab, 10000) - 1
    return [[rng.randint(100, hi) for _ in range(input_len)] for _ in range(num)]


def bench_pagebatch(config: EngineConfig, kind: str, prompts: list[list[int]], output_len: int,
                    num_iters: int) -> dict[str, Any]:
    from .engine import LLMEngine
    from .request import SamplingParams

    t0 = time.perf_counter()
    engine = LLMEngine(config)
    startup = time.perf_counter() - t0
    sp = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)

    def run(batch: list[list[int]]) -> tuple[float, float, int]:
        ttft = None
        start = time.perf_counter()
        for p in batch:
            engine.add_request({"prompt_token_ids": p}, sp)
        n_out = 0
        while engine.has_unfinished_requests:
            outs = engine.step()
            if ttft is None and outs:
                ttft = time.perf_counter() - start
            n_out += sum(len(o.outputs[0].token_ids) for o in outs if o.finished)
        return time.perf_counter() - start, ttft or 0.0, n_out

    run(prompts[:1])  # warm-up
    res: dict[str, Any] = {"engine": "pagebatch", "startup_s": round(startup, 2)}
    if kind == "throughput":
        times = [run(prompts) for _ in range(num_iters)]
        elapsed = min(t[0] for t in times)
        n_out = times[0][2]
        res.update(elapsed_s=elapsed, output_tokens=n_out, output_tok_s=n_out / elapsed)
    else:
        runs = [run([p]) for p in prompts for _ in range(num_iters)]
        ttft = sorted(r[1] for r in runs)[len(runs) // 2]
        decode = sorted((output_len - 1) / (r[0] - r[1]) for r in runs)[len(runs) // 2]
        res.update(ttft_s=ttft, decode_tok_s=decode)
    return res


def run_bench(args: argparse.Namespace, config: EngineConfig) -> int:
    from .model_loader import load_hf_config, resolve_model

    if args.bench_kind == "prefix":
        from .bench_prefix import run_prefix_bench

        return run_prefix_bench(args, config)

    source = resolve_model(config.model, config.load_format)
    vocab = int(load_hf_config(source.folder).vocab_size)
    prompts = make_prompts(args.num_prompts, args.input_len, vocab, config.seed)
    results = [bench_pagebatch(config, args.bench_kind, prompts, args.output_len, args.num_iters)]
    if args.compare == "hf":
        job = {"folder": str(source.folder), "kind": args.bench_kind, "prompts": prompts,
               "output_len": args.output_len, "num_iters": args.num_iters,
               "batch_size": args.hf_batch_size or len(prompts), "device": config.device,
               "dtype": config.dtype}
        proc = subprocess.run([sys.executable, "-m", "pagebatch.bench_hf"],
                              input=json.dumps(job), capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            print(proc.stderr[-4000:], file=sys.stderr)
            return proc.returncode
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    _print_table(args, results)
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k != "func"},
                       "config": config.to_dict(), "results": results}, f, indent=2)
    return 0


def _print_table(args: argparse.Namespace, results: list[dict[str, Any]]) -> None:
    print(f"\n{args.bench_kind}: {args.num_prompts} prompts x {args.input_len} in / "
          f"{args.output_len} out")
    if args.bench_kind == "throughput":
        print(f"{'engine':<14}{'output tok/s':>14}{'elapsed s':>12}")
        for r in results:
            print(f"{r['engine']:<14}{r['output_tok_s']:>14.1f}{r['elapsed_s']:>12.2f}")
        base = results[0]["output_tok_s"]
    else:
        print(f"{'engine':<14}{'decode tok/s':>14}{'TTFT ms':>10}")
        for r in results:
            print(f"{r['engine']:<14}{r['decode_tok_s']:>14.1f}{r['ttft_s'] * 1e3:>10.1f}")
        base = results[0]["decode_tok_s"]
    if len(results) > 1:
        other = results[1].get("output_tok_s") or results[1].get("decode_tok_s")
        print(f"pagebatch / {results[1]['engine']}: {base / other:.2f}x")
