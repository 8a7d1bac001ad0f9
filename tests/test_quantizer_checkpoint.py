"""The checkpoint ``pagebatch quantize`` writes (quant/calibrate/writer.py), on the tiny random
Llama: config.json ``quantization_config`` exactly as AutoAWQ / AutoGPTQ write it, the public
tensor layouts, the tokenizer files copied; and the folder loads back in pagebatch with the
greedy tokens of transformers running the dequantized weights (near-tie rule). For int8 (W8A8)
the reference also rounds each linear's input per token, as the int8 method does."""

from __future__ import annotations

import json
import random

import pytest
import torch

from numerics import assert_greedy_match, hf_greedy
from pagebatch import LLM, SamplingParams
from pagebatch.layers.linear import LinearBase
from pagebatch.quant.calibrate import QuantizeSpec, quantize
from pagebatch.quant.packing import dequantize_awq, dequantize_gptq
from tiny import random_prompts

PROJ = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
CASES = {
    "awq": dict(method="awq", group_size=32),
    "awq-no-zero-point": dict(method="awq", group_size=32, sym=True),
    "awq-rtn": dict(method="awq", group_size=-1, rtn=True),
    "gptq-act-order": dict(method="gptq", group_size=32, act_order=True),
    "gptq-asym": dict(method="gptq", group_size=64, sym=False),
    "gptq-8bit": dict(method="gptq", bits=8, group_size=-1),
    "gptq-lm-head": dict(method="gptq", group_size=32, act_order=True, lm_head=True),
    "int8": dict(method="int8"),
}


@pytest.fixture(scope="module")
def calib_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("calib") / "words.txt"
    rng = random.Random(0)  # the tiny tokenizer knows only "w3" .. "w255"
    path.write_text(" ".join(f"w{rng.randint(3, 255)}" for _ in range(3000)))
    return path


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tiny_model_dir, calib_file, tmp_path_factory):
    spec = QuantizeSpec(**CASES[request.param], calib_file=calib_file, num_samples=8,
                        seq_len=64)
    out = quantize(tiny_model_dir, tmp_path_factory.mktemp(request.param) / "q", spec,
                   progress=False)
    return request.param, spec, out


def _qconfig(folder):
    return json.loads((folder / "config.json").read_text())["quantization_config"]


def test_quantization_config_as_the_reference_tools_write_it(case):
    name, spec, out = case
    qc = _qconfig(out)
    if spec.method == "awq":  # AutoAWQ AwqConfig.to_transformers_dict
        assert qc == {"quant_method": "awq", "zero_point": name != "awq-no-zero-point",
                      "group_size": spec.group_size, "bits": 4, "version": "gemm",
                      "modules_to_not_convert": None}
    elif spec.method == "gptq":  # AutoGPTQ BaseQuantizeConfig.to_dict
        assert qc == {"bits": spec.bits, "group_size": spec.group_size, "damp_percent": 0.01,
                      "desc_act": spec.act_order, "static_groups": False,
                      "sym": name != "gptq-asym", "true_sequential": True,
                      "model_name_or_path": str(out), "model_file_base_name": "model",
                      "quant_method": "gptq", "checkpoint_format": "gptq",
                      **({"lm_head": True} if spec.lm_head else {})}  # GPTQModel's key
        assert json.loads((out / "quantize_config.json").read_text()) == qc
    else:
        assert qc == {"quant_method": "int8", "bits": 8, "activation_scheme": "dynamic"}
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["dtype"] == "float16" and cfg["architectures"] == ["LlamaForCausalLM"]


def test_tensors_in_the_public_layouts(case, tiny_model_dir):
    from safetensors.torch import load_file

    name, spec, out = case
    t = load_file(str(out / "model.safetensors"))
    for i in range(2):
        for proj in PROJ:
            p = f"model.layers.{i}.{proj}"
            n_out, n_in = {"mlp.down_proj": (64, 128), "mlp.gate_proj": (128, 64),
                           "mlp.up_proj": (128, 64), "self_attn.k_proj": (32, 64),
                           "self_attn.v_proj": (32, 64)}.get(proj, (64, 64))
            groups = 1 if spec.group_size == -1 else n_in // spec.group_size
            if spec.method == "int8":
                assert t[f"{p}.weight"].dtype == torch.int8
                assert t[f"{p}.weight"].shape == (n_out, n_in)
                assert t[f"{p}.weight_scale"].shape == (n_out,)
                continue
            assert f"{p}.weight" not in t
            assert t[f"{p}.scales"].shape == (groups, n_out)
            assert t[f"{p}.scales"].dtype == torch.float16
            if spec.method == "awq":
                assert t[f"{p}.qweight"].shape == (n_in, n_out // 8)
                assert (f"{p}.qzeros" in t) == (name != "awq-no-zero-point")
            else:
                pf = 32 // spec.bits
                assert t[f"{p}.qweight"].shape == (n_in // pf, n_out)
                assert t[f"{p}.qzeros"].shape == (groups, n_out // pf)
                assert t[f"{p}.g_idx"].shape == (n_in,)
    if spec.lm_head:  # [vocab 256, hidden 64], act-order
        assert "lm_head.weight" not in t and t["lm_head.g_idx"].shape == (64,)
        assert t["lm_head.qweight"].shape == (8, 256) and t["lm_head.scales"].shape == (2, 256)
    assert t["model.embed_tokens.weight"].dtype == torch.float16
    assert t["model.layers.0.input_layernorm.weight"].dtype == torch.float16
    for f in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / f).read_bytes() == (tiny_model_dir / f).read_bytes()


def _dequantized_transformers(src, out, spec):
    """transformers' model of ``src`` holding the checkpoint's weights, dequantized, in fp32."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    t = load_file(str(out / "model.safetensors"))
    qc = _qconfig(out)
    state = {}
    quantized = PROJ + (("lm_head",) if spec.lm_head else ())
    for name in hf.state_dict():
        mod = name.rpartition(".")[0]
        if not name.endswith(".weight") or not any(mod.endswith(p) for p in quantized):
            state[name] = t[name].float()
        elif spec.method == "awq":
            state[name] = dequantize_awq(t[f"{mod}.qweight"], t.get(f"{mod}.qzeros"),
                                         t[f"{mod}.scales"].float(), qc["group_size"])
        elif spec.method == "gptq":
            state[name] = dequantize_gptq(t[f"{mod}.qweight"], t[f"{mod}.qzeros"],
                                          t[f"{mod}.scales"].float(), t[f"{mod}.g_idx"],
                                          qc["bits"], qc["group_size"], qc["checkpoint_format"])
        else:
            state[name] = t[name].float() * t[f"{mod}.weight_scale"][:, None]
            round_inputs_per_token(hf.get_submodule(mod))
    hf.load_state_dict(state)
    return hf


def round_inputs_per_token(linear: torch.nn.Module):
    """Make a transformers linear see its input as W8A8 does: int8 per token (int8.py's
    ``quantize_per_token``), dequantized. Returns the hook handle."""
    from pagebatch.quant.int8 import quantize_per_token

    def hook(module, args):
        q, scale = quantize_per_token(args[0])
        return ((q.float() * scale).to(args[0].dtype),)

    return linear.register_forward_pre_hook(hook)


def test_loads_back_with_the_greedy_tokens_of_the_dequantized_model(case, tiny_model_dir):
    name, spec, out = case
    hf = _dequantized_transformers(tiny_model_dir, out, spec)
    llm = LLM(str(out), device="cpu", dtype="float32", num_kv_blocks=64, block_size=4)
    model = llm.engine.core.runner.model
    assert model.layers[0].self_attn.qkv_proj.quant_method.name == spec.method
    assert isinstance(model.lm_head, LinearBase) == spec.lm_head
    sp = SamplingParams(temperature=0.0, max_tokens=16)
    for p in random_prompts(3, seed=21):
        ref, gaps = hf_greedy(hf, p, 16)
        got = llm.generate({"prompt_token_ids": p}, sp, use_tqdm=False)[0]
        assert_greedy_match(ref, gaps, got.outputs[0].token_ids, what=f"{name} prompt {p}")


@pytest.fixture(scope="module")
def source_logits(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    src = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([t for p in random_prompts(4, seed=5, max_len=40) for t in p])[None]
    with torch.no_grad():
        return ids, src(ids).logits[0]


def test_checkpoint_approximates_the_source_model(case, tiny_model_dir, source_logits):
    """A gross error (a wrong group, zero or layout) shows as a large KL; the scale folding
    itself is checked exactly in test_quantizer.py."""
    from pagebatch.quant.calibrate.quality import compare

    name, spec, out = case
    ids, ref = source_logits
    with torch.no_grad():
        r = compare([ref], [_dequantized_transformers(tiny_model_dir, out, spec)(ids).logits[0]])
    assert r["kl"] < (0.02 if spec.method == "int8" or spec.bits == 8 else 0.6), r
