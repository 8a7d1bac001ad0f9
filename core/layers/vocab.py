"""Token embedding and the LM head (optionally tied to the embedding), vocab-parallel under
tensor parallelism (Megatron-LM's VocabParallelEmbedding).

With ``tp_size`` ranks the vocabulary is cut into ``tp_size`` contiguous ranges of
``ceil(vocab / tp_size)`` rows (the last one padded with zero rows). The embedding looks up the
ids of its range, zeroes the others and all-reduces; the LM head computes its range's logits and
all-gathers them, so every rank has the whole [n, vocab] logits (and samples the same tokens).
A quantized LM head (`QuantizedLMHead`, ``quantize_lm_head``) is a column-parallel linear layer
of the quant method's format instead, with the same output.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError
from .dense import cpu_weights, dense_linear
from .linear import LinearBase, QuantMethod

if TYPE_CHECKING:
    from ..distributed.parallel_state import ParallelContext


class _VocabShard(nn.Module):
    """A [rows, hidden] slice of a [vocab, hidden] table: rows ``vocab_start .. + rows`` of the
    checkpoint on this TP rank."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype,
                 device: torch.device, tp: "ParallelContext | None",
                 shared: "_VocabShard | None" = None):
        super().__init__()
        self.vocab_size = vocab_size
        self.tp = tp
        self.tp_size = tp.tp_size if tp is not None else 1
        self.rows = -(-vocab_size // self.tp_size)
        self.vocab_start = (tp.tp_rank if tp is not None else 0) * self.rows
        if shared is not None:  # tied: the same parameter (and loader) as ``shared``
            self.weight = shared.weight
            return
        self.weight = nn.Parameter(torch.zeros(self.rows, hidden_size, dtype=dtype,
                                               device=device), requires_grad=False)
        self.weight.weight_loader = self.load_weight

    def load_weight(self, tensor: torch.Tensor) -> None:
        """Copy this rank's rows of a checkpoint table [vocab, hidden] (padding stays zero).
        Raises ValueError on a shape mismatch."""
        want = (self.vocab_size, self.weight.shape[1])
        if tuple(tensor.shape) != want:
            raise ValueError(f"vocabulary table: checkpoint shape {tuple(tensor.shape)} does "
                             f"not match the model's {want}")
        part = tensor[self.vocab_start:self.vocab_start + self.rows]
        self.weight.data[:part.shape[0]].copy_(part)


class VocabEmbedding(_VocabShard):
    """``reduce_results=False`` (``custom_all_reduce``): under tensor parallelism the output is
    this rank's partial sum (its range's rows, zeros elsewhere), left for the first RMSNorm to
    all-reduce together with its (zero) residual, as a row-parallel layer's is."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype,
                 device: torch.device, tp: "ParallelContext | None" = None,
                 reduce_results: bool = True):
        super().__init__(vocab_size, hidden_size, dtype, device, tp)
        self.reduce_results = reduce_results

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: [num_tokens] int32/int64 -> [num_tokens, hidden] (a partial sum under
        tensor parallelism with ``reduce_results=False``)."""
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.rows)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        x = x.masked_fill(outside[:, None], 0)
        return self.tp.tp_all_reduce(x) if self.reduce_results else x


class LMHead(_VocabShard):
    """hidden [n, hidden] -> logits [n, vocab] in fp32 (whole vocabulary on every rank)."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype,
                 device: torch.device, tied_to: VocabEmbedding | None = None,
                 tp: "ParallelContext | None" = None):
        super().__init__(vocab_size, hidden_size, dtype, device, tp, shared=tied_to)
        self.cpu_weights = None

    def process_weights_after_loading(self) -> None:
        """Once the table is loaded: fp32 on the CPU, its transposed and oneDNN-blocked copies
        for the product (core/layers/dense.py; a tied table stays whole for the embedding)."""
        self.cpu_weights = cpu_weights(self.weight)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = dense_linear(hidden, self.weight, cpu=self.cpu_weights)
        if self.tp_size > 1:
            logits = self.tp.tp_all_gather(logits, dim=-1)[:, :self.vocab_size]
        return logits.float()


class QuantizedLMHead(LinearBase):
    """The LM head in a quant method's format (``quantize_lm_head``, or a GPTQModel checkpoint
    with ``lm_head: true``): hidden [n, hidden] -> logits [n, vocab] fp32, as `LMHead`. Loads
    ``lm_head.weight`` (quantized at load) or the method's own tensors (``lm_head.qweight``
    ...); a tied model's embedding table is loaded into it as ``weight`` (the embedding itself
    stays 16-bit). Under tensor parallelism each rank holds ``vocab / tp_size`` rows.

    Raises ConfigError when the vocabulary does not split evenly over the TP ranks."""

    def __init__(self, vocab_size: int, hidden_size: int, quant_method: QuantMethod,
                 dtype: torch.dtype, device: torch.device, tp: "ParallelContext | None" = None):
        tp_size = tp.tp_size if tp is not None else 1
        if vocab_size % tp_size:
            raise ConfigError(f"quantized LM head: vocab_size={vocab_size} does not split over "
                              f"tensor_parallel_size={tp_size}; turn quantize_lm_head off")
        super().__init__(hidden_size, [vocab_size], False, quant_method, dtype, device,
                         parallel="column", tp=tp)
        self.vocab_size = vocab_size

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.quant_method.apply(self, hidden)
        if self.tp_size > 1:
            logits = self.tp.tp_all_gather(logits, dim=-1)
        return logits.float()
