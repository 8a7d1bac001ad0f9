"""Parallel precompilation of the warm-up's Triton variants (core/kernels/precompile.py).

CPU: the recorder keeps one entry per variant and lets through what it cannot record; a
worker's failure is reported, never raised; the worker count's environment variable; nothing
happens without CUDA. GPU (skipped without CUDA): on a cold Triton cache (a new
``TRITON_CACHE_DIR``) an engine start records the warm-up's variants, compiles every one of
them in the worker processes, and the warm-up run after it then compiles nothing new (the workers'
cache entries are the ones the engine's own launches look up); greedy tokens equal those of a
start with precompile off."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from pagebatch.kernels import precompile


def test_recorder_keeps_one_entry_per_variant_and_passes_what_it_cannot_record():
    class Info:  # Triton's JitFunctionInfo: module, name (qualname), jit_function
        def __init__(self, module, name):
            self.module, self.name = module, name

    rec = precompile._Recorder()
    a = json.dumps({"name": "m.k", "constant_vals": [16]})
    b = json.dumps({"name": "m.k", "constant_vals": [32]})
    assert rec(fn=Info("m", "k"), compile={"specialization_data": a}) is True
    assert rec(fn=Info("m", "k"), compile={"specialization_data": a}) is True  # again: skipped
    assert rec(fn=Info("m", "k"), compile={"specialization_data": b}) is True
    assert list(rec.variants) == [a, b]
    # a kernel defined in a function cannot be imported by a worker: compiled where launched
    assert rec(fn=Info("m", "f.<locals>.k"), compile={"specialization_data": a}) is None
    assert rec(fn=Info("m", "k"), compile={}) is None  # a Triton without the data
    assert rec.unrecorded == 2 and len(rec.variants) == 2


def test_a_workers_failure_is_reported_not_raised():
    """The worker processes run and return each job's error text (here: no such module, no
    such kernel; on a CPU machine also no CUDA driver for preload)."""
    compiled, errors = precompile.compile_variants(
        {"{}": ("pagebatch_no_such_module", "k"), '{"x": 1}': ("json", "no_such_kernel")}, 2)
    assert compiled == 0 and len(errors) == 2
    assert any("pagebatch_no_such_module" in e for e in errors)
    assert any("json.no_such_kernel" in e for e in errors)


def _workers_from_a_daemon(queue):
    queue.put(precompile.compile_variants({"{}": ("pagebatch_no_such_module", "k")}, 2))


def test_workers_start_from_a_daemonic_process():
    """The engine core runs in a daemonic multiprocessing process (core_client.MPClient), where
    a multiprocessing pool cannot start: the workers must still run there."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_workers_from_a_daemon, args=(queue,), daemon=True)
    proc.start()
    compiled, errors = queue.get(timeout=120)
    proc.join(30)
    assert compiled == 0 and len(errors) == 1 and "pagebatch_no_such_module" in errors[0]
    assert "worker failed" not in errors[0]  # the job ran in a worker and reported its error


def test_worker_count_from_the_environment(monkeypatch):
    monkeypatch.setenv(precompile.ENV_WORKERS, "3")
    assert precompile.default_workers() == 3
    monkeypatch.setenv(precompile.ENV_WORKERS, "0")
    assert precompile.default_workers() == 0
    monkeypatch.setenv(precompile.ENV_WORKERS, "many")
    assert precompile.default_workers() == 0
    monkeypatch.setenv(precompile.ENV_WORKERS, "auto")
    auto = precompile.default_workers(processes_per_host=1)
    assert 0 <= auto <= precompile.MAX_WORKERS
    monkeypatch.delenv(precompile.ENV_WORKERS)
    assert precompile.default_workers(processes_per_host=1) == auto  # unset: auto
    assert precompile.default_workers(processes_per_host=10**6) == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU path")
def test_nothing_happens_without_cuda():
    ran = []
    assert precompile.in_parallel(lambda: ran.append(1), workers=4) is None
    assert ran == [] and not precompile.recording()


_GPU_RUN = textwrap.dedent("""
    import json, logging, os, sys
    from pagebatch import LLM, SamplingParams
    cache = os.environ["TRITON_CACHE_DIR"]
    seen = {}

    class Snap(logging.Handler):  # the cache's entries when each phase logs its end
        def emit(self, record):
            msg = record.getMessage()
            for tag in ("precompiled", "warmed up"):
                if msg.startswith(tag):
                    seen[tag] = sorted(  # kernels (a cubin), not launcher stubs
                        e for e in (os.listdir(cache) if os.path.isdir(cache) else [])
                        if any(f.endswith(".cubin") for f in os.listdir(os.path.join(cache, e))))
                    seen[tag + " msg"] = msg

    logging.getLogger("pagebatch").addHandler(Snap())
    logging.getLogger("pagebatch").setLevel(logging.INFO)
    llm = LLM(sys.argv[1], device="cuda", dtype="bfloat16", num_kv_blocks=512, block_size=16,
              max_num_batched_tokens=512, max_num_seqs=16, max_model_len=2048)
    prompts = [{"prompt_token_ids": [3 + (i * 7 + j) % 250 for j in range(5 + 37 * i)]}
               for i in range(6)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16,
                                                ignore_eos=True), use_tqdm=False)
    seen["tokens"] = [o.outputs[0].token_ids for o in outs]
    print("RESULT " + json.dumps(seen))
""")


def _gpu_start(folder, cache_dir, workers: str) -> dict:
    env = dict(os.environ, TRITON_CACHE_DIR=str(cache_dir), PAGEBATCH_PRECOMPILE_WORKERS=workers)
    out = subprocess.run([sys.executable, "-c", _GPU_RUN, str(folder)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.skipif(not precompile.supported(), reason="this Triton has no jit_cache_hook")
def test_cold_start_compiles_the_warmup_in_the_pool(tmp_path):
    from conftest import build_tiny_model

    folder = build_tiny_model(tmp_path / "tiny", hidden_size=256, intermediate_size=512,
                              num_attention_heads=8, num_key_value_heads=2,
                              max_position_embeddings=2048)
    on = _gpu_start(folder, tmp_path / "cache-on", "auto")
    assert "precompiled" in on, "the pool did not run"
    done, total = [int(w) for w in on["precompiled msg"].split()[1:4:2]]  # "precompiled D of T"
    assert total > 10 and done == total, on["precompiled msg"]
    new = set(on["warmed up"]) - set(on["precompiled"])
    assert not new, f"the warm-up compiled {len(new)} variants the pool had not"
    off = _gpu_start(folder, tmp_path / "cache-off", "0")
    assert "precompiled" not in off
    assert on["tokens"] == off["tokens"]


def test_a_choice_made_while_recording_is_not_remembered(monkeypatch):
    """The rule dense.py's and wna16.py's per-shape config caches follow."""
    cache = {}
    monkeypatch.setattr(precompile, "_recording", True)
    precompile.remember(cache, "shape", {"kernel": "gemv"})
    assert cache == {}
    monkeypatch.setattr(precompile, "_recording", False)
    precompile.remember(cache, "shape", {"kernel": "gemv"})
    assert cache == {"shape": {"kernel": "gemv"}}
