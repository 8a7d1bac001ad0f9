"""``pagebatch bench serve --base-url URL``: a load generator for any OpenAI-compatible server
(pagebatch serve, vllm serve, ...), in the manner of ``vllm bench serve``.

A seeded dataset (serve_dataset.py: mixed lengths with ``--range-ratio``, a common
``--shared-prefix-len`` prefix, token-id or text prompts), sent streamed to ``--endpoint`` at
``--request-rate`` (Poisson, gamma with ``--burstiness``, or ``--arrival constant``;
arrivals.py), at most ``--max-concurrency`` in flight (serve_client.py), from this process or
from ``--client-processes`` N (serve_workers.py). Reports throughputs,
goodput under ``--goodput`` SLOs and TTFT / TPOT / ITL / E2EL stats (serve_metrics.py), a table
(serve_report.py), JSON (``--output``), the cost per 1M output tokens (``--gpu-cost-per-hour``,
cost.py); ``--rates 1,2,4,inf`` runs one after another and ``--plot FILE.png`` draws latency
against load (serve_plot.py). Needs httpx; matplotlib for ``--plot`` only.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import math
import os
import sys
import time
from typing import Any

from .arrivals import ARRIVALS, arrival_times, check_rate
from .cost import add_cost_argument, cost_fields
from .serve_client import ENDPOINTS, one_request, request_body, send_on_schedule
from .serve_dataset import DatasetSpec, ServeRequest, make_dataset
from .serve_metrics import Result, parse_goodput, parse_percentiles, summarize
from .serve_report import print_sweep, print_table


def _rate(v: str) -> float:
    try:
        return check_rate(float(v))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{e} (got {v!r})") from None


def _rates(v: str) -> list[float]:
    return [_rate(part) for part in v.split(",")]


def _arg_type(parse):
    def wrapped(v: str):
        try:
            return parse(v)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return wrapped


def add_serve_bench_parser(bsub) -> None:
    p = bsub.add_parser("serve", help="load-test an OpenAI-compatible server (--base-url)")
    p.add_argument("--base-url", required=True, help="server root, e.g. http://127.0.0.1:8000")
    p.add_argument("--endpoint", choices=ENDPOINTS, default="/v1/completions")
    p.add_argument("--model", default=None, help="model name (default: the first of "
                   "/v1/models)")
    p.add_argument("--api-key", default=None, help="bearer key (default: $OPENAI_API_KEY or "
                   "$PAGEBATCH_API_KEY)")
    d = p.add_argument_group("dataset (seeded: --seed fixes every prompt and length)")
    d.add_argument("--num-prompts", type=int, default=100)
    d.add_argument("--input-len", type=int, default=128)
    d.add_argument("--output-len", type=int, default=64)
    d.add_argument("--range-ratio", "--random-range-ratio", type=float, default=0.0,
                   help="mixed lengths: input and output lengths uniform in [L*(1-r), "
                   "L*(1+r)] (vLLM's random dataset; 0: fixed)")
    d.add_argument("--shared-prefix-len", type=int, default=0,
                   help="tokens (words for text) of one prefix common to every prompt")
    d.add_argument("--prompt-kind", choices=["auto", "token-ids", "text"], default="auto",
                   help="token-id prompts (exact input length; /v1/completions) or random "
                   "words; auto: token ids on /v1/completions, text on chat")
    d.add_argument("--vocab-size", type=int, default=32000,
                   help="token ids are drawn from [min(100, vocab/4), min(vocab, 10000))")
    d.add_argument("--seed", type=int, default=0)
    a = p.add_argument_group("load")
    a.add_argument("--request-rate", type=_rate, default=math.inf,
                   help="requests per second (inf: all at once)")
    a.add_argument("--rates", type=_rates, default=None, metavar="R,R,...",
                   help="run once per rate, e.g. 1,2,4,inf (overrides --request-rate); each "
                   "run has the same lengths, its own tokens")
    a.add_argument("--arrival", choices=ARRIVALS, default="poisson",
                   help="poisson: gamma gaps of shape --burstiness (1: Poisson); constant: "
                   "request i at i / rate")
    a.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the gaps (vLLM's flag): <1 burstier, >1 steadier")
    a.add_argument("--max-concurrency", type=int, default=None,
                   help="most requests in flight at once")
    a.add_argument("--client-processes", type=int, default=1,
                   help="send from this many client processes (request i from process i mod "
                   "N; serve_workers.py), so that reading many streams in one event loop "
                   "does not add to the latencies measured")
    a.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    a.add_argument("--temperature", type=float, default=0.0)
    a.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    o = p.add_argument_group("report")
    o.add_argument("--percentiles", type=_arg_type(parse_percentiles), default=(50.0, 90.0,
                   99.0), metavar="P,P,...", help="latency percentiles (default 50,90,99)")
    o.add_argument("--goodput", nargs="+", type=str, default=None, metavar="METRIC:MS",
                   help="SLOs, e.g. ttft:500 itl:50 (ms; ttft, tpot, itl (a request's "
                   "longest gap), e2el): goodput = requests/s meeting all of them")
    add_cost_argument(o)
    o.add_argument("--output", metavar="JSON", help="write the results as JSON")
    o.add_argument("--plot", metavar="PNG", help="plot latency against load (matplotlib)")
    p.set_defaults(func=run_serve_bench)


def dataset_spec(args: argparse.Namespace) -> DatasetSpec:
    kind = args.prompt_kind
    if kind == "auto":
        kind = "text" if args.endpoint.endswith("/chat/completions") else "token-ids"
    return DatasetSpec(num_prompts=args.num_prompts, input_len=args.input_len,
                       output_len=args.output_len, range_ratio=args.range_ratio,
                       shared_prefix_len=args.shared_prefix_len,
                       token_ids=kind == "token-ids", vocab_size=args.vocab_size,
                       seed=args.seed)


async def _send_all(client: Any, args: argparse.Namespace, model: str,
                    requests: list[ServeRequest], rate: float) -> tuple[list[Result], float]:
    """Send ``requests`` on the schedule of ``rate``; (their results, the run's seconds)."""
    times = arrival_times(len(requests), rate, args.arrival, args.burstiness, args.seed)
    sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None

    async def send(req: ServeRequest) -> Result:
        body = request_body(args.endpoint, model, req, args.temperature, args.ignore_eos)
        if sem is None:
            return await one_request(client, args.endpoint, body, req.prompt_len)
        async with sem:
            return await one_request(client, args.endpoint, body, req.prompt_len)

    start = time.monotonic()
    results = await send_on_schedule(times, start, lambda i: send(requests[i]))
    return results, time.monotonic() - start


def _client_processes(args: argparse.Namespace, headers: dict[str, str]) -> Any:
    """`ClientProcesses` for ``--client-processes`` > 1 (a context manager), else a null
    context (None: this process sends)."""
    if args.client_processes == 1:
        return contextlib.nullcontext()
    from .serve_workers import ClientProcesses

    return ClientProcesses(args.client_processes, {
        "base_url": args.base_url.rstrip("/"), "headers": headers, "timeout": args.timeout,
        "connections": -(-args.num_prompts // args.client_processes)})


async def run_load(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One result per rate (``--rates``, else ``--request-rate``)."""
    import logging

    import httpx

    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a log line per request
    key = args.api_key or os.environ.get("OPENAI_API_KEY") or os.environ.get(
        "PAGEBATCH_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    limits = httpx.Limits(max_connections=args.max_concurrency or args.num_prompts,
                          max_keepalive_connections=args.max_concurrency or 100)
    spec = dataset_spec(args)
    slos = parse_goodput(args.goodput) if args.goodput else None
    rates = args.rates or [args.request_rate]
    runs = []
    with _client_processes(args, headers) as procs:
        async with httpx.AsyncClient(base_url=args.base_url.rstrip("/"), headers=headers,
                                     timeout=args.timeout, limits=limits) as client:
            model = args.model
            if model is None:
                r = await client.get("/v1/models")
                r.raise_for_status()
                model = r.json()["data"][0]["id"]
            for i, rate in enumerate(rates):
                requests = make_dataset(spec, variant=i if len(rates) > 1 else 0)
                if procs is None:
                    results, duration = await _send_all(client, args, model, requests, rate)
                else:  # blocks this loop, which has nothing else to do meanwhile
                    results, duration = procs.run(
                        args.endpoint, [request_body(args.endpoint, model, req,
                                                     args.temperature, args.ignore_eos)
                                        for req in requests],
                        [req.prompt_len for req in requests],
                        arrival_times(len(requests), rate, args.arrival, args.burstiness,
                                      args.seed))
                out = summarize(results, duration, args.percentiles, slos)
                out.update(model=model, base_url=args.base_url, endpoint=args.endpoint,
                           num_prompts=spec.num_prompts, input_len=spec.input_len,
                           output_len=spec.output_len, range_ratio=spec.range_ratio,
                           shared_prefix_len=spec.shared_prefix_len,
                           prompt_kind="token-ids" if spec.token_ids else "text",
                           request_rate=rate if math.isfinite(rate) else "inf",
                           arrival=args.arrival, burstiness=args.burstiness,
                           max_concurrency=args.max_concurrency, ignore_eos=args.ignore_eos,
                           seed=args.seed, client_processes=args.client_processes,
                           **cost_fields(args.gpu_cost_per_hour,
                                         out["output_token_throughput"]))
                runs.append(out)
    return runs


def _check(args: argparse.Namespace) -> str | None:
    """The first bad flag combination, as a message; None when all is well."""
    try:
        dataset_spec(args).check()
        if args.goodput:
            parse_goodput(args.goodput)
    except ValueError as e:
        return str(e)
    if args.max_concurrency is not None and args.max_concurrency < 1:
        return f"--max-concurrency must be >= 1, got {args.max_concurrency}"
    if args.client_processes < 1:
        return f"--client-processes must be >= 1, got {args.client_processes}"
    if args.client_processes > 1 and args.max_concurrency is not None:
        return (f"--max-concurrency {args.max_concurrency} is one limit over all requests; "
                f"it takes --client-processes 1, got {args.client_processes}")
    if not args.burstiness > 0 or math.isinf(args.burstiness):
        return f"--burstiness must be a finite number > 0, got {args.burstiness}"
    if args.arrival == "constant" and args.burstiness != 1.0:
        return "--burstiness shapes poisson arrivals; --arrival constant takes none"
    if args.prompt_kind == "token-ids" and args.endpoint.endswith("/chat/completions"):
        return f"{args.endpoint} takes text prompts: --prompt-kind text (or auto)"
    return None


def run_serve_bench(args: argparse.Namespace) -> int:
    """Run the load; exit status 0 when every request completed, 1 if any failed, 2 for bad
    flags."""
    err = _check(args)
    if err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    gc.collect()
    gc.freeze()  # the client's start-up objects: no full collection stalls its timing of streams
    runs = asyncio.run(run_load(args))
    for r in runs:
        print_table(r)
    if len(runs) > 1:
        print_sweep(runs)
    if args.output:
        with open(args.output, "w") as f:
            json.dump(runs[0] if args.rates is None else {"rates": [r["request_rate"] for r in
                      runs], "runs": runs}, f, indent=2)
    if args.plot:
        from .serve_plot import plot_sweep

        plot_sweep(runs, args.plot, title=f"{runs[0]['model']} at {args.base_url}")
    return 0 if all(r["failed"] == 0 for r in runs) else 1
