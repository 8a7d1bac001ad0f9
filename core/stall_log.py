"""Finding what stalls served streams: slow turns of the engine core's loop and of the front
half, and Triton kernels compiled after start-up.

A stall of the engine core's loop, of the front half's output thread or of its event loop holds
the next token of every running stream at once: one 100 ms stall per second puts a gap of over
100 ms into nearly every request's stream, and a goodput SLO on the inter-token latency (e.g.
`bench serve --goodput itl:50`) fails them all, while the pooled ITL p99 hardly moves.

- ``PAGEBATCH_SLOW_STEP_MS=N`` (off by default): each process logs, at WARNING, what took longer
  than N milliseconds: the engine core a turn of its loop (core/core_proc.py) with its phases
  (messages applied, schedule, forward launched, waiting for the oldest step's result, update,
  outputs sent) and what its steps held (rows, prefill tokens); the front half (core/
  async_engine.py) a turn of its output thread past the wait for the core; the HTTP frontend
  (plugins/frontends/http/server.py) its event loop held past N ms (`watch_event_loop`).
  Timing costs one ``time.perf_counter()`` per phase, only while the variable is set. A slow
  turn also says what else held it: the Python collector's time in the turn (``gc`` with the
  generation, from ``gc.callbacks``), and in the engine core on CUDA the caching allocator's
  events in the turn (`cuda_allocator_counters`: ``cudaMalloc`` / ``cudaFree`` calls and
  retries after a failed malloc, which free the cache and synchronize the device); reading the
  allocator's counters costs one ``torch.cuda.memory_stats`` call per turn (not measured).
- Always: `watch_triton_compiles` (called once start-up's warm-up is done) logs, at WARNING, each
  Triton kernel that compiles (or loads from Triton's disk cache) afterwards, with its time:
  with every stream stopped meanwhile, each one is a stall that start-up's warm-up
  (core/step_warmup.py) should have taken. It hooks ``triton.knobs.runtime.jit_cache_hook`` and
  ``jit_post_compile_hook`` (Triton >= 3.4), which Triton calls only on a cache miss: nothing is
  added to a launch that finds its kernel.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import time
from typing import Any, Callable

logger = logging.getLogger(__name__)

SLOW_STEP_ENV = "PAGEBATCH_SLOW_STEP_MS"


def slow_step_threshold_s(environ: dict[str, str] | None = None) -> float | None:
    """The threshold of ``PAGEBATCH_SLOW_STEP_MS`` in seconds, or None when it is unset or 0.

    Raises ValueError naming the variable when it is not a non-negative number."""
    raw = (os.environ if environ is None else environ).get(SLOW_STEP_ENV, "").strip()
    if not raw:
        return None
    try:
        ms = float(raw)
    except ValueError:
        raise ValueError(f"{SLOW_STEP_ENV}={raw!r}: expected milliseconds (a number >= 0, "
                         f"0 or unset: off)") from None
    if ms < 0 or ms != ms:
        raise ValueError(f"{SLOW_STEP_ENV}={raw!r}: expected milliseconds >= 0 (0: off)")
    return ms / 1e3 if ms > 0 else None


class TurnClock:
    """Phase times of one turn of a loop: ``start()``, then ``mark(name)`` at the end of each
    phase (a phase met twice in a turn adds up), then `slow` / `describe`. Notes (``note``)
    say what the turn held. Times in seconds, from ``time.perf_counter``."""

    enabled = True

    def __init__(self, threshold_s: float, watch_gc: bool = True) -> None:
        self.threshold_s = threshold_s
        self.phases: dict[str, float] = {}
        self.notes: list[str] = []
        self._t0 = self._last = 0.0
        # counters sampled at the start of each turn (e.g. `cuda_allocator_counters`): a slow
        # turn's description names those that moved
        self.counters: Callable[[], dict[str, int]] | None = None
        self._at_start: dict[str, int] = {}
        self.gc_s = 0.0  # the collector's seconds in this turn, and its oldest generation
        self.gc_generation = -1
        self._gc_t0 = 0.0
        if watch_gc:
            gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        else:
            self.gc_s += time.perf_counter() - self._gc_t0
            self.gc_generation = max(self.gc_generation, info.get("generation", 0))

    def close(self) -> None:
        """Stop watching the collector."""
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def start(self) -> None:
        self.phases.clear()
        self.notes.clear()
        self.gc_s, self.gc_generation = 0.0, -1
        if self.counters is not None:
            self._at_start = self.counters()
        self._t0 = self._last = time.perf_counter()

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.phases[name] = self.phases.get(name, 0.0) + now - self._last
        self._last = now

    def note(self, text: str) -> None:
        self.notes.append(text)

    @property
    def elapsed(self) -> float:
        return self._last - self._t0

    @property
    def slow(self) -> bool:
        return self.elapsed > self.threshold_s

    def describe(self) -> str:
        phases = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in self.phases.items())
        notes = list(self.notes)
        if self.gc_generation >= 0:
            notes.append(f"gc {self.gc_s * 1e3:.1f} ms (generation {self.gc_generation})")
        if self.counters is not None:
            now = self.counters()
            moved = [f"{k} +{now[k] - v}" for k, v in self._at_start.items()
                     if now.get(k, v) != v]
            if moved:
                notes.append("allocator " + ", ".join(moved))
        text = "; ".join(notes)
        return f"{self.elapsed * 1e3:.1f} ms ({phases} ms)" + (f"; {text}" if text else "")


def describe_step(so: Any) -> str:
    """What a `SchedulerOutput` holds, for a log line: rows, decode rows, prefill rows and
    their tokens."""
    decodes = prefill_rows = prefill_tokens = 0
    for sr in so.scheduled:
        n = len(sr.token_ids)
        if n == 1 and sr.new is None:
            decodes += 1
        else:
            prefill_rows += 1
            prefill_tokens += n
    return (f"{len(so.scheduled)} rows, {so.num_scheduled_tokens} tokens: {decodes} decodes, "
            f"{prefill_rows} prefill chunks of {prefill_tokens} tokens")


class NullClock:
    """`TurnClock`'s interface doing nothing (the loops' clock while the variable is unset)."""

    enabled = False
    slow = False

    def start(self) -> None:
        pass

    def mark(self, name: str) -> None:
        pass

    def note(self, text: str) -> None:
        pass

    def close(self) -> None:
        pass


CUDA_ALLOCATOR_EVENTS = ("num_device_alloc", "num_device_free", "num_alloc_retries",
                         "num_sync_all_streams", "num_ooms")


def cuda_allocator_counters(device: Any = None) -> Callable[[], dict[str, int]]:
    """A function returning the CUDA caching allocator's event counts on ``device``
    (``torch.cuda.memory_stats``): ``cudaMalloc`` and ``cudaFree`` calls
    (``num_device_alloc`` / ``num_device_free``), mallocs retried after freeing the cache
    (``num_alloc_retries``: each one synchronizes the device) and stream syncs."""
    import torch

    def read() -> dict[str, int]:
        stats = torch.cuda.memory_stats(device)
        return {k: int(stats.get(k, 0)) for k in CUDA_ALLOCATOR_EVENTS}
    return read


def turn_clock() -> TurnClock | NullClock:
    """A `TurnClock` at ``PAGEBATCH_SLOW_STEP_MS``'s threshold, or a `NullClock` when unset."""
    threshold = slow_step_threshold_s()
    return NullClock() if threshold is None else TurnClock(threshold)


_watching: tuple[Any, Any] | None = None  # the hooks installed before ours, while watching


def watch_triton_compiles(where: str) -> bool:
    """From now on log (WARNING) each Triton kernel compiled or loaded in this process, with
    the milliseconds it held the caller; ``where`` names the process in the message. Hooks
    that were installed before are still called. Returns False (and does nothing) without
    Triton's runtime hooks (Triton < 3.4, or no Triton)."""
    global _watching
    try:
        from triton import knobs
    except ImportError:
        return False
    rt = getattr(knobs, "runtime", None)
    if rt is None or not hasattr(rt, "jit_post_compile_hook"):
        return False
    if _watching is not None:
        return True
    before, after = rt.jit_cache_hook, rt.jit_post_compile_hook
    started: dict[Any, float] = {}

    def on_miss(*, key: Any, repr: str, **kw: Any) -> Any:
        started[key] = time.perf_counter()
        return before(key=key, repr=repr, **kw) if before is not None else None

    def on_compiled(*, key: Any, repr: str, fn: Any, **kw: Any) -> Any:
        t0 = started.pop(key, None)
        ms = (time.perf_counter() - t0) * 1e3 if t0 is not None else float("nan")
        name = getattr(fn, "name", None) or repr.split("[", 1)[0]
        logger.warning("%s: Triton compiled or loaded %s after start-up in %.0f ms (every "
                       "stream waited; start-up's warm-up missed this variant): %s",
                       where, name, ms, repr[:400])
        return after(key=key, repr=repr, fn=fn, **kw) if after is not None else None

    rt.jit_cache_hook = on_miss
    rt.jit_post_compile_hook = on_compiled
    _watching = (before, after)
    return True


def stop_watching_triton_compiles() -> None:
    """Put back the hooks `watch_triton_compiles` found (nothing when it is not watching)."""
    global _watching
    if _watching is None:
        return
    from triton import knobs
    knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = _watching
    _watching = None


def watch_event_loop(threshold_s: float, interval_s: float = 0.005,
                     log: Callable[..., None] | None = None) -> asyncio.Task:
    """Start a task on the running event loop that wakes every ``interval_s`` seconds and logs
    (WARNING) each wake-up later than ``threshold_s``: the loop was held by a callback (or by
    another thread holding the GIL) that long. Cancel the task to stop."""
    log = log or logger.warning

    async def watch() -> None:
        loop = asyncio.get_running_loop()
        while True:
            t0 = loop.time()
            await asyncio.sleep(interval_s)
            late = loop.time() - t0 - interval_s
            if late > threshold_s:
                log("the event loop was held %.1f ms past a %.0f ms sleep", late * 1e3,
                    interval_s * 1e3)

    return asyncio.get_running_loop().create_task(watch(), name="pagebatch-loop-watch")
