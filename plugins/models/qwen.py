"""The Qwen family: ``Qwen2ForCausalLM`` (Qwen2, Qwen2.5) and ``Qwen3ForCausalLM`` (dense Qwen3).

Both are Llama's layers with two changes in attention: Qwen2 has a bias on the q/k/v projections
(none on o_proj); Qwen3 has no bias but RMS-normalizes each head of q and k (a weight of
``head_dim``) before rotary, and takes ``head_dim`` from config.json rather than
hidden_size / num_attention_heads (Qwen3 technical report, Yang et al. 2025; transformers'
``Qwen3Attention``). Long-context Qwen configs use YaRN rope scaling (core/layers/rotary.py).

A sliding window is only in effect when ``use_sliding_window`` is true, and then only on layers
``max_window_layers`` and up (transformers' ``Qwen2Config`` builds ``layer_types`` so:
"sliding_attention" for layer i >= max_window_layers); a config's own ``layer_types`` wins.
Such a model mixes full and windowed layers: each layer attends as its type says, and the block
manager keeps whole block tables (core/model.py, ``kv_sliding_window``).
"""

from __future__ import annotations

import torch

from pagebatch.hookspecs import hookimpl
from pagebatch.layers.context import ModelContext
from pagebatch.layers.norm import RMSNorm

from pagebatch.plugins.models.llama import LlamaAttention, LlamaForCausalLM


def _sliding_windows(hf_config) -> list[int | None]:
    """Per layer of a Qwen config: the window, or None for full attention."""
    n = int(hf_config.num_hidden_layers)
    window = getattr(hf_config, "sliding_window", None)
    if not getattr(hf_config, "use_sliding_window", False) or not window:
        return [None] * n
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is None:  # transformers < 5: layers >= max_window_layers use the window
        first = getattr(hf_config, "max_window_layers", 0)
        layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
    return [int(window) if t == "sliding_attention" else None for t in layer_types[:n]]


class Qwen2Attention(LlamaAttention):
    @staticmethod
    def projection_biases(cfg) -> tuple[bool, bool]:
        """Qwen2: bias on q/k/v, none on o_proj."""
        return True, False


class Qwen2ForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen2Attention

    @classmethod
    def sliding_windows(cls, hf_config) -> list[int | None]:
        return _sliding_windows(hf_config)


class Qwen3Attention(LlamaAttention):
    """Qwen3 attention: per-head RMSNorm of q and k (``q_norm``, ``k_norm``, weight [head_dim])
    applied before rotary."""

    def __init__(self, cfg, ctx: ModelContext):
        super().__init__(cfg, ctx)
        eps = cfg.rms_norm_eps
        self.q_norm = RMSNorm(self.head_dim, eps, ctx.dtype, ctx.device)
        self.k_norm = RMSNorm(self.head_dim, eps, ctx.dtype, ctx.device)

    def qk_norm(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, Hq, head_dim], k: [T, Hkv, head_dim] -> each head RMS-normalized. On CUDA in
        place, both in one kernel (core/kernels/norm.py `qk_head_norm_`): q and k are views of
        the QKV projection's output, which nothing else reads."""
        if q.is_cuda:
            from pagebatch.kernels.norm import qk_head_norm_

            return qk_head_norm_(q, k, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
        return self.q_norm(q), self.k_norm(k)


class Qwen3ForCausalLM(Qwen2ForCausalLM):
    attention_cls = Qwen3Attention


@hookimpl
def register_models(register):
    register("Qwen2ForCausalLM", Qwen2ForCausalLM)
    register("Qwen3ForCausalLM", Qwen3ForCausalLM)
