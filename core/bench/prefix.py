"""``pagebatch bench prefix``: what prefix caching and the scheduling policy buy.

Two offline workloads of random token ids (all requests arrive at once, greedy, EOS ignored):

- **shared**: ``--num-prompts`` requests = one ``--shared-len`` system prompt + a unique
  ``--unique-len`` suffix; run with prefix caching off and on. Reports the fraction of prompt
  tokens served from the cache (ideal: shared / (shared + unique), less the first request) and
  the mean time to first token.
- **mixed**: ``--groups`` groups of requests, each group sharing its own prefix, shuffled
  together with as many unrelated prompts; run with ``fcfs`` and ``lpm``, prefix caching on.
  Reports the hit rate and mean TTFT per policy.

TTFT of a request = time from the submission of the whole batch to its first output token.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from dataclasses import replace
from typing import Any

from ..config import EngineConfig


def add_prefix_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--shared-len", type=int, default=512)
    p.add_argument("--unique-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--groups", type=int, default=8, help="mixed workload: prefix groups")
    p.add_argument("--group-size", type=int, default=4, help="mixed workload: requests/group")
    p.add_argument("--output", metavar="JSON", help="write results as JSON")


def _run(config: EngineConfig, prompts: list[list[int]], output_len: int) -> dict[str, Any]:
    from ..engine import LLMEngine
    from ..request import SamplingParams

    engine = LLMEngine(config)
    sp = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    engine.add_request({"prompt_token_ids": [7, 8, 9]}, sp)  # warm-up
    while engine.has_unfinished_requests:
        engine.step()
    stats = engine.core.kv_cache.stats
    q0, h0 = stats.queries, stats.hits
    start = time.perf_counter()
    ids = [engine.add_request({"prompt_token_ids": p}, sp) for p in prompts]
    first: dict[str, float] = {}
    while engine.has_unfinished_requests:
        for out in engine.step():
            if out.request_id not in first and out.outputs[0].token_ids:
                first[out.request_id] = time.perf_counter() - start
    elapsed = time.perf_counter() - start
    queries, hits = stats.queries - q0, stats.hits - h0
    return {"hit_rate": hits / queries if queries else 0.0,
            "mean_ttft_s": statistics.fmean(first[i] for i in ids),
            "elapsed_s": elapsed}


def run_prefix_bench(args: argparse.Namespace, config: EngineConfig) -> int:
    from ..model_loader import load_hf_config, resolve_model

    vocab = int(load_hf_config(resolve_model(config.model, config.load_format).folder).vocab_size)
    rng = random.Random(config.seed)

    def rand(n: int) -> list[int]:
        return [rng.randint(100, min(vocab, 10000) - 1) for _ in range(n)]

    system = rand(args.shared_len)
    shared = [system + rand(args.unique_len) for _ in range(args.num_prompts)]
    mixed = []
    for _ in range(args.groups):
        prefix = rand(args.shared_len)
        mixed += [prefix + rand(args.unique_len) for _ in range(args.group_size)]
    mixed += [rand(args.shared_len + args.unique_len) for _ in range(args.groups * args.group_size)]
    rng.shuffle(mixed)

    rows = []
    for name, prompts, cfg in [
        ("shared, caching off", shared, replace(config, enable_prefix_caching=False)),
        ("shared, caching on", shared, replace(config, enable_prefix_caching=True)),
        ("mixed, fcfs", mixed, replace(config, enable_prefix_caching=True,
                                       scheduling_policy="fcfs")),
        ("mixed, lpm", mixed, replace(config, enable_prefix_caching=True,
                                      scheduling_policy="lpm")),
    ]:
        rows.append({"run": name, **_run(cfg, prompts, args.output_len)})
    ideal = (args.num_prompts - 1) * args.shared_len / (
        args.num_prompts * (args.shared_len + args.unique_len))
    print(f"\nprefix: shared = {args.num_prompts} x ({args.shared_len} shared + "
          f"{args.unique_len} unique) tokens, ideal hit rate {ideal:.3f}; mixed = "
          f"{args.groups} groups x {args.group_size} + {args.groups * args.group_size} "
          f"unrelated; {args.output_len} output tokens each")
    print(f"{'run':<22}{'hit rate':>10}{'mean TTFT s':>13}{'elapsed s':>11}")
    for r in rows:
        print(f"{r['run']:<22}{r['hit_rate']:>10.3f}{r['mean_ttft_s']:>13.3f}"
              f"{r['elapsed_s']:>11.2f}")
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k != "func"},
                       "config": config.to_dict(), "ideal_hit_rate": ideal, "results": rows},
                      f, indent=2)
    return 0
