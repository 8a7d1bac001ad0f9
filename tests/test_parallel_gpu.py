"""Tensor and pipeline parallelism on two GPUs (NCCL): TP=2 (CUDA graphs with the all-reduce
captured, asynchronous scheduling; with ``custom_all_reduce`` on, the default, the one-shot
kernel fused with the norms, and off, NCCL) and PP=2 (each stage's decode steps in CUDA graphs)
give one GPU's eager greedy tokens (fp32, near-tie rule) for a batch of mixed lengths with
prefix-cache hits and chunked prefill. Skips without two CUDA devices (kind nvidia-h200-x2)."""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")]

KEYS = dict(device="cuda", dtype="float32", num_kv_blocks=1024, block_size=16,
            max_num_batched_tokens=256, max_num_seqs=24)


def _generate(folder, prompts, **keys):
    from numerics import top2_gaps
    from pagebatch import LLM, SamplingParams

    llm = LLM(str(folder), **KEYS, **keys)
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        tokens = [o.outputs[0].token_ids for o in outs]
        runner = llm.engine.core.runner
        gaps = None
        if keys.get("enforce_eager"):  # the reference: a single GPU
            gaps = [top2_gaps(runner.forward_scratch(p + t[:-1])[len(p) - 1:])
                    for p, t in zip(prompts, tokens)]
        replays = runner.graphs.num_replays if runner.graphs is not None else 0
        return tokens, gaps, replays, runner.parallel.one_shot is not None
    finally:
        llm.engine.shutdown()
        torch.cuda.empty_cache()


def test_tp2_and_pp2_greedy_equal_one_gpu(tmp_path):
    from conftest import build_tiny_model
    from numerics import assert_greedy_match

    folder = build_tiny_model(tmp_path / "tiny", hidden_size=256, intermediate_size=512,
                              num_hidden_layers=4, num_attention_heads=8,
                              num_key_value_heads=2, max_position_embeddings=1024)
    rng = random.Random(0)
    shared = [rng.randint(3, 255) for _ in range(96)]
    prompts = [[rng.randint(3, 255) for _ in range(rng.randint(1, 400))] for _ in range(16)]
    prompts += [shared + [rng.randint(3, 255) for _ in range(rng.randint(1, 50))]
                for _ in range(8)]
    ref, gaps, _, _ = _generate(folder, prompts, enforce_eager=True, async_scheduling=False)
    tp_tokens, _, tp_replays, _ = _generate(folder, prompts, tensor_parallel_size=2,
                                            custom_all_reduce=False)
    assert tp_replays > 20, "TP decode steps should replay CUDA graphs"
    pp_tokens, _, pp_replays, _ = _generate(folder, prompts, pipeline_parallel_size=2)
    assert pp_replays > 20, "PP decode steps should replay each stage's CUDA graphs"
    # the default: the one-shot all-reduce fused with the norms (every batch of this workload
    # fits it)
    ar_tokens, _, ar_replays, one_shot = _generate(folder, prompts, tensor_parallel_size=2)
    assert one_shot and ar_replays > 20
    for i, (r, g) in enumerate(zip(ref, gaps)):
        assert_greedy_match(r, g, tp_tokens[i], what=f"tp2 prompt {i}")
        assert_greedy_match(r, g, pp_tokens[i], what=f"pp2 prompt {i}")
        assert_greedy_match(r, g, ar_tokens[i], what=f"tp2 custom_all_reduce prompt {i}")
