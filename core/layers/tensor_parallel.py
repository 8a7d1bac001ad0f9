"""Model layers built from a `ModelContext`, split over the tensor-parallel ranks, with
``custom_all_reduce``'s fusion decided here once instead of in every model plugin.

Megatron-LM's split (Shoeybi et al. 2019): a column-parallel linear keeps its output split
(this rank's heads, its slice of the MLP width); a row-parallel linear after it sums the ranks'
partial outputs with an all-reduce; the embedding and the LM head are vocab-parallel
(core/layers/vocab.py). With ``custom_all_reduce`` (``ctx.parallel.fuse_all_reduce_norm``)
the row-parallel layers and the embedding return their partial sums, and the RMSNorm that
follows on the residual stream (`residual_rms_norm`) all-reduces them together with its residual
add, in one kernel where the one-shot all-reduce runs (core/layers/norm.py). A model built from
these functions gets that for free; one that builds `LinearBase` / `RMSNorm` itself keeps the
all-reduce inside each layer. On one rank every function returns the plain layer.
"""

from __future__ import annotations

from .context import ModelContext
from .linear import LinearBase
from .norm import RMSNorm
from .vocab import LMHead, QuantizedLMHead, VocabEmbedding


def column_parallel_linear(ctx: ModelContext, input_size: int, output_sizes: list[int],
                           bias: bool,
                           output_ranges: list[tuple[int, int]] | None = None) -> LinearBase:
    """``x [T, input_size] -> [T, this rank's part of sum(output_sizes)]``, shards stacked
    on the output dimension (fused QKV: three, gate/up: two). ``output_ranges``: this rank's
    (start, length) per shard (default an even split; fused QKV: `qkv_output_ranges`)."""
    return LinearBase(input_size, output_sizes, bias, ctx.quant_method, ctx.dtype, ctx.device,
                      parallel="column", tp=ctx.parallel, output_ranges=output_ranges)


def row_parallel_linear(ctx: ModelContext, input_size: int, output_size: int,
                        bias: bool) -> LinearBase:
    """``x [T, this rank's part of input_size] -> [T, output_size]``: the whole output, or
    under ``custom_all_reduce`` this rank's partial sum, which the next `residual_rms_norm`
    reduces (so build one after it)."""
    return LinearBase(input_size, [output_size], bias, ctx.quant_method, ctx.dtype, ctx.device,
                      parallel="row", tp=ctx.parallel,
                      reduce_results=not ctx.parallel.fuse_all_reduce_norm)


def residual_rms_norm(ctx: ModelContext, hidden_size: int, eps: float) -> RMSNorm:
    """An RMSNorm on the residual stream, after a row-parallel layer or the embedding: under
    ``custom_all_reduce`` called as ``norm(x, residual)`` it all-reduces their partial sum
    ``x`` first (the embedding's output comes with a zero residual)."""
    par = ctx.parallel
    return RMSNorm(hidden_size, eps, ctx.dtype, ctx.device,
                   tp=par if par.fuse_all_reduce_norm else None)


def vocab_parallel_embedding(ctx: ModelContext, vocab_size: int,
                             hidden_size: int) -> VocabEmbedding:
    """input_ids [T] -> [T, hidden_size]: each rank looks up its vocabulary range; the sum over
    the ranks is all-reduced here, or under ``custom_all_reduce`` by the first
    `residual_rms_norm` (given a zero residual)."""
    return VocabEmbedding(vocab_size, hidden_size, ctx.dtype, ctx.device, ctx.parallel,
                          reduce_results=not ctx.parallel.fuse_all_reduce_norm)


def lm_head(ctx: ModelContext, vocab_size: int, hidden_size: int,
            tied_to: VocabEmbedding | None = None) -> LMHead | QuantizedLMHead:
    """hidden [n, hidden_size] -> logits [n, vocab_size] fp32 on every rank: a 16-bit
    vocab-parallel head (sharing ``tied_to``'s table when given: tie_word_embeddings), or,
    with ``ctx.lm_head_quant`` (``quantize_lm_head``, GPTQModel's ``lm_head: true``), a
    column-parallel linear of that quant method (a tied table is then loaded into it).
    Raises ConfigError when a quantized head's vocabulary does not split over the ranks."""
    if ctx.lm_head_quant is not None:
        return QuantizedLMHead(vocab_size, hidden_size, ctx.lm_head_quant, ctx.dtype,
                               ctx.device, ctx.parallel)
    return LMHead(vocab_size, hidden_size, ctx.dtype, ctx.device, tied_to=tied_to,
                  tp=ctx.parallel)
