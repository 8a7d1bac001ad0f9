"""``pagebatch bench throughput|latency|prefix|serve``: the subcommand's parser and runner.

throughput: N prompts of random token ids (workload.py), EOS ignored, greedy; reports output
tokens per second over the whole run. latency: one request at a time; reports decode tokens per
second (output tokens after the first, over the time after the first) and TTFT. Both optionally
side by side with another engine on the same workload, in a separate process (``--compare hf``:
hf.py; ``--compare vllm``: vllm.py). prefix: prefix.py; serve: serve.py (drives a server, no
engine keys). ``--gpu-cost-per-hour USD`` adds the cost per 1M output tokens (cost.py).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from ..config import EngineConfig, parse_int
from ..request import SamplingParams
from . import hf, vllm
from .cost import add_cost_argument, cost_fields, cost_line
from .offline import bench_pagebatch
from .prefix import add_prefix_bench_args, run_prefix_bench
from .serve import add_serve_bench_parser
from .workload import bench_sampling, make_workload

# --compare NAME -> the adapter: (args, config, ModelSetup, prompts, output lengths) ->
# its result dict, or an exit status when it could not run
COMPARE = {"hf": hf.compare_hf, "vllm": vllm.compare_vllm}


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
    """Add ``bench`` and its kinds to the subparsers ``sub``. ``add_engine_args(parser)`` adds
    the engine keys; ``func(args)`` runs an engine benchmark (serve has its own)."""
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
        p.add_argument("--temperature", type=float, default=0.0,
                       help="sampling temperature (default 0: greedy); with top-p / top-k, "
                       "each prompt seeded (seed + its index)")
        p.add_argument("--top-p", type=float, default=1.0)
        p.add_argument("--top-k", type=int, default=0, help="0: off")
        p.add_argument("--compare", choices=list(COMPARE), default=None,
                       help="also run another engine on the same workload: hf "
                       "(transformers generate), vllm (vLLM's offline LLM, when importable)")
        p.add_argument("--hf-batch-size", type=_at_least(1), default=None,
                       help="transformers static batch size (default: all prompts at once)")
        add_cost_argument(p)
        p.add_argument("--output", metavar="JSON", help="write results as JSON")
        p.set_defaults(func=func)

    p = bsub.add_parser("prefix", help="prefix caching on/off and fcfs vs lpm")
    add_engine_args(p)
    add_prefix_bench_args(p)
    p.set_defaults(func=func)
    add_serve_bench_parser(bsub)  # no engine keys: it drives a server at --base-url


def run_bench(args: argparse.Namespace, config: EngineConfig) -> int:
    """Run ``pagebatch bench throughput|latency|prefix``; returns the exit status."""
    from ..model_setup import resolve_model_setup
    from ..registry import registry

    if args.bench_kind == "prefix":
        return run_prefix_bench(args, config)

    setup = resolve_model_setup(config, registry())  # the model and limits, for every engine
    vocab = int(setup.hf_config.vocab_size)
    prompts, out_lens = make_workload(args, vocab, config.seed)
    sampling = bench_sampling(args)
    if sampling is not None:  # checked before any engine starts
        SamplingParams(**sampling).validate()
    other = None
    if args.compare is not None:
        # the other engine first, in its own process: it exits before pagebatch starts, so each
        # finds the whole device free (vLLM refuses to start below gpu_memory_utilization free)
        other = COMPARE[args.compare](args, config, setup, prompts, out_lens)
        if isinstance(other, int):
            return other
    results = [bench_pagebatch(config, args.bench_kind, prompts, out_lens, args.num_iters,
                               sampling)]
    results[0]["workload_output_tokens"] = sum(out_lens)
    if other is not None:
        results.append(other)
    for r in results:
        r.update(cost_fields(args.gpu_cost_per_hour, priced_tok_s(r)))
    _print_table(args, results)
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k != "func"},
                       "config": config.to_dict(), "results": results}, f, indent=2)
    return 0


def priced_tok_s(result: dict[str, Any]) -> float:
    """The output tokens per second a result's cost is priced at: throughput's
    ``output_tok_s``; latency's ``decode_tok_s`` (one request at a time)."""
    return result.get("output_tok_s") or result.get("decode_tok_s") or 0.0


def _print_table(args: argparse.Namespace, results: list[dict[str, Any]]) -> None:
    sampling = bench_sampling(args)
    how = "" if sampling is None else ", sampled: " + ", ".join(
        f"{k} {v}" for k, v in sampling.items())
    if getattr(args, "preset", None):
        print(f"\n{args.bench_kind}: the {args.preset} workload{how}")
    else:
        print(f"\n{args.bench_kind}: {args.num_prompts} prompts x {args.input_len} in / "
              f"{args.output_len} out{how}")
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
    r = results[0]
    if "kv_peak_blocks" in r:
        print(f"KV cache: peak {r['kv_peak_blocks']} of {r['kv_blocks']} blocks in use "
              f"({r['kv_peak_gib']:.3g} GiB), {r['num_preemptions']} preemptions")
    if len(results) > 1:
        other = results[1].get("output_tok_s") or results[1].get("decode_tok_s")
        print(f"pagebatch / {results[1]['engine']}: {base / other:.2f}x")
    if args.gpu_cost_per_hour is not None:
        for r in results:
            print(cost_line(args.gpu_cost_per_hour, priced_tok_s(r), r["engine"]))
