"""Rotary position embedding (RoPE, Su et al. 2021) in the "rotate half" (GPT-NeoX) layout that
Hugging Face Llama checkpoints use, with the rope scalings of public Llama-family configs."""

from __future__ import annotations

import math

import torch
from torch import nn

from ..errors import ConfigError


def _inv_freq(head_dim: int, base: float, scaling: dict | None) -> torch.Tensor:
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv
    if rope_type == "linear":
        return inv / float(scaling["factor"])
    if rope_type == "llama3":  # Llama 3.1 "frequency-dependent" scaling (Meta's reference code)
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        low_wavelen, high_wavelen = old_len / low, old_len / high
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        mid = (1 - smooth) * inv / factor + smooth * inv
        is_mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        return torch.where(is_mid, mid, scaled)
    raise ConfigError(f"rope_scaling type {rope_type!r} is not supported; supported: "
                      f"['default', 'linear', 'llama3']")


def rope_params(hf_config) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from a Hugging Face config, old or new (rope_parameters) style."""
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        return float(params["rope_theta"]), scaling or None
    return float(getattr(hf_config, "rope_theta", 10000.0)), getattr(hf_config, "rope_scaling",
                                                                       None)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, base: float,
                 scaling: dict | None, device: torch.device):
        super().__init__()
        self.head_dim = head_dim
        inv = _inv_freq(head_dim, base, scaling).float()
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv)
        # [max_position, head_dim]: cos then sin halves, fp32
        self.register_buffer("cos_sin", torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(device),
                             persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """positions: [num_tokens] int64; q: [num_tokens, Hq, D]; k: [num_tokens, Hkv, D].
        Returns rotated (q, k) in their dtypes."""
        cos, sin = self.cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out.to(x.dtype)
