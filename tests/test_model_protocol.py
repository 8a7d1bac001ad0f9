"""The model plugin interface (core/model.py): the built-in models are `CausalLM`s with
pipeline-stage forwards, a model without ``forward_stage`` or ``max_model_len_limit`` is still a
model, and `DecoderForCausalLM` (core/layers/decoder.py) says what a subclass forgot."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from pagebatch import LLM
from pagebatch.layers.context import ModelContext
from pagebatch.layers.decoder import DecoderForCausalLM
from pagebatch.model import CausalLM, PipelineStageLM, max_model_len_limit, sliding_windows
from pagebatch.registry import registry

ARCHITECTURES = ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                 "Qwen3ForCausalLM"]


def _params(fn) -> list[tuple[str, inspect._ParameterKind]]:
    return [(p.name, p.kind) for p in inspect.signature(fn).parameters.values()]


class BareModel(nn.Module):
    """The least a model plugin needs: no forward_stage, no max_model_len_limit."""

    num_layers, num_kv_heads, head_dim = 1, 1, 4

    def __init__(self, hf_config=None, ctx=None):
        super().__init__()

    def forward(self, input_ids, positions, kv_caches, attn_metadata):
        return None

    def compute_logits(self, hidden):
        return hidden.float()

    def load_weights(self, weights):
        return set()


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_builtin_classes_follow_the_protocol(arch):
    cls = registry().model_class(arch)
    assert issubclass(cls, DecoderForCausalLM)
    for name in ("forward_stage", "compute_logits", "load_weights"):
        assert _params(getattr(cls, name)) == _params(getattr(PipelineStageLM, name)), name
    assert _params(cls.forward) == _params(CausalLM.__call__)
    assert max_model_len_limit(cls, SimpleNamespace(sliding_window=None)) is None


def test_built_model_is_a_pipeline_stage_lm(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), device="cpu", dtype="float32", num_kv_blocks=16,
              block_size=4, max_model_len=64)
    model = llm.engine.core.runner.model
    assert isinstance(model, CausalLM) and isinstance(model, PipelineStageLM)
    assert (model.num_layers, model.num_kv_heads, model.head_dim, model.hidden_size) == (
        2, 2, 16, 64)


def test_optional_members_are_optional():
    model = BareModel()
    assert isinstance(model, CausalLM)
    assert not isinstance(model, PipelineStageLM)  # the runner runs its stages eagerly
    assert max_model_len_limit(BareModel, SimpleNamespace()) is None
    mistral = registry().model_class("MistralForCausalLM")
    assert max_model_len_limit(mistral, SimpleNamespace(sliding_window=4096)) is None
    assert sliding_windows(mistral, SimpleNamespace(sliding_window=4096,
                                                    num_hidden_layers=2)) == [4096, 4096]
    assert sliding_windows(BareModel, SimpleNamespace(num_hidden_layers=2)) == [None, None]


def _ctx() -> ModelContext:
    reg = registry()
    return ModelContext(torch.float32, torch.device("cpu"), reg.quant_method("fp16")(),
                        reg.attention_backend("torch_ref")(), max_model_len=64)


HF = SimpleNamespace(hidden_size=8, num_hidden_layers=2, vocab_size=16, rms_norm_eps=1e-5)


def test_decoder_without_make_layer_says_so():
    with pytest.raises(NotImplementedError, match="must define make_layer"):
        DecoderForCausalLM(HF, _ctx())


def test_decoder_layer_without_attention_says_so():
    class NoAttention(DecoderForCausalLM):
        def make_layer(self, hf_config, ctx):
            return nn.Linear(2, 2)

    with pytest.raises(TypeError, match="has no pagebatch.layers.attention.Attention"):
        NoAttention(HF, _ctx())
