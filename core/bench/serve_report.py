"""The printed table of a ``pagebatch bench serve`` run (serve.py) and the one-line-per-rate
table of a ``--rates`` sweep."""

from __future__ import annotations

from typing import Any

from .cost import cost_line
from .serve_metrics import METRICS


def _stat_keys(r: dict[str, Any]) -> list[str]:
    """The stats of a run in print order: mean, median, the percentiles (std left to JSON;
    p50 is the median)."""
    return [k for k in r["ttft"] if k not in ("std_ms", "p50_ms")]


def print_table(r: dict[str, Any]) -> None:
    """Print one run's result (serve.py's `run_one`) as a two-column table."""
    print(f"\nserve: {r['num_prompts']} requests x {r['input_len']} in / {r['output_len']} out"
          f" (range ratio {r['range_ratio']}, shared prefix {r['shared_prefix_len']}) to "
          f"{r['base_url']}{r['endpoint']} (rate {r['request_rate']}, {r['arrival']}, max "
          f"concurrency {r['max_concurrency']})")
    rows = [("completed / failed", f"{r['completed']} / {r['failed']}"),
            ("duration s", f"{r['duration_s']:.2f}"),
            ("request throughput req/s", f"{r['request_throughput']:.2f}"),
            ("output token throughput tok/s", f"{r['output_token_throughput']:.1f}"),
            ("total token throughput tok/s", f"{r['total_token_throughput']:.1f}")]
    if r["request_goodput"] is not None:
        slos = " ".join(f"{k}:{v:g}" for k, v in r["goodput_slos_ms"].items())
        rows.append((f"goodput req/s ({slos} ms)", f"{r['request_goodput']:.2f}"))
    for k in _stat_keys(r):
        for name in METRICS:
            rows.append((f"{k[:-3]} {name.upper()} ms", f"{r[name][k]:.2f}"))
    for k, v in rows:
        print(f"{k:<36}{v:>14}")
    if r.get("gpu_cost_per_hour") is not None:
        print(cost_line(r["gpu_cost_per_hour"], r["output_token_throughput"]))
    for e in r["errors"]:
        print(f"error: {e}")


def print_sweep(runs: list[dict[str, Any]]) -> None:
    """One line per rate: throughputs, goodput and TTFT / ITL / E2EL at the top percentile."""
    top = [k for k in runs[0]["ttft"] if k.startswith("p")][-1:] or ["median_ms"]
    k = top[0]
    print(f"\n{'rate':>6}{'req/s':>8}{'out tok/s':>11}{'goodput':>9}"
          f"{'TTFT ' + k[:-3]:>11}{'ITL ' + k[:-3]:>10}{'TPOT ' + k[:-3]:>11}"
          f"{'E2EL ' + k[:-3]:>11}  (ms)")
    for r in runs:
        good = "-" if r["request_goodput"] is None else f"{r['request_goodput']:.2f}"
        print(f"{r['request_rate']!s:>6}{r['request_throughput']:>8.2f}"
              f"{r['output_token_throughput']:>11.1f}{good:>9}{r['ttft'][k]:>11.1f}"
              f"{r['itl'][k]:>10.1f}{r['tpot'][k]:>11.1f}{r['e2el'][k]:>11.1f}")
