"""What a model plugin is built with."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention import AttentionBackend
from .linear import QuantMethod


@dataclass
class ModelContext:
    dtype: torch.dtype
    device: torch.device
    quant_method: QuantMethod
    attn_backend: AttentionBackend
    max_model_len: int
