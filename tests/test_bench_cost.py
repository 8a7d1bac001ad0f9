"""`--gpu-cost-per-hour`: the cost per 1M output tokens from a measured throughput (core/bench/
cost.py), its flag on bench throughput / latency / serve, and its errors."""

from __future__ import annotations

import argparse

import pytest

from pagebatch.bench.command import priced_tok_s
from pagebatch.bench.cost import cost_fields, cost_line, cost_per_million_tokens, usd_per_hour


def test_cost_per_million_tokens():
    # $3.60/h at 1,000 tok/s: 3.6M tokens an hour -> $1.00 per 1M
    assert cost_per_million_tokens(3.6, 1000.0) == 1.0
    # docs/tuning.md's worked example: T1 on an H200, 7,110 output tok/s at $3.00/h
    assert round(cost_per_million_tokens(3.0, 7110.0), 4) == 0.1172
    assert cost_per_million_tokens(0.0, 500.0) == 0.0
    assert cost_per_million_tokens(3.0, 0.0) is None
    assert cost_fields(None, 10.0) == {}
    assert cost_fields(7.2, 2000.0) == {"gpu_cost_per_hour": 7.2,
                                        "cost_per_1m_output_tokens": 1.0}
    assert cost_line(3.0, 7110.0, "pagebatch") == (
        "pagebatch: $0.1172 per 1M output tokens at $3.00/h and 7110.0 output tok/s")
    # latency results are priced at their batch-1 decode rate
    assert priced_tok_s({"output_tok_s": 7110.0}) == 7110.0
    assert priced_tok_s({"decode_tok_s": 250.0, "ttft_s": 0.1}) == 250.0


@pytest.mark.parametrize("bad", ["-1", "inf", "nan", "abc"])
def test_bad_price(bad):
    with pytest.raises(argparse.ArgumentTypeError, match=bad):
        usd_per_hour(bad)


@pytest.mark.parametrize("kind", ["throughput", "latency", "serve"])
def test_flag_on_every_bench(kind):
    from pagebatch.cli import build_parser

    extra = ["--base-url", "http://x"] if kind == "serve" else []
    args = build_parser().parse_args(["bench", kind, *extra, "--gpu-cost-per-hour", "2.5"])
    assert args.gpu_cost_per_hour == 2.5
