"""The `http` frontend's /metrics after known traffic, the metric names the examples/ Grafana
dashboard and Kubernetes HPA use, and `pagebatch bench serve`, against a real uvicorn server over
the tiny model (a server of this module's own, so the traffic is known)."""

from __future__ import annotations

import json
import re

import pytest

from http_helpers import GREEDY, KEY, MODEL, PROMPT, metric


# ---- metrics -----------------------------------------------------------------------------------

def _deltas(http, series: list, traffic) -> None:
    """Run ``traffic()``; each (name, labels, want) series must move by exactly ``want``."""
    def values():
        return [metric(http, "pagebatch:" + name, labels, default=0)
                for name, labels, _ in series]

    before = values()
    traffic()
    after = values()
    assert {name: a - b for (name, _, _), a, b in zip(series, after, before)} == \
        {name: want for name, _, want in series}


def test_metrics_after_known_traffic(client, http):
    """Counters and histogram counts move by exactly what known requests imply. One request of
    4 prompt tokens, n=2 samples of 8 tokens: once per request for request-level series, once
    per sample for the core's queue/prefill/decode times. One of n=1 and 8 tokens: 8 engine
    steps (prefill + 7 decodes) and 7 inter-token gaps (with n=2 the samples reach the core as
    two requests and may be prefilled one step apart)."""
    _deltas(http, [
        ("request_success_total", 'finished_reason="length"', 1),
        ("prompt_tokens_total", "", 4),
        ("generation_tokens_total", "", 16),
        ("request_prompt_tokens_sum", "", 4),
        ("request_prompt_tokens_count", "", 1),
        ("request_generation_tokens_sum", "", 16),
        ("time_to_first_token_seconds_count", "", 1),
        ("e2e_request_latency_seconds_count", "", 1),
        ("request_queue_time_seconds_count", "", 2),
        ("request_prefill_time_seconds_count", "", 2),
        ("request_decode_time_seconds_count", "", 2),
        ("num_preemptions_total", "", 0),
    ], lambda: client.completions.create(model=MODEL, prompt=PROMPT, n=2, **GREEDY))
    _deltas(http, [
        ("engine_steps_total", "", 8),
        ("inter_token_latency_seconds_count", "", 7),
        ("request_generation_tokens_sum", "", 8),
    ], lambda: client.completions.create(model=MODEL, prompt=PROMPT, **GREEDY))
    text = http.get("/metrics").text
    for name in ("request_success_total", "prompt_tokens_total", "generation_tokens_total",
                 "num_preemptions_total", "engine_steps_total", "prefix_cache_queries_total",
                 "prefix_cache_hits_total", "time_to_first_token_seconds_bucket",
                 "inter_token_latency_seconds_bucket", "e2e_request_latency_seconds_bucket",
                 "request_queue_time_seconds_bucket", "request_prefill_time_seconds_bucket",
                 "request_decode_time_seconds_bucket", "request_prompt_tokens_bucket",
                 "request_generation_tokens_bucket"):
        assert re.search(rf"^pagebatch:{name}\{{.*model_name=\"{MODEL}\"", text, re.M), name
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert metric(http, "pagebatch:" + gauge) == 0, gauge  # idle again
    assert "vllm:" not in text  # metrics_vllm_names is off by default


def test_prefix_cache_metrics(client, http):
    """A 9-token prompt (two full blocks of 4) run twice: the second run finds 8 tokens
    cached (the last prompt token is always computed)."""
    prompt = [41, 42, 43, 44, 45, 46, 47, 48, 49]

    def values():
        return [metric(http, "pagebatch:prefix_cache_queries_total"),
                metric(http, "pagebatch:prefix_cache_hits_total")]

    q0, h0 = values()
    client.completions.create(model=MODEL, prompt=prompt, **GREEDY)
    q1, h1 = values()
    client.completions.create(model=MODEL, prompt=prompt, **GREEDY)
    q2, h2 = values()
    assert (q1 - q0, h1 - h0) == (9, 0)
    assert (q2 - q1, h2 - h1) == (9, 8)


# ---- examples/: the Grafana dashboard and the Kubernetes HPA -----------------------------------

ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]
_METRIC_RE = re.compile(r"pagebatch:[A-Za-z_][A-Za-z0-9_]*")


def _dashboard_exprs(node) -> list[str]:
    """Every PromQL text in a Grafana dashboard: targets' exprs and template queries."""
    out = []
    if isinstance(node, dict):
        for k, v in node.items():
            if k in ("expr", "definition") and isinstance(v, str):
                out.append(v)
            elif k == "query" and isinstance(v, str):
                out.append(v)
            else:
                out += _dashboard_exprs(v)
    elif isinstance(node, list):
        for v in node:
            out += _dashboard_exprs(v)
    return out


def test_example_metric_names_are_served(client, http):
    """Every pagebatch: series named in examples/grafana and examples/kubernetes (dashboard
    queries, the HPA, comments) is served at /metrics, exactly as named there (histograms as
    _bucket/_sum/_count, counters as _total)."""
    import yaml

    dash = json.loads((ROOT / "examples/grafana/pagebatch-dashboard.json").read_text())
    exprs = _dashboard_exprs(dash)
    used = {m for e in exprs for m in _METRIC_RE.findall(e)}
    hpa_text = (ROOT / "examples/kubernetes/hpa.yaml").read_text()
    hpa = yaml.safe_load(hpa_text)
    assert hpa["apiVersion"] == "autoscaling/v2" and hpa["kind"] == "HorizontalPodAutoscaler"
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    assert metric["pods"]["metric"]["name"] == "pagebatch:num_requests_waiting"
    assert 40 <= float(metric["pods"]["target"]["averageValue"]) <= 60
    hpa_used = set(_METRIC_RE.findall(hpa_text))
    assert hpa_used == {"pagebatch:num_requests_waiting"}
    used |= hpa_used
    # and any name anywhere in the two folders' files (comments, legends, adapter rules);
    # `image: .../pagebatch:TAG` is a container image, not a metric
    for f in [*(ROOT / "examples/kubernetes").iterdir(), *(ROOT / "examples/grafana").iterdir()]:
        used |= {m for line in f.read_text().splitlines() if "image:" not in line
                 for m in _METRIC_RE.findall(line)}
    # the panels the issue asks for are there
    for family in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                   "generation_tokens_total", "time_to_first_token_seconds_bucket",
                   "inter_token_latency_seconds_bucket", "e2e_request_latency_seconds_bucket",
                   "num_preemptions_total", "prefix_cache_hits_total",
                   "prefix_cache_queries_total"):
        assert "pagebatch:" + family in used, family

    # labelled counters (request_success) appear once a request has finished
    client.completions.create(model=MODEL, prompt=PROMPT, **GREEDY)
    served = {line.split("{")[0].split(" ")[0]
              for line in http.get("/metrics").text.splitlines()
              if line.startswith("pagebatch:")}
    missing = sorted(used - served)
    assert not missing, f"used in examples/ but not served at /metrics: {missing}"


# ---- pagebatch bench serve ---------------------------------------------------------------------

@pytest.mark.parametrize("extra", [
    ["--request-rate", "40", "--max-concurrency", "3"],
    ["--prompt-kind", "text"],  # request rate inf: all at once
])
def test_bench_serve(base, tmp_path, capsys, extra):
    from pagebatch.cli import main

    out = tmp_path / "serve.json"
    rc = main(["bench", "serve", "--base-url", base, "--api-key", KEY, "--num-prompts", "6",
               "--input-len", "8", "--output-len", "6", "--vocab-size", "256",
               "--output", str(out), *extra])
    assert rc == 0
    assert "TTFT" in capsys.readouterr().out
    r = json.loads(out.read_text())
    assert (r["completed"], r["failed"], r["errors"]) == (6, 0, [])
    assert r["model"] == MODEL and r["total_output_tokens"] == 36  # ignore_eos
    if "text" not in extra:
        assert r["total_input_tokens"] == 48
    assert r["duration_s"] > 0
    assert r["request_throughput"] == pytest.approx(6 / r["duration_s"])
    assert r["output_token_throughput"] == pytest.approx(36 / r["duration_s"])
    assert r["total_token_throughput"] > r["output_token_throughput"]
    for name in ("ttft", "tpot", "itl", "e2el"):
        s = r[name]
        assert 0 < s["median_ms"] <= s["p99_ms"] and 0 < s["mean_ms"] <= s["p99_ms"], name
    assert r["ttft"]["p99_ms"] <= r["e2el"]["p99_ms"]
    assert r["e2el"]["p99_ms"] <= r["duration_s"] * 1e3
