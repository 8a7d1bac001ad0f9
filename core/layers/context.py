"""What a model plugin is built with."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..attention import AttentionBackend
from ..distributed.parallel_state import ParallelContext
from .linear import QuantMethod


@dataclass
class ModelContext:
    """``parallel``: this rank's place in tensor/pipeline parallelism (a single rank by
    default); layers take it as ``tp=`` and stage-aware models read their layer range from
    it."""

    dtype: torch.dtype
    device: torch.device
    quant_method: QuantMethod
    attn_backend: AttentionBackend
    max_model_len: int
    parallel: ParallelContext = field(default_factory=ParallelContext.single)
    lm_head_quant: QuantMethod | None = None
    """The LM head's quant method (``quantize_lm_head``), or None for a 16-bit LM head."""
