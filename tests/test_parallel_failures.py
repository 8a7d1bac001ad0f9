"""Tensor/pipeline-parallel processes on CPU: a killed worker takes the engine to a clean error
(in process: `EngineDeadError`; under `pagebatch serve`: /health 503, the engine-core process
and then the server exit non-zero within 30 s, log lines naming the worker), never a hang; and
two processes on loopback with the torchrun environment (the same command line for both ranks)
stand in for two hosts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import re

import httpx
import pytest

from conftest import build_tiny_model
from http_helpers import ENGINE_KEYS as HTTP_KEYS, KEY, MODEL, cli_args, free_port, \
    serve_process
from pagebatch import LLM, SamplingParams
from pagebatch.engine_core import EngineCore, EngineCoreRequest
from pagebatch.errors import EngineDeadError
from procs import one_thread_children
from tiny import engine_config

KEYS = dict(device="cpu", dtype="float32", num_kv_blocks=64, block_size=4, max_model_len=128)
DEADLINE_S = 30.0


def _spawned_children(pid: int) -> list[int]:
    """Live multiprocessing "spawn" children of ``pid`` (its workers, not its resource
    tracker)."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z" and b"spawn_main" in cmd:
            out.append(int(d))
    return out


def test_killed_worker_in_process_raises_engine_dead(tiny_model_dir):
    with one_thread_children():
        core = EngineCore.from_config(engine_config(tiny_model_dir, KEYS,
                                                    tensor_parallel_size=2))
    try:
        for i in range(3):
            core.add_request(EngineCoreRequest(f"k{i}", [5 + i] * 7, SamplingParams(
                temperature=0.0, max_tokens=50, ignore_eos=True), frozenset({2}), seed=i))
        core.step()
        worker = core.executor.workers[1].proc
        os.kill(worker.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match=r"worker rank 1 died \(pid \d+, killed by "
                                                  r"SIGKILL\)"):
            while time.monotonic() - start < DEADLINE_S:
                core.step()
        assert time.monotonic() - start < DEADLINE_S
        with pytest.raises(EngineDeadError):  # and it stays dead
            core.step()
    finally:
        core.shutdown()  # returns: nothing left waiting on the dead rank


def test_killed_worker_under_the_server(tiny_model_dir, tmp_path):
    """`pagebatch serve` as a process: the engine core (with rank 0) in its own process, one
    worker under it; the worker is killed while the engine is idle. The core process exits
    non-zero (the server's log gives its exit code), then the server, both within 30 s."""
    log = tmp_path / "serve.log"
    with serve_process([str(tiny_model_dir), *cli_args(HTTP_KEYS),
                        "--tensor-parallel-size=2"], log) as (proc, base):
        auth = {"Authorization": f"Bearer {KEY}"}
        r = httpx.post(base + "/v1/completions", headers=auth, timeout=60, json=dict(
            model=MODEL, prompt="w5 w6 w7", max_tokens=4, temperature=0.0))
        assert r.status_code == 200, r.text
        (core,) = _spawned_children(proc.pid)
        (worker,) = _spawned_children(core)
        os.kill(worker, signal.SIGKILL)
        start = time.monotonic()
        while httpx.get(base + "/health").status_code != 503:
            assert time.monotonic() - start < DEADLINE_S, "/health still 200"
            time.sleep(0.2)
        r = httpx.post(base + "/v1/completions", headers=auth, timeout=10,
                       json=dict(model=MODEL, prompt="w5", max_tokens=2))
        assert r.status_code == 503
        assert proc.wait(max(0.0, DEADLINE_S - (time.monotonic() - start))) == 1
    text = log.read_text()
    assert "worker rank 1 died" in text and "SIGKILL" in text, text[-3000:]
    assert re.search(rf"engine core process \(pid {core}\) is gone \(exit code [1-9]", text), \
        text[-3000:]
    assert "pagebatch serve exits with status 1" in text, text[-3000:]


def test_torchrun_environment_two_processes_on_loopback(tmp_path):
    """Rank 0 and rank 1 run the same command (python -m pagebatch.distributed.launch
    generate ...) with MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE, a pipeline stage each, and
    print the single-process text. The model ties its LM head to the embedding, which the last
    stage (without the embedding) must load itself."""
    model = build_tiny_model(tmp_path / "tied", seed=3, tie_word_embeddings=True)
    prompt, n = "w5 w6 w7 w8 w9", 8
    ref = LLM(str(model), **KEYS).generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    cmd = [sys.executable, "-m", "pagebatch.distributed.launch", "--log-level", "WARNING",
           "generate", str(model), "--prompt", prompt, "--max-tokens", str(n),
           "--temperature", "0", "--ignore-eos", "--pipeline-parallel-size", "2",
           "--distributed-timeout", "30"] + [f"--{k.replace('_', '-')}={v}"
                                              for k, v in KEYS.items()]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               WORLD_SIZE="2", OMP_NUM_THREADS="1")
    procs = [subprocess.Popen(cmd, env=dict(env, RANK=str(r)), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    try:
        out0, err0 = procs[0].communicate(timeout=120)
        out1, err1 = procs[1].communicate(timeout=30)  # leaves when rank 0's connection closes
    finally:
        for p in procs:
            p.kill()
    assert procs[0].returncode == 0, err0[-3000:]
    assert procs[1].returncode == 0, err1[-3000:]
    assert out0.strip() == ref[0].outputs[0].text.strip()
    assert out1.strip() == ""  # rank 1 is a worker: it prints nothing
