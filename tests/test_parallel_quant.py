"""Tensor parallel with quantized checkpoints (CPU, gloo): the tiny model written as an AutoAWQ
and as an AutoGPTQ act-order (desc_act, shuffled g_idx) checkpoint gives the same greedy tokens
with tensor_parallel_size=2 as with one rank (near-tie rule). Each rank cuts the packed qweight,
qzeros, scales and g_idx of its column- or row-parallel slice (group size 32: the row-parallel
o_proj and down_proj slices hold one and two groups); the GPTQ checkpoint also with GPTQModel's
``lm_head: true`` (the quantized LM head column-parallel over the vocabulary)."""

from __future__ import annotations

import pytest
import torch

from numerics import assert_greedy_match, top2_gaps
from pagebatch.engine_core import EngineCore, EngineCoreRequest
from pagebatch.layers.vocab import QuantizedLMHead
from pagebatch.request import SamplingParams
from procs import one_thread_children
from test_quant_e2e import _quantize_folder
from tiny import engine_config, random_prompts

KEYS = dict(device="cpu", dtype="float32", num_kv_blocks=64, block_size=4, max_model_len=128)
MAX_TOKENS = 10


def _greedy(core: EngineCore, prompts: list[list[int]]) -> dict[str, list[int]]:
    for i, p in enumerate(prompts):
        core.add_request(EngineCoreRequest(f"q{i}", p, SamplingParams(
            temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True), frozenset({2}), seed=i))
    out: dict[str, list[int]] = {f"q{i}": [] for i in range(len(prompts))}
    while core.has_unfinished_requests:
        for o in core.step():
            out[o.request_id] += o.new_token_ids
    return out


@pytest.mark.parametrize("method,lm_head", [("awq", False), ("gptq", False), ("gptq", True)])
def test_quantized_tp2_equals_tp1(tiny_model_dir, tmp_path, method, lm_head):
    """``lm_head``: GPTQModel's ``lm_head: true`` (the head column-parallel over the vocabulary,
    each rank cutting its columns of qweight, qzeros and scales)."""
    folder, _ = _quantize_folder(tiny_model_dir, tmp_path, method, lm_head)
    prompts = random_prompts(6, seed=11, max_len=30)
    ref_core = EngineCore.from_config(engine_config(folder, KEYS))
    ref = _greedy(ref_core, prompts)
    gaps = {f"q{i}": top2_gaps(ref_core.runner.forward_scratch(p + ref[f"q{i}"])[len(p) - 1:-1])
            for i, p in enumerate(prompts)}
    ref_core.shutdown()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with one_thread_children():
            core = EngineCore.from_config(engine_config(folder, KEYS, tensor_parallel_size=2))
        try:
            qkv = core.runner.model.layers[0].self_attn.qkv_proj
            assert qkv.quant_method.name == method and qkv.tp_size == 2
            head = core.runner.model.lm_head
            assert isinstance(head, QuantizedLMHead) == lm_head
            if lm_head:
                assert head.tp_size == 2 and head.output_size == head.full_output_sizes[0] // 2
            o_proj = core.runner.model.layers[0].self_attn.o_proj
            if method == "gptq":  # act-order, row-parallel: every group, this rank's channels
                assert o_proj.scales.shape[0] == o_proj.full_input_size // 32
                assert o_proj.perm is not None and o_proj.perm.numel() == o_proj.input_size
            got = _greedy(core, prompts)
        finally:
            core.shutdown()
    finally:
        torch.set_num_threads(threads)
    for rid, toks in ref.items():
        assert_greedy_match(toks, gaps[rid], got[rid], what=f"{method} {rid}")
