"""CUDA graphs and async scheduling on the GPU: the same greedy tokens with both as with neither
(eager, one step at a time; near-tie rule), for a batch of mixed lengths with prefix-cache hits
and chunked prefill. Skips without CUDA."""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_greedy_tokens_with_and_without_cuda_graphs(tmp_path):
    from conftest import build_tiny_model
    from numerics import assert_greedy_match, top2_gaps
    from pagebatch import LLM, SamplingParams

    folder = build_tiny_model(tmp_path / "tiny", hidden_size=256, intermediate_size=512,
                              num_attention_heads=8, num_key_value_heads=2,
                              max_position_embeddings=1024)
    rng = random.Random(0)
    shared = [rng.randint(3, 255) for _ in range(96)]
    prompts = [[rng.randint(3, 255) for _ in range(rng.randint(1, 400))] for _ in range(20)]
    prompts += [shared + [rng.randint(3, 255) for _ in range(rng.randint(1, 50))]
                for _ in range(12)]  # prefix-cache hits on 6 full blocks
    sp = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    runs = {}
    for eager in (True, False):
        llm = LLM(str(folder), device="cuda", dtype="float32", enforce_eager=eager,
                  async_scheduling=not eager,
                  num_kv_blocks=1024, block_size=16, max_num_batched_tokens=256,
                  max_num_seqs=24)
        runner = llm.engine.core.runner
        assert (runner.graphs is None) == eager
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        tokens = [o.outputs[0].token_ids for o in outs]
        gaps = [top2_gaps(runner.forward_scratch(p + t[:-1])[len(p) - 1:])
                for p, t in zip(prompts, tokens)]
        if not eager:
            assert runner.graphs.num_replays > 40  # decode steps did replay graphs
        assert llm.engine.core.stats().prefix_cache_hits > 0
        runs[eager] = (tokens, gaps)
        del llm, runner
        torch.cuda.empty_cache()
    for ref, gaps, got in zip(runs[True][0], runs[True][1], runs[False][0]):
        assert_greedy_match(ref, gaps, got, what="CUDA graphs vs eager")
