"""`CausalLM`: what the engine calls on a model plugin. Read this first to write one.

A model plugin registers a class per Hugging Face architecture (``register_models``). The
engine constructs it once per rank, loads its weights, and from then on calls only what
`CausalLM` lists: the model runner (core/model_runner.py) sizes the paged KV cache from
``num_layers``, ``num_kv_heads`` and ``head_dim``, runs ``model(...)`` on each step's flattened
batch, and turns the sampled rows' hidden states into logits with ``compute_logits``. The class
must also be a ``torch.nn.Module``: the runner calls ``eval()``, and ``load_format: dummy``
fills ``named_parameters()`` and the ``LinearBase`` layers among ``modules()`` itself.

Three members are optional, and each has its named contract here instead of a guess at the call
site: `PipelineStageLM` (``forward_stage``: pipeline stages captured in CUDA graphs), the
classmethod ``max_model_len_limit`` (read through `max_model_len_limit`) and the classmethod
``sliding_windows`` (read through `sliding_windows`).

The built-in Llama family (plugins/models/) builds on `pagebatch.layers.decoder.
DecoderForCausalLM`, which implements all of it, pipeline stages included, from one decoder
layer class (docs/plugins.md).
"""

from __future__ import annotations

from typing import Any, Iterable, Protocol, runtime_checkable

import torch

from .attention import AttentionMetadata
from .layers.context import ModelContext

__all__ = ["CausalLM", "PipelineStageLM", "max_model_len_limit", "sliding_windows",
           "kv_sliding_window"]


@runtime_checkable
class CausalLM(Protocol):
    """A decoder-only causal language model over the paged KV cache (one rank's part of it
    under tensor/pipeline parallelism). T: the number of tokens in the step, B: sequences.

    Attributes the runner reads once the model is built (this rank's values):

    - ``num_layers``: decoder layers on this rank (its pipeline stage's); the runner allocates
      one KV cache tensor per layer and passes the list as ``kv_caches``.
    - ``num_kv_heads``: KV heads on this rank (the model's divided by ``tensor_parallel_size``,
      at least 1: replicated below it).
    - ``head_dim``: channels per head.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int

    def __init__(self, hf_config: Any, ctx: ModelContext) -> None:
        """``hf_config``: the transformers config of the checkpoint's config.json; ``ctx``:
        dtype, device, the quant method and attention backend plugins, max_model_len and this
        rank's `ParallelContext` (core/layers/context.py). Build parameters on ``ctx.device`` in
        ``ctx.dtype``; raise ConfigError for a config the class cannot run."""

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 kv_caches: list[torch.Tensor],
                 attn_metadata: AttentionMetadata) -> torch.Tensor | None:
        """One step (``nn.Module.__call__``, i.e. ``forward``) over a flattened batch of mixed
        prefill and decode tokens.

        input_ids: [T] token ids; positions: [T], each token's position in its sequence;
        both int32 in engine steps (views of the step's packed int32 input buffer,
        core/input_batch.py), int64 in ``ModelRunner.forward_scratch``. kv_caches:
        ``num_layers`` tensors, layer i's paged cache in the attention backend's
        ``kv_cache_shape`` (the model writes the step's K/V into it and attends over it,
        through `pagebatch.layers.attention.Attention`). attn_metadata: the batch's
        `AttentionMetadata` (slot mapping [T], query start locations [B+1], sequence lengths
        [B], block tables [B, W]).

        Returns the final-normed hidden states [T, hidden_size] in the model dtype; None on a
        pipeline stage before the last, which sends its output to the next stage instead
        (``ctx.parallel.send_payload``; the next stage receives with ``recv_payload``).
        """

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [n, hidden_size] rows of ``__call__``'s output -> logits [n, vocab_size]
        fp32, the whole vocabulary on every tensor-parallel rank. Called on the last pipeline
        stage only."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load a checkpoint: ``weights`` yields (Hugging Face tensor name, tensor in the model
        dtype, whole: not yet cut for tensor parallelism) in no particular order; tensors of
        other pipeline stages come too and are skipped. Call
        ``quant_method.process_weights_after_loading(layer)`` for every ``LinearBase`` at the
        end. Returns the names loaded. Raises ValueError for a name with no place in the model
        or a shape mismatch. Not called with ``load_format: dummy``."""


@runtime_checkable
class PipelineStageLM(CausalLM, Protocol):
    """Optional: a `CausalLM` whose pipeline stage runs without communication, so that the
    runner moves the stage boundary's tensors itself and captures each stage's decode steps in
    CUDA graphs (a model without it runs its pipeline stages eagerly; core/model_runner.py).

    ``hidden_size``: the model's hidden width H (the runner sizes the stage input buffer
    [max_num_seqs, 2 * H] from it).
    """

    hidden_size: int

    def forward_stage(self, input_ids: torch.Tensor, positions: torch.Tensor,
                      kv_caches: list[torch.Tensor], attn_metadata: AttentionMetadata,
                      hidden_in: torch.Tensor | None) -> torch.Tensor:
        """``__call__`` without the sends and receives. hidden_in: None on the first stage
        (it embeds ``input_ids``), else the previous stage's output [T, 2 * H] in the model
        dtype (hidden states, then the residual). Returns that [T, 2 * H] on a stage before
        the last, the final-normed hidden states [T, H] on the last."""


def max_model_len_limit(model_cls: type[CausalLM], hf_config: Any) -> int | None:
    """The optional classmethod ``model_cls.max_model_len_limit(hf_config) -> int | None``:
    the longest sequence the model runs exactly for this config, or None for no limit beyond
    max_position_embeddings. A class without the classmethod has no limit. The engine lowers
    max_model_len to it with a warning (core/model_setup.py)."""
    limit = getattr(model_cls, "max_model_len_limit", None)
    return None if limit is None else limit(hf_config)


def sliding_windows(model_cls: type[CausalLM], hf_config: Any) -> list[int | None]:
    """The optional classmethod ``model_cls.sliding_windows(hf_config) -> list[int | None]``:
    per decoder layer of the checkpoint (``num_hidden_layers`` entries), the sliding window in
    tokens that the layer attends over (a token at position i sees keys j with
    i - window < j <= i, transformers' ``sliding_window_overlay``), or None for full attention.
    A class without the classmethod attends fully on every layer."""
    windows = getattr(model_cls, "sliding_windows", None)
    if windows is None:
        return [None] * int(getattr(hf_config, "num_hidden_layers", 0) or 0)
    return list(windows(hf_config))


def kv_sliding_window(windows: list[int | None]) -> int | None:
    """The window behind which the block manager may return a request's blocks: the largest
    layer window when every layer has one, else None (a full-attention layer reads every block;
    such hybrid models keep whole block tables, see docs/tuning.md)."""
    if not windows or any(w is None for w in windows):
        return None
    return max(windows)
