"""Shared fixtures: a tiny random Llama folder (built, never downloaded) and SmolLM2 loaded once
per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# kernels take a table's config or the rule's, not a start-up timing (core/kernels/autotune.py;
# tests/test_autotune.py turns it on where it tests it)
os.environ.setdefault("PAGEBATCH_AUTOTUNE", "0")


class _NoTriton:
    """A meta path finder that refuses Triton: tests/test_without_triton.py runs a selection
    with ``PAGEBATCH_TEST_NO_TRITON=1``, as in the README's main set-up (no Triton)."""

    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ImportError(f"No module named {name!r} (PAGEBATCH_TEST_NO_TRITON=1)")
        return None


if os.environ.get("PAGEBATCH_TEST_NO_TRITON") == "1":
    import sys

    sys.meta_path.insert(0, _NoTriton())

TINY_LLAMA = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1,
    eos_token_id=2,
)


def build_tiny_model(folder: Path, seed: int = 0, model_type: str = "llama",
                     norm_std: float = 0.0, **overrides) -> Path:
    """A random causal LM of transformers' ``model_type`` (default a LlamaForCausalLM; also
    "mistral", "qwen2", "qwen3", ...) saved as a Hugging Face folder (config.json, safetensors)
    with a word-level tokenizer (tests that need text use it). ``overrides`` are config fields on
    top of TINY_LLAMA. Norm weights stay 1 unless ``norm_std`` > 0: then 1 + N(0, norm_std), so
    that a norm weight that fails to load shows in the logits."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(model_type, **{**TINY_LLAMA, **overrides})
    model = AutoModelForCausalLM.from_config(cfg).to(torch.float32)
    with torch.no_grad():  # HF's init is tiny (std 0.02): widen it so logits are not all ties
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.2)
            elif norm_std > 0:
                p.normal_(1.0, norm_std)
    model.save_pretrained(folder, safe_serialization=True)
    _write_tokenizer(folder, cfg.vocab_size)
    return folder


def _write_tokenizer(folder: Path, vocab_size: int) -> None:
    """A word-level tokenizer over vocab_size tokens (tokenizers library), saved as a
    PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for i in range(3, vocab_size):
        vocab[f"w{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")
    fast.chat_template = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} "
                          "{% endfor %}{% if add_generation_prompt %}w3{% endif %}")
    fast.save_pretrained(folder)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The SmolLM2 Hugging Face folder converted from the packaged GGUF (cached on disk)."""
    from pagebatch.model_loader import resolve_model

    return resolve_model("smollm2-135m").folder


@pytest.fixture(scope="session")
def smollm2_llm():
    """One SmolLM2 LLM for the whole session (fp32, CPU, small KV cache)."""
    from pagebatch import LLM

    return LLM("smollm2-135m", device="cpu", dtype="float32", kv_cache_memory="512MiB",
               max_model_len=2048)


# The HTTP API test files' server (module scope: each module that uses it gets its own, so it
# knows its own traffic) and clients; tests/http_helpers.py has the rest.

@pytest.fixture(scope="module")
def base(tiny_model_dir):
    from http_helpers import tiny_server

    with tiny_server(tiny_model_dir) as url:
        yield url


@pytest.fixture(scope="module")
def http(base):
    from http_helpers import keyed_http

    with keyed_http(base) as c:
        yield c


@pytest.fixture(scope="module")
def client(base):
    from http_helpers import keyed_openai

    return keyed_openai(base)
