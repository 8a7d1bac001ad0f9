"""CUDA graphs of the model's forward for decode-only steps.

At start the forward is captured once per bucketed batch size (1, 2, 4, 8, then every 16 up to
max_num_seqs), largest first, all graphs sharing one memory pool. A decode-only step of B
requests replays the graph of the smallest bucket >= B, its inputs padded (`InputBatch` writes
them straight into the graph's static input buffer with one host-to-device copy). Padding
requests have one query token at position 0, a slot mapping of -1 (nothing is written to the
KV cache) and a context of one token; their outputs are ignored.

This is the approach of vLLM's CUDA-graph runner (decode graphs over bucketed batch sizes, a
shared pool); only attention backends that launch a fixed grid from tensor metadata
(``AttentionBackend.supports_cuda_graphs``) can be captured.
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import Callable

import torch

from .attention import AttentionMetadata
from .step_layout import PAD_SLOT, StepLayout

logger = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture, ascending: 1, 2, 4, 8, 16, 32, 48, ... and max_num_seqs."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs]
    sizes += list(range(16, max_num_seqs, 16))
    return sorted(set(sizes + [max_num_seqs]))


def bucket_for(num_reqs: int, sizes: list[int]) -> int | None:
    """The smallest captured size >= num_reqs, or None past the largest."""
    i = bisect.bisect_left(sizes, num_reqs)
    return sizes[i] if i < len(sizes) else None


class CUDAGraphs:
    """Captured decode graphs. ``forward(ids, positions, meta) -> hidden [T, hidden]`` is the
    model call; ``device_buf`` is the int32 device buffer the step inputs are copied into."""

    def __init__(self, forward: Callable[..., torch.Tensor], device_buf: torch.Tensor,
                 max_num_seqs: int, max_blocks: int, max_model_len: int, num_kv_groups: int = 1):
        self.sizes = capture_sizes(max_num_seqs)
        self.max_blocks = max_blocks
        self.num_kv_groups = num_kv_groups  # a hybrid model's (core/kv_hybrid.py)
        self.max_model_len = max_model_len
        self._forward = forward
        self._buf = device_buf
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.num_replays = 0

    def metadata(self, bs: int) -> tuple[dict[str, torch.Tensor], AttentionMetadata]:
        """Static views and attention metadata of bucket ``bs`` (contexts sized for the worst
        case, so the attention launch covers max_model_len)."""
        layout = StepLayout.for_graph(bs, self.max_blocks, self.num_kv_groups)
        v = layout.views(self._buf)
        meta = AttentionMetadata(
            slot_mapping=v["slot_mapping"], query_start_loc=v["query_start_loc"],
            seq_lens=v["seq_lens"], block_tables=v["block_tables"], max_query_len=1,
            max_seq_len=self.max_model_len, query_start_loc_cpu=list(range(bs + 1)),
            seq_lens_cpu=[self.max_model_len] * bs).with_groups(layout.group_views(v))
        return v, meta

    def _fill_dummy(self, v: dict[str, torch.Tensor], bs: int) -> None:
        v["input_ids"].zero_()
        v["positions"].zero_()
        v["slot_mapping"].fill_(PAD_SLOT)
        v["query_start_loc"].copy_(torch.arange(bs + 1, dtype=torch.int32))
        v["seq_lens"].fill_(1)
        v["block_tables"].zero_()
        for k in range(1, self.num_kv_groups):
            v[f"slot_mapping_{k}"].fill_(PAD_SLOT)
            v[f"block_tables_{k}"].zero_()

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for bs in reversed(self.sizes):
            v, meta = self.metadata(bs)
            self._fill_dummy(v, bs)
            for _ in range(2):  # compile Triton kernels and settle the allocator, uncaptured
                self._forward(v["input_ids"], v["positions"], meta)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                out = self._forward(v["input_ids"], v["positions"], meta)
            self.graphs[bs] = g
            self.outputs[bs] = out
        torch.cuda.synchronize()
        logger.info("captured CUDA graphs for %d batch sizes (1..%d) in %.1f s",
                    len(self.sizes), self.sizes[-1], time.perf_counter() - start)

    def bucket(self, num_reqs: int) -> int | None:
        return bucket_for(num_reqs, self.sizes)

    def replay(self, bs: int) -> torch.Tensor:
        """Run bucket ``bs`` on the inputs already in the device buffer; returns its static
        hidden-state output [bs, hidden] (valid until the next replay)."""
        self.graphs[bs].replay()
        self.num_replays += 1
        return self.outputs[bs]
