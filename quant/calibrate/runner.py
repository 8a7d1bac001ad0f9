"""The layer-by-layer driver of ``pagebatch quantize``.

The model is a transformers causal LM in fp32 on the CPU (or a given device). Calibration text is
tokenized into ``num_samples`` windows of ``seq_len`` tokens; the inputs of decoder layer 0 are
caught with a forward pre-hook, then each layer in turn is quantized (AWQ, GPTQ, RTN or int8 on
its linears, in AutoGPTQ's / AutoAWQ's order) and run on its inputs with its quantized weights to
give the next layer's inputs, so that later layers see (and compensate for) the error before
them (AutoGPTQ's way; AutoAWQ passes on the unquantized outputs). Besides the model's own weights
only one layer's activations are alive at a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Callable, Collection

import torch
from torch import nn

from pagebatch.errors import ConfigError

from . import decoder
from .awq import awq_layer
from .gptq import GPTQ, gptq_layer
from .rtn import QuantGrid, QuantizedWeight

METHODS = ("awq", "gptq", "int8")
_DROP_KWARGS = ("cache", "past_key_values", "past_key_value", "use_cache")


@dataclass
class QuantizeSpec:
    """What ``pagebatch quantize`` was asked for.

    sym: None picks the method's usual default (AWQ: zero points, i.e. asymmetric; GPTQ:
    symmetric, as AutoGPTQ). rtn: round to nearest, no calibration (the fast baseline).
    clip: AWQ's clipping search. int8 is per-output-channel round to nearest and ignores the
    grid options. lm_head: quantize the LM head too (GPTQ only, GPTQModel's ``lm_head: true``;
    calibrated on the final-normed hidden states).
    """

    method: str
    bits: int = 4
    group_size: int = 128
    sym: bool | None = None
    act_order: bool = False
    rtn: bool = False
    clip: bool = True
    damp_percent: float = 0.01
    calib_file: str | Path | None = None
    num_samples: int = 16
    seq_len: int = 128
    seed: int = 0
    lm_head: bool = False

    @property
    def symmetric(self) -> bool:
        return self.sym if self.sym is not None else self.method == "gptq"

    @property
    def calibrated(self) -> bool:
        return self.method in ("awq", "gptq") and not self.rtn

    def grid(self) -> QuantGrid:
        # AutoGPTQ's v1 checkpoints store zero - 1: keep asymmetric zero points >= 1
        min_zero = 1 if self.method == "gptq" and not self.symmetric else 0
        return QuantGrid(self.bits, self.group_size, self.symmetric, min_zero)

    def validate(self) -> None:
        """Raises ConfigError naming the option and value."""
        if self.method not in METHODS:
            raise ConfigError(f"--method {self.method!r}: choose one of {METHODS}")
        if self.method == "awq" and self.bits != 4:
            raise ConfigError(f"--bits {self.bits}: AutoAWQ's GEMM format is 4-bit only")
        if self.method == "gptq" and self.bits not in (4, 8):
            raise ConfigError(f"--bits {self.bits}: GPTQ checkpoints here are 4 or 8 bits")
        if self.act_order and self.method != "gptq":
            raise ConfigError("--act-order is a GPTQ option (desc_act)")
        if self.act_order and self.rtn:
            raise ConfigError("--act-order needs calibration; it cannot go with --rtn")
        if self.lm_head and self.method != "gptq":
            raise ConfigError(f"--lm-head with --method {self.method}: only GPTQ checkpoints "
                              f"store a quantized LM head (GPTQModel's lm_head: true)")
        if self.group_size != -1 and self.group_size <= 0:
            raise ConfigError(f"--group-size {self.group_size}: a positive size or -1")
        if self.num_samples < 1 or self.seq_len < 2:
            raise ConfigError(f"--num-samples {self.num_samples} / --seq-len {self.seq_len}: "
                              f"need at least 1 sample of 2 tokens")


def default_calibration_text() -> str:
    """The English text shipped with pagebatch for calibration (calibration.txt)."""
    return (resources.files(__package__) / "calibration.txt").read_text(encoding="utf-8")


def calibration_ids(tokenizer: Any, text: str, num_samples: int, seq_len: int,
                    seed: int = 0) -> torch.Tensor:
    """``num_samples`` windows of ``seq_len`` tokens at random offsets (seeded) of the tokenized
    text, as GPTQ's wikitext loader cuts them -> [num_samples, seq_len] int64. Raises
    ConfigError when the text has fewer than ``seq_len`` tokens."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) < seq_len:
        raise ConfigError(f"calibration text has {len(ids)} tokens, fewer than --seq-len "
                          f"{seq_len}")
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(ids) - seq_len + 1, (num_samples,), generator=g).tolist()
    t = torch.tensor(ids, dtype=torch.long)
    return torch.stack([t[s:s + seq_len] for s in starts])


class _Stop(Exception):
    pass


@torch.no_grad()
def layer0_inputs(model: nn.Module, input_ids: torch.Tensor
                  ) -> tuple[torch.Tensor, dict[str, Any]]:
    """Hidden states [n, seq_len, hidden] and keyword arguments (rotary embeddings, mask) that
    decoder layer 0 receives for ``input_ids``; the forward stops there."""
    caught: dict[str, Any] = {}

    def hook(module, args, kwargs):
        caught["x"] = args[0] if args else kwargs.pop("hidden_states")
        caught["kwargs"] = {k: v for k, v in kwargs.items()
                            if k not in _DROP_KWARGS and k != "hidden_states"}
        raise _Stop

    layers = model.model.layers
    handle = layers[0].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        model(input_ids.to(model.device), use_cache=False)
    except _Stop:
        pass
    finally:
        handle.remove()
    return caught["x"], caught["kwargs"]


def check_shapes(model: nn.Module, layout: decoder.DecoderLayout, spec: QuantizeSpec) -> None:
    """Every linear's input size must be a multiple of the group size, and with ``--lm-head``
    the vocabulary a multiple of the values packed per int32 (ConfigError, before any
    calibration)."""
    pf = 32 // spec.bits
    if spec.lm_head and model.lm_head.out_features % pf:  # GPTQ only (validate)
        raise ConfigError(f"--lm-head: the LM head's {model.lm_head.out_features} outputs "
                          f"(vocab_size) are not a multiple of {pf} ({spec.bits}-bit zero points "
                          f"packed {pf} per int32 in GPTQ's qzeros); drop --lm-head")
    if spec.method == "int8" or spec.group_size == -1:
        return
    layer = model.model.layers[0]
    for name in layout.linears:
        n_in = decoder.linear(layer, name).in_features
        if n_in % spec.group_size:
            raise ConfigError(f"--group-size {spec.group_size} does not divide {name}'s input "
                              f"size {n_in} (hidden size {model.config.hidden_size}: try 64 "
                              f"or 32)")



@torch.no_grad()
def quantize_layers(model: nn.Module, spec: QuantizeSpec, input_ids: torch.Tensor | None,
                    on_linear: Callable[[str, Any], None], progress: bool = True,
                    layers: Collection[int] | None = None) -> None:
    """Quantize every decoder layer of ``model`` in place: each linear's weight becomes its
    dequantized value (AWQ also rescales norms and previous linears). ``on_linear(name, q)`` gets
    each linear's full module name and its result: a QuantizedWeight, or for int8 a tuple
    (int8 weight [out, in], fp32 scale [out]). input_ids: [n, seq_len] calibration tokens
    (needed when ``spec.calibrated``). layers: only these layer indices (the others stay
    16-bit; for quick measurements, no checkpoint can be written from that)."""
    from tqdm import tqdm

    layout = decoder.layout_for(model.config.model_type)
    check_shapes(model, layout, spec)
    grid = spec.grid()
    x = kwargs = None
    if spec.calibrated:
        x, kwargs = layer0_inputs(model, input_ids)
    label = f"{spec.method}{' rtn' if spec.rtn else ''}"
    for i, layer in enumerate(tqdm(model.model.layers, desc=f"quantize {label}", unit="layer",
                                   disable=not progress)):
        if layers is not None and i not in layers:
            if i > max(layers):
                break
        else:
            results = _quantize_layer(layer, layout, spec, grid, x, kwargs)
            for name in layout.linears:
                on_linear(f"model.layers.{i}.{name}", results[name])
        if x is not None:
            x = decoder.run(layer, x, kwargs)
    if spec.lm_head and layers is None:
        on_linear("lm_head", _quantize_lm_head(model, spec, grid, x))


def _quantize_lm_head(model: nn.Module, spec: QuantizeSpec, grid: QuantGrid,
                      x: torch.Tensor | None) -> QuantizedWeight:
    """GPTQ (or RTN) of the LM head on the last layer's outputs after the final norm; the head
    gets its own dequantized weight (a tied embedding table stays as it was)."""
    head = model.lm_head
    if x is not None:
        solver = GPTQ(head.in_features, head.weight.device)
        solver.add_batch(model.model.norm(x))
        qw = solver.quantize(head.weight, grid, act_order=spec.act_order,
                             damp=spec.damp_percent)
    else:
        qw = grid.quantize(head.weight)
    head.weight = nn.Parameter(qw.dequantize().to(head.weight.dtype), requires_grad=False)
    return qw


def _quantize_layer(layer: nn.Module, layout: decoder.DecoderLayout, spec: QuantizeSpec,
                    grid: QuantGrid, x: torch.Tensor | None,
                    kwargs: dict[str, Any] | None) -> dict[str, Any]:
    if spec.method == "awq" and spec.calibrated:
        return awq_layer(layer, layout, x, kwargs, grid, clip_search=spec.clip)
    if spec.method == "gptq" and spec.calibrated:
        return gptq_layer(layer, layout, x, kwargs, grid, act_order=spec.act_order,
                          damp=spec.damp_percent)
    from pagebatch.quant.packing import quantize_int8_per_channel

    results: dict[str, Any] = {}
    for name in layout.linears:
        lin = decoder.linear(layer, name)
        if spec.method == "int8":
            q, scale = quantize_int8_per_channel(lin.weight)
            lin.weight.data = (q.float() * scale[:, None]).to(lin.weight.dtype)
            results[name] = (q, scale)
        else:
            results[name] = grid.quantize(lin.weight)
            lin.weight.data = results[name].dequantize().to(lin.weight.dtype)
    return results


def load_model(folder: Path, device: str = "cpu") -> nn.Module:
    """The transformers causal LM of ``folder`` in fp32, eval mode, sdpa attention."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32,
                                                 attn_implementation="sdpa")
    return model.to(device).eval()


def quantization_config(spec: QuantizeSpec, out_dir: Path) -> dict[str, Any]:
    from .writer import (awq_quantization_config, gptq_quantization_config,
                         int8_quantization_config)

    if spec.method == "awq":
        return awq_quantization_config(spec.bits, spec.group_size, not spec.symmetric)
    if spec.method == "gptq":
        return gptq_quantization_config(spec.bits, spec.group_size, spec.symmetric,
                                        spec.act_order, spec.damp_percent, out_dir,
                                        spec.lm_head)
    return int8_quantization_config()


def quantize(model: str | Path, out_dir: str | Path, spec: QuantizeSpec,
             device: str = "cpu", progress: bool = True) -> Path:
    """Quantize ``model`` (a name or folder, see pagebatch.model_loader.resolve_model) and write
    the checkpoint folder ``out_dir``. Raises ConfigError for bad options, ModelNotFoundError."""
    from transformers import AutoTokenizer

    from pagebatch.model_loader import resolve_model

    from .writer import CheckpointWriter

    spec.validate()
    source = resolve_model(str(model)).folder
    out_dir = Path(out_dir)
    lm = load_model(source, device)
    decoder.layout_for(lm.config.model_type)  # fail early on an unknown architecture
    input_ids = None
    if spec.calibrated:
        text = (Path(spec.calib_file).read_text(encoding="utf-8") if spec.calib_file
                else default_calibration_text())
        tokenizer = AutoTokenizer.from_pretrained(str(source))
        input_ids = calibration_ids(tokenizer, text, spec.num_samples, spec.seq_len, spec.seed)
    writer = CheckpointWriter(out_dir, quantization_config(spec, out_dir))

    def on_linear(name: str, q: Any) -> None:
        if isinstance(q, QuantizedWeight):
            writer.add(name, q)
        else:
            writer.add_int8(name, *q)

    quantize_layers(lm, spec, input_ids, on_linear, progress=progress)
    return writer.finish(lm, source)
