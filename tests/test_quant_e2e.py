"""End to end: the tiny random Llama (tests/conftest.py) written as an AutoAWQ and an AutoGPTQ
checkpoint folder with quant/packing.py (round to nearest), loaded by pagebatch, gives the
greedy tokens of transformers running the same model with the dequantized weights in fp32
(near-tie rule, tests/numerics.py). The fused q/k/v and gate/up layers and the unmerged o/down
layers all load from the per-projection checkpoint names. Also: every method runs with
``load_format: dummy`` and on a 16-bit checkpoint quantized at load."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from numerics import assert_greedy_match, hf_greedy
from pagebatch.errors import ConfigError
from pagebatch.layers.linear import LinearBase
from pagebatch.layers.vocab import QuantizedLMHead
from pagebatch import LLM, SamplingParams
from pagebatch.quant.common import rtn_quantize
from pagebatch.quant.packing import default_g_idx, dequantize, pack_awq, pack_gptq
from tiny import random_prompts

PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GROUP = 32  # hidden 64, intermediate 128


def _quantize_folder(src: Path, dst: Path, method: str,
                     lm_head: bool = False) -> tuple[Path, Path]:
    """Write ``dst/quant`` (the checkpoint) and ``dst/deq`` (the same model with each linear
    weight replaced by its dequantized value, unquantized). GPTQ: 4 bits, act-order (one shuffled
    g_idx per layer input, shared by q/k/v and by gate/up as GPTQ's Hessian order is), v1;
    ``lm_head``: the LM head quantized too (GPTQModel's ``lm_head: true``)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(next(src.glob("*.safetensors"))))
    quant, deq = {}, {}
    gen = torch.Generator().manual_seed(0)
    shared_g_idx: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        proj = next((p for p in PROJ if f".{p}." in name), None)
        if lm_head and name == "lm_head.weight":
            proj = "lm_head"
        if proj is None or not name.endswith(".weight"):
            quant[name] = deq[name] = t
            continue
        prefix = name[: -len(".weight")]
        k = t.shape[1]
        if method == "awq":
            q, z, s = rtn_quantize(t, 4, GROUP, sym=False)
            s = s.half()
            quant.update({f"{prefix}.{n}": v for n, v in pack_awq(q, z, s, GROUP).items()})
            g_idx = default_g_idx(k, GROUP)
        else:
            key = prefix.rsplit(".", 1)[0] + {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv",
                                              "gate_proj": "gu", "up_proj": "gu"}.get(proj, proj)
            if key not in shared_g_idx:
                shared_g_idx[key] = default_g_idx(k, GROUP)[torch.randperm(k, generator=gen)]
            g_idx = shared_g_idx[key]
            # RTN per group of the act-order channels: gather each group's columns
            perm = torch.argsort(g_idx, stable=True)
            q, z, s = rtn_quantize(t[:, perm], 4, GROUP, sym=True)
            q = torch.empty_like(q).index_copy_(1, perm, q)
            s = s.half()
            quant.update({f"{prefix}.{n}": v
                          for n, v in pack_gptq(q, z, s, g_idx, 4, GROUP, "gptq").items()})
        deq[name] = dequantize(q, z, s.float(), g_idx)
    config = json.loads((src / "config.json").read_text())
    out = {}
    for sub, weights, qcfg in (
            ("quant", quant, {"quant_method": "awq", "bits": 4, "group_size": GROUP,
                              "zero_point": True, "version": "gemm"} if method == "awq" else
             {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": True,
              "sym": True, "checkpoint_format": "gptq", "lm_head": lm_head}),
            ("deq", deq, None)):
        folder = dst / sub
        shutil.copytree(src, folder, ignore=shutil.ignore_patterns("*.safetensors"))
        save_file({n: v.clone().contiguous() for n, v in weights.items()},
                  str(folder / "model.safetensors"))
        cfg = dict(config, quantization_config=qcfg) if qcfg else config
        (folder / "config.json").write_text(json.dumps(cfg))
        out[sub] = folder
    return out["quant"], out["deq"]


@pytest.mark.parametrize("method,lm_head", [("awq", False), ("gptq", False), ("gptq", True)])
def test_quantized_checkpoint_greedy_equals_dequantized_transformers(tiny_model_dir, tmp_path,
                                                                      method, lm_head):
    from transformers import AutoModelForCausalLM

    qdir, ddir = _quantize_folder(tiny_model_dir, tmp_path, method, lm_head)
    hf = AutoModelForCausalLM.from_pretrained(ddir, dtype=torch.float32).eval()
    llm = LLM(str(qdir), device="cpu", dtype="float32", num_kv_blocks=64, block_size=4)
    model = llm.engine.core.runner.model
    layer = model.layers[0]
    assert layer.self_attn.qkv_proj.quant_method.name == method
    assert isinstance(model.lm_head, QuantizedLMHead) == lm_head
    if method == "gptq":
        assert layer.mlp.gate_up_proj.perm is not None  # act-order sorted once at load
    if lm_head:
        assert model.lm_head.perm is not None
    sp = SamplingParams(temperature=0.0, max_tokens=16)
    for p in random_prompts(3, seed=21):
        ref, gaps = hf_greedy(hf, p, 16)
        got = llm.generate({"prompt_token_ids": p}, sp, use_tqdm=False)[0]
        assert_greedy_match(ref, gaps, got.outputs[0].token_ids, what=f"{method} prompt {p}")


@pytest.mark.parametrize("method", ["int8", "fp8", "awq", "gptq"])
def test_methods_run_on_dummy_and_16bit_weights(tiny_model_dir, method):
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for fmt in ("dummy", "auto"):
        llm = LLM(str(tiny_model_dir), device="cpu", dtype="float32", num_kv_blocks=64,
                  block_size=4, quantization=method, load_format=fmt)
        out = llm.generate({"prompt_token_ids": [5, 6, 7]}, sp, use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == 4
        linears = [m for m in llm.engine.core.runner.model.modules()
                   if isinstance(m, LinearBase)]
        assert linears and all(m.quant_method.name == method for m in linears)


@pytest.mark.parametrize("method", ["int8", "fp8", "awq", "gptq"])
def test_quantize_lm_head_at_load_and_dummy(tiny_model_dir, method):
    """``quantize_lm_head``: the LM head is built with the method (16-bit checkpoint quantized
    at load, and dummy weights in the method's format); its logits stay close to the 16-bit
    head's on the same hidden states."""
    from pagebatch.layers.vocab import LMHead

    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for fmt in ("dummy", "auto"):
        llm = LLM(str(tiny_model_dir), device="cpu", dtype="float32", num_kv_blocks=64,
                  block_size=4, quantization=method, load_format=fmt, quantize_lm_head=True)
        out = llm.generate({"prompt_token_ids": [5, 6, 7]}, sp, use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == 4
        head = llm.engine.core.runner.model.lm_head
        assert isinstance(head, QuantizedLMHead) and head.quant_method.name == method
    from safetensors.torch import load_file

    w = load_file(str(next(tiny_model_dir.glob("*.safetensors"))))["lm_head.weight"]
    dense = LMHead(w.shape[0], w.shape[1], torch.float32, torch.device("cpu"))
    dense.weight.data.copy_(w)
    hidden = torch.randn(5, w.shape[1], generator=torch.Generator().manual_seed(1))
    ref, got = dense(hidden), head(hidden)
    assert got.shape == ref.shape == (5, w.shape[0]) and got.dtype == torch.float32
    err = (got - ref).norm() / ref.norm()
    # relative rounding error of one weight: int8 per channel ~1/(127 * sqrt(12)) x range,
    # fp8 e4m3 (3 mantissa bits) ~2**-4 / sqrt(3), 4 bits per group of 32 ~1/(15 * sqrt(12))
    # x range; the logits' relative error is of that order
    assert err < {"int8": 0.02, "fp8": 0.05}.get(method, 0.15), err


def test_quantize_lm_head_of_a_tied_model(tiny_model_dir, tmp_path):
    """A tied model: the embedding stays 16-bit and the LM head is a quantized copy of it."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "tied"
    shutil.copytree(tiny_model_dir, folder)
    f = next(folder.glob("*.safetensors"))
    tensors = load_file(str(f))
    del tensors["lm_head.weight"]
    save_file(tensors, str(f))
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(cfg, tie_word_embeddings=True)))
    llm = LLM(str(folder), device="cpu", dtype="float32", num_kv_blocks=64, block_size=4,
              quantization="awq", quantize_lm_head=True)
    model = llm.engine.core.runner.model
    emb = tensors["model.embed_tokens.weight"]
    assert torch.equal(model.embed_tokens.weight, emb)
    deq = model.lm_head.quant_method.dequantized_weight(model.lm_head)
    assert deq.shape == emb.shape
    assert (deq - emb).norm() / emb.norm() < 0.15
    # the same tied model as a GPTQ checkpoint with lm_head: true (pagebatch quantize
    # --lm-head): the head loads its own tensors, not the embedding table
    from pagebatch.quant.calibrate import QuantizeSpec, quantize
    from pagebatch.quant.packing import dequantize_gptq

    out = quantize(folder, tmp_path / "q", QuantizeSpec("gptq", group_size=32, rtn=True,
                                                        lm_head=True), progress=False)
    t = load_file(str(out / "model.safetensors"))
    want = dequantize_gptq(t["lm_head.qweight"], t["lm_head.qzeros"], t["lm_head.scales"].float(),
                           t["lm_head.g_idx"], 4, 32, "gptq")
    head = LLM(str(out), device="cpu", dtype="float32", num_kv_blocks=64,
               block_size=4).engine.core.runner.model.lm_head
    assert head.quant_method.name == "gptq" and head.quant_method.checkpoint_lm_head
    torch.testing.assert_close(head.quant_method.dequantized_weight(head), want)


def test_quantize_lm_head_errors(tiny_model_dir, tmp_path):
    with pytest.raises(ConfigError, match="quantize_lm_head: true needs a quantization"):
        LLM(str(tiny_model_dir), device="cpu", num_kv_blocks=64, quantize_lm_head=True)
    qdir, _ = _quantize_folder(tiny_model_dir, tmp_path, "gptq", lm_head=True)
    with pytest.raises(ConfigError, match="LM head is stored quantized"):
        LLM(str(qdir), device="cpu", num_kv_blocks=64, quantize_lm_head=False)
    # a tensor of the quantized head missing: the error names the layer and the tensor
    from safetensors.torch import load_file, save_file

    f = next(qdir.glob("*.safetensors"))
    tensors = load_file(str(f))
    del tensors["lm_head.qzeros"]
    save_file(tensors, str(f))
    with pytest.raises(ValueError, match=r"lm_head: gptq: .* lacks .*\['qzeros'\]"):
        LLM(str(qdir), device="cpu", num_kv_blocks=64)


def test_quantize_lm_head_of_an_fp8_checkpoint(tiny_model_dir, tmp_path):
    """An fp8 checkpoint keeps its LM head 16-bit (llm-compressor ignores lm_head): with
    ``quantize_lm_head`` that head should be quantized at load with per-channel scales, not
    cast to fp8 as if it held fp8 values (weights of ~0.002 are mostly fp8 subnormals)."""
    from safetensors.torch import load_file, save_file

    from pagebatch.quant.packing import quantize_fp8_per_channel

    folder = tmp_path / "fp8"
    shutil.copytree(tiny_model_dir, folder)
    f = next(folder.glob("*.safetensors"))
    tensors = {}
    for name, t in load_file(str(f)).items():
        if any(f".{p}." in name for p in PROJ):
            q, s = quantize_fp8_per_channel(t)
            tensors[name], tensors[name.replace(".weight", ".weight_scale")] = q, s.float()
        else:
            tensors[name] = (t * 0.01 if name == "lm_head.weight" else t).to(torch.bfloat16)
    save_file(tensors, str(f))
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    (folder / "config.json").write_text(json.dumps(cfg))
    llm = LLM(str(folder), device="cpu", dtype="float32", num_kv_blocks=64, block_size=4,
              quantize_lm_head=True)
    head = llm.engine.core.runner.model.lm_head
    assert isinstance(head, QuantizedLMHead) and head.quant_method.name == "fp8"
    w = tensors["lm_head.weight"].float()
    err = (head.quant_method.dequantized_weight(head) - w).norm() / w.norm()
    assert err < 0.05, err  # e4m3 per channel ~0.03; cast without a scale: ~0.28
