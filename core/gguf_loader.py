"""GGUF -> Hugging Face folder, cached on disk.

A GGUF file (llama.cpp's format, https://github.com/ggml-org/ggml/blob/master/docs/gguf.md) is
converted once into a folder with config.json, model.safetensors (fp32, dequantized) and the
tokenizer files; later starts load that folder directly. The ``gguf`` package reads and
dequantizes the tensors; transformers builds the config and the tokenizer (with the chat
template) from the GGUF metadata.

llama.cpp's converter permutes the rows of q and k (``LlamaModel.permute`` in
convert_hf_to_gguf.py) from Hugging Face's rotate-half rotary layout to interleaved pairs; this
module undoes that.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

from .errors import ModelNotFoundError

logger = logging.getLogger(__name__)

_LAYER_MAP = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_ARCHITECTURES = {"llama": "LlamaForCausalLM"}
_TOP_MAP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def cache_root() -> Path:
    return Path(os.environ.get("PAGEBATCH_CACHE", Path.home() / ".cache" / "pagebatch"))


def hf_name(gguf_name: str) -> str:
    """Hugging Face tensor name of a llama-architecture GGUF tensor name."""
    base, _, suffix = gguf_name.rpartition(".")
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    if m and m.group(2) in _LAYER_MAP:
        return f"model.layers.{m.group(1)}.{_LAYER_MAP[m.group(2)]}.{suffix}"
    if base in _TOP_MAP:
        return f"{_TOP_MAP[base]}.{suffix}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no known Hugging Face name")


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation. w: [n_head * head_dim, hidden]."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_gguf_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """Dequantized fp32 tensors of a llama-architecture GGUF file, by Hugging Face name."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    arch = reader.fields["general.architecture"].contents()
    if arch != "llama":
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: ['llama']")
    n_head = int(reader.fields["llama.attention.head_count"].contents())
    n_kv = int(reader.fields.get("llama.attention.head_count_kv",
                                 reader.fields["llama.attention.head_count"]).contents())
    out = {}
    for t in reader.tensors:
        arr = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        name = hf_name(t.name)
        if name.endswith("q_proj.weight"):
            arr = unpermute(arr, n_head)
        elif name.endswith("k_proj.weight"):
            arr = unpermute(arr, n_kv)
        out[name] = torch.from_numpy(np.array(arr, dtype=np.float32))  # writable copy
    return out


def gguf_to_hf_folder(path: str | Path) -> Path:
    """The cached Hugging Face folder for a GGUF file, converting it on first use.

    The cache key is the file's name, size and modification time. Raises ModelNotFoundError when
    the file does not exist.
    """
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoTokenizer

    p = Path(path)
    if not p.is_file():
        raise ModelNotFoundError(f"GGUF file {str(path)!r} does not exist")
    st = p.stat()
    key = hashlib.sha256(f"{p.resolve()}:{st.st_size}:{st.st_mtime_ns}:v2".encode()).hexdigest()
    dest = cache_root() / "gguf" / f"{p.stem}-{key[:16]}"
    if (dest / "done").exists():
        return dest
    logger.info("converting %s to a Hugging Face folder in %s (once)", p.name, dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=".tmp-"))
    try:
        cfg = AutoConfig.from_pretrained(str(p.parent), gguf_file=p.name)
        cfg.architectures = [_ARCHITECTURES[cfg.model_type]]
        cfg.save_pretrained(tmp)
        tok = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
        tok.save_pretrained(tmp)
        state = read_gguf_state_dict(p)
        if getattr(cfg, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "done").write_text(json.dumps({"source": str(p)}))
        try:
            tmp.rename(dest)
        except OSError:  # another process finished the same conversion first
            if not (dest / "done").exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return dest
