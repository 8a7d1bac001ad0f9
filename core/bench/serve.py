"""``pagebatch bench serve --base-url URL``: a load generator for any OpenAI-compatible server
(pagebatch serve, vllm serve, ...), in the manner of vLLM's ``benchmark_serving``.

Random prompts of ``--input-len`` tokens (token-id prompts on /v1/completions, or text of as
many random words with ``--prompt-kind text``), ``--output-len`` tokens each with ``ignore_eos``,
all streamed. Requests arrive as a Poisson process of ``--request-rate`` per second (``inf``:
all at once), optionally capped at ``--max-concurrency`` in flight. Reports request and token
throughput and TTFT / TPOT / ITL / end-to-end latency mean, median and p99 as a table, and as
JSON with ``--output`` (serve_metrics.py). Needs only httpx (async).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from typing import Any

from .serve_metrics import Result, print_table, summarize

WORDS = ("the of and to in is you that it he was for on are as with his they at be this "
         "have from or one had by word but not what all were we when your can said there use "
         "an each which she do how their if will up other about out many then them these so "
         "some her would make like him into time has look two more write go see number no way "
         "could people my than first water been call who oil its now find long down day did "
         "get come made may part").split()


def add_serve_bench_parser(bsub) -> None:
    p = bsub.add_parser("serve", help="load-test an OpenAI-compatible server (--base-url)")
    p.add_argument("--base-url", required=True, help="server root, e.g. http://127.0.0.1:8000")
    p.add_argument("--endpoint", default="/v1/completions")
    p.add_argument("--model", default=None, help="model name (default: the first of "
                   "/v1/models)")
    p.add_argument("--api-key", default=None, help="bearer key (default: $OPENAI_API_KEY or "
                   "$PAGEBATCH_API_KEY)")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--prompt-kind", choices=["token-ids", "text"], default="token-ids",
                   help="token-id prompts (exact input length) or random words")
    p.add_argument("--vocab-size", type=int, default=32000,
                   help="token ids are drawn from [min(100, vocab/4), min(vocab, 10000))")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests per second, Poisson arrivals (inf: all at once)")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="most requests in flight at once")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--output", metavar="JSON", help="write the results as JSON")
    p.set_defaults(func=run_serve_bench)


def make_prompts(args: argparse.Namespace) -> list[Any]:
    rng = random.Random(args.seed)
    if args.prompt_kind == "text":
        return [" ".join(rng.choice(WORDS) for _ in range(args.input_len))
                for _ in range(args.num_prompts)]
    hi = min(args.vocab_size, 10000)
    lo = min(100, args.vocab_size // 4)
    return [[rng.randrange(lo, hi) for _ in range(args.input_len)]
            for _ in range(args.num_prompts)]


async def one_request(client: Any, url: str, body: dict[str, Any], input_len: int) -> Result:
    res = Result(prompt_tokens=input_len)
    start = time.perf_counter()
    last = None
    chunks = 0
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:300]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    res.error = str(obj["error"])[:300]
                    return res
                usage = obj.get("usage")
                if usage:
                    res.prompt_tokens = usage.get("prompt_tokens", res.prompt_tokens)
                    res.output_tokens = usage.get("completion_tokens", 0)
                if obj.get("choices"):
                    now = time.perf_counter()
                    if last is None:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
                    chunks += 1
    except Exception as e:  # noqa: BLE001 - a failed request is counted, not fatal
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.latency = time.perf_counter() - start
    res.output_tokens = res.output_tokens or chunks
    res.ok = last is not None
    if not res.ok:
        res.error = "no output"
    return res


async def run_load(args: argparse.Namespace) -> dict[str, Any]:
    import logging

    import httpx

    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a log line per request

    key = args.api_key or os.environ.get("OPENAI_API_KEY") or os.environ.get(
        "PAGEBATCH_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    limits = httpx.Limits(max_connections=args.max_concurrency or args.num_prompts or 1,
                          max_keepalive_connections=args.max_concurrency or 100)
    async with httpx.AsyncClient(base_url=args.base_url.rstrip("/"), headers=headers,
                                 timeout=args.timeout, limits=limits) as client:
        model = args.model
        if model is None:
            r = await client.get("/v1/models")
            r.raise_for_status()
            model = r.json()["data"][0]["id"]
        prompts = make_prompts(args)
        rng = random.Random(args.seed + 1)
        sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None

        async def limited(p: Any) -> Result:
            body = {"model": model, "prompt": p, "max_tokens": args.output_len,
                    "temperature": args.temperature, "ignore_eos": args.ignore_eos,
                    "stream": True, "stream_options": {"include_usage": True}}
            n_in = len(p) if isinstance(p, list) else len(p.split())
            if sem is None:
                return await one_request(client, args.endpoint, body, n_in)
            async with sem:
                return await one_request(client, args.endpoint, body, n_in)

        start = time.perf_counter()
        tasks = []
        for i, p in enumerate(prompts):
            if i and math.isfinite(args.request_rate) and args.request_rate > 0:
                await asyncio.sleep(rng.expovariate(args.request_rate))
            tasks.append(asyncio.ensure_future(limited(p)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    out = summarize(list(results), duration)
    out.update(model=model, base_url=args.base_url, endpoint=args.endpoint,
               num_prompts=args.num_prompts, input_len=args.input_len,
               output_len=args.output_len, prompt_kind=args.prompt_kind,
               request_rate=args.request_rate if math.isfinite(args.request_rate) else "inf",
               max_concurrency=args.max_concurrency, ignore_eos=args.ignore_eos)
    return out


def run_serve_bench(args: argparse.Namespace) -> int:
    if args.num_prompts < 1 or args.input_len < 1 or args.output_len < 1:
        print("error: --num-prompts, --input-len and --output-len must be >= 1",
              file=sys.stderr)
        return 2
    result = asyncio.run(run_load(args))
    print_table(result)
    if args.output:
        with open(args.output, "w") as f:
            json.dump(result, f, indent=2)
    return 0 if result["failed"] == 0 else 1
