"""``pagebatch bench serve --client-processes N``: one run's requests sent from N client
processes instead of one event loop, so that the client's own cost does not show up as the
server's latency.

One asyncio process reading 256 SSE streams spends ~80 us per event (httpx, h11, anyio; this
project's 2-core CPU machine, scripts/fake_sse_server.py): ~20 ms per 256-stream step, so near
one step every 30 ms it falls behind, reads several events of a stream at once and reports gaps
of 0 between them (ITL p50 ~0) and the step after as a long one. N processes each read every
N-th request.

Request i goes to process i mod N with its own send time from the run's one arrival schedule
(arrivals.py). Each process builds its HTTP client first; then all wait on one barrier, the
parent sets the start time t0 (``time.monotonic``, one clock for every process on a host) and
each sends its requests at t0 + offset. A run's duration is t0 to the last process's end.
``--max-concurrency`` is not split over processes (serve.py refuses the two together).
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import time
from typing import Any

from .serve_metrics import Result

_START_DELAY_S = 0.05  # from the parent's t0 to the first send: every process is awake by then


def _worker(conn: dict[str, Any], jobs: Any, results: Any, barrier: Any, t0: Any) -> None:
    asyncio.run(_worker_loop(conn, jobs, results, barrier, t0))


async def _worker_loop(conn: dict[str, Any], jobs: Any, results: Any, barrier: Any,
                       t0: Any) -> None:
    import logging

    import httpx

    from .serve_client import one_request, send_on_schedule

    logging.getLogger("httpx").setLevel(logging.WARNING)
    async with httpx.AsyncClient(base_url=conn["base_url"], headers=conn["headers"],
                                 timeout=conn["timeout"],
                                 limits=httpx.Limits(max_connections=conn["connections"],
                                                     max_keepalive_connections=100)) as client:
        while True:
            job = jobs.get()  # blocking: nothing is in flight between two runs
            if job is None:
                return
            endpoint, items = job  # [(index, send offset s, body, prompt length)]
            barrier.wait()  # every process has its job and its client
            barrier.wait()  # the parent has set t0
            done = await send_on_schedule(
                [offset for _, offset, _, _ in items], t0.value,
                lambda k: one_request(client, endpoint, items[k][2], items[k][3]))
            results.put(([idx for idx, *_ in items], done, time.monotonic()))


class ClientProcesses:
    """N client processes (spawned once, kept for every run of a sweep); ``run`` sends one
    run's requests over them. Use as a context manager (``close`` stops them).

    ``conn``: base_url, headers, timeout (s), connections (per process). Raises ValueError for
    n < 2 (one process is serve.py's own loop) and RuntimeError when a process dies."""

    def __init__(self, n: int, conn: dict[str, Any]):
        if n < 2:
            raise ValueError(f"client processes must be >= 2 here, got {n}")
        ctx = mp.get_context("spawn")  # no fork of a process that may hold threads
        self.n = n
        self._barrier = ctx.Barrier(n + 1)
        self._t0 = ctx.Value("d", 0.0)
        self._results = ctx.Queue()
        self._jobs = [ctx.Queue() for _ in range(n)]
        self._procs = [ctx.Process(target=_worker, daemon=True,
                                   args=(conn, q, self._results, self._barrier, self._t0))
                       for q in self._jobs]
        for p in self._procs:
            p.start()

    def run(self, endpoint: str, bodies: list[dict[str, Any]], prompt_lens: list[int],
            offsets: list[float]) -> tuple[list[Result], float]:
        """Send request i (``bodies[i]``, ``prompt_lens[i]``) at ``offsets[i]`` s after one
        common start; (the results in request order, the run's seconds)."""
        for w, q in enumerate(self._jobs):
            q.put((endpoint, [(i, offsets[i], bodies[i], prompt_lens[i])
                              for i in range(w, len(bodies), self.n)]))
        self._barrier.wait(timeout=120)  # the processes' start-up (imports, clients)
        self._t0.value = t0 = time.monotonic() + _START_DELAY_S
        self._barrier.wait(timeout=120)
        out: list[Result | None] = [None] * len(bodies)
        end = t0
        for _ in range(self.n):
            while True:
                try:
                    idxs, done, t_end = self._results.get(timeout=5)
                    break
                except Exception:  # queue.Empty: check that no process died
                    if not all(p.is_alive() for p in self._procs):
                        raise RuntimeError("a bench serve client process died") from None
            for i, r in zip(idxs, done):
                out[i] = r
            end = max(end, t_end)
        return [r for r in out if r is not None], end - t0

    def close(self) -> None:
        for q in self._jobs:
            q.put(None)
        for p in self._procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()

    def __enter__(self) -> "ClientProcesses":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
