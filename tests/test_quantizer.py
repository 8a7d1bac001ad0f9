"""The quantizer's algorithms (quant/calibrate/): on a synthetic linear layer with a few salient
input channels, calibrated AWQ and GPTQ (with and without act-order) clearly beat round to
nearest on output error; AWQ's scale folding leaves a decoder layer's function unchanged; the
grid, the options and the ``pagebatch quantize`` command."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from pagebatch.errors import ConfigError
from pagebatch.quant.calibrate import QuantizeSpec
from pagebatch.quant.calibrate.awq import clip, fold_scale, search_clip, search_scale
from pagebatch.quant.calibrate.gptq import GPTQ
from pagebatch.quant.calibrate.rtn import QuantGrid, find_params

N_IN, N_OUT, TOKENS = 256, 128, 2048
SALIENT = 8  # input channels with 20x the activation magnitude
MARGIN = 0.8  # calibrated output MSE must be at most 80% of RTN's


@pytest.fixture(scope="module")
def layer():
    """(x [TOKENS, N_IN], w [N_OUT, N_IN]): correlated activations, a few salient channels."""
    g = torch.Generator().manual_seed(0)
    mix = torch.randn(N_IN, N_IN, generator=g) / N_IN ** 0.5
    x = torch.randn(TOKENS, N_IN, generator=g) @ (torch.eye(N_IN) + mix)
    x[:, torch.randperm(N_IN, generator=g)[:SALIENT]] *= 20
    w = torch.randn(N_OUT, N_IN, generator=g) * 0.05
    return x, w


def _mse(x, w, wq) -> float:
    return (x @ wq.T - x @ w.T).pow(2).mean().item()


GRIDS = [QuantGrid(4, 64, sym=False), QuantGrid(4, 64, sym=True), QuantGrid(4, -1, sym=True),
         QuantGrid(4, 32, sym=False, min_zero=1), QuantGrid(8, 128, sym=True)]


@pytest.mark.parametrize("grid", GRIDS, ids=str)
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_beats_rtn(layer, grid, act_order):
    x, w = layer
    solver = GPTQ(N_IN)
    for chunk in x.split(512):  # the running mean over batches
        solver.add_batch(chunk)
    qw = solver.quantize(w, grid, act_order=act_order)
    assert qw.intweight.min() >= 0 and qw.intweight.max() < 2 ** grid.bits
    assert qw.zeros.min() >= grid.min_zero
    rtn = _mse(x, w, grid.fake(w))
    assert _mse(x, w, qw.dequantize()) < MARGIN * rtn
    if act_order:  # g_idx: each group holds group_size columns, in diag(H) order
        gs = N_IN if grid.group_size == -1 else grid.group_size
        assert torch.bincount(qw.g_idx.long()).tolist() == [gs] * (N_IN // gs)
        first = torch.argsort(torch.diag(solver.H), descending=True, stable=True)[:gs]
        assert (qw.g_idx[first] == 0).all()
    else:
        assert qw.g_idx is None


@pytest.mark.parametrize("grid", GRIDS[:3], ids=str)
def test_awq_beats_rtn(layer, grid):
    x, w = layer
    fwd = lambda ws: F.linear(x, w if ws is None else ws[0])
    s = search_scale(x, [w], fwd, grid)
    assert s[torch.argsort(x.abs().mean(0))[-SALIENT:]].min() > s.median()  # salient scaled up
    ws = w * s  # Q(W s) (x / s): the 1/s goes to the op before
    rtn = _mse(x, w, grid.fake(w))
    assert _mse(x, w, grid.fake(ws) / s) < MARGIN * rtn
    clipped = clip(ws, search_clip(ws, x / s, grid))
    assert _mse(x, w, grid.fake(clipped) / s) <= _mse(x, w, grid.fake(ws) / s) * 1.01


def test_grid_conventions():
    w = torch.tensor([[-1.0, 0.5, 2.0, 3.0], [0.0, 1.0, 2.0, 3.0]])
    scale, zero = find_params(w, 4, sym=True)
    assert zero.tolist() == [8, 8] and torch.allclose(scale, torch.tensor([0.4, 0.4]))
    assert QuantGrid(4, -1, sym=True).fake(w)[1, -1] > 2.7  # 2.8, not 7/15 of 3
    scale, zero = find_params(w, 4, sym=False)  # range widened to include 0
    assert torch.allclose(scale, torch.tensor([4 / 15, 3 / 15])) and zero.tolist() == [4, 0]
    scale, zero = find_params(w, 4, sym=False, min_zero=1)  # AutoGPTQ v1 cannot store 0
    assert zero.tolist() == [4, 1] and torch.allclose(scale[1], torch.tensor(3 / 14))
    q = QuantGrid(4, 2, sym=False).quantize(w)
    assert q.scales.shape == (2, 2) and torch.allclose(q.dequantize(), w, atol=0.1)
    assert torch.equal(QuantGrid(4, 2).fake(w), q.dequantize())


def test_fold_scale_keeps_the_layer_function(tiny_model_dir):
    """AWQ's s / (1/s) folding into the RMSNorm and the previous linear is exact in fp32."""
    from transformers import AutoModelForCausalLM

    from pagebatch.quant.calibrate import decoder
    from pagebatch.quant.calibrate.runner import layer0_inputs

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    x, kwargs = layer0_inputs(model, torch.randint(3, 250, (2, 8)))
    layer = model.model.layers[0]
    before = decoder.run(layer, x, kwargs)
    g = torch.Generator().manual_seed(1)
    for group in decoder.LLAMA.awq_groups:
        lins = [decoder.linear(layer, n) for n in group.linears]
        prev = layer.get_submodule(group.prev_op)
        if isinstance(prev, torch.nn.Linear) and prev.out_features != lins[0].in_features:
            continue  # v -> o under GQA (tiny: 2 kv heads of 4)
        fold_scale(prev, lins, torch.rand(lins[0].in_features, generator=g) + 0.5)
    torch.testing.assert_close(decoder.run(layer, x, kwargs), before, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kwargs,field", [
    (dict(method="awq", bits=8), "--bits 8"), (dict(method="gptq", bits=3), "--bits 3"),
    (dict(method="awq", act_order=True), "--act-order"),
    (dict(method="gptq", act_order=True, rtn=True), "--rtn"),
    (dict(method="gptq", group_size=0), "--group-size 0"), (dict(method="nf4"), "'nf4'"),
    (dict(method="awq", lm_head=True), "--lm-head with --method awq")])
def test_bad_options_name_the_option(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        QuantizeSpec(**kwargs).validate()


def test_spec_defaults():
    assert QuantizeSpec("awq").grid() == QuantGrid(4, 128, sym=False)  # AutoAWQ: zero points
    assert QuantizeSpec("gptq").grid() == QuantGrid(4, 128, sym=True)  # AutoGPTQ: sym
    assert QuantizeSpec("gptq", sym=False).grid().min_zero == 1


def test_calibration_windows():
    from pagebatch.quant.calibrate.runner import calibration_ids, default_calibration_text

    text = default_calibration_text()
    assert len(text) > 8000 and "photosynthesis" in text.lower()
    tok = lambda s, add_special_tokens: {"input_ids": [len(w) for w in s.split()]}  # a stand-in
    ids = calibration_ids(tok, text, num_samples=5, seq_len=64, seed=3)
    assert ids.shape == (5, 64)
    assert torch.equal(ids, calibration_ids(tok, text, 5, 64, seed=3))
    with pytest.raises(ConfigError, match="fewer than --seq-len"):
        calibration_ids(tok, "too short", 1, 64)


def _tiny_calib(path) -> str:
    rng = random.Random(0)
    path.write_text(" ".join(f"w{rng.randint(3, 255)}" for _ in range(2000)))
    return str(path)


def test_cli_quantize_writes_a_folder(tiny_model_dir, tmp_path, capsys):
    from pagebatch.cli import main

    out = tmp_path / "q"
    rc = main(["quantize", str(tiny_model_dir), str(out), "--method", "gptq", "--group-size",
               "32", "--act-order", "--calib-file", _tiny_calib(tmp_path / "c.txt"),
               "--num-samples", "4", "--seq-len", "32"])
    assert rc == 0 and capsys.readouterr().out.strip() == str(out)
    assert {"config.json", "quantize_config.json", "model.safetensors",
            "tokenizer.json"} <= {p.name for p in out.iterdir()}
    rc = main(["quantize", str(tiny_model_dir), str(tmp_path / "bad"), "--method", "awq",
               "--group-size", "48"])
    assert rc == 2 and "--group-size 48 does not divide" in capsys.readouterr().err


def test_lm_head_vocab_must_pack(tmp_path):
    """--lm-head on a vocabulary that GPTQ's qzeros cannot pack (not a multiple of 8 at 4 bits):
    a ConfigError before any layer is quantized, not a packing error after all of them."""
    from conftest import build_tiny_model
    from pagebatch.quant.calibrate import quantize

    folder = build_tiny_model(tmp_path / "v252", vocab_size=252)
    with pytest.raises(ConfigError, match="--lm-head: the LM head's 252 outputs"):
        quantize(folder, tmp_path / "q", QuantizeSpec("gptq", group_size=32, rtn=True,
                                                      lm_head=True), progress=False)
    assert not (tmp_path / "q").exists()


@pytest.fixture(scope="module")
def autogptq_gptq():
    """AutoGPTQ's own auto_gptq/quantization/gptq.py (and its quantizer.py), loaded from the
    installed files under stand-in packages so that auto_gptq/__init__.py (CUDA extensions)
    never runs."""
    import importlib.util
    import sys
    import types

    spec = importlib.util.find_spec("auto_gptq")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("auto-gptq is not installed (pip install --no-deps -r requirements-ref.txt)")
    root = spec.submodule_search_locations[0]
    saved = {k: v for k, v in sys.modules.items() if k.startswith("auto_gptq")}
    for name, path in (("auto_gptq", root), ("auto_gptq.quantization", f"{root}/quantization")):
        m = types.ModuleType(name)
        m.__path__ = [path]
        sys.modules[name] = m
    try:
        s = importlib.util.spec_from_file_location("auto_gptq.quantization.gptq",
                                                   f"{root}/quantization/gptq.py")
        mod = importlib.util.module_from_spec(s)
        s.loader.exec_module(mod)
    finally:
        for k in [k for k in sys.modules if k.startswith("auto_gptq")]:
            del sys.modules[k]
        sys.modules.update(saved)
    return mod


@pytest.mark.parametrize("group_size,sym,act_order", [
    (128, True, False), (128, False, True), (-1, True, True), (-1, False, False)])
def test_gptq_equals_autogptq(layer, autogptq_gptq, monkeypatch, group_size, sym, act_order):
    """Same weights as AutoGPTQ's ``fasterquant`` where the two agree by construction: groups
    that start a 128-column block (AutoGPTQ takes a later group's grid from not yet updated
    columns; here from the updated ones)."""
    x, w = layer
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)  # fasterquant calls it
    lin = torch.nn.Linear(N_IN, N_OUT, bias=False)
    lin.weight.data = w.clone()
    ref = autogptq_gptq.GPTQ(lin)
    ref.quantizer.configure(4, perchannel=True, sym=sym, mse=False)
    ref.add_batch(x.unsqueeze(0), None)
    scale, zero, g_idx = ref.fasterquant(blocksize=128, percdamp=0.01, group_size=group_size,
                                         actorder=act_order)
    ours = GPTQ(N_IN)
    ours.add_batch(x)
    qw = ours.quantize(w, QuantGrid(4, group_size, sym), act_order=act_order)
    same = torch.isclose(qw.dequantize(), lin.weight.data, atol=1e-5).float().mean().item()
    assert same > 0.995  # float summation order may flip a rounding tie or two
    torch.testing.assert_close(qw.scales, scale, atol=1e-6, rtol=1e-4)
    if act_order:
        assert torch.equal(qw.g_idx, g_idx)
