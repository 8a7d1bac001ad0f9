"""The compare adapter for vLLM: ``pagebatch bench throughput|latency --compare vllm``.

`compare_vllm` (in the bench process) runs `main` as its own process (``python -m
pagebatch.bench.vllm``), so that each engine has the device to itself, when ``vllm`` is
importable. The child builds vLLM's offline ``LLM`` on the same model folder with the same
limits (``max_model_len``, ``max_num_batched_tokens``, ``max_num_seqs``, dtype, load format,
prefix caching, ``gpu_memory_utilization``, tensor parallel size, ``enforce_eager``, seed),
``skip_tokenizer_init=True`` and token-id prompts, and times the identical workload the same
way as pagebatch's side (offline.py): one warm-up run of the whole workload, then
``--num-iters`` timed runs, each on prompts shifted to miss the prefix cache (`shift_ids`);
greedy (or ``--temperature`` / ``--top-p`` / ``--top-k`` with pagebatch's per-prompt seeds),
EOS ignored, no detokenization. Latency: per prompt and iteration, TTFT from a
one-token run and the decode rate from a full run of another shift, (n - 1) / (full - TTFT)
(vLLM's offline API does not stream). It reads a JSON job on stdin and prints one JSON line in
bench_pagebatch's keys (``engine: vllm``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from typing import Any

from ..config import EngineConfig
from ..model_setup import ModelSetup
from .child import print_result, run_adapter
from .workload import bench_sampling, shift_ids


def engine_args(job: dict[str, Any]) -> dict[str, Any]:
    """vLLM ``LLM(**kwargs)`` for a job: pagebatch's resolved limits, vLLM's names."""
    kw = dict(model=job["folder"], skip_tokenizer_init=True, load_format=job["load_format"],
              dtype=job["dtype"], max_model_len=job["max_model_len"],
              max_num_batched_tokens=job["max_num_batched_tokens"],
              max_num_seqs=job["max_num_seqs"], enable_prefix_caching=job["prefix_caching"],
              gpu_memory_utilization=job["gpu_memory_utilization"],
              tensor_parallel_size=job["tensor_parallel_size"],
              enforce_eager=job["enforce_eager"], seed=job["seed"])
    if kw["load_format"] in ("auto", "gguf"):
        kw["load_format"] = "auto"
    return kw


def compare_vllm(args: argparse.Namespace, config: EngineConfig, setup: ModelSetup,
                 prompts: list[list[int]], out_lens: list[int]) -> dict[str, Any] | int:
    """Run the workload (``prompts`` of token ids, ``out_lens`` tokens each) on vLLM's offline
    ``LLM`` over the model of ``setup`` with the limits pagebatch ran with. Returns its result, or
    an exit status: 2 when vllm is not importable, the process's own when it failed (the tail of
    its stderr printed)."""
    if importlib.util.find_spec("vllm") is None:
        print("--compare vllm needs the vllm package importable (on the GPU machine: "
              "docs/gpu.md, ../shared/tools/vllm-gpu)", file=sys.stderr)
        return 2
    dtype = str(setup.dtype).removeprefix("torch.")
    job = {"folder": str(setup.source.folder), "kind": args.bench_kind, "prompts": prompts,
           "out_lens": out_lens, "num_iters": args.num_iters, "dtype": dtype,
           "load_format": config.load_format, "max_model_len": setup.max_model_len,
           "max_num_batched_tokens": setup.max_num_batched_tokens,
           "max_num_seqs": config.max_num_seqs,
           "prefix_caching": bool(config.enable_prefix_caching),
           "gpu_memory_utilization": config.gpu_memory_utilization,
           "tensor_parallel_size": config.tensor_parallel_size,
           "enforce_eager": bool(config.enforce_eager), "seed": config.seed,
           "sampling": bench_sampling(args)}
    return run_adapter("pagebatch.bench.vllm", job)


def main() -> None:
    """The adapter's process: the job from stdin, one JSON result line on stdout."""
    from vllm import LLM, SamplingParams

    job = json.loads(sys.stdin.read())
    t0 = time.perf_counter()
    llm = LLM(**engine_args(job))
    startup = time.perf_counter() - t0
    prompts, out_lens = job["prompts"], job["out_lens"]
    hi = max(max(p, default=0) for p in prompts) + 1

    sampling = job["sampling"]

    def params(n: int, i: int):
        """Prompt i's: greedy, or the bench's sampling with pagebatch's seed for it."""
        if not sampling:
            return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True,
                                  detokenize=False)
        return SamplingParams(temperature=sampling["temperature"], top_p=sampling["top_p"],
                              top_k=sampling["top_k"] or -1, seed=job["seed"] + i,
                              max_tokens=n, ignore_eos=True, detokenize=False)

    def run(batch: list[list[int]], lens: list[int], first: int = 0) -> tuple[float, int]:
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in batch],
                            [params(n, first + i) for i, n in enumerate(lens)],
                            use_tqdm=False)
        return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outs)

    t0 = time.perf_counter()
    warm = shift_ids(prompts, hi - 1, hi)
    if job["kind"] == "throughput":
        run(warm, out_lens)
    else:
        run(warm[:1], out_lens[:1])
    res: dict[str, Any] = {"engine": "vllm", "startup_s": round(startup, 2),
                           "warmup_s": round(time.perf_counter() - t0, 2)}
    if job["kind"] == "throughput":
        times = [run(shift_ids(prompts, i, hi), out_lens) for i in range(job["num_iters"])]
        elapsed = min(t for t, _ in times)
        n_out = times[0][1]
        res.update(elapsed_s=elapsed, output_tokens=n_out, output_tok_s=n_out / elapsed,
                   elapsed_each_s=[round(t, 3) for t, _ in times])
    else:
        ttfts, rates = [], []
        for j, (p, n) in enumerate(zip(prompts, out_lens)):
            for i in range(job["num_iters"]):
                by = 1 + 2 * (j * job["num_iters"] + i)  # two shifts of its own per run
                ttft = run(shift_ids([p], by, hi), [1], j)[0]
                full, got = run(shift_ids([p], by + 1, hi), [n], j)
                ttfts.append(ttft)
                rates.append((got - 1) / (full - ttft))
        res.update(ttft_s=sorted(ttfts)[len(ttfts) // 2],
                   decode_tok_s=sorted(rates)[len(rates) // 2])
    print_result(res)


if __name__ == "__main__":
    main()
