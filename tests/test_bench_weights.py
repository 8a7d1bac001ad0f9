"""`pagebatch bench`'s weights figure (core/bench/offline.py weight_bytes): parameters and
persistent buffers, each storage once; derived non-persistent caches left out."""

from __future__ import annotations

import torch

from pagebatch.bench.offline import weight_bytes


def test_weight_bytes_counts_tied_storage_once_and_skips_caches():
    model = torch.nn.Module()
    model.embed = torch.nn.Embedding(10, 4)  # 40 fp32 = 160 bytes
    model.head = torch.nn.Linear(4, 10, bias=False)
    model.head.weight = model.embed.weight  # tied
    model.register_buffer("qweight", torch.zeros(3, 5, dtype=torch.int32))  # 60 bytes
    model.register_buffer("cos_sin", torch.zeros(1000), persistent=False)  # not weights
    assert weight_bytes(model) == 160 + 60


def test_throughput_iterations_do_not_hit_each_others_prefix_cache(tiny_model_dir):
    """`bench throughput --num-iters 2`: the second timed run gets prompts of its own, so its
    figure is not a prefix-cache replay of the first (the H200 run that found this had the
    second iteration 1.7x faster)."""
    from pagebatch.bench.offline import bench_pagebatch
    from pagebatch.config import EngineConfig
    from pagebatch.engine import LLMEngine

    hits = []
    step = LLMEngine.step

    def counting_step(self):  # the prefix-cache hits of every step, as the engine saw them
        out = step(self)
        hits.append(self.core.kv_cache.stats.hits)
        return out

    prompts = [[(7 * i + 3 * j) % 200 + 3 for j in range(64)] for i in range(4)]
    cfg = EngineConfig.from_sources(cli=dict(model=str(tiny_model_dir), device="cpu",
                                             block_size=16, num_kv_blocks=256))
    LLMEngine.step = counting_step
    try:
        res = bench_pagebatch(cfg, "throughput", prompts, [4] * 4, num_iters=2)
    finally:
        LLMEngine.step = step
    assert len(res["elapsed_each_s"]) == 2 and res["output_tokens"] == 16
    assert hits and hits[-1] == 0
