"""Helpers of the HTTP frontend tests (tests/test_http_*.py): a real uvicorn server over an
`AsyncEngine` on 127.0.0.1, SSE and /metrics parsing, and an engine core whose steps are slowed
down on purpose, so that "within two engine steps" can be checked by the clock of a busy 2-core
machine.

The slow core is this module's `slow_engine_core`, run as the engine core process's main (it is
pickled by reference: the "spawn" child imports this module, tests/ being on its sys.path).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from functools import partial
from pathlib import Path
from typing import Any, Iterator

from pagebatch.distributed.parallel_state import free_port

KEY = "test-key"
MODEL = "tiny"
ENGINE_KEYS = dict(device="cpu", dtype="float32", num_kv_blocks=96, block_size=4,
                   max_model_len=128, served_model_name=MODEL, api_key=KEY,
                   max_prompts_per_request=8, max_n_per_request=4,
                   max_request_body_bytes=20000)


PROMPT = "w5 w6 w7 w8"
GREEDY = dict(temperature=0.0, max_tokens=8, extra_body={"ignore_eos": True})


@contextlib.contextmanager
def uvicorn_server(app: Any) -> Iterator[str]:
    """Serve ``app`` with uvicorn on a thread at a free port; yields the base URL."""
    import uvicorn

    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert srv.started
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        thread.join(10)


@contextlib.contextmanager
def tiny_server(model_dir: Any, keys: dict[str, Any] | None = None,
                step_s: float = 0.0) -> Iterator[str]:
    """`build_app` on uvicorn over the tiny model in ``model_dir`` with ``keys`` (default
    ENGINE_KEYS), the engine core in its own process (one torch thread; each step slowed by
    ``step_s`` seconds when given, see `slow_core`); yields the base URL."""
    from pagebatch import AsyncEngine, EngineConfig
    from pagebatch.plugins.frontends.http.server import build_app
    from procs import one_thread_children

    config = EngineConfig.from_sources(cli={"model": str(model_dir),
                                            **(ENGINE_KEYS if keys is None else keys)})
    slow = slow_core(step_s) if step_s else contextlib.nullcontext()
    with one_thread_children(), slow:
        engine = AsyncEngine.from_config(config, multiprocess=True)
    try:
        with uvicorn_server(build_app(engine, config)) as base:
            yield base
    finally:
        engine.shutdown()


@contextlib.contextmanager
def keyed_http(url: str, timeout: float = 60) -> Iterator[Any]:
    """An httpx client of the server at ``url`` with the test API key."""
    import httpx

    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=timeout) as c:
        yield c


def keyed_openai(url: str, timeout: float = 60) -> Any:
    """The openai SDK's client of the server at ``url`` with the test API key, no retries."""
    import openai

    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=timeout)


def events(text: str) -> list:
    """The data lines of an SSE body, parsed; the last must be [DONE]."""
    parts = [p for p in text.split("\n\n") if p]
    assert all(p.startswith("data: ") for p in parts), text[:200]
    datas = [p[len("data: "):] for p in parts]
    assert datas[-1] == "[DONE]"
    return [json.loads(d) for d in datas[:-1]]


def metric(http: Any, name: str, labels: str = "", default: float | None = None) -> float:
    """One series of /metrics (``http``: an httpx client on the server); ``default`` for a
    series not there (yet: a labelled counter appears with its first increment)."""
    text = http.get("/metrics").text
    m = re.search(rf"^{re.escape(name)}\{{[^}}]*{re.escape(labels)}[^}}]*\}} (\S+)$", text, re.M)
    if m is None and default is not None:
        return default
    assert m, f"{name} {labels} not in /metrics"
    return float(m.group(1))


# ---- an engine core with slow steps ------------------------------------------------------------

def slow_engine_core(step_s: float, *args: Any, **kwargs: Any) -> None:
    """`run_engine_core` whose every engine step first sleeps ``step_s`` seconds."""
    from pagebatch.core_proc import run_engine_core
    from pagebatch.engine_core import EngineCore

    step = EngineCore.step

    def slow_step(self: EngineCore) -> Any:
        time.sleep(step_s)
        return step(self)

    EngineCore.step = slow_step
    run_engine_core(*args, **kwargs)


@contextlib.contextmanager
def slow_core(step_s: float) -> Iterator[None]:
    """Engine core processes started inside sleep ``step_s`` seconds before each step."""
    from pagebatch import core_client

    original = core_client.run_engine_core
    core_client.run_engine_core = partial(slow_engine_core, step_s)
    try:
        yield
    finally:
        core_client.run_engine_core = original


def serve_main(argv: list[str]) -> int:
    """``python -c 'import http_helpers as h, sys; sys.exit(h.serve_main(sys.argv[1:]))'
    STEP_S serve ...``: `pagebatch` with a slow engine core (the SIGTERM tests)."""
    from pagebatch.cli import main

    with slow_core(float(argv[0])):
        return main(argv[1:])


# ---- `pagebatch serve` as a process ------------------------------------------------------------

def cli_args(keys: dict[str, Any]) -> list[str]:
    """Config keys as command-line flags: ``{"max_model_len": 128}`` -> ``--max-model-len=128``."""
    return [f"--{k.replace('_', '-')}={v}" for k, v in keys.items()]


@contextlib.contextmanager
def serve_process(args: list[str], log_path: Path, step_s: float = 0.0
                  ) -> Iterator[tuple[subprocess.Popen, str]]:
    """``pagebatch --log-level WARNING serve ARGS --port P`` in a session of its own (one torch
    thread per process; engine steps slowed by ``step_s`` seconds, `serve_main`), its stdout
    and stderr, its engine core's included, in ``log_path``. Yields (the process, its base URL)
    once /health answers 200; kills its process group, if still there, at exit."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    tests = str(Path(__file__).resolve().parent)
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")]))}
    main = (["-c", "import sys, http_helpers as h; sys.exit(h.serve_main(sys.argv[1:]))",
             str(step_s)] if step_s else ["-m", "pagebatch.cli"])
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, *main, "--log-level", "WARNING", "serve",
                                 *args, "--port", str(port)], env=env,
                                start_new_session=True, stdout=log, stderr=subprocess.STDOUT)
    try:
        import httpx

        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, Path(log_path).read_text()
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.1)
        yield proc, base
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the server and its engine core, if left
        except ProcessLookupError:
            pass
        proc.wait(10)
