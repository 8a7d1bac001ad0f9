"""The scheduler alone under a serve sweep's arrivals (no model, no GPU): where TTFT and TPOT
(and ITL, over every gap between two of a request's tokens) would be if every step took what a
step-time model says, to tell scheduling from runtime.

Poisson arrivals at RATE req/s of NUM requests, input 512 and output 128 tokens +-50 % (uniform,
seeded: the sweep of scripts/gpu_serve.sh), the real Scheduler (fcfs, block size 16, 256 seqs,
chunked prefill, ``--max-num-batched-tokens``, ``--long-prefill-token-threshold``,
``--max-mixed-prefill-tokens``), and a step time of

    max(weights_s, tokens * flop_per_token / flops) + host_s + context_tokens * kv_bytes / hbm

(defaults: the Llama-3.1-8B shape in bf16 on an H200: 16 GB of weights over 4 TB/s = 4 ms,
16 GFLOP per token at 600 TFLOP/s, 1 ms of host and launch time, 128 KiB of KV per token);
a step with prefill tokens above ``--graph-max-tokens`` (no piecewise CUDA graph) takes
max(GPU time, ``--eager-host-s``) instead. Also counts the requests whose longest gap between
two tokens passed ``--itl-slo-ms`` (what fails a goodput ITL SLO).

    .venv/bin/python scripts/sim_serve.py 8 16 32
    # session 39, the H100 of session 38 (16 GB / 3 TB/s, 550 TFLOP/s, eager past 512 tokens):
    .venv/bin/python scripts/sim_serve.py 8 32 64 1000 --max-num-batched-tokens 16384 \
        --graph-max-tokens 512 --weights-s 5.3e-3 --flops 550e12 --hbm 3e12
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers_sched import make_request  # noqa: E402

from pagebatch.kv_cache import KVCacheManager  # noqa: E402
from pagebatch.scheduler import Scheduler  # noqa: E402
from pagebatch.schedulers.fcfs import FCFSPolicy  # noqa: E402


def simulate(rate: float, num: int, mnbt: int, a: argparse.Namespace) -> str:
    rng = random.Random(0)
    t, arrivals = 0.0, []
    for _ in range(num):
        t += rng.expovariate(rate)
        arrivals.append((t, int(512 * rng.uniform(0.5, 1.5)), int(128 * rng.uniform(0.5, 1.5))))
    now = 0.0
    sched = Scheduler(KVCacheManager(50_000, 16), FCFSPolicy(None), 256, mnbt,
                      clock=lambda: now, enable_chunked_prefill=True,
                      long_prefill_token_threshold=a.long_prefill_token_threshold,
                      max_mixed_prefill_tokens=a.max_mixed_prefill_tokens)
    arrived, first, last, count, prev, gap = {}, {}, {}, {}, {}, {}
    itl = []  # every gap between two of a request's tokens, s
    i = steps = mixed = 0
    long_steps = []  # tokens of each step longer than the ITL SLO
    while len(last) < num:
        while i < num and arrivals[i][0] <= now:
            r = make_request(f"r{i}", arrivals[i][1], max_tokens=arrivals[i][2], ignore_eos=True)
            arrived[r.request_id] = arrivals[i][0]
            sched.add_request(r)
            i += 1
        so = sched.schedule()
        if not so.scheduled:
            now = arrivals[i][0]
            continue
        context = sum(s.start_pos + len(s.token_ids) for s in so.scheduled)
        steps += 1
        mixed += any(len(s.token_ids) > 1 for s in so.scheduled)
        gpu = (max(a.weights_s, so.num_scheduled_tokens * a.flop_per_token / a.flops)
               + context * a.kv_bytes / a.hbm)
        eager = so.num_scheduled_tokens > a.graph_max_tokens and any(
            len(s.token_ids) > 1 for s in so.scheduled)  # no CUDA graph: host-bound launches
        dt = max(gpu, a.eager_host_s) if eager else gpu + a.host_s
        now += dt
        if dt > a.itl_slo_ms / 1e3:
            long_steps.append(so.num_scheduled_tokens)
        for req, toks in sched.update_from_output(
                so, {s.request_id: 5 for s in so.scheduled if s.sample}):
            rid = req.request_id
            first.setdefault(rid, now)
            if toks and rid in prev:
                itl.append(now - prev[rid])
                gap[rid] = max(gap.get(rid, 0.0), itl[-1])
            if toks:
                prev[rid] = now
            count[rid] = count.get(rid, 0) + len(toks)
            if req.is_finished:
                last[rid] = now
    ttft = sorted(first[r] - arrived[r] for r in first)
    tpot = sorted((last[r] - first[r]) / (count[r] - 1) for r in last if count[r] > 1)
    slow = sum(gap.get(r, 0.0) > a.itl_slo_ms / 1e3 for r in last)
    itl.sort()

    def q(v, p):
        return v[min(len(v) - 1, int(p * len(v)))] * 1e3

    out_tps = sum(count.values()) / max(last.values())
    return (f"rate {rate:g}: {steps} steps ({mixed} with a prefill), {out_tps:,.0f} out tok/s, "
            f"TTFT p50 / p99 {q(ttft, .5):.1f} / {q(ttft, .99):.1f} ms, "
            f"TPOT p50 / p99 {q(tpot, .5):.1f} / {q(tpot, .99):.1f} ms, "
            f"ITL p50 / p99 {q(itl, .5):.1f} / {q(itl, .99):.1f} ms, "
            f"{slow} of {num} requests with a gap > {a.itl_slo_ms:g} ms"
            + (f" ({len(long_steps)} steps over it, {min(long_steps)}-{max(long_steps)} tokens)"
               if long_steps else ""))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("rates", nargs="+", type=float)
    p.add_argument("--num", type=int, default=200)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--weights-s", type=float, default=4.0e-3)
    p.add_argument("--flop-per-token", type=float, default=16e9)
    p.add_argument("--flops", type=float, default=600e12)
    p.add_argument("--host-s", type=float, default=1.0e-3)
    p.add_argument("--kv-bytes", type=float, default=128 * 1024)
    p.add_argument("--hbm", type=float, default=4e12)
    p.add_argument("--graph-max-tokens", type=int, default=10**9,
                   help="steps with prefill tokens above this run eagerly (no piecewise graph)")
    p.add_argument("--eager-host-s", type=float, default=21e-3,
                   help="host time of an eager step (session 37, 8B shape: ~21 ms)")
    p.add_argument("--itl-slo-ms", type=float, default=50.0)
    p.add_argument("--long-prefill-token-threshold", type=int, default=0,
                   help="most tokens of one request in a step (the engine's option); 0: no cap")
    p.add_argument("--max-mixed-prefill-tokens", type=int, default=0,
                   help="most prompt tokens of a step with decodes (engine option); 0: no cap")
    a = p.parse_args()
    for rate in a.rates:
        print(simulate(rate, a.num, a.max_num_batched_tokens, a))


if __name__ == "__main__":
    main()
