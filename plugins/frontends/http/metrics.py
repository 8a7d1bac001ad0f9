"""Prometheus metrics of the HTTP server, under ``pagebatch:`` with a ``model_name`` label
(the names vLLM's dashboards and autoscalers use, with vLLM's ``vllm:`` prefix replaced).

Two sources: the engine core's `EngineCoreStats` (gauges and engine counters, read from the
latest snapshot at scrape time, so they stay true when idle; per-request queue, prefill and
decode times observed as they arrive on the output thread), and the request handlers (TTFT,
inter-token latency, end-to-end latency, token counts, finished requests). Each `Metrics` has
its own CollectorRegistry, so several servers can live in one process (tests). With
``vllm_names`` (the ``metrics_vllm_names`` option) the same series are also served under vLLM's
``vllm:`` names (vllm_names.py). docs/observability.md lists each metric.
"""

from __future__ import annotations

from typing import Any, Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pagebatch.engine_core import EngineCoreStats

from .vllm_names import VllmAliases

P = "pagebatch:"
_LATENCY = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
            7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_TOKENS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


class _CoreCollector:
    """Gauges and counters from the latest core snapshot, computed at scrape time."""

    def __init__(self, model: str, stats: Callable[[], EngineCoreStats | None]) -> None:
        self.model, self.stats = model, stats

    def collect(self):
        s = self.stats() or EngineCoreStats()
        lab = ["model_name"]
        for name, doc, value in (
                ("num_requests_running", "Requests in the running batch (on the GPU).",
                 s.num_running),
                ("num_requests_waiting", "Requests waiting to be scheduled (queued or "
                 "preempted).", s.num_waiting),
                ("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0..1).",
                 s.kv_cache_usage)):
            g = GaugeMetricFamily(P + name, doc, labels=lab)
            g.add_metric([self.model], value)
            yield g
        for name, doc, value in (
                ("num_preemptions", "Requests preempted (to recompute) since start.",
                 s.num_preemptions),
                ("engine_steps", "Engine steps run since start.", s.num_steps),
                ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                 s.prefix_cache_queries),
                ("prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                 s.prefix_cache_hits)):
            c = CounterMetricFamily(P + name, doc, labels=lab)
            c.add_metric([self.model], value)
            yield c


class Metrics:
    """The server's series under ``pagebatch:`` (``registry``), and, with ``vllm_names``, their
    ``vllm:`` copies (``aliases``), for the model ``model`` (the ``model_name`` label)."""

    def __init__(self, model: str, core_stats: Callable[[], EngineCoreStats | None],
                 vllm_names: bool = False) -> None:
        self.model = model
        self.registry = CollectorRegistry()
        self.registry.register(_CoreCollector(model, core_stats))
        self.aliases: CollectorRegistry | None = None
        if vllm_names:
            self.aliases = CollectorRegistry()
            self.aliases.register(VllmAliases(self.registry, P))
        r, lab = self.registry, ["model_name"]

        def counter(name: str, doc: str, labels: list[str] = lab) -> Any:
            return Counter(P + name, doc, labels, registry=r)

        def hist(name: str, doc: str, buckets: tuple) -> Any:
            return Histogram(P + name, doc, lab, buckets=buckets, registry=r).labels(model)

        self.prompt_tokens = counter("prompt_tokens", "Prefill tokens processed.").labels(model)
        self.generation_tokens = counter("generation_tokens",
                                         "Generation tokens produced.").labels(model)
        self.request_success = counter("request_success", "Finished requests (once per "
                                       "request whatever n), by finish reason.",
                                       ["model_name", "finished_reason"])
        self.ttft = hist("time_to_first_token_seconds", "Time to first token (s).", _LATENCY)
        self.itl = hist("inter_token_latency_seconds", "Time between outputs of a request "
                        "(s).", _LATENCY)
        self.e2e = hist("e2e_request_latency_seconds", "Request latency, arrival to last "
                        "token (s).", _LATENCY)
        self.queue = hist("request_queue_time_seconds", "Time waiting before first "
                          "scheduled (s).", _LATENCY)
        self.prefill = hist("request_prefill_time_seconds", "Time from first scheduled to "
                            "first token (s).", _LATENCY)
        self.decode = hist("request_decode_time_seconds", "Time from first token to last "
                           "token (s).", _LATENCY)
        self.req_prompt_tokens = hist("request_prompt_tokens", "Prompt tokens per request.",
                                      _TOKENS)
        self.req_generation_tokens = hist("request_generation_tokens", "Generated tokens per "
                                          "request (all n samples).", _TOKENS)

    def on_core_stats(self, s: EngineCoreStats) -> None:
        """`AsyncEngine` stats listener (output thread)."""
        for h, values in ((self.queue, s.queue_times), (self.prefill, s.prefill_times),
                          (self.decode, s.decode_times)):
            for v in values:
                h.observe(v)

    def request_done(self, prompt_tokens: int, generation_tokens: int, reason: str,
                     e2e: float) -> None:
        self.req_prompt_tokens.observe(prompt_tokens)
        self.req_generation_tokens.observe(generation_tokens)
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generation_tokens)
        self.request_success.labels(self.model, reason).inc()
        self.e2e.observe(e2e)

    def render(self) -> bytes:
        """The Prometheus text format of every series (the vLLM-named copies after)."""
        text = generate_latest(self.registry)
        return text if self.aliases is None else text + generate_latest(self.aliases)
