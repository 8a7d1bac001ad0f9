"""The start-up warm-up batches (core/step_warmup.py) reach every launch choice (kernel, KIND,
tiles, split count) that the triton backend's rules make for random mixed batches, for many
head layouts and limits, so that serving never stops for a Triton compile the warm-up could
have done; and the warm-up runs a model end to end on the CPU."""

from __future__ import annotations

import random

import pytest
import torch

from pagebatch.step_warmup import batch_metadata, warm_up_step_variants, warmup_batches

CUDA = torch.device("cuda")
HEADS = [(32, 8, 128), (28, 4, 128), (32, 32, 128), (16, 8, 64), (40, 8, 128), (64, 8, 128),
         (14, 2, 64), (32, 4, 256), (24, 24, 64), (8, 1, 128)]


def launch_choices(reqs, hq, hkv, d, dtype=torch.bfloat16):
    """The attention launches of one batch (the dispatch of `paged_attention`, new_kv given)."""
    from pagebatch.plugins.attention import triton_backend as tb
    from pagebatch.plugins.attention.prefill import choose_prefill_config

    _, _, meta = batch_metadata(reqs, 16, torch.device("cpu"))
    group = hq // hkv
    decodes, prefills = meta.parts
    out = set()

    def paged(part, kind):
        cfg = tb.choose_config(part.tok_end - part.tok_begin, part.seq_end - part.seq_begin,
                               part.max_query_len, part.max_seq_len, hkv, group, d, dtype, CUDA)
        out.add(("paged", kind, cfg))

    if decodes is not None:
        paged(decodes, 0 if decodes.pure else 1)
    if prefills is not None:
        if prefills.max_seq_len <= tb.PREFILL_KERNEL_MAX_CONTEXT * prefills.max_query_len:
            out.add(("prefill", choose_prefill_config(prefills.max_query_len, group, d, dtype,
                                                      CUDA)))
        else:
            paged(prefills, 0 if prefills.pure else 2)
    return out


def random_batch(rng, max_model_len, budget, max_seqs):
    reqs, used = [], 0
    for _ in range(rng.randint(1, min(40, max_seqs))):
        q = 1 if rng.random() < 0.6 else rng.randint(2, min(budget, 2048))
        if used + q > budget:
            break
        c = rng.randint(q, max_model_len)
        reqs.append((q, c))
        used += q
    return reqs or [(1, rng.randint(1, max_model_len))]


@pytest.mark.parametrize("hq,hkv,d", HEADS)
@pytest.mark.parametrize("max_model_len,budget,seqs", [(4096, 16384, 256), (32768, 8192, 64),
                                                      (2048, 512, 8)])
def test_warmup_reaches_every_launch_choice_of_random_batches(hq, hkv, d, max_model_len, budget,
                                                              seqs, monkeypatch):
    from pagebatch.plugins.attention import triton_backend as tb
    from pagebatch.plugins.attention import prefill

    monkeypatch.setattr(tb, "num_sms", lambda device: 132)
    monkeypatch.setattr(prefill, "_smem_bytes", lambda index: 232448)
    monkeypatch.setattr(prefill, "_hopper", lambda index: True)
    monkeypatch.setattr(prefill, "_index", lambda device: 0)
    warm = set()
    for reqs in warmup_batches(max_model_len, budget, seqs):
        assert sum(q for q, _ in reqs) <= budget and len(reqs) <= seqs
        assert all(q <= c <= max_model_len for q, c in reqs)
        warm |= launch_choices(reqs, hq, hkv, d)
    rng = random.Random(hq * 1000 + hkv * 10 + d + max_model_len)
    for _ in range(150):
        reqs = random_batch(rng, max_model_len, budget, seqs)
        missing = launch_choices(reqs, hq, hkv, d) - warm
        assert not missing, (reqs, missing)


def test_warmup_runs_a_model_on_the_cpu(tiny_model_dir):
    """torch_ref on the CPU: every synthetic batch is a valid step for a real model."""
    from pagebatch.config import EngineConfig
    from pagebatch.engine_core import EngineCore
    from pagebatch.registry import registry

    config = EngineConfig.from_sources(cli=dict(model=str(tiny_model_dir), device="cpu",
                                                num_kv_blocks=64, block_size=4,
                                                max_num_batched_tokens=64,
                                                max_model_len=256))
    core = EngineCore.from_config(config, registry())
    runner = core.runner
    calls = []

    def forward(ids, pos, meta):
        calls.append(meta.max_seq_len)
        return runner.model(ids, pos, runner.kv_caches, meta)

    warm_up_step_variants(forward, runner.block_size, runner.max_model_len,
                          runner.max_num_batched_tokens, runner.device)
    assert len(calls) == len(warmup_batches(runner.max_model_len, runner.max_num_batched_tokens))
    assert max(calls) == 256
    core.shutdown()
