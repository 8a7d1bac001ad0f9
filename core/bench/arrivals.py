"""When the requests of ``pagebatch bench serve`` are sent: offsets in seconds from the start of
a run, as vLLM's ``benchmark_serving`` draws them.

- ``poisson`` with ``burstiness`` B: the gaps are Gamma(shape B, scale 1 / (rate * B)), mean
  1 / rate; B = 1 is a Poisson process (exponential gaps), B < 1 burstier, B > 1 steadier
  (vLLM's ``--burstiness``);
- ``constant``: request i at exactly i / rate (the limit of B -> inf);
- rate ``inf``: every request at 0.

The first request is sent at 0 and each gap is drawn after it (vLLM's order), from
``random.Random(seed)``, so a seed fixes the schedule to the last digit.
"""

from __future__ import annotations

import math
import random

ARRIVALS = ("poisson", "constant")


def check_rate(rate: float) -> float:
    """``rate`` (requests per second) if it is > 0 or inf; raises ValueError naming it."""
    if not (rate > 0):  # also NaN
        raise ValueError(f"request rate must be > 0 requests/s or inf, got {rate}")
    return rate


def arrival_times(n: int, rate: float, arrival: str = "poisson", burstiness: float = 1.0,
                  seed: int = 0) -> list[float]:
    """Send times of ``n`` requests, seconds after the start, non-decreasing, the first 0.

    ``rate``: requests per second (> 0, or inf); ``arrival``: one of ARRIVALS; ``burstiness``:
    the Gamma shape of the gaps (> 0, poisson only). Raises ValueError naming the value."""
    check_rate(rate)
    if arrival not in ARRIVALS:
        raise ValueError(f"arrival must be one of {', '.join(ARRIVALS)}, got {arrival!r}")
    if not (burstiness > 0) or math.isinf(burstiness):
        raise ValueError(f"burstiness must be a finite number > 0, got {burstiness}")
    if n < 0:
        raise ValueError(f"number of requests must be >= 0, got {n}")
    if math.isinf(rate):
        return [0.0] * n
    if arrival == "constant":
        return [i / rate for i in range(n)]
    rng = random.Random(seed)
    scale = 1.0 / (rate * burstiness)
    times, t = [], 0.0
    for _ in range(n):
        times.append(t)
        t += rng.gammavariate(burstiness, scale)
    return times
