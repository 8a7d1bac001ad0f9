"""Piecewise CUDA graphs (core/piecewise_graphs.py) on the GPU: steps with prefill tokens replay
the pieces between attention calls and give the greedy tokens of the same steps run eagerly
(near-tie rule), with chunked prefill, prefix-cache hits and async scheduling; a step longer
than the largest captured size still runs eagerly. Skips without CUDA."""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("model_type,dtype", [("llama", "float32"), ("llama", "bfloat16"),
                                              ("qwen3", "bfloat16"), ("qwen2", "float32")])
def test_greedy_tokens_with_and_without_piecewise_graphs(tmp_path, model_type, dtype):
    from conftest import build_tiny_model
    from numerics import assert_greedy_match, top2_gaps
    from pagebatch import LLM, SamplingParams

    folder = build_tiny_model(tmp_path / "tiny", model_type=model_type, hidden_size=256,
                              intermediate_size=512,
                              num_attention_heads=8, num_key_value_heads=2,
                              max_position_embeddings=1024)
    rng = random.Random(1)
    shared = [rng.randint(3, 255) for _ in range(80)]
    prompts = [[rng.randint(3, 255) for _ in range(rng.randint(1, 300))] for _ in range(16)]
    prompts += [shared + [rng.randint(3, 255) for _ in range(rng.randint(1, 40))]
                for _ in range(8)]
    sp = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    runs = {}
    for limit in (0, 96):  # 96 < the step budget: the longest steps stay eager
        llm = LLM(str(folder), device="cuda", dtype=dtype, num_kv_blocks=1024, block_size=16,
                  max_num_batched_tokens=160, max_num_seqs=24,
                  piecewise_cuda_graph_max_tokens=limit)
        runner = llm.engine.core.runner
        assert (runner.piecewise is None) == (limit == 0)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        tokens = [o.outputs[0].token_ids for o in outs]
        gaps = [top2_gaps(runner.forward_scratch(p + t[:-1])[len(p) - 1:])
                for p, t in zip(prompts, tokens)]
        if limit:
            assert runner.piecewise.sizes[-1] == 96
            assert runner.piecewise.num_replays > 5
            assert len(runner.piecewise.buckets[96].graphs) == runner.model.num_layers + 1
        runs[limit] = (tokens, gaps)
        del llm, runner
        torch.cuda.empty_cache()
    for ref, gaps, got in zip(runs[0][0], runs[0][1], runs[96][0]):
        assert_greedy_match(ref, gaps, got,
                            what=f"piecewise CUDA graphs vs eager ({model_type}, {dtype})")
