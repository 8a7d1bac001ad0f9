"""`DecoderForCausalLM`: a decoder-only causal LM split into pipeline stages, which model
plugins subclass with their decoder layer. It implements the `CausalLM` protocol (core/model.py)
including ``forward_stage``, so a model plugin is its architecture and nothing else.

The shape it assumes is the Llama family's (and most decoder-only models'): a token embedding,
N decoder layers on a pre-norm residual stream, a final RMSNorm and an LM head. Under pipeline
parallelism (GPipe-style stages, as Megatron-LM and vLLM split them) this rank holds only its
stage's layers, ``ctx.parallel.stage_layers(N)``: the first stage also embeds, the last also
normalizes and computes logits, and every stage but the first receives (hidden, residual) from
the one before. With ``custom_all_reduce`` the row-parallel layers' partial sums go on through
the residual stream (core/layers/tensor_parallel.py): the embedding's with a zero residual, and
a stage's last one across the stage boundary, reduced by the next stage's first norm over its
own TP ranks (rank i of a stage sends to rank i of the next, so the sum is the same).

Checkpoints load by Hugging Face names (``model.layers.5.mlp.down_proj.weight``) through
`stage_key`, which maps each name to this stage's module or skips another stage's tensor
(core/layers/checkpoint.py does the loading).
"""

from __future__ import annotations

from typing import Any, ClassVar, Iterable

import torch
from torch import nn

from ..attention import AttentionMetadata
from .attention import Attention
from .checkpoint import load_checkpoint
from .context import ModelContext
from .linear import LinearBase
from .tensor_parallel import lm_head, residual_rms_norm, vocab_parallel_embedding


class DecoderForCausalLM(nn.Module):
    """Embedding, this stage's decoder layers, final norm and LM head, over the paged KV cache.

    A subclass gives its architecture:

    - `make_layer(hf_config, ctx)`: one decoder layer, an ``nn.Module`` whose
      ``forward(positions, x, residual, kv_cache, attn_metadata) -> (x, residual)`` takes
      positions [T] int, x [T, H], the residual [T, H] (None for the first layer without
      ``custom_all_reduce``: x is then the residual too), this layer's KV cache tensor and the
      step's `AttentionMetadata`, and returns the layer's output and the new residual (the
      norm of the next layer, or the final one, adds them). It attends through one
      `pagebatch.layers.attention.Attention`, which gives the KV cache geometry.
    - ``stacked`` (class attribute): checkpoint layer names merged into one of the model's
      layers, e.g. ``{"q_proj": ("qkv_proj", 0)}`` (shard 0 of ``qkv_proj``).
    - optionally ``max_model_len_limit(hf_config)`` (classmethod; this one returns None).
    - optionally ``sliding_windows(hf_config)`` (classmethod): each checkpoint layer's sliding
      window in tokens or None (core/model.py); this one reads ``layer_types`` of a
      transformers 5 config ("sliding_attention" layers get ``sliding_window``), else None
      everywhere. Each layer's `Attention` gets its window as ``sliding_window``.

    Reads ``hidden_size``, ``num_hidden_layers``, ``vocab_size``, ``rms_norm_eps`` and
    ``tie_word_embeddings`` of the Hugging Face config. Attributes: ``embed_tokens`` (first
    stage, else None), ``layers`` (this stage's, counted from 0), ``norm`` and ``lm_head``
    (last stage, else None), ``start_layer`` / ``end_layer`` (this stage's layers
    [start, end) of the checkpoint's), and the protocol's ``num_layers``, ``num_kv_heads``,
    ``head_dim`` (this rank's), ``hidden_size``.
    """

    stacked: ClassVar[dict[str, tuple[str, int]]] = {}

    def __init__(self, hf_config: Any, ctx: ModelContext):
        super().__init__()
        cfg = self.config = hf_config
        par = self.parallel = ctx.parallel
        self.hidden_size, self.dtype = cfg.hidden_size, ctx.dtype
        self.start_layer, self.end_layer = par.stage_layers(cfg.num_hidden_layers)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        # custom_all_reduce: the embedding's partial sum is reduced by the first layer's norm,
        # given a zero residual (so the layer takes its fused path; the sum + 0 is exact)
        self.embed_partial = par.fuse_all_reduce_norm
        self.embed_tokens = (vocab_parallel_embedding(ctx, cfg.vocab_size, cfg.hidden_size)
                             if par.is_first_stage else None)
        self.layers = nn.ModuleList(self.make_layer(cfg, ctx)
                                    for _ in range(self.start_layer, self.end_layer))
        self.norm = self.lm_head = None
        if par.is_last_stage:
            self.norm = residual_rms_norm(ctx, cfg.hidden_size, cfg.rms_norm_eps)
            tied = self.embed_tokens if self.tie_word_embeddings else None
            self.lm_head = lm_head(ctx, cfg.vocab_size, cfg.hidden_size, tied)
        windows = type(self).sliding_windows(cfg)
        for i, layer in zip(range(self.start_layer, self.end_layer), self.layers):
            _attention_of(layer).set_sliding_window(windows[i])
        attn = _attention_of(self.layers[0])
        self.num_layers = len(self.layers)  # this stage's: one KV cache tensor each
        self.num_kv_heads, self.head_dim = attn.num_kv_heads, attn.head_dim  # this rank's

    def make_layer(self, hf_config: Any, ctx: ModelContext) -> nn.Module:
        """One decoder layer (see the class docstring); called once per layer of the stage,
        from ``DecoderForCausalLM.__init__`` (so it may read class attributes, not ones a
        subclass sets after ``super().__init__``)."""
        raise NotImplementedError(f"{type(self).__name__} must define make_layer")

    @classmethod
    def max_model_len_limit(cls, hf_config: Any) -> int | None:
        """The longest sequence this model runs exactly for ``hf_config``, or None for no limit
        beyond max_position_embeddings (core/model.py). None here."""
        return None

    @classmethod
    def sliding_windows(cls, hf_config: Any) -> list[int | None]:
        """Per checkpoint layer: its sliding window in tokens, or None for full attention
        (core/model.py). From ``layer_types`` when the config has it (transformers 5:
        "sliding_attention" / "full_attention"), else full attention on every layer."""
        n = int(hf_config.num_hidden_layers)
        window = getattr(hf_config, "sliding_window", None)
        types = getattr(hf_config, "layer_types", None)
        if types is None or not window:
            return [None] * n
        return [int(window) if t == "sliding_attention" else None for t in types[:n]]

    # ---- forward ------------------------------------------------------------------------------

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor],
                attn_metadata: AttentionMetadata) -> torch.Tensor | None:
        """input_ids, positions: [T] -> hidden states [T, H] on the last pipeline stage; None
        on the others, which send (hidden, residual) [T, 2H] to the next stage."""
        par = self.parallel
        hidden_in = None
        if not par.is_first_stage:
            hidden_in = par.recv_payload(input_ids.shape[0], 2 * self.hidden_size, self.dtype)
        out = self.forward_stage(input_ids, positions, kv_caches, attn_metadata, hidden_in)
        if par.is_last_stage:
            return out
        par.send_payload(out)
        return None

    def forward_stage(self, input_ids: torch.Tensor, positions: torch.Tensor,
                      kv_caches: list[torch.Tensor], attn_metadata: AttentionMetadata,
                      hidden_in: torch.Tensor | None) -> torch.Tensor:
        """This stage's computation without communication (`PipelineStageLM`): hidden_in None
        on the first stage (it embeds ``input_ids``), else the previous stage's output
        [T, 2H] (hidden states, then the residual). Returns that [T, 2H] on a stage before the
        last, the final-normed hidden states [T, H] on the last."""
        if hidden_in is None:
            x = self.embed_tokens(input_ids)
            residual = torch.zeros_like(x) if self.embed_partial else None
        else:
            x, residual = hidden_in[:, :self.hidden_size], hidden_in[:, self.hidden_size:]
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(positions, x, residual, kv_cache, attn_metadata)
        if not self.parallel.is_last_stage:
            return torch.cat([x, residual], dim=-1)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [n, H] -> logits [n, vocab] fp32 (last pipeline stage only)."""
        return self.lm_head(hidden)

    # ---- checkpoint names on this stage -------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load Hugging Face-named tensors (core/layers/checkpoint.py); returns the names
        loaded. Raises ValueError for a tensor the model has no place for, or a shape
        mismatch."""
        return load_checkpoint(self, weights)

    def head_from_embedding(self) -> bool:
        """Whether this stage's LM head is loaded from the embedding table: tied, and not
        stored quantized in the checkpoint (GPTQModel ``lm_head: true`` has its own tensors)."""
        head = self.lm_head
        return self.tie_word_embeddings and head is not None and not (
            isinstance(head, LinearBase) and head.quant_method.checkpoint_lm_head)

    def stage_key(self, key: str) -> str | None:
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
            return "lm_head.weight" if self.head_from_embedding() else None
        if key.startswith("lm_head.") and (self.lm_head is None or (
                self.tie_word_embeddings and key == "lm_head.weight")):
            return None  # another stage's head, or tied: loaded with the embedding
        if key.startswith("norm.") and self.norm is None:
            return None
        return key

    def checkpoint_module(self, path: str) -> str:
        """Module ``path`` for messages, with the checkpoint's layer index (a pipeline stage
        counts its layers from 0), e.g. ``model.layers.5.self_attn.qkv_proj``, ``lm_head``."""
        if path.startswith("layers."):
            index, rest = path[len("layers."):].split(".", 1)
            return f"model.layers.{int(index) + self.start_layer}.{rest}"
        return path


def _attention_of(layer: nn.Module) -> Attention:
    """The `Attention` of a decoder layer (its KV cache geometry). Raises TypeError without."""
    for m in layer.modules():
        if isinstance(m, Attention):
            return m
    raise TypeError(f"{type(layer).__name__} has no pagebatch.layers.attention.Attention: the "
                    f"KV cache geometry (num_kv_heads, head_dim) comes from it")
