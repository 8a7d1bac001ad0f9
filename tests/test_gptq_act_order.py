"""GPTQ act-order (``desc_act``) checkpoints packed by AutoGPTQ's own code (auto-gptq 0.7.1
``QuantLinear.pack``, loaded as in tests/test_quant_packing.py) load and give the greedy tokens
of transformers running the library's own dequantization of the same tensors in fp32 (its torch
path, ``QuantLinear.forward`` on an identity; near-tie rule, tests/numerics.py).

Layouts: ``shared``, one act-order permutation per layer input (q/k/v share one, gate/up one:
GPTQ's order comes from the Hessian of the input), which keeps the fast path (one ``perm`` per
layer); ``per_shard``, every projection its own permutation (shards calibrated apart, legal in
the format), which loads through the per-shard fallback (``shard_orders``, quant/wna16.py);
``mixed``, some shards of a fused layer sharing a permutation and others not (the fallback too).
Sym and asym grids (v1 format: zero points stored minus one), group sizes 32, 64 and 128 on a
tiny Llama of hidden size 128 (intermediate 256).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import build_tiny_model
from numerics import assert_greedy_match, hf_greedy
from pagebatch import LLM, SamplingParams
from pagebatch.quant.common import rtn_quantize
from tiny import random_prompts

PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FUSED = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gu", "up_proj": "gu"}


@pytest.fixture(scope="module")
def qlinear_ref():
    spec = importlib.util.find_spec("auto_gptq")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("auto-gptq is not installed (pip install --no-deps -r requirements-ref.txt)")
    path = f"{spec.submodule_search_locations[0]}/nn_modules/qlinear/qlinear_cuda.py"
    s = importlib.util.spec_from_file_location("_ref_gptq_qlinear_cuda_act", path)
    mod = importlib.util.module_from_spec(s)
    s.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama-128"), hidden_size=128,
                            intermediate_size=256)


def _reference_pack(qlinear_ref, w: torch.Tensor, g_idx: torch.Tensor, group_size: int,
                    sym: bool):
    """Round-to-nearest per act-order group of ``w`` [out, in], packed by AutoGPTQ's
    ``QuantLinear.pack`` (v1). Returns (checkpoint tensors, the library's dequantized weight
    [out, in] fp32)."""
    out, k = w.shape
    perm = torch.argsort(g_idx, stable=True)
    q, z, s = rtn_quantize(w[:, perm], 4, group_size, sym=sym)
    if not sym:  # v1 cannot store a zero point of 0 (AutoGPTQ's packer spills it)
        z = z.clamp(min=1)
        q = (torch.round(w[:, perm].reshape(out, -1, group_size) / s[..., None])
             + z[..., None]).clamp(0, 15).reshape(out, k).to(torch.int32)
    q = torch.empty_like(q).index_copy_(1, perm, q)
    s = s.half().float()  # the fp16 scales AutoGPTQ's files hold
    ref = qlinear_ref.QuantLinear(4, group_size, k, out, False, weight_dtype=torch.float32)
    lin = torch.nn.Linear(k, out, bias=False)
    g = g_idx.long()
    lin.weight.data = (q.float() - z.float()[:, g]) * s[:, g]
    ref.pack(lin, s, z.clone(), g_idx=g_idx)  # it decrements zeros in place
    with torch.no_grad():
        deq = ref(torch.eye(k)).t().contiguous()  # the library's own unpacking, fp32
    tensors = {"qweight": ref.qweight, "qzeros": ref.qzeros, "scales": ref.scales.half(),
               "g_idx": ref.g_idx.to(torch.int32)}
    return tensors, deq


def _write(base: Path, dst: Path, qlinear_ref, group_size: int, sym: bool, layout: str):
    """``dst/quant`` (the AutoGPTQ checkpoint) and ``dst/deq`` (its dequantized weights)."""
    from safetensors.torch import load_file, save_file

    gen = torch.Generator().manual_seed(group_size + 2 * sym)
    quant, deq, perms = {}, {}, {}
    for name, t in load_file(str(base / "model.safetensors")).items():
        proj = next((p for p in PROJ if f".{p}." in name), None)
        if proj is None:
            quant[name] = deq[name] = t
            continue
        prefix = name.removesuffix(".weight")
        own = layout == "per_shard" or (layout == "mixed" and proj in ("v_proj", "up_proj"))
        key = prefix if own else prefix.rsplit(".", 1)[0] + FUSED.get(proj, proj)
        k = t.shape[1]
        if key not in perms:
            perms[key] = (torch.arange(k, dtype=torch.int32) // group_size)[
                torch.randperm(k, generator=gen)]
        packed, deq[name] = _reference_pack(qlinear_ref, t, perms[key], group_size, sym)
        quant.update({f"{prefix}.{n}": v for n, v in packed.items()})
    config = json.loads((base / "config.json").read_text())
    qcfg = {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": True,
            "sym": sym, "checkpoint_format": "gptq"}
    for sub, weights, cfg in (("quant", quant, dict(config, quantization_config=qcfg)),
                              ("deq", deq, config)):
        folder = dst / sub
        shutil.copytree(base, folder, ignore=shutil.ignore_patterns("*.safetensors"))
        save_file({n: v.contiguous() for n, v in weights.items()},
                  str(folder / "model.safetensors"))
        (folder / "config.json").write_text(json.dumps(cfg))
    return dst / "quant", dst / "deq", deq


@pytest.mark.parametrize("group_size,sym,layout", [
    *((g, sym, layout) for layout in ("shared", "per_shard") for sym in (True, False)
      for g in (32, 64, 128)),
    (64, False, "mixed"),  # q and k share a permutation, v its own (gate one, up another)
])
def test_autogptq_act_order_greedy_equals_reference(base_dir, tmp_path, qlinear_ref,
                                                    group_size, sym, layout):
    from transformers import AutoModelForCausalLM

    qdir, ddir, deq = _write(base_dir, tmp_path, qlinear_ref, group_size, sym, layout)
    llm = LLM(str(qdir), device="cpu", dtype="float32", num_kv_blocks=64, block_size=4)
    model = llm.engine.core.runner.model
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    for fused, names, sub in ((attn.qkv_proj, ("q_proj", "k_proj", "v_proj"), "self_attn"),
                              (mlp.gate_up_proj, ("gate_proj", "up_proj"), "mlp"),
                              (mlp.down_proj, ("down_proj",), "mlp")):
        ref = torch.cat([deq[f"model.layers.0.{sub}.{n}.weight"] for n in names])
        assert torch.equal(fused.quant_method.dequantized_weight(fused), ref)
    gu = mlp.gate_up_proj
    if layout == "shared" and group_size < 128:
        assert gu.perm is not None and gu.shard_orders is None  # the fast path
    if layout == "per_shard" and group_size < 128:
        assert gu.perm is None and [o[:2] for o in gu.shard_orders] == [(0, 256), (256, 256)]
    hf = AutoModelForCausalLM.from_pretrained(ddir, dtype=torch.float32).eval()
    sp = SamplingParams(temperature=0.0, max_tokens=12)
    for p in random_prompts(2, seed=5):
        ref_tokens, gaps = hf_greedy(hf, p, 12)
        got = llm.generate({"prompt_token_ids": p}, sp, use_tqdm=False)[0].outputs[0].token_ids
        assert_greedy_match(ref_tokens, gaps, got, what=f"group {group_size} {layout}")
