"""Shared set-up of the Triton kernel test files: on a GPU the kernels run compiled in the test
process; on the CPU each file runs itself once more in a child process under TRITON_INTERPRET=1
(`run_under_interpreter`), and its other tests skip in the parent (`kernels_run_here`, an
autouse fixture the files import); and the paged-cache batches they test on (`make_batch`)."""

from __future__ import annotations

import os
import random
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


def run_under_interpreter(test_file: str, timeout: int = 900, select: str | None = None) -> None:
    """Run ``test_file`` (its tests matching ``-k select``, when given) in a fresh process under
    TRITON_INTERPRET=1; fail with its output."""
    pytest.importorskip("triton")
    if IN_PROCESS:
        pytest.skip("kernels run in this process")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--tb=short",
         *(["-k", select] if select else []), test_file],
        env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-2000:]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in fp64."""
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def make_batch(seed, query_lens, context_lens, hq, hkv, d, block_size, dtype,
               cache_dtype=None, magnitude=None, write=None):
    """A NaN-poisoned paged cache (on DEVICE, ``cache_dtype`` or ``dtype``) holding each
    request's cached prefix at shuffled blocks; returns (cache, metadata, query, new_k, new_v):
    the new K/V still to be written by slot mapping. K/V are N(0, 1) (times ``magnitude``) in
    ``dtype``; ``write(k, v, cache, slot)`` stores the prefix (default: plain assignment)."""
    from pagebatch.attention import AttentionMetadata

    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in context_lens) + 4
    shape = (2, num_blocks, block_size, hkv, d)
    if cache_dtype is None:
        cache = torch.full(shape, float("nan"), dtype=dtype)
    else:
        cache = torch.full(shape, float("nan")).to(cache_dtype)
    free = list(range(num_blocks))
    rng.shuffle(free)
    qs, slots, ks, vs, tables, qsl = [], [], [], [], [], [0]
    for n, length in zip(query_lens, context_lens):
        table = [free.pop() for _ in range(-(-length // block_size))]
        k = torch.randn(length, hkv, d, generator=g)
        v = torch.randn(length, hkv, d, generator=g)
        if magnitude is not None:
            k, v = k * magnitude, v * magnitude
        k, v = k.to(dtype), v.to(dtype)
        pos = torch.arange(length)
        slot = torch.tensor(table)[pos // block_size] * block_size + pos % block_size
        if write is None:
            cache[0].view(-1, hkv, d)[slot[:length - n]] = k[:length - n]
            cache[1].view(-1, hkv, d)[slot[:length - n]] = v[:length - n]
        else:
            write(k[:length - n], v[:length - n], cache, slot[:length - n])
        qs.append(torch.randn(n, hq, d, generator=g).to(dtype))
        slots.append(slot[length - n:])
        ks.append(k[length - n:])
        vs.append(v[length - n:])
        tables.append(table)
        qsl.append(qsl[-1] + n)
    width = max(len(t) for t in tables) + 1  # a padding column past every table
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    dev = DEVICE
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots).to(dev),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
        seq_lens=torch.tensor(context_lens, dtype=torch.int32, device=dev),
        block_tables=bt.to(dev), max_query_len=max(query_lens), max_seq_len=max(context_lens),
        query_start_loc_cpu=qsl, seq_lens_cpu=list(context_lens))
    return (cache.to(dev), meta, torch.cat(qs).to(dev), torch.cat(ks).to(dev),
            torch.cat(vs).to(dev))
