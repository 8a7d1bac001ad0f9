"""The CPU features in the environment of the README's main set-up, which installs no Triton
(`scripts/setup` without ``--test``): tensor + pipeline parallelism over gloo with the fused
all-reduce, every quant method, the quantizer's CLI and the HTTP server, run in a child pytest
that refuses any import of Triton (``PAGEBATCH_TEST_NO_TRITON=1``, tests/conftest.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

TESTS = Path(__file__).parent
SELECTION = [
    "test_parallel.py::test_parallel_greedy_equals_single_rank[tp2-pp2-mb3-fused-ar]",
    "test_quant_e2e.py::test_methods_run_on_dummy_and_16bit_weights",
    "test_quantizer.py::test_cli_quantize_writes_a_folder",
    "test_http_server.py::test_completion_openai_sync",
    "test_http_server.py::test_chat_openai_sync_and_logprobs",
]


def test_cpu_features_run_without_triton():
    if torch.cuda.is_available():
        import pytest

        pytest.skip("the CPU set-up's check (a GPU machine has Triton)")
    env = {**os.environ, "PAGEBATCH_TEST_NO_TRITON": "1"}
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--tb=short",
         *(str(TESTS / s) for s in SELECTION)],
        cwd=TESTS.parent, env=env, capture_output=True, text=True, timeout=600)
    tail = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0, tail
    summary = [line for line in proc.stdout.splitlines() if " passed" in line]
    assert summary and "skipped" not in summary[-1], tail  # each selected test ran
