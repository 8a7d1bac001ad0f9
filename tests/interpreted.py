"""Shared set-up of the Triton kernel test files: on a GPU the kernels run compiled in the test
process; on the CPU each file runs itself once more in a child process under TRITON_INTERPRET=1
(`run_under_interpreter`), and its other tests skip in the parent (`kernels_run_here`, an
autouse fixture the files import)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

ON_GPU = torch.cuda.is_available()
IN_PROCESS = ON_GPU or os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
DTYPES = [torch.bfloat16, torch.float16] if ON_GPU else [torch.float16, torch.float32]
# ||out - ref|| / ||ref|| bounds (METHOD.md): P is rounded to the cache dtype before P @ V
REL_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}


@pytest.fixture(autouse=True)
def kernels_run_here(request):
    if not IN_PROCESS and request.node.originalname != "test_kernels_under_interpreter":
        pytest.skip("CPU: runs in the TRITON_INTERPRET=1 child of test_kernels_under_interpreter")
    pytest.importorskip("triton")


def run_under_interpreter(test_file: str, timeout: int = 900) -> None:
    """Run ``test_file`` in a fresh process under TRITON_INTERPRET=1; fail with its output."""
    if IN_PROCESS:
        pytest.skip("kernels run in this process")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--tb=short",
         test_file], env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-2000:]
