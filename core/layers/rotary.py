"""Rotary position embedding (RoPE, Su et al. 2021) in the "rotate half" (GPT-NeoX) layout that
Hugging Face Llama checkpoints use, with the rope scalings of public Llama/Mistral/Qwen configs.

Supported ``rope_type``s (the names of transformers' ``ROPE_INIT_FUNCTIONS``, whose results these
match): ``default``, ``linear`` (position interpolation, Chen et al. 2023), ``llama3`` (Llama 3.1's
frequency-dependent scaling, Meta's reference code), ``yarn`` (Peng et al. 2023, "YaRN: Efficient
Context Window Extension of Large Language Models", as Qwen2/Qwen3 configs use it) and
``dynamic`` (dynamic NTK, see `_dynamic_ntk`). Other types raise ConfigError.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..errors import ConfigError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic")
# rope types whose pretraining length is `original_max_position_embeddings` (transformers fills it
# in from max_position_embeddings when absent)
_NEEDS_ORIGINAL_LEN = ("llama3", "yarn")


def _base_inv_freq(head_dim: int, base: float) -> torch.Tensor:
    """[head_dim // 2] fp32: base ** (-2i / head_dim), the unscaled RoPE frequencies."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (base ** exponents)


def _llama3(inv: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1 scaling (``apply_scaling`` in Meta's llama-models reference code): wavelengths
    longer than original_len / low_freq_factor are divided by ``factor``, shorter than
    original_len / high_freq_factor kept, and those between interpolated smoothly."""
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


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature, the paper's sqrt(1/t) = 0.1 * mscale * ln(factor) + 1."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn(inv: torch.Tensor, head_dim: int, base: float,
          scaling: dict) -> tuple[torch.Tensor, float]:
    """YaRN (Peng et al. 2023): "NTK-by-parts" interpolation plus an attention temperature.

    Dimensions that rotate more than ``beta_fast`` times over the original context keep their
    frequency (extrapolation), those rotating fewer than ``beta_slow`` times are divided by
    ``factor`` (interpolation), with a linear ramp between. Returns (inv_freq, mscale); mscale
    multiplies cos and sin, which scales q.k by mscale**2 as the paper's temperature does.
    """
    orig = float(scaling["original_max_position_embeddings"])
    factor = float(scaling["factor"])
    mscale = scaling.get("attention_factor")
    if mscale is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        mscale = (_yarn_mscale(factor, m) / _yarn_mscale(factor, m_all) if m and m_all
                  else _yarn_mscale(factor))
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def dim_of(rotations: float) -> float:
        # the dimension index 2i whose wavelength fits `rotations` times in the original context
        return head_dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    lo, hi = dim_of(beta_fast), dim_of(beta_slow)
    if scaling.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, head_dim - 1)
    if lo == hi:
        hi += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    inv = (inv / factor) * ramp + inv * (1 - ramp)
    return inv, float(mscale)


def _dynamic_ntk(inv: torch.Tensor, scaling: dict, max_position: int) -> torch.Tensor:
    """Dynamic NTK scaling (reddit /u/bloc97, /u/emozilla) as transformers runs it: the base grows
    only once a forward pass sees more than ``max_position_embeddings`` positions; up to that
    length the frequencies are the unscaled ones. The engine never runs past
    max_position_embeddings (a larger max_model_len is a ConfigError), so this is exact. Past it,
    transformers recomputes the frequencies for each forward's length while its cache keeps keys
    rotated with the old ones; a paged cache cannot reproduce that, so it is refused."""
    model_max = int(scaling["max_position_embeddings"])
    if max_position > model_max:
        raise ConfigError(
            f"rope_type 'dynamic' (dynamic NTK) with max_model_len={max_position} above "
            f"max_position_embeddings={model_max} is not supported: its frequencies would depend "
            f"on each step's length; use max_model_len <= {model_max}")
    return inv


def rope_frequencies(head_dim: int, base: float, scaling: dict | None,
                     max_position: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim // 2] fp32, attention scaling applied to cos/sin) for a rope config.

    ``scaling`` is the second item of `rope_params` (None for plain RoPE). ``max_position`` is
    the number of positions the engine will use (max_model_len). Raises ConfigError for an
    unsupported ``rope_type``.
    """
    scaling = scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if float(scaling.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ConfigError(f"partial_rotary_factor={scaling['partial_rotary_factor']} is not "
                          f"supported (only 1.0: the whole head is rotated)")
    inv = _base_inv_freq(head_dim, base)
    if rope_type == "default":
        return inv, 1.0
    if rope_type == "linear":
        return inv / float(scaling["factor"]), 1.0
    if rope_type == "llama3":
        return _llama3(inv, scaling), 1.0
    if rope_type == "yarn":
        return _yarn(inv, head_dim, base, scaling)
    if rope_type == "dynamic":
        return _dynamic_ntk(inv, scaling, max_position), 1.0
    raise ConfigError(f"rope_scaling type {rope_type!r} is not supported; supported: "
                      f"{list(SUPPORTED_ROPE_TYPES)}")


def rope_params(hf_config) -> tuple[float, dict | None]:
    """(rope_theta, rope scaling dict or None) from a Hugging Face config, in either style:
    transformers 5's ``rope_parameters`` (theta inside the dict) or the older ``rope_theta`` +
    ``rope_scaling`` attributes.

    The scaling dict is a copy with ``rope_type`` set (old configs say ``type``) and, as
    transformers' ``standardize_rope_params`` does, ``original_max_position_embeddings`` filled
    in from ``max_position_embeddings`` for llama3/yarn when absent; a yarn ``factor`` of None
    becomes max_position_embeddings / original_max_position_embeddings; dynamic NTK gets
    ``max_position_embeddings``, the length past which it would rescale.
    """
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        base = float(params["rope_theta"])
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        base = float(getattr(hf_config, "rope_theta", None) or 10000.0)
        scaling = dict(getattr(hf_config, "rope_scaling", None) or {})
    if not scaling:
        return base, None
    rope_type = scaling.pop("type", None)
    scaling.setdefault("rope_type", rope_type or "default")
    model_max = getattr(hf_config, "max_position_embeddings", None)
    if scaling["rope_type"] in _NEEDS_ORIGINAL_LEN:
        if scaling.get("original_max_position_embeddings") is None:
            scaling["original_max_position_embeddings"] = model_max
        if scaling["rope_type"] == "yarn" and scaling.get("factor") is None:
            scaling["factor"] = model_max / scaling["original_max_position_embeddings"]
    if scaling["rope_type"] == "dynamic":
        scaling["max_position_embeddings"] = model_max
    return base, scaling


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q and k from a precomputed [max_position, head_dim] cos/sin table (fp32),
    already multiplied by the scaling's attention factor (YaRN's mscale; 1 otherwise)."""

    def __init__(self, head_dim: int, max_position: int, base: float,
                 scaling: dict | None, device: torch.device):
        super().__init__()
        self.head_dim = head_dim
        inv, self.attention_scaling = rope_frequencies(head_dim, base, scaling, max_position)
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv.float())
        cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1) * self.attention_scaling
        # [max_position, head_dim]: cos then sin halves, fp32
        self.register_buffer("cos_sin", cos_sin.to(device), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """positions: [num_tokens] int64; q: [num_tokens, Hq, D]; k: [num_tokens, Hkv, D].
        Returns rotated (q, k) in their dtypes. On CUDA one fused Triton kernel
        (core/kernels/rotary.py) rotates both."""
        if q.is_cuda:
            from ..kernels.rotary import apply_rotary

            return apply_rotary(positions, q, k, self.cos_sin)
        return self.forward_torch(positions, q, k)

    def forward_torch(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """`forward` in plain torch (the CPU path and the kernel's reference)."""
        cos, sin = self.cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out.to(x.dtype)
