"""The math of `pagebatch bench serve` on known synthetic timings, no server: TTFT / ITL / TPOT /
E2EL as vLLM's benchmark_serving defines them, percentiles (numpy's linear interpolation),
goodput under SLOs, the arrival schedules (Poisson with a seed, gamma burstiness, constant) and
the seeded dataset. Timings are multiples of 1/8 s so that every figure is exact in binary and
asserted with ==."""

from __future__ import annotations

import math
import random

import pytest

from pagebatch.bench.arrivals import arrival_times
from pagebatch.bench.serve_dataset import DatasetSpec, length_range, make_dataset
from pagebatch.bench.serve_metrics import (
    Result, good, parse_goodput, parse_percentiles, stats, summarize)


def _req(start: float, stamps: list[float], prompt: int = 10, out: int = 0) -> Result:
    return Result.from_chunks(start, stamps, prompt, out)


def _linear(sorted_ms: list[float], p: float) -> float:
    """The p-th percentile as numpy's default ("linear", Hyndman & Fan type 7) computes it:
    rank p/100 * (n - 1), a + (b - a) * t, or b - (b - a) * (1 - t) when t >= 0.5."""
    rank = p / 100 * (len(sorted_ms) - 1)
    i = math.floor(rank)
    t = rank - i
    a, b = sorted_ms[i], sorted_ms[min(i + 1, len(sorted_ms) - 1)]
    return b - (b - a) * (1 - t) if t >= 0.5 else a + (b - a) * t


# five requests: (send time, output chunk times); one token per chunk unless said
SYNTH = [
    _req(0.0, [0.25, 0.375, 0.5, 0.625]),          # TTFT 250, ITL 125 x3, E2EL 625
    _req(0.125, [0.625, 0.75, 1.0]),               # TTFT 500, ITL 125, 250, E2EL 875
    _req(0.25, [0.375, 0.5, 0.625, 0.75, 0.875]),  # TTFT 125, ITL 125 x4, E2EL 625
    _req(0.5, [1.5], out=1),                       # TTFT 1000, no ITL, E2EL 1000
    _req(1.0, [1.125, 1.875], out=4),              # usage: 4 tokens in 2 chunks
]


def test_result_definitions():
    a, b, _, d, e = SYNTH
    assert (a.ok, a.ttft, a.latency, a.itl, a.output_tokens) == (
        True, 0.25, 0.625, [0.125, 0.125, 0.125], 4)
    assert a.tpot == (0.625 - 0.25) / 3 == 0.125
    assert (b.ttft, b.itl, b.latency) == (0.5, [0.125, 0.25], 0.875)
    assert b.tpot == 0.375 / 2
    assert (d.tpot, d.itl, d.value("itl")) == (0.0, [], 0.0)  # one token: TPOT 0 (vLLM)
    # TPOT counts tokens (the server's usage), ITL counts chunks
    assert (e.output_tokens, e.itl, e.tpot) == (4, [0.75], 0.75 / 3)
    assert b.value("itl") == 0.25 and b.value("e2el") == 0.875 and b.value("ttft") == 0.5
    failed = _req(0.0, [])
    assert (failed.ok, failed.error) == (False, "no output")


def test_percentiles_and_summary():
    s = summarize([*SYNTH, Result(error="HTTP 500: boom")], duration=2.0)
    assert (s["completed"], s["failed"], s["errors"]) == (5, 1, ["HTTP 500: boom"])
    assert s["total_input_tokens"] == 50 and s["total_output_tokens"] == 4 + 3 + 5 + 1 + 4
    assert s["request_throughput"] == 2.5
    assert s["output_token_throughput"] == 17 / 2
    assert s["total_token_throughput"] == 67 / 2
    assert (s["goodput_slos_ms"], s["good_requests"], s["request_goodput"]) == (
        None, None, None)
    # TTFT ms sorted: 125 250 500 1000 125 -> 125 125 250 500 1000; numpy "linear":
    # rank p/100 * (n - 1): p50 -> 2 (250), p90 -> 3.6 (500 + 0.6 * 500 = 800),
    # p99 -> 3.96 (500 + 0.96 * 500 = 980)
    assert s["ttft"] == {"mean_ms": 400.0, "median_ms": 250.0,
                         "std_ms": math.sqrt((2 * 275**2 + 150**2 + 100**2 + 600**2) / 5),
                         "p50_ms": 250.0,
                         "p90_ms": 800.0, "p99_ms": 980.0}
    # ITL pooled over requests: 125 x3, 125, 250, 125 x4, 750 -> 8 x 125, 250, 750
    assert s["itl"]["mean_ms"] == (8 * 125 + 250 + 750) / 10 == 200.0
    assert s["itl"]["median_ms"] == 125.0
    # rank 0.9 * 9 = 8.1 between 250 and 750: 300, less the binary rounding of 0.9 * 9
    assert s["itl"]["p90_ms"] == _linear([125.0] * 8 + [250.0, 750.0], 90)
    assert s["itl"]["p90_ms"] == pytest.approx(300.0, abs=1e-12)
    # TPOT of the requests of more than one token: 125, 187.5, 125, 250
    assert s["tpot"]["mean_ms"] == (125 + 187.5 + 125 + 250) / 4
    assert s["tpot"]["median_ms"] == 156.25
    assert s["e2el"]["median_ms"] == 875.0  # 625 625 875 1000 875 -> 625 625 875 875 1000
    assert s["e2el"]["p99_ms"] == _linear([625.0, 625.0, 875.0, 875.0, 1000.0], 99) == 995.0
    for p in (50, 90, 99):
        assert s["ttft"][f"p{p}_ms"] == _linear([125.0, 125.0, 250.0, 500.0, 1000.0], p)
    # configurable percentiles, keys like vLLM's (p99.9)
    t = stats([r.ttft for r in SYNTH], (25.0, 99.9))
    assert set(t) == {"mean_ms", "median_ms", "std_ms", "p25_ms", "p99.9_ms"}
    assert t["p25_ms"] == 125.0
    assert stats([], (50.0,)) == {"mean_ms": 0.0, "median_ms": 0.0, "std_ms": 0.0,
                                  "p50_ms": 0.0}


def test_goodput():
    """A request counts when every SLO given holds (<=, vLLM's rule)."""
    slos = parse_goodput(["ttft:500", "itl:125"])
    assert slos == {"ttft": 500.0, "itl": 125.0}
    # a: ttft 250, max ITL 125 ok; b: ITL 250 no; c: ok; d: ttft 1000 no; e: ITL 750 no
    assert [good(r, slos) for r in SYNTH] == [True, False, True, False, False]
    s = summarize(SYNTH, duration=4.0, slos=slos)
    assert (s["good_requests"], s["request_goodput"], s["goodput_slos_ms"]) == (
        2, 0.5, slos)
    # TPOT (0 for a 1-token request) and E2EL
    assert [good(r, {"tpot": 187.5, "e2el": 1000}) for r in SYNTH] == [
        True, True, True, True, False]
    assert not good(Result(error="x"), {"ttft": 1e9})


@pytest.mark.parametrize("bad, msg", [
    (["ttft"], "METRIC:MS, got 'ttft'"),
    (["foo:1"], "one of ttft, tpot, itl, e2el, got 'foo'"),
    (["ttft:abc"], "number of ms, got 'abc'"),
    (["ttft:0"], "> 0, got 0"),
])
def test_goodput_errors(bad, msg):
    with pytest.raises(ValueError, match=msg.replace("(", r"\(")):
        parse_goodput(bad)


def test_parse_percentiles():
    assert parse_percentiles("50,90,99") == (50.0, 90.0, 99.0)
    with pytest.raises(ValueError, match=r"\[0, 100\], got 101"):
        parse_percentiles("50,101")


def test_poisson_arrivals_seeded():
    """Gaps Exp(rate) from random.Random(seed) in vLLM's order (first request at 0), to the
    last digit; another seed, another schedule; the mean gap is 1 / rate."""
    times = arrival_times(6, 4.0, "poisson", 1.0, seed=7)
    rng, t, want = random.Random(7), 0.0, []
    for _ in range(6):
        want.append(t)
        t += -math.log(1.0 - rng.random()) * (1.0 / 4.0)
    assert times == want
    assert times == arrival_times(6, 4.0, seed=7)
    assert times != arrival_times(6, 4.0, seed=8)
    many = arrival_times(4001, 4.0, seed=1)
    assert many[-1] / 4000 == pytest.approx(0.25, rel=0.05)


def test_burstiness_and_constant():
    """Gamma(B, 1 / (rate * B)) gaps: mean 1 / rate, coefficient of variation 1 / sqrt(B);
    constant: request i at exactly i / rate; inf: all at 0."""
    for b in (0.25, 4.0):
        t = arrival_times(4001, 2.0, "poisson", b, seed=3)
        gaps = [y - x for x, y in zip(t, t[1:])]
        mean = sum(gaps) / len(gaps)
        cv = math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps)) / mean
        assert mean == pytest.approx(0.5, rel=0.1) and cv == pytest.approx(b ** -0.5, rel=0.1)
    assert arrival_times(4, 3.0, "constant") == [0.0, 1 / 3, 2 / 3, 1.0]
    assert arrival_times(3, math.inf) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="> 0 requests/s or inf, got 0"):
        arrival_times(3, 0.0)
    with pytest.raises(ValueError, match="burstiness must be a finite number > 0, got -1"):
        arrival_times(3, 1.0, burstiness=-1)


def test_dataset_mixed_lengths_and_shared_prefix():
    spec = DatasetSpec(num_prompts=50, input_len=40, output_len=10, range_ratio=0.5,
                       shared_prefix_len=8, vocab_size=256, seed=3)
    reqs = make_dataset(spec)
    assert reqs == make_dataset(spec)  # seeded
    assert length_range(40, 0.5) == (20, 60) and length_range(10, 0.5) == (5, 15)
    assert all(28 <= r.prompt_len <= 68 and 5 <= r.output_len <= 15 for r in reqs)
    assert len({r.prompt_len for r in reqs}) > 10  # mixed
    assert all(len(r.prompt) == r.prompt_len for r in reqs)
    assert len({tuple(r.prompt[:8]) for r in reqs}) == 1  # one shared prefix
    assert all(64 <= t < 256 for r in reqs for t in r.prompt)
    other = make_dataset(spec, variant=1)  # a sweep's next rate: same lengths, other tokens
    assert [(r.prompt_len, r.output_len) for r in other] == [
        (r.prompt_len, r.output_len) for r in reqs]
    assert other[0].prompt != reqs[0].prompt
    fixed = make_dataset(DatasetSpec(num_prompts=3, input_len=5, output_len=2, token_ids=False))
    assert [(len(r.prompt.split()), r.prompt_len, r.output_len) for r in fixed] == [(5, 5, 2)] * 3
    with pytest.raises(ValueError, match=r"--range-ratio must be in \[0, 1\), got 1.0"):
        make_dataset(DatasetSpec(num_prompts=1, input_len=5, output_len=2, range_ratio=1.0))
