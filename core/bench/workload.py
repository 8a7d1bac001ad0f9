"""The workloads of ``pagebatch bench throughput|latency``: prompts of random token ids, input
and output lengths fixed or uniform in a range (``--input-len-min`` / ``--output-len-min``).

``--preset nanovllm`` is nano-vllm's bench.py workload exactly: ``random.seed(0)``; 256 prompts
of ``randint(100, 1024)`` ids each ``randint(0, 10000)``, then 256 output lengths
``randint(100, 1024)`` (133,966 output tokens).
"""

from __future__ import annotations

import argparse
import random
from typing import Any

from ..errors import ConfigError


def make_workload(args: argparse.Namespace, vocab: int,
                  seed: int) -> tuple[list[list[int]], list[int]]:
    """(prompts, output length of each) for the bench arguments.

    ``args``: ``num_prompts``, ``input_len``, ``output_len``, ``input_len_min``,
    ``output_len_min`` (None: fixed) and optionally ``preset``; ``vocab``: the vocabulary size
    (ids are drawn from [100, min(vocab, 10000) - 1]). Raises ConfigError when a minimum is
    above its maximum."""
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


def shift_ids(prompts: list[list[int]], by: int, hi: int) -> list[list[int]]:
    """``prompts`` with every id shifted by ``by`` modulo ``hi`` (the largest id + 1, so the ids
    stay inside the vocabulary): each run of a benchmark gets its own shift, so that no run hits
    the prefix cache that the ones before it left (every engine of a comparison the same way)."""
    return prompts if by == 0 else [[(t + by) % hi for t in p] for p in prompts]


def bench_sampling(args: argparse.Namespace) -> dict[str, Any] | None:
    """The ``--temperature`` / ``--top-p`` / ``--top-k`` of a bench run as `SamplingParams`
    fields, or None for greedy (the default)."""
    if args.temperature == 0.0 and args.top_p == 1.0 and args.top_k == 0:
        return None
    return {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k}
