"""The measurements of ``pagebatch bench serve`` (serve.py) and their summary, defined as
vLLM's ``benchmark_serving`` defines them:

- TTFT (time to first token): send -> the first streamed chunk with output;
- ITL (inter-token latency): the gaps between a request's output chunks, every gap of every
  request pooled;
- TPOT (time per output token after the first): (E2EL - TTFT) / (output tokens - 1), one value
  per request of more than one output token (0 for the others in goodput);
- E2EL (end-to-end latency): send -> the last output chunk.

Each is reported as mean, median, std and the ``--percentiles`` (default 50, 90, 99; numpy's
linear interpolation) in milliseconds. Goodput (``--goodput ttft:500 itl:50``, ms) counts the
requests that meet every SLO given: TTFT, TPOT and E2EL per request as vLLM does, and (this
project's addition) ``itl``: the request's longest gap.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

METRICS = ("ttft", "tpot", "itl", "e2el")
DEFAULT_PERCENTILES = (50.0, 90.0, 99.0)


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

    @classmethod
    def from_chunks(cls, start: float, stamps: list[float], prompt_tokens: int,
                    output_tokens: int) -> "Result":
        """The result of a request sent at ``start`` whose output chunks arrived at ``stamps``
        (seconds, one clock); ``output_tokens`` 0: one per chunk. No chunk: failed."""
        if not stamps:
            return cls(error="no output", prompt_tokens=prompt_tokens)
        return cls(ok=True, prompt_tokens=prompt_tokens,
                   output_tokens=output_tokens or len(stamps), ttft=stamps[0] - start,
                   latency=stamps[-1] - start,
                   itl=[b - a for a, b in zip(stamps, stamps[1:])])

    @property
    def tpot(self) -> float:
        """(latency - ttft) / (output_tokens - 1) seconds; 0 for one output token or none."""
        if self.output_tokens <= 1:
            return 0.0
        return (self.latency - self.ttft) / (self.output_tokens - 1)

    def value(self, metric: str) -> float:
        """This request's figure for an SLO on ``metric`` (one of METRICS), seconds."""
        if metric == "itl":
            return max(self.itl, default=0.0)
        return {"ttft": self.ttft, "tpot": self.tpot, "e2el": self.latency}[metric]


def percentile_key(p: float) -> str:
    """``50`` -> ``p50_ms``, ``99.9`` -> ``p99.9_ms``."""
    return f"p{p:g}_ms"


def parse_percentiles(text: str) -> tuple[float, ...]:
    """``"50,90,99"`` -> (50.0, 90.0, 99.0); raises ValueError naming a value outside [0, 100]."""
    out = []
    for part in str(text).split(","):
        try:
            p = float(part)
        except ValueError:
            raise ValueError(f"percentile {part.strip()!r} is not a number") from None
        if not 0.0 <= p <= 100.0:
            raise ValueError(f"percentile must be in [0, 100], got {p:g}")
        out.append(p)
    return tuple(out)


def parse_goodput(items: list[str]) -> dict[str, float]:
    """``["ttft:500", "itl:50"]`` -> {"ttft": 500.0, "itl": 50.0} (milliseconds, > 0).
    Raises ValueError naming the item, the metric or the value."""
    slos: dict[str, float] = {}
    for item in items:
        name, sep, value = str(item).partition(":")
        if not sep:
            raise ValueError(f"goodput SLO must be METRIC:MS, got {item!r}")
        if name not in METRICS:
            raise ValueError(f"goodput metric must be one of {', '.join(METRICS)}, got "
                             f"{name!r}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"goodput SLO {name} must be a number of ms, got {value!r}") \
                from None
        if not (ms > 0) or math.isinf(ms):
            raise ValueError(f"goodput SLO {name} must be a finite number of ms > 0, got "
                             f"{value}")
        slos[name] = ms
    return slos


def stats(values: list[float], percentiles=DEFAULT_PERCENTILES) -> dict[str, float]:
    """mean, median, std (population) and each percentile of ``values`` (seconds), in
    milliseconds; all 0 for no values."""
    keys = ["mean_ms", "median_ms", "std_ms", *map(percentile_key, percentiles)]
    if not values:
        return dict.fromkeys(keys, 0.0)
    import numpy as np

    a = np.asarray(values, dtype=float) * 1e3
    out = {"mean_ms": float(a.mean()), "median_ms": float(np.median(a)),
           "std_ms": float(a.std())}
    for p in percentiles:
        out[percentile_key(p)] = float(np.percentile(a, p))
    return out


def good(r: Result, slos: dict[str, float]) -> bool:
    """Whether the completed ``r`` meets every SLO of ``slos`` (metric -> milliseconds)."""
    return r.ok and all(r.value(m) <= ms / 1e3 for m, ms in slos.items())


def summarize(results: list[Result], duration: float, percentiles=DEFAULT_PERCENTILES,
              slos: dict[str, float] | None = None) -> dict[str, Any]:
    """Counts, throughputs (per second of ``duration``, seconds), goodput under ``slos``
    (None when none are given) and the latency stats of the completed requests (the first five
    distinct errors of the others)."""
    done = [r for r in results if r.ok]
    n_in = sum(r.prompt_tokens for r in done)
    n_out = sum(r.output_tokens for r in done)
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    n_good = sum(good(r, slos) for r in done) if slos else None
    return {
        "completed": len(done), "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration, "total_input_tokens": n_in, "total_output_tokens": n_out,
        "request_throughput": per_s(len(done)),
        "output_token_throughput": per_s(n_out),
        "total_token_throughput": per_s(n_in + n_out),
        "goodput_slos_ms": slos or None, "good_requests": n_good,
        "request_goodput": None if n_good is None else per_s(n_good),
        "ttft": stats([r.ttft for r in done], percentiles),
        "tpot": stats([r.tpot for r in done if r.output_tokens > 1], percentiles),
        "itl": stats([x for r in done for x in r.itl], percentiles),
        "e2el": stats([r.latency for r in done], percentiles),
    }
