"""Start-up warm-up of the eager step's kernel variants: the model runs once on each of a few
synthetic batches (`warmup_batches`) whose shapes lead the attention backends' launch rules to
every tile / split-KV choice a served step can make, so that Triton compiles (or loads from its
disk cache) those variants before the first request, not in the middle of a stream.

Why: a served engine meets batch shapes that a uniform offline benchmark never does (decodes of
any context beside a new prompt, chunks of any length after any context). Each new constexpr
combination of a Triton kernel (the triton backend's BLOCK_M from the longest query, its
NUM_SPLITS from the batch and context: plugins/attention/triton_backend.py `choose_config`;
the prefill kernel's BLOCK_M) compiles on first use, with every stream stopped meanwhile. On
an H200 (session 12, docs/benchmarks.md) `pagebatch serve` without this warm-up had TTFT p99
7.8 s and ITL p99 341 ms at 8 requests/s (vLLM: 54 ms, 15 ms), improving rate after rate as
the run went on. vLLM likewise runs dummy batches at start-up (its compile and capture sizes).
Decode-only steps are covered by the CUDA-graph capture (core/cuda_graphs.py).

The batches: the query-length buckets (2, 3, 5, 9, ... 257 new tokens: the shortest query of
each BLOCK_M bucket of any GQA group, and past a 128-row tile) as prefills alone and beside a
decode, and after contexts of 256, 256 * 2^k - 1 and max_model_len tokens (every power-of-two
split count of a decode or of a chunk after a long context) in the compositions of
`warmup_batches`. tests/test_step_warmup.py checks that these reach every launch choice of
random mixed batches. Each batch's tokens skip the KV write (slot PAD_SLOT) and read block 0
(the outputs are discarded).
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import torch

from .attention import AttentionMetadata
from .step_layout import PAD_SLOT

logger = logging.getLogger(__name__)

# new tokens of a prefill request: the shortest of each power-of-two bucket of rows (q x group)
QUERY_BUCKETS = (2, 3, 5, 9, 17, 33, 65, 129, 257)  # (and past a 128-row tile)
MANY = 64  # requests of the largest batches
FIRST_SPLIT_CONTEXT = 256  # the triton backend's MIN_TOKENS_PER_SPLIT: a context per split


def warmup_batches(max_model_len: int, max_num_batched_tokens: int,
                   max_num_seqs: int = MANY) -> list[list[tuple[int, int]]]:
    """The synthetic batches, each a list of requests ``(new_tokens, context_len)`` (context
    includes the new tokens), within ``max_model_len``, ``max_num_batched_tokens`` and
    ``max_num_seqs`` requests: for
    each query bucket q, q new tokens alone and beside a decode; then for each context c (256,
    256 * 2^k - 1 and max_model_len) and each q <= c, a chunk of q after context c alone, beside a
    decode of context c, between two such decodes, and before a decode and a 2-token chunk
    (the kernel's KIND of each part differs: triton_backend.py `paged_attention`), and, where
    c > 4q (the chunk takes the paged kernel), with and without a decode, before up to
    MANY - 2 chunks of 2 tokens (programs enough that no split is needed)."""
    queries = [q for q in QUERY_BUCKETS if q + 1 <= max_num_batched_tokens and q <= max_model_len]
    # 256, then the longest context of each power-of-two split count (2^k * 256 - 1), and
    # max_model_len: every split count, each with the longest chunk-free stretch before it
    contexts = sorted({min(FIRST_SPLIT_CONTEXT, max_model_len), max_model_len} | {
        (FIRST_SPLIT_CONTEXT << k) - 1 for k in range(1, 32)
        if (FIRST_SPLIT_CONTEXT << k) - 1 <= max_model_len})
    batches: list[list[tuple[int, int]]] = []
    for q in queries:
        batches += [[(q, q)], [(1, contexts[0]), (q, q)]]
    for c in contexts:
        for q in (q for q in queries if q <= c):
            # alone; the decodes apart (KIND 0); decodes around it (1); a decode among chunks (2)
            batches += [[(q, c)], [(1, c), (q, c)], [(1, c), (q, c), (1, c)],
                        [(q, c), (1, c), (2, c)]]
            many = min(MANY, max_num_seqs) - 2
            many = min(many, (max_num_batched_tokens - q - 1) // 2)
            if c > 4 * q and many > 0:  # enough programs that the paged kernel needs no split
                batches += [[(q, c), (1, c)] + [(2, c)] * many, [(q, c)] + [(2, c)] * many]
    return [b for b in batches if len(b) <= max_num_seqs
            and sum(q for q, _ in b) <= max_num_batched_tokens]


def batch_metadata(reqs: list[tuple[int, int]], block_size: int,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """(input ids [T] int32, positions [T] int32, metadata) of one synthetic batch ``reqs``:
    zero ids and positions, no KV written, every block table entry block 0."""
    qsl = [0]
    for q, _ in reqs:
        qsl.append(qsl[-1] + q)
    lens = [c for _, c in reqs]
    n = qsl[-1]
    width = max(-(-c // block_size) for c in lens)
    meta = AttentionMetadata(
        slot_mapping=torch.full((n,), PAD_SLOT, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        block_tables=torch.zeros((len(reqs), width), dtype=torch.int32, device=device),
        max_query_len=max(q for q, _ in reqs), max_seq_len=max(lens),
        query_start_loc_cpu=qsl, seq_lens_cpu=lens)
    zeros = torch.zeros(n, dtype=torch.int32, device=device)  # as a step's buffer views are
    return zeros, zeros, meta


def decode_batches(sizes: list[int], max_model_len: int) -> list[list[tuple[int, int]]]:
    """Decode-only batches of each CUDA-graph size in ``sizes`` at max_model_len (the contexts
    a graph's launch is chosen for: core/cuda_graphs.py `CUDAGraphs.metadata`)."""
    return [[(1, max_model_len)] * bs for bs in sizes]


@torch.inference_mode()
def warm_up_step_variants(forward: Callable[..., torch.Tensor], block_size: int,
                          max_model_len: int, max_num_batched_tokens: int,
                          device: torch.device, max_num_seqs: int = MANY,
                          graph_sizes: list[int] | None = None,
                          processes_per_host: int = 1) -> None:
    """Run ``forward(ids, positions, metadata)`` (the model over the KV caches) on every batch
    of `warmup_batches`; logs the time taken. On CUDA the Triton variants of those batches and
    of `decode_batches` (``graph_sizes``: the CUDA graphs about to be captured) are first
    compiled in parallel processes (core/kernels/precompile.py), so that the run itself, and
    the capture after it, load them from Triton's disk cache."""
    start = time.perf_counter()
    batches = warmup_batches(max_model_len, max_num_batched_tokens, max_num_seqs)

    def run(which: list[list[tuple[int, int]]]) -> None:
        for reqs in which:
            ids, pos, meta = batch_metadata(reqs, block_size, device)
            forward(ids, pos, meta)

    if device.type == "cuda":
        from .kernels import precompile

        decodes = decode_batches(graph_sizes or [], max_model_len)
        precompile.in_parallel(lambda: run(batches + decodes),
                               precompile.default_workers(processes_per_host))
    run(batches)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    logger.info("warmed up the eager step's kernels on %d batch shapes in %.1f s", len(batches),
                time.perf_counter() - start)
