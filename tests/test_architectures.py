"""The Llama-family architectures (Mistral, Qwen2, Qwen3, Llama 3.1 rope scaling, YaRN) on tiny
random models: logits and greedy tokens against transformers, the rope scalings against
transformers' ``ROPE_INIT_FUNCTIONS``, and the layers' sliding windows."""

from __future__ import annotations

import logging
import random
from types import SimpleNamespace

import pytest
import torch

from conftest import build_tiny_model
from numerics import LOGITS_ATOL, LOGITS_RTOL, assert_greedy_match, hf_greedy
from pagebatch import LLM, SamplingParams
from pagebatch.errors import ConfigError
from pagebatch.layers.rotary import rope_frequencies, rope_params
from pagebatch.registry import registry

# Rope scaling only changes positions past the original context: 64 here, and the tests run
# ~200 tokens (max_position_embeddings is 256 in TINY_LLAMA).
ORIGINAL_LEN = 64
LLAMA3_SCALING = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=ORIGINAL_LEN)
YARN_SCALING = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=ORIGINAL_LEN)

# case -> (transformers model_type, config overrides)
CASES = {
    "mistral": ("mistral", dict(sliding_window=None)),
    "qwen2": ("qwen2", dict(rope_theta=1e6)),
    "qwen2-yarn": ("qwen2", dict(rope_theta=1e6, rope_scaling=YARN_SCALING)),
    # head_dim 32 != hidden_size / heads = 16: Qwen3 takes it from the config; tied embeddings
    "qwen3": ("qwen3", dict(head_dim=32, tie_word_embeddings=True)),
    "qwen3-yarn": ("qwen3", dict(head_dim=16, rope_scaling={**YARN_SCALING, "factor": 8.0})),
    "llama3-scaling": ("llama", dict(rope_theta=500000.0, rope_scaling=LLAMA3_SCALING)),
}


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(3, 255) for _ in range(n)]


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    """(name, HF folder, transformers model, our LLM) for one architecture case."""
    from transformers import AutoModelForCausalLM

    model_type, overrides = CASES[request.param]
    folder = build_tiny_model(tmp_path_factory.mktemp(request.param), seed=3,
                              model_type=model_type, norm_std=0.1, **overrides)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    llm = LLM(str(folder), device="cpu", dtype="float32", num_kv_blocks=40, block_size=16,
              max_num_seqs=4)
    return request.param, folder, hf, llm


def test_builtin_plugins_register_the_architectures():
    reg = registry()
    assert reg.provider("model", "MistralForCausalLM") == "mistral"
    assert reg.provider("model", "Qwen2ForCausalLM") == "qwen"
    assert reg.provider("model", "Qwen3ForCausalLM") == "qwen"
    assert reg.provider("model", "LlamaForCausalLM") == "llama"


def test_logits_match_transformers(case):
    """200 tokens: past the rope's original context (64) where the scalings matter."""
    name, _, hf, llm = case
    ids = _ids(200, seed=7)
    ours = llm.engine.core.runner.forward_scratch(ids)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(ours, ref, atol=LOGITS_ATOL, rtol=LOGITS_RTOL, msg=name)


def test_greedy_matches_transformers(case):
    name, _, hf, llm = case
    sp = SamplingParams(temperature=0.0, max_tokens=40)
    for seed in (1, 2):
        prompt = _ids(150, seed=seed)
        ref, gaps = hf_greedy(hf, prompt, 40)
        got = llm.generate({"prompt_token_ids": prompt}, sp, use_tqdm=False)[0]
        assert_greedy_match(ref, gaps, got.outputs[0].token_ids, what=f"{name} seed {seed}")


def test_qwen3_has_per_head_qk_norm(case):
    name, _, _, llm = case
    attn = llm.engine.core.runner.model.layers[0].self_attn
    if name.startswith("qwen3"):
        assert attn.q_norm.weight.shape == (attn.head_dim,)
        assert not torch.all(attn.q_norm.weight == 1)  # loaded from the checkpoint
    if name.startswith("qwen2"):
        assert attn.qkv_proj.bias is not None and attn.o_proj.bias is None
    if name == "qwen3":
        assert attn.head_dim == 32 and attn.qkv_proj.bias is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_qwen3_on_cuda_fused_qk_norm_matches_the_two_norms_and_transformers(tmp_path,
                                                                             monkeypatch):
    """On CUDA Qwen3's q/k norms run as one in-place kernel (`qk_head_norm_`): the logits equal
    those of the two separate norms, and transformers' within a GPU fp32 margin."""
    from transformers import AutoModelForCausalLM

    from pagebatch.plugins.models.qwen import Qwen3Attention

    folder = build_tiny_model(tmp_path, seed=3, model_type="qwen3", norm_std=0.1, head_dim=32,
                              tie_word_embeddings=True)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    llm = LLM(str(folder), device="cuda", dtype="float32", num_kv_blocks=40, block_size=16,
              max_num_seqs=4)
    ids = _ids(200, seed=7)
    fused = llm.engine.core.runner.forward_scratch(ids).cpu()
    monkeypatch.setattr(Qwen3Attention, "qk_norm",
                        lambda self, q, k: (self.q_norm(q), self.k_norm(k)))
    separate = llm.engine.core.runner.forward_scratch(ids).cpu()
    torch.testing.assert_close(fused, separate, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(fused, ref, atol=2e-2, rtol=1e-3)


# ---- sliding windows (the attention and block manager tests: tests/test_sliding_window.py) ----


@pytest.fixture(scope="module")
def mistral_window_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("mistral-window"), seed=5,
                            model_type="mistral", sliding_window=64)


@pytest.mark.parametrize("asked, expected", [(None, 256), (128, 128), (32, 32)])
def test_mistral_sliding_window_no_longer_caps_max_model_len(mistral_window_dir, caplog, asked,
                                                              expected):
    caplog.set_level(logging.WARNING, logger="pagebatch.engine")
    llm = LLM(str(mistral_window_dir), device="cpu", dtype="float32", num_kv_blocks=16,
              block_size=16, max_model_len=asked, enable_chunked_prefill=True,
              max_num_batched_tokens=32)
    assert llm.engine.max_model_len == expected
    assert llm.engine.core.runner.max_model_len == expected
    assert not [r for r in caplog.records if "max_model_len lowered" in r.getMessage()]
    assert llm.engine.core.kv_cache.sliding_window == 64
    assert [layer.self_attn.attn.sliding_window
            for layer in llm.engine.core.runner.model.layers] == [64, 64]


def test_mistral_logits_past_the_window_match_transformers(mistral_window_dir):
    """200 tokens, three windows: transformers masks with its sliding-window causal mask."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(mistral_window_dir, dtype=torch.float32).eval()
    llm = LLM(str(mistral_window_dir), device="cpu", dtype="float32", num_kv_blocks=20,
              block_size=16)
    ids = _ids(200, seed=4)
    ours = llm.engine.core.runner.forward_scratch(ids)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(ours, ref, atol=LOGITS_ATOL, rtol=LOGITS_RTOL)


def test_qwen_sliding_window_only_when_used():
    from transformers import Qwen2Config

    from pagebatch.model import kv_sliding_window
    from pagebatch.plugins.models.qwen import Qwen2ForCausalLM, Qwen3ForCausalLM

    base = dict(num_hidden_layers=4, sliding_window=128, max_position_embeddings=1024)
    assert Qwen2ForCausalLM.sliding_windows(Qwen2Config(**base)) == [None] * 4
    used = Qwen2Config(**base, use_sliding_window=True, max_window_layers=2)
    assert Qwen2ForCausalLM.sliding_windows(used) == [None, None, 128, 128]
    assert Qwen3ForCausalLM.sliding_windows(used) == [None, None, 128, 128]
    assert kv_sliding_window([None, None, 128, 128]) is None  # hybrid: whole block tables
    assert kv_sliding_window([128] * 4) == 128
    none_windowed = Qwen2Config(**base, use_sliding_window=True, max_window_layers=4)
    assert Qwen2ForCausalLM.sliding_windows(none_windowed) == [None] * 4
    old_style = SimpleNamespace(use_sliding_window=True, sliding_window=128, max_window_layers=2,
                                num_hidden_layers=4)  # transformers < 5: no layer_types
    assert Qwen2ForCausalLM.sliding_windows(old_style) == [None, None, 128, 128]
    typed = SimpleNamespace(use_sliding_window=True, sliding_window=128, num_hidden_layers=4,
                            layer_types=["sliding_attention", "full_attention"] * 2)
    assert Qwen2ForCausalLM.sliding_windows(typed) == [128, None, 128, None]


# ---- rope scalings against transformers -----------------------------------------------------

ROPE_CASES = [
    dict(rope_type="linear", factor=2.0),
    LLAMA3_SCALING,
    dict(LLAMA3_SCALING, low_freq_factor=2.0, high_freq_factor=8.0, factor=4.0),
    YARN_SCALING,
    dict(YARN_SCALING, beta_fast=16, beta_slow=2, truncate=False),
    dict(YARN_SCALING, mscale=0.707, mscale_all_dim=1.0),
    dict(YARN_SCALING, attention_factor=1.5),
    dict(type="yarn", factor=4.0),  # old "type" key; original length = max_position_embeddings
    dict(rope_type="dynamic", factor=2.0),
]


@pytest.mark.parametrize("theta", [10000.0, 1e6])
@pytest.mark.parametrize("head_dim", [16, 128])
@pytest.mark.parametrize("scaling", ROPE_CASES, ids=lambda s: str(s.get("rope_type", s)))
def test_rope_frequencies_match_transformers(scaling, head_dim, theta):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4,
                      max_position_embeddings=256, rope_theta=theta, rope_scaling=dict(scaling))
    ref_inv, ref_scale = ROPE_INIT_FUNCTIONS[cfg.rope_parameters["rope_type"]](cfg, "cpu")
    base, ours = rope_params(cfg)
    inv, scale = rope_frequencies(head_dim, base, ours, max_position=256)
    torch.testing.assert_close(inv, ref_inv, rtol=1e-6, atol=0)
    assert scale == pytest.approx(ref_scale, rel=1e-12)


def test_rope_params_old_and_new_config_styles():
    old = SimpleNamespace(rope_theta=1e6, max_position_embeddings=4096,
                          rope_scaling={"type": "yarn", "factor": 4.0,
                                        "original_max_position_embeddings": 1024})
    new = SimpleNamespace(max_position_embeddings=4096,
                          rope_parameters={"rope_theta": 1e6, "rope_type": "yarn", "factor": 4.0,
                                           "original_max_position_embeddings": 1024})
    want = (1e6, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024})
    assert rope_params(old) == rope_params(new) == want
    assert rope_params(SimpleNamespace(rope_theta=5e5, rope_scaling=None)) == (5e5, None)
    assert rope_params(SimpleNamespace(rope_parameters={"rope_theta": 5e5,
                                                        "rope_type": "default"}))[0] == 5e5
    assert old.rope_scaling["type"] == "yarn"  # the config's own dict is not modified


def test_unsupported_rope_raises_config_error():
    longrope = {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
    with pytest.raises(ConfigError, match="longrope.*supported"):
        rope_frequencies(16, 10000.0, longrope, 256)
    dynamic = {"rope_type": "dynamic", "factor": 2.0, "max_position_embeddings": 256}
    with pytest.raises(ConfigError, match="max_model_len=512 above max_position_embeddings=256"):
        rope_frequencies(16, 10000.0, dynamic, 512)
    with pytest.raises(ConfigError, match="partial_rotary_factor"):
        rope_frequencies(16, 10000.0, {"rope_type": "default", "partial_rotary_factor": 0.5}, 8)
