"""Start-up autotuning of launch configs for shapes that no table has, shared by the 16-bit
GEMV (core/layers/dense.py, kernel ``dense_gemv``) and the W4A16 kernels (quant/kernels/wna16.py,
kernel ``wna16``): "a tuned table is a cache of a rule, not the rule" (STYLE.md 18).

`choose` gives the config of (kernel, shape key, rows): the tables first (core/kernels/tuned.py:
``$PAGEBATCH_KERNEL_CONFIG_DIR`` > the user cache > the packaged table); else, where tuning is
allowed (`tuning_allowed`), it times the kernel rule's few candidates for the shape at the row
count's bucket (`row_bucket`: 1, 2, 4, 8, 16), keeps the fastest correct one and writes it to
the user cache (``$PAGEBATCH_CACHE/kernel_configs/v1/<kernel>_<GPU>.json``); else the rule's
best guess. Tuning is never done while a CUDA graph is being captured (the rule's guess is
returned then, and not remembered): the engine's warm-up runs every decode bucket eagerly
before it captures (core/cuda_graphs.py) and the LM head at the same sizes (core/model_runner.py
`_warm_lm_head`), so the configs are settled before capture.

Timing (`measure`): no CUDA graph; per candidate one untimed launch (it compiles), then
``REPS`` launches each after an L2 flush (a write of twice the L2), each timed by a pair of
``torch.cuda.Event``; the median. Each candidate's output is checked against the reference
(relative error < ``TOL``) before and after (which catches split-K counters left non-zero).

Start-up cost: the candidate sets are 2-8 configs per (shape, bucket) (the rule and its
neighbours: core/kernels/gemv_configs.py, quant/kernels/wna16_configs.py); a decoder model has
4 linear shapes + the LM head, and decode uses buckets 1-16, so one model meets ~25 (shape,
bucket) pairs per kernel family: ~100 candidates. Timing one is ~1 ms; compiling a new Triton
variant 0.3-1.5 s (once per distinct config; Triton's disk cache keeps them across processes),
so a cold start spends ~10-40 s, a start with the user cache filled none
(``stats()``: seconds and candidates; ``pagebatch bench`` reports them). The total is capped:
past ``$PAGEBATCH_AUTOTUNE_MAX_S`` seconds (default 120) of tuning in a process the rule's
guess is used. ``PAGEBATCH_AUTOTUNE=0`` turns tuning off (tables, then the rule).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any, Callable

import torch

from . import precompile, tuned

ENV_ENABLE = "PAGEBATCH_AUTOTUNE"  # "0": no tuning
ENV_MAX_S = "PAGEBATCH_AUTOTUNE_MAX_S"
DEFAULT_MAX_S = 120.0
MAX_BUCKET = 16  # row counts tuned at: 1, 2, 4, 8, 16 (decode sizes)
REPS = 10
TOL = 2e-2  # relative error a candidate's output may have against the reference
logger = logging.getLogger(__name__)

Config = dict[str, Any]
# run(cfg) launches a candidate on the bucket's rows and returns its output; ref is the
# reference output (or None: no check)
Bench = tuple[Callable[[Config], torch.Tensor], "torch.Tensor | None"]
Timer = Callable[[Config, Callable[[], Any]], float]
_stats = {"seconds": 0.0, "candidates": 0, "shapes": 0}


def row_bucket(m: int) -> int:
    """The row count a config for ``m`` rows is tuned and stored at: the next power of two
    (1, 2, 4, 8, 16). Raises ValueError for ``m`` outside 1..MAX_BUCKET."""
    if not 1 <= m <= MAX_BUCKET:
        raise ValueError(f"row_bucket: m={m} is outside 1..{MAX_BUCKET}")
    return 1 << (m - 1).bit_length()


def enabled() -> bool:
    return os.environ.get(ENV_ENABLE, "1") != "0"


def _budget_s() -> float:
    try:
        return float(os.environ.get(ENV_MAX_S, DEFAULT_MAX_S))
    except ValueError:
        logger.warning("%s=%r is not a number of seconds: %s s", ENV_MAX_S,
                       os.environ.get(ENV_MAX_S), DEFAULT_MAX_S)
        return DEFAULT_MAX_S


def tuning_allowed(device: torch.device) -> bool:
    """Whether `choose` may time candidates now: a CUDA device, ``PAGEBATCH_AUTOTUNE`` not 0,
    no CUDA-graph capture going on, and this process's tuning time under the budget."""
    return (device.type == "cuda" and enabled() and not torch.cuda.is_current_stream_capturing()
            and _stats["seconds"] < _budget_s())


def stats() -> dict[str, float]:
    """This process's tuning so far: ``seconds`` (wall), ``candidates`` timed, ``shapes``
    ((shape, bucket) pairs tuned)."""
    return dict(_stats)


def choose(kernel: str, device: torch.device, key: str, m: int, directory: Path,
           candidates: Callable[[int], list[Config]], bench: Callable[[int], Bench],
           timer: Timer | None = None) -> Config:
    """The config of ``kernel`` for shape ``key`` at ``m`` rows (1..MAX_BUCKET): a table's
    entry measured within ``m``'s bucket (at ``m`` .. ``row_bucket(m)`` rows); else the
    fastest of ``candidates(bucket)`` (the rule's best guess first, never empty) timed on
    ``bench(bucket)`` and remembered in the user cache; else (no tuning now, or no candidate
    ran) ``candidates(bucket)[0]``, even where a table has an entry at more rows. ``directory``:
    the owner's packaged tables. ``timer(cfg, launch) -> seconds`` (default `measure`)."""
    bucket = row_bucket(m)
    found = tuned.lookup_measured(kernel, device, key, m, directory)
    if found is not None and found[0] <= bucket:
        return found[1]
    # no entry, or only one measured at more rows than the bucket: a config tuned for 16 rows
    # (the tensor-core kernel, or cuBLAS) is not one for a single row (the GEMV), and the
    # start-up warm-up reaches the largest decode bucket first
    cands = candidates(bucket)
    if len(cands) == 1 or not tuning_allowed(device) or precompile.recording():
        return dict(cands[0])
    start = time.perf_counter()
    try:
        run, ref = bench(bucket)
        results = time_candidates(cands, run, ref, timer or measure)
    except torch.cuda.OutOfMemoryError:
        logger.warning("autotune of %s %s at %d rows: out of memory, the rule's config used",
                       kernel, key, bucket)
        results = []
    spent = time.perf_counter() - start
    _stats["seconds"] += spent
    _stats["candidates"] += len(cands)
    _stats["shapes"] += 1
    if not results:
        return dict(cands[0])
    best_s, best = min(results, key=lambda r: r[0])
    logger.info("autotuned %s %s at %d rows: %s (%.1f us; %d candidates, %.2f s)", kernel,
                key, bucket, best, best_s * 1e6, len(cands), spent)
    tuned.remember(kernel, tuned.device_name(device), key, bucket, best)
    return dict(best)


def time_candidates(cands: list[Config], run: Callable[[Config], torch.Tensor],
                    ref: torch.Tensor | None, timer: Timer) -> list[tuple[float, Config]]:
    """[(seconds, cfg)] of the candidates that launch and match ``ref`` before and after their
    timing; the others (an exception, e.g. out of shared memory, or a wrong result) are
    dropped with a debug log."""
    out = []
    for cfg in cands:
        try:
            if not _close(run(cfg), ref):
                logger.debug("autotune: %s gives a wrong result", cfg)
                continue
            seconds = timer(cfg, lambda cfg=cfg: run(cfg))
            if not _close(run(cfg), ref):
                logger.debug("autotune: %s wrong after its timing", cfg)
                continue
        except torch.cuda.OutOfMemoryError:
            raise
        except Exception as e:  # noqa: BLE001 - a candidate that does not launch is skipped
            logger.debug("autotune: %s failed: %s: %s", cfg, type(e).__name__, e)
            continue
        out.append((seconds, cfg))
    return out


def _close(out: torch.Tensor | None, ref: torch.Tensor | None) -> bool:
    if ref is None:
        return True
    if out is None or out.shape != ref.shape:
        return False
    den = ref.float().norm()
    return bool(((out.float() - ref.float()).norm() <= TOL * den) if den > 0 else
                torch.equal(out.float(), ref.float()))


def measure(cfg: Config, launch: Callable[[], Any], reps: int = REPS) -> float:
    """Seconds of one ``launch`` on the current CUDA device: the median of ``reps`` launches,
    each after an L2 flush and timed by CUDA events (no graph: launch gaps count only where
    the GPU outruns the host). ``cfg`` is for the log only."""
    launch()
    flush = _flush_buffer()
    times = []
    for _ in range(reps):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        launch()
        end.record()
        times.append((start, end))
    torch.cuda.synchronize()
    ms = sorted(s.elapsed_time(e) for s, e in times)
    return ms[len(ms) // 2] * 1e-3


def _flush_buffer() -> torch.Tensor:
    """Twice the L2 of the current device in bytes (256 MiB where torch does not say)."""
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    size = 2 * getattr(props, "L2_cache_size", 0) or 256 * 2**20
    return torch.empty(size, dtype=torch.uint8, device="cuda")
