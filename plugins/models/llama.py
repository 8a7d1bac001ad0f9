"""The Llama family: ``LlamaForCausalLM`` (Llama 2/3, SmolLM2), and the classes that Mistral
and Qwen (plugins/models/mistral.py, qwen.py) subclass.

Weights load by Hugging Face tensor names; q/k/v and gate/up are fused into one linear each.

Tensor parallel (Megatron-LM): qkv_proj and gate_up_proj are column-parallel (each rank holds
its heads / its slice of the MLP width; KV heads are replicated when fewer than the ranks),
o_proj and down_proj row-parallel, the embedding and LM head vocab-parallel; with
``custom_all_reduce`` the row-parallel all-reduces are fused into the RMSNorm after them
(core/layers/tensor_parallel.py). Pipeline parallel, the embedding, final norm and LM head and
checkpoint loading are `DecoderForCausalLM`'s (core/layers/decoder.py): this file is the
architecture of one decoder layer.
"""

from __future__ import annotations

import torch
from torch import nn

from pagebatch.attention import AttentionMetadata
from pagebatch.hookspecs import hookimpl
from pagebatch.layers.activation import SiluAndMul
from pagebatch.layers.attention import Attention
from pagebatch.layers.context import ModelContext
from pagebatch.layers.decoder import DecoderForCausalLM
from pagebatch.layers.linear import qkv_output_ranges
from pagebatch.layers.rotary import RotaryEmbedding, rope_params
from pagebatch.layers.tensor_parallel import (column_parallel_linear, residual_rms_norm,
                                              row_parallel_linear)


class LlamaAttention(nn.Module):
    """Grouped-query attention with RoPE. Subclasses change the q/k/v and o biases
    (`projection_biases`) and may transform q and k per head before rotary (`qk_norm`)."""

    def __init__(self, cfg, ctx: ModelContext):
        super().__init__()
        hidden = cfg.hidden_size
        heads = cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        self.head_dim = getattr(cfg, "head_dim", None) or hidden // heads
        tp_rank, tp_size = ctx.parallel.tp_rank, ctx.parallel.tp_size
        # this rank's heads (all of them on one rank); KV heads replicated below tp_size
        self.num_heads = heads // tp_size
        self.num_kv_heads = max(kv_heads // tp_size, 1)
        qkv_bias, o_bias = self.projection_biases(cfg)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        full_q, full_kv = heads * self.head_dim, kv_heads * self.head_dim
        self.qkv_proj = column_parallel_linear(
            ctx, hidden, [full_q, full_kv, full_kv], qkv_bias,
            qkv_output_ranges(heads, kv_heads, self.head_dim, tp_rank, tp_size))
        self.o_proj = row_parallel_linear(ctx, full_q, hidden, o_bias)
        base, scaling = rope_params(cfg)
        self.rotary = RotaryEmbedding(self.head_dim, ctx.max_model_len, base, scaling, ctx.device)
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim,
                              self.head_dim ** -0.5, ctx.attn_backend)

    @staticmethod
    def projection_biases(cfg) -> tuple[bool, bool]:
        """(q/k/v bias, o_proj bias): Llama's ``attention_bias`` sets both (False by default)."""
        bias = bool(getattr(cfg, "attention_bias", False))
        return bias, bias

    def qk_norm(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, Hq, D], k: [T, Hkv, D] before rotary; Llama leaves them as they are."""
        return q, k

    def forward(self, positions, x, kv_cache, meta: AttentionMetadata):
        """positions: [T] int64, x: [T, hidden] -> [T, hidden]."""
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        t = x.shape[0]
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        q, k = self.qk_norm(q, k)
        # rotary inside the KV write and attention where the backend can (else the layer's)
        return self.o_proj(self.attn(q, k, v, kv_cache, meta, rope=(positions, self.rotary)))


class LlamaMLP(nn.Module):
    def __init__(self, cfg, ctx: ModelContext):
        super().__init__()
        bias = bool(getattr(cfg, "mlp_bias", False))
        inter = cfg.intermediate_size
        self.gate_up_proj = column_parallel_linear(ctx, cfg.hidden_size, [inter, inter], bias)
        self.down_proj = row_parallel_linear(ctx, inter, cfg.hidden_size, bias)
        self.act = SiluAndMul()

    def forward(self, x):
        # at decode sizes the gate_up GEMV applies the activation in its epilogue where the
        # quant method can (no activation kernel); else the product, then the activation
        h = self.gate_up_proj.forward_silu_mul(x)
        if h is None:
            h = self.act(self.gate_up_proj(x))
        return self.down_proj(h)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg, ctx: ModelContext,
                 attention_cls: type[LlamaAttention] = LlamaAttention):
        super().__init__()
        eps = cfg.rms_norm_eps
        self.self_attn = attention_cls(cfg, ctx)
        self.mlp = LlamaMLP(cfg, ctx)
        self.input_layernorm = residual_rms_norm(ctx, cfg.hidden_size, eps)
        self.post_attention_layernorm = residual_rms_norm(ctx, cfg.hidden_size, eps)

    def forward(self, positions, x, residual, kv_cache, meta):
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, kv_cache, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(DecoderForCausalLM):
    """The `CausalLM` of core/model.py through `DecoderForCausalLM`, with Llama's decoder layer.
    Subclasses for other families of the same shape (Mistral, Qwen) set ``attention_cls``."""

    attention_cls: type[LlamaAttention] = LlamaAttention

    # HF name of a checkpoint tensor -> (our module path, shard index of a merged layer)
    stacked = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def make_layer(self, cfg, ctx: ModelContext) -> LlamaDecoderLayer:
        return LlamaDecoderLayer(cfg, ctx, self.attention_cls)


@hookimpl
def register_models(register):
    register("LlamaForCausalLM", LlamaForCausalLM)
