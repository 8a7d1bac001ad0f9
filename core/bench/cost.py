"""``--gpu-cost-per-hour USD`` of ``pagebatch bench throughput|latency|serve``: what one million
output tokens cost at a measured output throughput.

    cost per 1M output tokens (USD) = USD per hour / (output tokens per second * 3600) * 1e6

e.g. $3.00/h at 7,110 output tok/s (T1 on an H200, docs/benchmarks.md): 3 / 25,596,000 * 1e6
= $0.1172 per 1M output tokens. It prices GPU time only (no host, network or idle time) at the
throughput of the run, so a benchmark at saturation gives the floor of a real deployment.
"""

from __future__ import annotations

import argparse
import math


def usd_per_hour(v: str) -> float:
    """An argparse type: a finite price >= 0 (USD per GPU-hour)."""
    try:
        x = float(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected USD per hour, got {v!r}") from None
    if not (x >= 0) or math.isinf(x):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0 USD per hour, got {v}")
    return x


def cost_per_million_tokens(usd_per_gpu_hour: float, output_tok_s: float) -> float | None:
    """USD per 1M output tokens at ``output_tok_s`` (tokens per second) and
    ``usd_per_gpu_hour``; None when nothing was produced (no throughput to price)."""
    if not output_tok_s > 0:
        return None
    return usd_per_gpu_hour / (output_tok_s * 3600.0) * 1e6


def add_cost_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gpu-cost-per-hour", type=usd_per_hour, default=None, metavar="USD",
                   help="price of the GPU time (USD/h, all GPUs of the run): also report "
                   "the cost per 1M output tokens at the measured throughput")


def cost_fields(usd: float | None, output_tok_s: float) -> dict[str, float | None]:
    """The JSON fields of a priced result: ``gpu_cost_per_hour`` and
    ``cost_per_1m_output_tokens`` (USD); {} when no price was given."""
    if usd is None:
        return {}
    return {"gpu_cost_per_hour": usd,
            "cost_per_1m_output_tokens": cost_per_million_tokens(usd, output_tok_s)}


def cost_line(usd: float, output_tok_s: float, who: str = "") -> str:
    """``$0.1172 per 1M output tokens at $3.00/h and 7110.0 output tok/s``."""
    c = cost_per_million_tokens(usd, output_tok_s)
    head = f"{who}: " if who else ""
    if c is None:
        return f"{head}no output tokens: no cost per 1M output tokens"
    return (f"{head}${c:.4f} per 1M output tokens at ${usd:.2f}/h and {output_tok_s:.1f} "
            f"output tok/s")
