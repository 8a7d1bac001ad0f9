"""``pagebatch bench throughput|latency``: offline benchmarks, optionally side by side with
Hugging Face transformers (``--compare hf``, run in a separate process on the same workload).

throughput: N prompts of random token ids, input and output lengths fixed or uniform in a range
(``--input-len-min`` / ``--output-len-min``), EOS ignored, greedy; reports output tokens per
second over the whole run. ``--preset nanovllm`` is nano-vllm's bench.py workload exactly:
``random.seed(0)``; 256 prompts of ``randint(100, 1024)`` ids each ``randint(0, 10000)``, then
256 output lengths ``randint(100, 1024)`` (133,966 output tokens). latency: one request at a
time; reports decode tokens per second (output tokens after the first, over the time after the
first) and TTFT.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from typing import Any

from .config import EngineConfig, parse_int
from .errors import ConfigError


def weight_bytes(model) -> int:
    """Bytes of the model's weights: parameters and persistent buffers (quantized weights,
    scales), each storage once (tied embeddings); not derived caches such as the rotary
    cos/sin table (a non-persistent buffer)."""
    seen, total = set(), 0
    for t in [*model.parameters(), *model.state_dict().values()]:
        if t is None or t.untyped_storage().data_ptr() in seen:
            continue
        seen.add(t.untyped_storage().data_ptr())
        total += t.untyped_storage().nbytes()
    return total


def _at_least(minimum: int):
    """An argparse type: config's `parse_int` (argparse names the flag and exits 2)."""
    check = parse_int(minimum)

    def parse(v: str) -> int:
        try:
            return check(v)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"{e}, got {v}") from None

    return parse


def add_bench_parser(sub, add_engine_args, func) -> None:
    b = sub.add_parser("bench", help="offline throughput / latency benchmarks; serve: "
                       "load-test a server")
    bsub = b.add_subparsers(dest="bench_kind", required=True)
    for kind in ("throughput", "latency"):
        p = bsub.add_parser(kind)
        add_engine_args(p)
        p.add_argument("--num-prompts", type=_at_least(1),
                       default=16 if kind == "throughput" else 1)
        p.add_argument("--input-len", type=_at_least(1), default=128)
        p.add_argument("--output-len", type=_at_least(1), default=64)
        p.add_argument("--input-len-min", type=_at_least(1), default=None,
                       help="input lengths uniform in [this, --input-len] (default: fixed)")
        p.add_argument("--output-len-min", type=_at_least(1), default=None,
                       help="output lengths uniform in [this, --output-len] (default: fixed)")
        p.add_argument("--preset", choices=["nanovllm"], default=None,
                       help="a named workload (overrides prompts and lengths)")
        p.add_argument("--num-iters", type=_at_least(1), default=1 if kind == "throughput" else 3)
        p.add_argument("--compare", choices=["hf"], default=None,
                       help="also run transformers generate on the same workload")
        p.add_argument("--hf-batch-size", type=_at_least(1), default=None,
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


def make_workload(args: argparse.Namespace, vocab: int,
                  seed: int) -> tuple[list[list[int]], list[int]]:
    """(prompts, output length of each) for the bench arguments."""
    if getattr(args, "preset", None) == "nanovllm":
        rng = random.Random(0)  # nano-vllm's bench.py seeds the global stream with 0
        prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(100, 1024))]
                   for _ in range(256)]
        return prompts, [rng.randint(100, 1024) for _ in range(256)]
    rng = random.Random(seed)
    hi = min(vocab, 10000) - 1
    in_lo = args.input_len_min or args.input_len
    out_lo = args.output_len_min or args.output_len
    for flag, lo, top in (("input", in_lo, args.input_len), ("output", out_lo, args.output_len)):
        if lo > top:
            raise ConfigError(f"--{flag}-len-min={lo} is above --{flag}-len={top}")
    prompts = [[rng.randint(100, hi) for _ in range(rng.randint(in_lo, args.input_len))]
               for _ in range(args.num_prompts)]
    return prompts, [rng.randint(out_lo, args.output_len) for _ in prompts]


def bench_pagebatch(config: EngineConfig, kind: str, prompts: list[list[int]],
                    out_lens: list[int], num_iters: int) -> dict[str, Any]:
    from .engine import LLMEngine
    from .request import SamplingParams

    t0 = time.perf_counter()
    engine = LLMEngine(config)
    startup = time.perf_counter() - t0
    params = {n: SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
              for n in set(out_lens)}
    sp_of = {i: params[n] for i, n in enumerate(out_lens)}

    def run(batch: list[list[int]]) -> tuple[float, float, int]:
        ttft = None
        start = time.perf_counter()
        for i, p in enumerate(batch):
            core_req, state = engine.prepare({"prompt_token_ids": p}, sp_of[i])
            if kind == "throughput":  # latency's TTFT needs the first output
                state.want_final_only()
            engine.submit(core_req, state)
        n_out = 0
        while engine.has_unfinished_requests:
            outs = engine.step()
            if ttft is None and outs:
                ttft = time.perf_counter() - start
            n_out += sum(len(o.outputs[0].token_ids) for o in outs if o.finished)
        return time.perf_counter() - start, ttft or 0.0, n_out

    # every run's prompts have their ids shifted by a run-own amount (mod the largest id + 1,
    # so inside the vocabulary): no run may hit the prefix cache that the ones before it left
    hi = max(max(p, default=0) for p in prompts) + 1

    def shifted(ps: list[list[int]], by: int) -> list[list[int]]:
        return ps if by == 0 else [[(t + by) % hi for t in p] for p in ps]

    # warm-up (shift -1): throughput runs the whole workload once, latency one request. Triton
    # compiles (or loads from its cache) the kernel variants a workload meets on first use; a
    # quarter of the workload left 1-3 s of that in the first timed run on an H200 (session 7:
    # 8.7 s then 5.8, 5.8 s for the nano-vllm workload). The time is reported as warmup_s.
    t0 = time.perf_counter()
    warm = shifted(prompts, hi - 1)
    run(warm if kind == "throughput" else warm[:1])
    res: dict[str, Any] = {"engine": "pagebatch", "startup_s": round(startup, 2),
                           "warmup_s": round(time.perf_counter() - t0, 2)}
    runner = getattr(engine.core, "runner", None)  # in this process (no client)
    if runner is not None:
        model = runner.model
        res["weights_gb"] = round(weight_bytes(model) / 1e9, 3)
        res["kv_cache_tokens"] = runner.num_blocks * runner.block_size
    if kind == "throughput":
        times = [run(shifted(prompts, i)) for i in range(num_iters)]
        elapsed = min(t[0] for t in times)
        n_out = times[0][2]
        res.update(elapsed_s=elapsed, output_tokens=n_out, output_tok_s=n_out / elapsed,
                   elapsed_each_s=[round(t[0], 3) for t in times])
    else:
        # each iteration a prompt of its own: TTFT without prefix-cache hits
        runs = [run(shifted([p], 1 + i)) for p in prompts for i in range(num_iters)]
        ttft = sorted(r[1] for r in runs)[len(runs) // 2]
        decode = sorted((r[2] - 1) / (r[0] - r[1]) for r in runs)[len(runs) // 2]
        res.update(ttft_s=ttft, decode_tok_s=decode)
    engine.shutdown()  # give the device back before --compare runs the other engine
    engine = None
    _free_device_memory()
    return res


def _free_device_memory() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_bench(args: argparse.Namespace, config: EngineConfig) -> int:
    from .model_loader import load_hf_config, resolve_model

    if args.bench_kind == "prefix":
        from .bench_prefix import run_prefix_bench

        return run_prefix_bench(args, config)

    source = resolve_model(config.model, config.load_format)
    vocab = int(load_hf_config(source.folder).vocab_size)
    prompts, out_lens = make_workload(args, vocab, config.seed)
    results = [bench_pagebatch(config, args.bench_kind, prompts, out_lens, args.num_iters)]
    results[0]["workload_output_tokens"] = sum(out_lens)
    if args.compare == "hf":
        if len(set(out_lens)) > 1 or len({len(p) for p in prompts}) > 1:
            print("--compare hf runs fixed-length workloads only (static batches)",
                  file=sys.stderr)
            return 2
        job = {"folder": str(source.folder), "kind": args.bench_kind, "prompts": prompts,
               "output_len": args.output_len, "num_iters": args.num_iters,
               "batch_size": args.hf_batch_size or len(prompts), "device": config.device,
               "dtype": config.dtype, "load_format": config.load_format}
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
    if getattr(args, "preset", None):
        print(f"\n{args.bench_kind}: the {args.preset} workload")
    else:
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
