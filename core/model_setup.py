"""`ModelSetup`: what an `EngineConfig` resolves to once the model is known -- the model's folder
and Hugging Face config, the device, the dtype and the token limits that follow from them.

It is resolved once (`resolve_model_setup`) and handed on: the front half, the engine core, its
executor, every parallel worker and the model runner take the object and read the resolved values
from it, never from the config again, so no resolved value has two sources of truth. The front
half and the engine core's own process each resolve it (the core's process gets only the config).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from .config import EngineConfig, check_token_budget
from .errors import ConfigError
from .kv_hybrid import MAX_KV_GROUPS, KVCacheGroups, kv_cache_groups
from .model import kv_sliding_window, max_model_len_limit, sliding_windows
from .model_loader import ModelSource, architecture, load_hf_config, resolve_model
from .registry import Registry

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ModelSetup:
    """A config's resolved model and limits.

    source: the model's local folder. hf_config: its Hugging Face config. device_type: ``cuda``
    or ``cpu`` (each parallel rank adds its own GPU index). dtype: the activations' and 16-bit
    weights' dtype. max_model_len: tokens per request (prompt + output). max_num_batched_tokens:
    the token budget of one step. sliding_window: the tokens behind which the block manager
    returns a request's blocks (every layer attends over a window of at most this many tokens;
    `kv_sliding_window`), or None. kv_groups: for a model that mixes full-attention and
    windowed layers, its KV cache groups (core/kv_hybrid.py: a block table per group), else
    None (one table per request; also with ``disable_hybrid_kv_cache_manager`` and with
    pipeline parallelism, where the hybrid manager is not built yet).
    """

    source: ModelSource
    hf_config: Any
    device_type: str
    dtype: torch.dtype
    max_model_len: int
    max_num_batched_tokens: int
    sliding_window: int | None = None
    kv_groups: KVCacheGroups | None = None


def resolve_device(name: str) -> torch.device:
    """``auto`` -> cuda when torch sees a GPU, else cpu. Raises ConfigError for ``cuda`` without
    one."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device='cuda' but torch sees no CUDA device; use device: cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto`` -> bfloat16 on CUDA, float32 elsewhere."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


def resolve_model_setup(config: EngineConfig, registry: Registry) -> ModelSetup:
    """Resolve the model and the limits of ``config``. Raises ModelNotFoundError, ConfigError,
    PluginError."""
    source = resolve_model(config.model, config.load_format)
    hf_config = load_hf_config(source.folder)
    device = resolve_device(config.device)
    max_model_len = _resolve_max_model_len(config, hf_config, registry)
    mnbt = config.max_num_batched_tokens or (
        8192 if config.enable_chunked_prefill else max(max_model_len, 2048))
    check_token_budget(mnbt, max_model_len, config.enable_chunked_prefill)
    layer_windows = sliding_windows(registry.model_class(architecture(hf_config)), hf_config)
    window = kv_sliding_window(layer_windows)
    groups, whole_tables = None, None  # (the reason a hybrid model keeps whole tables)
    if window is None and any(w is not None for w in layer_windows):
        if config.disable_hybrid_kv_cache_manager:
            whole_tables = "disable_hybrid_kv_cache_manager"
        elif config.pipeline_parallel_size > 1:
            whole_tables = "pipeline parallelism"
        elif (groups := kv_cache_groups(layer_windows)) is None:
            whole_tables = (f"their layer counts make more than {MAX_KV_GROUPS} KV cache groups "
                            f"of equal size")
    if whole_tables:
        logger.info("full and sliding-window layers: one whole block table per request (%s)",
                    whole_tables)
    return ModelSetup(source, hf_config, device.type, resolve_dtype(config.dtype, device),
                      max_model_len, mnbt, window, groups)


def _resolve_max_model_len(config: EngineConfig, hf_config: Any, registry: Registry) -> int:
    model_max = getattr(hf_config, "max_position_embeddings", None)
    want = config.max_model_len
    if want is None:
        if model_max is None:
            raise ConfigError("the model's config.json has no max_position_embeddings: "
                              "set max_model_len")
        return _cap_max_model_len(int(model_max), hf_config, registry)
    if model_max is not None and want > model_max:
        raise ConfigError(f"max_model_len={want} exceeds the model's "
                          f"max_position_embeddings={model_max}")
    return _cap_max_model_len(want, hf_config, registry)


def _cap_max_model_len(max_model_len: int, hf_config: Any, registry: Registry) -> int:
    """Apply the model class's optional ``max_model_len_limit(hf_config) -> int | None``:
    a larger max_model_len is lowered to it, with a warning. (Sliding windows are no limit:
    the attention backends implement them.)"""
    arch = architecture(hf_config)
    limit = max_model_len_limit(registry.model_class(arch), hf_config)
    if limit is not None and limit < max_model_len:
        logger.warning("max_model_len lowered from %d to %d: %s runs this config exactly "
                       "only up to %d tokens (its max_model_len_limit)",
                       max_model_len, limit, arch, limit)
        return int(limit)
    return max_model_len
