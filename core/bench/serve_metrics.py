"""The measurements of ``pagebatch bench serve`` (serve.py) and their summary, in vLLM's
``benchmark_serving`` terms: TTFT (time to first token), TPOT (time per output token after the
first), ITL (inter-token latency: time between streamed chunks) and E2EL (end-to-end latency),
each as mean, median and p99 in milliseconds."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Result:
    """One streamed request: ``ttft``, ``latency`` (end to end) and each ``itl`` in seconds;
    ``ok`` False with ``error`` when it failed."""

    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)


def _stats(values: list[float]) -> dict[str, float]:
    """mean, median and p99 in milliseconds (0 for none)."""
    if not values:
        return {"mean_ms": 0.0, "median_ms": 0.0, "p99_ms": 0.0}
    import numpy as np

    a = np.asarray(values, dtype=float) * 1e3
    return {"mean_ms": float(a.mean()), "median_ms": float(np.median(a)),
            "p99_ms": float(np.percentile(a, 99))}


def summarize(results: list[Result], duration: float) -> dict[str, Any]:
    """Counts, throughputs (per second of ``duration``, seconds) and the latency stats of the
    requests that completed (the first five distinct errors of the others)."""
    done = [r for r in results if r.ok]
    n_in = sum(r.prompt_tokens for r in done)
    n_out = sum(r.output_tokens for r in done)
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    return {
        "completed": len(done), "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration, "total_input_tokens": n_in, "total_output_tokens": n_out,
        "request_throughput": len(done) / duration if duration > 0 else 0.0,
        "output_token_throughput": n_out / duration if duration > 0 else 0.0,
        "total_token_throughput": (n_in + n_out) / duration if duration > 0 else 0.0,
        "ttft": _stats([r.ttft for r in done]), "tpot": _stats(tpot),
        "itl": _stats([x for r in done for x in r.itl]),
        "e2el": _stats([r.latency for r in done]),
    }


def print_table(r: dict[str, Any]) -> None:
    """Print `summarize`'s result (with the run's settings added) as a two-column table."""
    print(f"\nserve: {r['num_prompts']} requests x {r['input_len']} in / {r['output_len']} out"
          f" to {r['base_url']} (rate {r['request_rate']}, max concurrency "
          f"{r['max_concurrency']})")
    rows = [("completed / failed", f"{r['completed']} / {r['failed']}"),
            ("duration s", f"{r['duration_s']:.2f}"),
            ("request throughput req/s", f"{r['request_throughput']:.2f}"),
            ("output token throughput tok/s", f"{r['output_token_throughput']:.1f}"),
            ("total token throughput tok/s", f"{r['total_token_throughput']:.1f}")]
    for w, k in (("mean", "mean_ms"), ("median", "median_ms"), ("p99", "p99_ms")):
        for name in ("ttft", "tpot", "itl", "e2el"):
            rows.append((f"{w} {name.upper()} ms", f"{r[name][k]:.2f}"))
    for k, v in rows:
        print(f"{k:<32}{v:>14}")
    for e in r["errors"]:
        print(f"error: {e}")
