"""The engine end to end on a tiny random Llama: logits and greedy tokens against transformers,
batch invariance, blocks returned."""

from __future__ import annotations


import pytest
import torch

from numerics import LOGITS_ATOL, LOGITS_RTOL, assert_greedy_match, hf_greedy
from pagebatch import LLM, SamplingParams
from tiny import random_prompts


@pytest.fixture(scope="module")
def hf_tiny(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tiny_llm(tiny_model_dir):
    return LLM(str(tiny_model_dir), device="cpu", dtype="float32", num_kv_blocks=96,
               block_size=4, max_num_seqs=16)


def test_logits_match_transformers(tiny_llm, hf_tiny):
    ids = random_prompts(1, seed=7)[0] + list(range(3, 60))
    ours = tiny_llm.engine.core.runner.forward_scratch(ids)
    with torch.no_grad():
        ref = hf_tiny(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(ours, ref, atol=LOGITS_ATOL, rtol=LOGITS_RTOL)


def test_greedy_matches_transformers(tiny_llm, hf_tiny):
    sp = SamplingParams(temperature=0.0, max_tokens=24)
    for p in random_prompts(4, seed=3):
        ref, gaps = hf_greedy(hf_tiny, p, 24)
        got = tiny_llm.generate({"prompt_token_ids": p}, sp, use_tqdm=False)[0]
        assert_greedy_match(ref, gaps, got.outputs[0].token_ids, what=f"prompt {p}")


def test_batch_of_16_equals_solo(tiny_llm):
    prompts = [{"prompt_token_ids": p} for p in random_prompts(16, seed=5)]
    sp = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    batched = tiny_llm.generate(prompts, sp, use_tqdm=False)
    solo = [tiny_llm.generate(p, sp, use_tqdm=False)[0] for p in prompts]
    for b, s in zip(batched, solo):
        assert b.outputs[0].token_ids == s.outputs[0].token_ids
        assert len(b.outputs[0].token_ids) == 20
    core = tiny_llm.engine.core
    assert core.kv_cache.num_free_blocks == core.kv_cache.num_blocks


def test_preemption_gives_the_same_tokens(tiny_model_dir):
    """A cache of 24 blocks x 4 tokens cannot hold 8 requests of ~30 tokens: preemption by
    recompute must leave every output as it would be alone."""
    llm = LLM(str(tiny_model_dir), device="cpu", num_kv_blocks=24, block_size=4,
              max_model_len=64, max_num_batched_tokens=256)
    prompts = [{"prompt_token_ids": p} for p in random_prompts(8, seed=11)]
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    batched = llm.generate(prompts, sp, use_tqdm=False)
    assert llm.engine.core.scheduler.stats.num_preemptions > 0
    solo = [llm.generate(p, sp, use_tqdm=False)[0] for p in prompts]
    assert [b.outputs[0].token_ids for b in batched] == [s.outputs[0].token_ids for s in solo]
    assert llm.engine.core.kv_cache.num_free_blocks == 24


def test_seeded_sampling_is_batch_invariant(tiny_llm):
    prompts = [{"prompt_token_ids": p} for p in random_prompts(16, seed=2)]
    mixed = [SamplingParams(temperature=0.0, max_tokens=12) if i % 3 else
             SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=100 + i)
             for i in range(16)]
    batched = tiny_llm.generate(prompts, mixed, use_tqdm=False)
    for i in range(0, 16, 3):
        alone = tiny_llm.generate(prompts[i], mixed[i], use_tqdm=False)[0]
        assert alone.outputs[0].token_ids == batched[i].outputs[0].token_ids


def test_top_k_1_equals_greedy(tiny_llm):
    p = {"prompt_token_ids": random_prompts(1, seed=9)[0]}
    g = tiny_llm.generate(p, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
                          use_tqdm=False)[0]
    k1 = tiny_llm.generate(p, SamplingParams(temperature=0.7, top_k=1, max_tokens=16,
                                             ignore_eos=True, seed=3), use_tqdm=False)[0]
    assert g.outputs[0].token_ids == k1.outputs[0].token_ids


def test_stop_token_ids_and_max_tokens(tiny_llm):
    p = {"prompt_token_ids": random_prompts(1, seed=4)[0]}
    free = tiny_llm.generate(p, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
                             use_tqdm=False)[0].outputs[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 10
    stop_at = free.token_ids[4]
    first = free.token_ids.index(stop_at)
    out = tiny_llm.generate(p, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True,
                                              stop_token_ids=[stop_at]), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].token_ids == free.token_ids[:first + 1]
    assert out.outputs[0].stop_reason == stop_at


def test_generation_config_sets_sampling_defaults(tiny_model_dir, tmp_path):
    import json
    import shutil

    folder = tmp_path / "with-genconfig"
    shutil.copytree(tiny_model_dir, folder)
    (folder / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.25, "top_k": 7, "max_new_tokens": 5}))
    llm = LLM(str(folder), device="cpu", num_kv_blocks=64)
    d = llm.engine.default_sampling_params()
    assert (d.temperature, d.top_k, d.max_tokens) == (0.25, 7, 5)
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, use_tqdm=False)[0]
    assert 1 <= len(out.outputs[0].token_ids) <= 5  # max_new_tokens is the default max_tokens
    explicit = llm.generate({"prompt_token_ids": [5, 6, 7]},
                            SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    assert len(explicit.outputs[0].token_ids) == 8  # given params are used as they are
    plain = LLM(str(folder), device="cpu", num_kv_blocks=64, generation_config="vllm")
    assert plain.engine.default_sampling_params().temperature == 1.0


def test_config_file_and_keywords(tiny_model_dir, tmp_path):
    cfg = tmp_path / "engine.yaml"
    cfg.write_text(f"model: {tiny_model_dir}\ndevice: cpu\nnum-kv-blocks: 40\nblock_size: 8\n"
                   f"max_num_seqs: 3\n")
    llm = LLM(config_file=cfg, max_num_seqs=5)
    assert llm.config.num_kv_blocks == 40 and llm.config.block_size == 8
    assert llm.config.max_num_seqs == 5  # the keyword (like the CLI) wins over the file
    assert llm.engine.core.scheduler.max_num_seqs == 5


def test_profile_forward_longer_than_max_model_len(tiny_model_dir):
    """The memory-profiling step covers the whole token budget in sequences of at most
    max_model_len tokens (positions past max_model_len once read outside the rotary cache)."""
    llm = LLM(str(tiny_model_dir), device="cpu", num_kv_blocks=64, max_model_len=32,
              max_num_batched_tokens=100)
    runner = llm.engine.core.runner
    runner._dummy_forward(100)
    with pytest.raises(ValueError, match="max_model_len=32"):
        runner.forward_scratch(list(range(40)))
