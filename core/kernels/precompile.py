"""Parallel compilation of the Triton kernel variants a piece of code launches: the start-up
warm-up's (core/step_warmup.py) otherwise compiles one variant after another on a cold cache.

`in_parallel(run)` runs ``run()`` twice over, in effect:

1. **Record.** ``run()`` with Triton's ``knobs.runtime.jit_cache_hook`` set. Triton calls that
   hook before it compiles a variant missing from a kernel's in-memory cache, with the
   variant's *specialization data* (Triton's own JSON of signature, constexprs, attributes,
   options and target: what ``JITFunction.preload`` takes). The hook keeps it and returns True,
   which tells Triton to skip the compile and that launch. Triton kernels therefore do not run
   in this pass (their outputs hold garbage; the torch ops around them run on it), and the
   kernel autotuner answers with the rule's guess, which its callers do not remember
   (`recording`).
2. **Compile.** Worker subprocesses (`compile_variants`), each importing the kernel's module
   and calling ``preload`` with the recorded data: Triton compiles the variant into its disk cache
   (``TRITON_CACHE_DIR``, default ``~/.triton/cache``). Then ``run()`` again, by the caller,
   normally: each variant now loads from the disk cache instead of compiling.

A variant that cannot be recorded or compiled this way (a kernel defined inside a function, a
constexpr Triton cannot serialize, a worker's error) is simply compiled on its first launch,
as without this module; nothing here changes what runs, only when the compiles happen.
Requires a CUDA device and Triton's hook and preload (Triton >= 3.4; checked on 3.6 and 3.9).
``PAGEBATCH_PRECOMPILE_WORKERS``: processes; ``auto`` (the default): up to 8, one core left
free per engine process on the host; 0 or 1: off, every variant compiles where it is first
launched. Measured on the H200 (session 14, cold Triton cache, the 1B shape): 49 of 49
variants precompiled by 8 processes in 18.0 s, start-up 27.7 s instead of 79.7 s serially;
tests/test_precompile.py's GPU test (tokens equal with it off, nothing left to compile) passed.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

logger = logging.getLogger(__name__)

ENV_WORKERS = "PAGEBATCH_PRECOMPILE_WORKERS"
MAX_WORKERS = 8
_recording = False


def recording() -> bool:
    """True while `in_parallel` records: Triton launches are skipped, so a timing or an
    output seen now means nothing and no choice made from one may be remembered."""
    return _recording


def remember(cache: dict, key: Any, value: Any) -> None:
    """``cache[key] = value`` for a per-shape launch choice, except in a record pass (the
    choice rests on skipped launches: the next real call chooses again)."""
    if not _recording:
        cache[key] = value


def default_workers(processes_per_host: int = 1) -> int:
    """``$PAGEBATCH_PRECOMPILE_WORKERS``: a number of processes; ``auto``: up to MAX_WORKERS
    of this host's cores left after one each for ``processes_per_host`` engine processes;
    unset: ``auto``."""
    env = os.environ.get(ENV_WORKERS, "auto")
    if env != "auto":
        try:
            return max(int(env), 0)
        except ValueError:
            logger.warning("%s=%r is not a number of processes: precompile off", ENV_WORKERS,
                           env)
            return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
        os.cpu_count() or 1)
    return max(min(MAX_WORKERS, cores // max(processes_per_host, 1) - 1), 0)


def supported() -> bool:
    """Whether this Triton has the hook and ``JITFunction.preload`` that recording needs."""
    try:
        import triton
        from triton.runtime.jit import JITFunction
    except ImportError:
        return False
    knobs = getattr(triton, "knobs", None)
    return (knobs is not None and hasattr(knobs.runtime, "jit_cache_hook")
            and hasattr(JITFunction, "preload"))


class _Recorder:
    """The jit_cache_hook of the record pass: one (module, qualname, specialization data)
    per distinct variant, in first-launch order."""

    def __init__(self) -> None:
        self.variants: dict[str, tuple[str, str]] = {}  # data -> (module, qualname)
        self.unrecorded = 0

    def __call__(self, **kw: Any) -> bool | None:
        fn, data = kw.get("fn"), (kw.get("compile") or {}).get("specialization_data")
        module, name = getattr(fn, "module", None), getattr(fn, "name", None)
        if not (data and module and name) or "<locals>" in name:
            self.unrecorded += 1
            return None  # compiled now, as without the hook
        self.variants.setdefault(data, (module, name))
        return True  # skip this compile and launch


def record(run: Callable[[], Any]) -> _Recorder:
    """Run ``run()`` with Triton's compiles and the launches that need them skipped,
    recording each variant; returns the recorder (``variants``). An exception from ``run``
    ends the pass early (what was recorded so far is kept), logged at debug level: the
    record pass computes on garbage and is allowed to trip over it."""
    import triton

    global _recording
    rec = _Recorder()
    previous = triton.knobs.runtime.jit_cache_hook
    triton.knobs.runtime.jit_cache_hook = rec
    _recording = True
    try:
        run()
    except Exception as e:  # noqa: BLE001 (see the docstring)
        logger.debug("precompile: the record pass stopped early: %r", e)
    finally:
        _recording = False
        triton.knobs.runtime.jit_cache_hook = previous
    return rec


def _compile_one(module: str, qualname: str, data: str) -> str | None:
    """In a worker: compile one recorded variant into Triton's disk cache; None, or the
    error's text."""
    import importlib

    try:
        from triton.runtime.jit import JITFunction

        obj: Any = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
        while not isinstance(obj, JITFunction) and hasattr(obj, "fn"):  # autotuner, heuristics
            obj = obj.fn
        obj.preload(data)
        return None
    except Exception as e:  # noqa: BLE001 (the variant then compiles at its first launch)
        return f"{module}.{qualname}: {e!r}"


RESULT_TAG = "pagebatch-precompile-errors: "
WORKER_TIMEOUT_S = 900.0


def compile_variants(variants: dict[str, tuple[str, str]], workers: int) -> tuple[int, list[str]]:
    """Compile ``variants`` (`_Recorder.variants`) in ``workers`` worker processes; returns
    (the number compiled, the errors' texts).

    The workers are plain subprocesses (``python -m pagebatch.kernels.precompile``, jobs as
    JSON on stdin), not a multiprocessing pool: the engine core usually runs in a daemonic
    multiprocessing process, which may not start multiprocessing children. Each worker takes
    every ``workers``-th job; one that fails or runs past WORKER_TIMEOUT_S reports all its
    jobs as errors (they then compile at their first launch)."""
    jobs = [[m, q, d] for d, (m, q) in variants.items()]
    n = max(min(workers, len(jobs)), 1)
    slices = [jobs[i::n] for i in range(n)]
    env = dict(os.environ,  # the kernels' modules import as here (multiprocessing's spawn does so)
               PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    procs = [subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for _ in slices]

    def finish(proc: subprocess.Popen, part: list) -> list[str]:
        try:
            out, err = proc.communicate(json.dumps(part), timeout=WORKER_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            return [f"{m}.{q}: the worker ran past {WORKER_TIMEOUT_S:.0f} s"
                    for m, q, _ in part]
        lines = [ln for ln in out.splitlines() if ln.startswith(RESULT_TAG)]
        if proc.returncode != 0 or not lines:
            why = (err.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
            return [f"{m}.{q}: the worker failed ({why})" for m, q, _ in part]
        return json.loads(lines[-1][len(RESULT_TAG):])

    with ThreadPoolExecutor(len(procs)) as waiters:
        results = list(waiters.map(finish, procs, slices))
    errors = [e for part in results for e in part]
    return len(jobs) - len(errors), errors


def _worker_main() -> None:
    """A worker (`compile_variants`): JSON ``[[module, qualname, data], ...]`` on stdin, one
    RESULT_TAG line with the JSON list of error texts on stdout."""
    jobs = json.load(sys.stdin)
    errors = [e for e in (_compile_one(*job) for job in jobs) if e is not None]
    print(RESULT_TAG + json.dumps(errors), flush=True)


def in_parallel(run: Callable[[], Any], workers: int | None = None) -> dict[str, Any] | None:
    """Record the Triton variants ``run()`` would compile and compile them in ``workers``
    processes (default `default_workers`); the caller then runs its code normally. Returns
    {"variants", "compiled", "errors", "seconds"}, or None where this is off or unsupported
    (fewer than 2 workers, no CUDA, an older Triton)."""
    import torch

    workers = default_workers() if workers is None else workers
    if workers < 2 or not torch.cuda.is_available() or not supported():
        return None
    start = time.perf_counter()
    rec = record(run)
    if not rec.variants:
        return {"variants": 0, "compiled": 0, "errors": [], "seconds": 0.0}
    try:
        compiled, errors = compile_variants(rec.variants, workers)
    except Exception as e:  # noqa: BLE001 (workers that cannot start: compiles stay serial)
        logger.warning("precompile: the workers failed (%r); kernels compile on first use",
                       e)
        return None
    for err in errors[:3]:
        logger.debug("precompile: %s", err)
    seconds = time.perf_counter() - start
    logger.info("precompiled %d of %d Triton kernel variants in %d processes in %.1f s "
                "(%d launches left to compile where they run)", compiled, len(rec.variants),
                workers, seconds, rec.unrecorded)
    return {"variants": len(rec.variants), "compiled": compiled, "errors": errors,
            "seconds": seconds}


if __name__ == "__main__":
    _worker_main()
