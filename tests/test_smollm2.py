"""The default model, SmolLM2-135M-Instruct from the packaged GGUF, against transformers."""

from __future__ import annotations

import random

import pytest
import torch

from numerics import (LOGITS_ATOL, LOGITS_RTOL, assert_greedy_match, hf_greedy, top2_gaps)
from pagebatch import SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land"]


@pytest.fixture(scope="module")
def hf_smollm2(smollm2_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()


def test_gguf_conversion_matches_transformers_gguf_loader(smollm2_dir):
    """Our dequantize + q/k un-permute against transformers' own GGUF loader."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from pagebatch.model_loader import smollm2_gguf_path

    g = smollm2_gguf_path()
    ref = AutoModelForCausalLM.from_pretrained(str(g.parent), gguf_file=g.name,
                                               dtype=torch.float32).state_dict()
    ours = load_file(str(smollm2_dir / "model.safetensors"))
    assert set(ours) == {k for k in ref if k != "lm_head.weight"}
    for name, t in ours.items():
        torch.testing.assert_close(t, ref[name], atol=0, rtol=0, msg=name)


def test_logits_match_transformers(smollm2_llm, hf_smollm2):
    tok = smollm2_llm.get_tokenizer()
    ids = tok("The quick brown fox jumps over the lazy dog. " * 6)["input_ids"]
    ours = smollm2_llm.engine.core.runner.forward_scratch(ids)
    with torch.no_grad():
        ref = hf_smollm2(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(ours, ref, atol=LOGITS_ATOL, rtol=LOGITS_RTOL)


def test_greedy_matches_transformers(smollm2_llm, hf_smollm2):
    tok = smollm2_llm.get_tokenizer()
    sp = SamplingParams(temperature=0.0, max_tokens=24)
    for text in PROMPTS:
        ids = tok(text)["input_ids"]
        ref, gaps = hf_greedy(hf_smollm2, ids, 24)
        got = smollm2_llm.generate(text, sp, use_tqdm=False)[0].outputs[0]
        assert_greedy_match(ref, gaps, got.token_ids, what=text)


def test_chat_answers_paris(smollm2_llm):
    out = smollm2_llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                           SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"
    prompt = out.prompt_token_ids
    bos = smollm2_llm.get_tokenizer().convert_tokens_to_ids("<|im_start|>")
    assert prompt[0] == bos and prompt[1] != bos  # the template's start once, not twice


def test_sixteen_mixed_prompts_batched_equal_solo(smollm2_llm):
    rng = random.Random(0)
    tok = smollm2_llm.get_tokenizer()
    words = "the a cat dog runs over under house tree river blue red quickly slowly".split()
    prompts = [" ".join(rng.choice(words) for _ in range(rng.randint(2, 60))) for _ in range(16)]
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    batched = smollm2_llm.generate(prompts, sp, use_tqdm=False)
    runner = smollm2_llm.engine.core.runner
    for text, b in zip(prompts, batched):
        solo = smollm2_llm.generate(text, sp, use_tqdm=False)[0].outputs[0].token_ids
        ids = tok(text)["input_ids"]
        gaps = top2_gaps(runner.forward_scratch(ids + solo)[len(ids) - 1:-1])
        assert_greedy_match(solo, gaps, b.outputs[0].token_ids, what=text)
    kv = smollm2_llm.engine.core.kv_cache
    assert kv.num_free_blocks == kv.num_blocks


def test_cli_generate_says_paris(capsys):
    from pagebatch.cli import main

    rc = main(["generate", "--chat", "--prompt", "What is the capital of France?",
               "--temperature", "0", "--max-tokens", "32", "--device", "cpu",
               "--kv-cache-memory", "256MiB", "--max-model-len", "1024"])
    assert rc == 0
    assert "Paris" in capsys.readouterr().out
