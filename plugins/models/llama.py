"""The Llama family: ``LlamaForCausalLM`` (Llama 2/3, SmolLM2), and the classes that Mistral
and Qwen (plugins/models/mistral.py, qwen.py) subclass.

Weights load by Hugging Face tensor names; q/k/v and gate/up are fused into one linear each.

Tensor parallel (Megatron-LM): qkv_proj and gate_up_proj are column-parallel (each rank holds
its heads / its slice of the MLP width; KV heads are replicated when fewer than the ranks),
o_proj and down_proj row-parallel (all-reduced), the embedding and LM head vocab-parallel.
With ``custom_all_reduce`` the row-parallel layers (and the embedding) return partial sums and
the RMSNorm after each (the next layer's, or the final one) all-reduces them together with its
residual add (a zero residual after the embedding; core/layers/norm.py); a pipeline stage then
sends its last partial sum on, and the next stage's first norm reduces it over its own TP ranks
(rank i of a stage sends to rank i of the next, so the sum is the same).
Pipeline parallel: the model holds only its stage's layers (``ctx.parallel.stage_layers``); the
first stage embeds, the others receive (hidden, residual) from the previous stage; every stage
but the last sends its output on and returns None.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from pagebatch.attention import AttentionMetadata
from pagebatch.hookspecs import hookimpl
from pagebatch.layers.activation import SiluAndMul
from pagebatch.layers.attention import Attention
from pagebatch.layers.context import ModelContext
from pagebatch.layers.linear import LinearBase, qkv_output_ranges
from pagebatch.layers.norm import RMSNorm
from pagebatch.layers.rotary import RotaryEmbedding, rope_params
from pagebatch.layers.vocab import LMHead, QuantizedLMHead, VocabEmbedding


def _linear(ctx: ModelContext, n_in: int, outs: list[int], bias: bool, parallel: str,
            output_ranges: list[tuple[int, int]] | None = None) -> LinearBase:
    fused = parallel == "row" and ctx.parallel.fuse_all_reduce_norm  # reduced by the next norm
    return LinearBase(n_in, outs, bias, ctx.quant_method, ctx.dtype, ctx.device,
                      parallel=parallel, tp=ctx.parallel, output_ranges=output_ranges,
                      reduce_results=not fused)


def _norm(ctx: ModelContext, hidden: int, eps: float) -> RMSNorm:
    """A norm that follows a row-parallel layer (through the residual stream)."""
    par = ctx.parallel
    return RMSNorm(hidden, eps, ctx.dtype, ctx.device,
                   tp=par if par.fuse_all_reduce_norm else None)


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
        self.qkv_proj = _linear(ctx, hidden, [full_q, full_kv, full_kv], qkv_bias, "column",
                                qkv_output_ranges(heads, kv_heads, self.head_dim, tp_rank,
                                                  tp_size))
        self.o_proj = _linear(ctx, full_q, [hidden], o_bias, "row")
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
        self.gate_up_proj = _linear(ctx, cfg.hidden_size, [inter, inter], bias, "column")
        self.down_proj = _linear(ctx, inter, [cfg.hidden_size], bias, "row")
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
        self.input_layernorm = _norm(ctx, cfg.hidden_size, eps)
        self.post_attention_layernorm = _norm(ctx, cfg.hidden_size, eps)

    def forward(self, positions, x, residual, kv_cache, meta):
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, kv_cache, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    """Model interface (see docs/plugins.md): ``forward``, ``compute_logits``, ``load_weights``,
    the KV geometry ``num_layers``, ``num_kv_heads``, ``head_dim``, and the optional
    ``max_model_len_limit``. Subclasses for other families of the same shape (Mistral, Qwen)
    set ``attention_cls``."""

    attention_cls: type[LlamaAttention] = LlamaAttention

    # HF name of a checkpoint tensor -> (our module path, shard index of a merged layer)
    stacked = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg, ctx: ModelContext):
        super().__init__()
        self.config = cfg
        par = self.parallel = ctx.parallel
        self.hidden_size, self.dtype = cfg.hidden_size, ctx.dtype
        # this pipeline stage's layers [start_layer, end_layer) (all of them without PP)
        self.start_layer, self.end_layer = par.stage_layers(cfg.num_hidden_layers)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        # custom_all_reduce: the embedding's partial sum is reduced by the first layer's norm,
        # given a zero residual (so the layer takes its fused path; the sum + 0 is exact)
        self.embed_partial = par.fuse_all_reduce_norm
        self.embed_tokens = (VocabEmbedding(cfg.vocab_size, cfg.hidden_size, ctx.dtype,
                                            ctx.device, par,
                                            reduce_results=not self.embed_partial)
                             if par.is_first_stage else None)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, ctx, self.attention_cls)
                                    for _ in range(self.start_layer, self.end_layer))
        self.norm = self.lm_head = None
        if par.is_last_stage:
            self.norm = _norm(ctx, cfg.hidden_size, cfg.rms_norm_eps)
            tied = self.embed_tokens if self.tie_word_embeddings else None
            if ctx.lm_head_quant is not None:
                self.lm_head = QuantizedLMHead(cfg.vocab_size, cfg.hidden_size,
                                               ctx.lm_head_quant, ctx.dtype, ctx.device, par)
            else:
                self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size, ctx.dtype, ctx.device,
                                      tied_to=tied, tp=par)
        attn = self.layers[0].self_attn
        self.num_layers = len(self.layers)  # this stage's: one KV cache tensor each
        self.num_kv_heads, self.head_dim = attn.num_kv_heads, attn.head_dim  # this rank's

    @classmethod
    def max_model_len_limit(cls, hf_config) -> int | None:
        """The longest sequence this model runs exactly for ``hf_config``, or None for no limit
        beyond max_position_embeddings. The engine caps max_model_len to it with a warning
        (core/engine.py). Llama has none; sliding-window families return their window."""
        return None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor | None:
        """input_ids, positions: [T] int64 -> hidden states [T, hidden] on the last pipeline
        stage; None on the others, which send (hidden, residual) to the next stage."""
        par = self.parallel
        hidden_in = None
        if not par.is_first_stage:
            hidden_in = par.recv_payload(input_ids.shape[0], 2 * self.hidden_size, self.dtype)
        out = self.forward_stage(input_ids, positions, kv_caches, meta, hidden_in)
        if par.is_last_stage:
            return out
        par.send_payload(out)
        return None

    def forward_stage(self, input_ids: torch.Tensor, positions: torch.Tensor,
                      kv_caches: list[torch.Tensor], meta: AttentionMetadata,
                      hidden_in: torch.Tensor | None) -> torch.Tensor:
        """This pipeline stage's computation, without communication (so that the runner can
        capture it in a CUDA graph and move the stage boundary's tensors itself).
        hidden_in: None on the first stage (it embeds ``input_ids``), else the previous
        stage's output [T, 2 * hidden] (hidden states, then the residual). Returns that
        [T, 2 * hidden] on a stage before the last, the final-normed hidden states
        [T, hidden] on the last."""
        if hidden_in is None:
            x = self.embed_tokens(input_ids)
            residual = torch.zeros_like(x) if self.embed_partial else None
        else:
            x, residual = hidden_in[:, :self.hidden_size], hidden_in[:, self.hidden_size:]
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(positions, x, residual, kv_cache, meta)
        if not self.parallel.is_last_stage:
            return torch.cat([x, residual], dim=-1)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [n, hidden] -> logits [n, vocab] fp32 (last pipeline stage only)."""
        return self.lm_head(hidden)

    def _head_from_embedding(self) -> bool:
        """Whether this stage's LM head is loaded from the embedding table: tied, and not
        stored quantized in the checkpoint (GPTQModel ``lm_head: true`` has its own tensors)."""
        head = self.lm_head
        return self.tie_word_embeddings and head is not None and not (
            isinstance(head, LinearBase) and head.quant_method.checkpoint_lm_head)

    def _stage_key(self, key: str) -> str | None:
        """Where checkpoint tensor ``key`` (without "model.") lives on this pipeline stage, or
        None when another stage holds it. Layer indices count from the stage's first layer; on
        a last stage without the embedding, a tied LM head loads the embedding table (unless
        the checkpoint stores the head quantized: GPTQModel's ``lm_head: true``)."""
        if key.startswith("layers."):
            index, rest = key[len("layers."):].split(".", 1)
            i = int(index)
            if not self.start_layer <= i < self.end_layer:
                return None
            return f"layers.{i - self.start_layer}.{rest}"
        if key == "embed_tokens.weight" and self.embed_tokens is None:
            return "lm_head.weight" if self._head_from_embedding() else None
        if key.startswith("lm_head.") and (self.lm_head is None or (
                self.tie_word_embeddings and key == "lm_head.weight")):
            return None  # another stage's head, or tied: loaded with the embedding
        if key.startswith("norm.") and self.norm is None:
            return None
        return key

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load Hugging Face-named tensors; returns the names loaded.

        Raises ValueError for a tensor the model has no place for, or a shape mismatch.
        """
        modules = dict(self.named_modules())
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            key = self._stage_key(name.removeprefix("model."))
            if key is None:  # another pipeline stage's tensor
                continue
            parts = key.rsplit(".", 2)  # [..., module, param]
            if len(parts) == 3 and parts[1] in self.stacked:
                target, shard = self.stacked[parts[1]]
                modules[f"{parts[0]}.{target}"].load(parts[2], tensor, shard)
            elif len(parts) >= 2 and isinstance(modules.get(key.rsplit(".", 1)[0]), LinearBase):
                mod, pname = key.rsplit(".", 1)
                modules[mod].load(pname, tensor, None)
            elif key in params:
                p = params[key]
                loader = getattr(p, "weight_loader", None)  # vocab-parallel tables
                if loader is not None:
                    loader(tensor)
                elif p.shape != tensor.shape:
                    raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} does not "
                                     f"match the model's {tuple(p.shape)}")
                else:
                    p.data.copy_(tensor)
            else:
                raise ValueError(f"checkpoint tensor {name!r} has no place in "
                                 f"{type(self).__name__}")
            if key == "embed_tokens.weight" and isinstance(self.lm_head, LinearBase) and (
                    self._head_from_embedding()):
                self.lm_head.load("weight", tensor)  # a quantized copy of the tied table
            loaded.add(name)
        for path, mod in modules.items():
            if isinstance(mod, LinearBase):
                try:
                    mod.quant_method.process_weights_after_loading(mod)
                except ValueError as e:  # e.g. a tensor missing: name the layer
                    if type(e) is not ValueError:  # ConfigError & co. keep their type
                        raise
                    raise ValueError(f"{self._checkpoint_module(path)}: {e}") from e
        return loaded

    def _checkpoint_module(self, path: str) -> str:
        """Module ``path`` for messages, with the checkpoint's layer index (a pipeline stage
        counts its layers from 0), e.g. ``model.layers.5.self_attn.qkv_proj``, ``lm_head``."""
        if path.startswith("layers."):
            index, rest = path[len("layers."):].split(".", 1)
            return f"model.layers.{int(index) + self.start_layer}.{rest}"
        return path


@hookimpl
def register_models(register):
    register("LlamaForCausalLM", LlamaForCausalLM)
