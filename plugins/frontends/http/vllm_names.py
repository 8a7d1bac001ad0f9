"""``metrics_vllm_names: true``: /metrics also serves the pagebatch series under vLLM's names
(``vllm:`` prefix, vLLM's "Production Metrics"), so Grafana dashboards and autoscaler rules
written for ``vllm serve`` (``vllm:num_requests_waiting``, ...) work unchanged.

The aliases are copies made at scrape time of the ``pagebatch:`` families (same type, samples,
values and ``model_name`` label), so they cost nothing per request and can never disagree
with the originals. Where vLLM renamed a series, both of its names are served:
``vllm:kv_cache_usage_perc`` and the older ``vllm:gpu_cache_usage_perc``;
``vllm:inter_token_latency_seconds`` and the older ``vllm:time_per_output_token_seconds``
(which vLLM also observed once per output gap). pagebatch series with no vLLM counterpart
(``engine_steps``) get no alias.
"""

from __future__ import annotations

from typing import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric

# pagebatch family (no prefix, counters without _total) -> its vLLM names
VLLM_NAMES: dict[str, tuple[str, ...]] = {
    "num_requests_running": ("vllm:num_requests_running",),
    "num_requests_waiting": ("vllm:num_requests_waiting",),
    "kv_cache_usage_perc": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "num_preemptions": ("vllm:num_preemptions",),
    "prefix_cache_queries": ("vllm:prefix_cache_queries",),
    "prefix_cache_hits": ("vllm:prefix_cache_hits",),
    "prompt_tokens": ("vllm:prompt_tokens",),
    "generation_tokens": ("vllm:generation_tokens",),
    "request_success": ("vllm:request_success",),
    "time_to_first_token_seconds": ("vllm:time_to_first_token_seconds",),
    "inter_token_latency_seconds": ("vllm:inter_token_latency_seconds",
                                    "vllm:time_per_output_token_seconds"),
    "e2e_request_latency_seconds": ("vllm:e2e_request_latency_seconds",),
    "request_queue_time_seconds": ("vllm:request_queue_time_seconds",),
    "request_prefill_time_seconds": ("vllm:request_prefill_time_seconds",),
    "request_decode_time_seconds": ("vllm:request_decode_time_seconds",),
    "request_prompt_tokens": ("vllm:request_prompt_tokens",),
    "request_generation_tokens": ("vllm:request_generation_tokens",),
}


def renamed(family: Metric, name: str) -> Metric:
    """A copy of ``family`` named ``name``: each sample renamed with its suffix kept
    (``_total``, ``_bucket``, ``_sum``, ``_count``, ``_created``)."""
    out = Metric(name, family.documentation, family.type, family.unit)
    out.samples = [s._replace(name=name + s.name[len(family.name):]) for s in family.samples]
    return out


class VllmAliases:
    """A collector of the vLLM-named copies of the families of ``source`` whose names are
    ``prefix`` + a key of VLLM_NAMES. Register it in another registry than ``source``."""

    def __init__(self, source: CollectorRegistry, prefix: str) -> None:
        self.source, self.prefix = source, prefix

    def collect(self) -> Iterator[Metric]:
        for family in self.source.collect():
            base = family.name[len(self.prefix):] if family.name.startswith(self.prefix) else ""
            for name in VLLM_NAMES.get(base, ()):
                yield renamed(family, name)
