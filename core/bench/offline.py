"""pagebatch's side of ``pagebatch bench throughput|latency``: one engine in this process, a
warm-up run, then the timed runs (command.py reads the workload and prints the table).
"""

from __future__ import annotations

import time
from typing import Any

from ..config import EngineConfig
from ..engine_core import EngineCore
from ..kernels import autotune
from .workload import shift_ids


def weight_bytes(model) -> int:
    """Bytes of the model's weights: parameters and persistent buffers (quantized weights,
    scales), each storage once (tied embeddings); not derived caches such as the rotary
    cos/sin table (a non-persistent buffer)."""
    seen, total = set(), 0
    for t in [*model.parameters(), *model.state_dict().values()]:
        if t is None or t.untyped_storage().data_ptr() in seen:
            continue
        seen.add(t.untyped_storage().data_ptr())
        total += t.untyped_storage().nbytes()
    return total


def sampling_params_of(config: EngineConfig, out_lens: list[int],
                       sampling: dict[str, Any] | None):
    """Prompt index -> its `SamplingParams`: ``out_lens[i]`` tokens, EOS ignored; greedy for
    ``sampling`` None, else those fields with seed ``config.seed + i`` (every run draws the same
    tokens)."""
    from ..request import SamplingParams

    if sampling:
        return {i: SamplingParams(**sampling, seed=config.seed + i, max_tokens=n,
                                  ignore_eos=True) for i, n in enumerate(out_lens)}
    params = {n: SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
              for n in set(out_lens)}
    return {i: params[n] for i, n in enumerate(out_lens)}


def run_workload(engine, kind: str, batch: list[list[int]],
                 sp_of: dict, on_step=None) -> tuple[float, float, int]:
    """Submit ``batch`` (token ids; prompt i with ``sp_of[i]``) to ``engine`` (an `LLMEngine`)
    and step until it is done. Returns (elapsed seconds, seconds to the first output or 0.0,
    output tokens). ``kind`` ``"throughput"`` asks for final outputs only. ``on_step()``: called
    after every step (O(1) host work: e.g. a peak KV usage reading)."""
    ttft = None
    start = time.perf_counter()
    for i, p in enumerate(batch):
        core_req, state = engine.prepare({"prompt_token_ids": p}, sp_of[i])
        if kind == "throughput":  # latency's TTFT needs the first output
            state.want_final_only()
        engine.submit(core_req, state)
    n_out = 0
    while engine.has_unfinished_requests:
        outs = engine.step()
        if on_step is not None:
            on_step()
        if ttft is None and outs:
            ttft = time.perf_counter() - start
        n_out += sum(len(o.outputs[0].token_ids) for o in outs if o.finished)
    return time.perf_counter() - start, ttft or 0.0, n_out


def bench_pagebatch(config: EngineConfig, kind: str, prompts: list[list[int]],
                    out_lens: list[int], num_iters: int,
                    sampling: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run ``prompts`` (token ids; ``out_lens[i]`` tokens each, EOS ignored) on a new
    `LLMEngine`: a warm-up, then ``num_iters`` timed runs, each on prompts shifted to miss the
    prefix cache. ``kind``: ``"throughput"`` (all at once) or ``"latency"`` (one at a time).
    ``sampling``: `SamplingParams` fields (temperature, top_p, top_k; None: greedy); prompt i
    then gets seed ``config.seed + i``.

    Returns ``engine``, ``startup_s``, ``warmup_s``, ``autotune_s`` (seconds; the kernel
    autotuning inside them), ``autotune_candidates``, ``weights_gb`` and
    ``kv_cache_tokens``, ``kv_blocks`` (usable), ``kv_peak_blocks`` (the most blocks held
    after any step: a sliding window returns blocks behind it), ``kv_peak_gib`` (those
    blocks' bytes: a hybrid model's block holds one layer group, core/kv_hybrid.py) and
    ``num_preemptions``
    (in-process core only); throughput adds ``elapsed_s`` (the fastest
    run), ``elapsed_each_s``, ``output_tokens``, ``output_tok_s``; latency adds ``ttft_s`` and
    ``decode_tok_s`` (medians over prompts x iterations). The engine is shut down after."""
    from ..engine import LLMEngine

    t0 = time.perf_counter()
    engine = LLMEngine(config)
    startup = time.perf_counter() - t0
    sp_of = sampling_params_of(config, out_lens, sampling)
    kv = engine.core.kv_cache if isinstance(engine.core, EngineCore) else None
    peak = [0]

    def track() -> None:
        peak[0] = max(peak[0], kv.num_blocks - kv.num_free_blocks)

    def run(batch: list[list[int]]) -> tuple[float, float, int]:
        return run_workload(engine, kind, batch, sp_of, track if kv is not None else None)

    # every run's prompts have their ids shifted by a run-own amount (mod the largest id + 1,
    # so inside the vocabulary): no run may hit the prefix cache that the ones before it left
    hi = max(max(p, default=0) for p in prompts) + 1

    def shifted(ps: list[list[int]], by: int) -> list[list[int]]:
        return shift_ids(ps, by, hi)

    # warm-up (shift -1): throughput runs the whole workload once, latency one request. Triton
    # compiles (or loads from its cache) the kernel variants a workload meets on first use; a
    # quarter of the workload left 1-3 s of that in the first timed run on an H200 (session 7:
    # 8.7 s then 5.8, 5.8 s for the nano-vllm workload). The time is reported as warmup_s.
    t0 = time.perf_counter()
    warm = shifted(prompts, hi - 1)
    run(warm if kind == "throughput" else warm[:1])
    res: dict[str, Any] = {"engine": "pagebatch", "startup_s": round(startup, 2),
                           "warmup_s": round(time.perf_counter() - t0, 2)}
    tuning = autotune.stats()  # this process's start-up autotuning (core/kernels/autotune.py)
    res.update(autotune_s=round(tuning["seconds"], 2), autotune_candidates=tuning["candidates"])
    if isinstance(engine.core, EngineCore):  # in this process (no client): its runner
        runner = engine.core.runner  # (no local may hold the model past the shutdown below)
        res["weights_gb"] = round(weight_bytes(runner.model) / 1e9, 3)
        res["kv_cache_tokens"] = runner.num_blocks * runner.block_size
        res["kv_blocks"] = kv.num_blocks
        del runner
    if kind == "throughput":
        times = [run(shifted(prompts, i)) for i in range(num_iters)]
        elapsed = min(t[0] for t in times)
        n_out = times[0][2]
        res.update(elapsed_s=elapsed, output_tokens=n_out, output_tok_s=n_out / elapsed,
                   elapsed_each_s=[round(t[0], 3) for t in times])
    else:
        # each iteration a prompt of its own: TTFT without prefix-cache hits
        runs = [run(shifted([p], 1 + i)) for p in prompts for i in range(num_iters)]
        ttft = sorted(r[1] for r in runs)[len(runs) // 2]
        decode = sorted((r[2] - 1) / (r[0] - r[1]) for r in runs)[len(runs) // 2]
        res.update(ttft_s=ttft, decode_tok_s=decode)
    if kv is not None:
        res.update(kv_peak_blocks=peak[0],
                   kv_peak_gib=peak[0] * engine.core.runner.kv_bytes_per_block / 2**30,
                   num_preemptions=engine.core.scheduler.stats.num_preemptions)
    engine.shutdown()  # give the device back before --compare runs the other engine
    engine = None
    _free_device_memory()
    return res


def _free_device_memory() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
