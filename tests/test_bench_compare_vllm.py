"""`pagebatch bench --compare vllm` (core/bench/vllm.py) on the CPU, against a stand-in `vllm`
package that records what it is given: the child process builds vLLM's offline `LLM` with
pagebatch's resolved limits and `skip_tokenizer_init`, runs the identical token-id workload
(the same warm-up and per-run shifts), greedy with EOS ignored, and the ratio is printed. The
real vLLM 0.24.0 runs only on the GPU machine (docs/benchmarks.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from pagebatch.bench.workload import shift_ids
from pagebatch.config import EngineConfig
from pagebatch.model_setup import resolve_model_setup
from pagebatch.registry import registry

FAKE_VLLM = textwrap.dedent('''
    """A stand-in for vllm's offline API: records the engine kwargs and every generate call;
    logs to stdout as vLLM does, after the result line too (at exit)."""
    import atexit, json, os, time

    print("INFO vllm: initializing an engine")
    atexit.register(print, "INFO vllm: shutting down")

    class SamplingParams:
        def __init__(self, **kw):
            self.kw = kw

    class _Out:
        def __init__(self, n):
            self.token_ids = list(range(n))

    class _Req:
        def __init__(self, n):
            self.outputs = [_Out(n)]

    class LLM:
        def __init__(self, **kw):
            self.log = os.environ["FAKE_VLLM_LOG"]
            self._write({"init": kw})

        def _write(self, rec):
            with open(self.log, "a") as f:
                f.write(json.dumps(rec) + "\\n")

        def generate(self, prompts, params, use_tqdm=True):
            self._write({"prompts": [p["prompt_token_ids"] for p in prompts],
                         "params": [p.kw for p in params]})
            time.sleep(0.01 * max(p.kw["max_tokens"] for p in params))  # a token takes 10 ms
            return [_Req(p.kw["max_tokens"]) for p in params]
''')


def _bench(tiny_model_dir, tmp_path, *extra, fake=True):
    env = dict(os.environ, FAKE_VLLM_LOG=str(tmp_path / "vllm.jsonl"))
    if fake:
        (tmp_path / "fake" / "vllm").mkdir(parents=True)
        (tmp_path / "fake" / "vllm" / "__init__.py").write_text(FAKE_VLLM)
        env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "fake"), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "pagebatch.cli", "bench", *extra, str(tiny_model_dir),
           "--device", "cpu", "--num-kv-blocks", "64", "--block-size", "4",
           "--compare", "vllm", "--output", str(tmp_path / "out.json")]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)


def test_throughput_runs_the_same_workload_with_the_same_limits(tiny_model_dir, tmp_path):
    proc = _bench(tiny_model_dir, tmp_path, "throughput", "--num-prompts", "3",
                  "--input-len", "6", "--output-len", "5", "--num-iters", "2",
                  "--max-num-seqs", "7", "--max-model-len", "96")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "pagebatch / vllm:" in proc.stdout
    pb, other = json.loads((tmp_path / "out.json").read_text())["results"]
    assert other["engine"] == "vllm" and other["output_tokens"] == pb["output_tokens"] == 15
    recs = [json.loads(line) for line in (tmp_path / "vllm.jsonl").read_text().splitlines()]
    kw = recs[0]["init"]
    assert kw["skip_tokenizer_init"] is True and kw["model"] == str(tiny_model_dir)
    assert (kw["max_model_len"], kw["max_num_seqs"], kw["dtype"]) == (96, 7, "float32")
    cfg = EngineConfig.from_sources(cli=dict(model=str(tiny_model_dir), device="cpu",
                                             max_model_len=96, max_num_seqs=7))
    want = resolve_model_setup(cfg, registry()).max_num_batched_tokens
    assert kw["max_num_batched_tokens"] == want  # what pagebatch resolved, not vLLM's default
    runs = recs[1:]
    assert len(runs) == 3  # the warm-up and two timed runs
    assert all(p == {"temperature": 0.0, "max_tokens": 5, "ignore_eos": True,
                     "detokenize": False} for r in runs for p in r["params"])
    # pagebatch's shifts: warm-up by hi - 1, timed run i by i (run 0 is the workload itself)
    base = runs[1]["prompts"]
    hi = max(max(p) for p in base) + 1
    assert runs[0]["prompts"] == shift_ids(base, hi - 1, hi)
    assert runs[2]["prompts"] == shift_ids(base, 1, hi) != base


def test_latency_times_a_first_token_and_a_full_run(tiny_model_dir, tmp_path):
    proc = _bench(tiny_model_dir, tmp_path, "latency", "--input-len", "6", "--output-len", "5",
                  "--num-iters", "2", "--gpu-cost-per-hour", "3.6")
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((tmp_path / "out.json").read_text())["results"]
    for r in results:  # --gpu-cost-per-hour: priced at the batch-1 decode rate, each engine
        assert r["gpu_cost_per_hour"] == 3.6
        assert r["cost_per_1m_output_tokens"] == 3.6 / (r["decode_tok_s"] * 3600) * 1e6
        assert f"{r['engine']}: ${r['cost_per_1m_output_tokens']:.4f} per 1M output tokens" \
            in proc.stdout
    other = results[1]
    # the stand-in takes 10 ms a token: TTFT about 10 ms, about 100 tokens per second after it
    assert 0.009 < other["ttft_s"] < 0.5 and 50 < other["decode_tok_s"] < 150
    recs = [json.loads(line) for line in (tmp_path / "vllm.jsonl").read_text().splitlines()]
    lens = [r["params"][0]["max_tokens"] for r in recs[1:]]
    assert lens == [5, 1, 5, 1, 5]  # warm-up, then a one-token and a full run per iteration


def test_without_vllm_the_comparison_is_refused(tiny_model_dir, tmp_path):
    import importlib.util

    import pytest

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed here: the comparison runs for real")
    proc = _bench(tiny_model_dir, tmp_path, "throughput", "--num-prompts", "1", fake=False)
    assert proc.returncode == 2 and "needs the vllm package" in proc.stderr


def test_sampled_runs_give_both_engines_the_same_parameters_and_seeds(tiny_model_dir, tmp_path):
    proc = _bench(tiny_model_dir, tmp_path, "throughput", "--num-prompts", "3",
                  "--input-len", "6", "--output-len", "4", "--temperature", "0.8",
                  "--top-p", "0.95", "--top-k", "50", "--seed", "11")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "sampled: temperature 0.8, top_p 0.95, top_k 50" in proc.stdout
    pb, other = json.loads((tmp_path / "out.json").read_text())["results"]
    assert pb["output_tokens"] == other["output_tokens"] == 12
    recs = [json.loads(line) for line in (tmp_path / "vllm.jsonl").read_text().splitlines()]
    for run in recs[1:]:
        assert [p["seed"] for p in run["params"]] == [11, 12, 13]  # pagebatch's: seed + index
        assert all((p["temperature"], p["top_p"], p["top_k"]) == (0.8, 0.95, 50)
                   for p in run["params"])


def test_hf_refuses_a_sampled_comparison_and_bad_values_are_refused(tiny_model_dir):
    from pagebatch.cli import main

    base = ["bench", "throughput", str(tiny_model_dir), "--device", "cpu", "--num-prompts", "1",
            "--input-len", "4", "--output-len", "2"]
    assert main(base + ["--temperature", "0.5", "--compare", "hf"]) == 2
    assert main(base + ["--temperature", "-1"]) == 2  # SamplingParams' own check, by name
