"""`metrics_vllm_names`: /metrics serves vLLM's `vllm:` names as well as pagebatch's, with the
same values and the `model_name` label (plugins/frontends/http/vllm_names.py), and only when the
option is on. No server: a `Metrics` fed known observations; tests/test_bench_serve.py checks
a real `pagebatch serve --metrics-vllm-names` after known traffic."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagebatch.engine_core import EngineCoreStats
from pagebatch.plugins.frontends.http.metrics import Metrics
from pagebatch.plugins.frontends.http.vllm_names import VLLM_NAMES

# vLLM's "Production Metrics" names a dashboard or an HPA rule for `vllm serve` reads
VLLM_SERIES = [
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc", "vllm:num_preemptions_total",
    "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
    "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
    "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
    "vllm:time_per_output_token_seconds_bucket", "vllm:e2e_request_latency_seconds_bucket",
    "vllm:request_queue_time_seconds_count", "vllm:request_prefill_time_seconds_count",
    "vllm:request_decode_time_seconds_count", "vllm:request_prompt_tokens_sum",
    "vllm:request_generation_tokens_sum",
]


def _metrics(vllm_names: bool) -> Metrics:
    stats = EngineCoreStats(num_running=3, num_waiting=5, kv_cache_usage=0.25)
    m = Metrics("tiny", lambda: stats, vllm_names=vllm_names)
    m.ttft.observe(0.3)
    for gap in (0.02, 0.03, 0.2):
        m.itl.observe(gap)
    m.request_done(4, 8, "length", 1.5)
    m.request_done(6, 2, "stop", 0.5)
    m.on_core_stats(EngineCoreStats(queue_times=[0.1], prefill_times=[0.2],
                                    decode_times=[0.3, 0.4]))
    return m


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples
            if not s.name.endswith("_created")}


def test_off_by_default():
    text = _metrics(False).render().decode()
    assert "vllm:" not in text and "pagebatch:num_requests_waiting" in text


def test_vllm_names_with_the_values_and_labels_of_pagebatch():
    samples = _samples(_metrics(True).render().decode())
    names = {n for n, _ in samples}
    assert set(VLLM_SERIES) <= names, sorted(set(VLLM_SERIES) - names)
    model = (("model_name", "tiny"),)
    assert samples[("vllm:num_requests_waiting", model)] == 5
    assert samples[("vllm:num_requests_running", model)] == 3
    assert samples[("vllm:kv_cache_usage_perc", model)] == 0.25
    assert samples[("vllm:gpu_cache_usage_perc", model)] == 0.25
    assert samples[("vllm:prompt_tokens_total", model)] == 10
    assert samples[("vllm:generation_tokens_total", model)] == 10
    assert samples[("vllm:request_success_total",
                    (("finished_reason", "length"), ("model_name", "tiny")))] == 1
    assert samples[("vllm:request_success_total",
                    (("finished_reason", "stop"), ("model_name", "tiny")))] == 1
    assert samples[("vllm:time_to_first_token_seconds_sum", model)] == 0.3
    assert samples[("vllm:e2e_request_latency_seconds_count", model)] == 2
    for name in ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"):
        assert samples[(name + "_count", model)] == 3
        assert samples[(name + "_bucket", (("le", "0.04"), ("model_name", "tiny")))] == 2
    assert samples[("vllm:request_decode_time_seconds_count", model)] == 2
    # every vllm: series is a pagebatch: one under another name, value for value
    for (name, labels), value in samples.items():
        if not name.startswith("vllm:"):
            continue
        family = next(f for f, aliases in VLLM_NAMES.items()
                      if any(name.startswith(a) for a in aliases))
        alias = next(a for a in VLLM_NAMES[family] if name.startswith(a))
        original = "pagebatch:" + family + name[len(alias):]
        assert samples[(original, labels)] == value, name
    # pagebatch's own series are all still there
    assert ("pagebatch:engine_steps_total", model) in samples
    assert not any(n.startswith("vllm:engine_steps") for n in names)


@pytest.mark.parametrize("value, want", [("true", True), ("off", False)])
def test_option_parses(value, want, tiny_model_dir):
    from pagebatch.config import EngineConfig
    from pagebatch.plugins.frontends.http.server import Settings

    cfg = EngineConfig.from_sources(cli={"model": str(tiny_model_dir),
                                         "metrics_vllm_names": value})
    assert Settings.from_config(cfg).metrics_vllm_names is want
