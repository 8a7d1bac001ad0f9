"""The persistent input batch: per-request state kept across steps, and one step's inputs
packed into a single pinned host buffer so that they reach the device in one copy.

A running request owns a *slot* (a row of ``block_table``) from its first scheduled step until
it finishes or is preempted. Each step appends only the blocks a request gained since the
previous step; positions and the slot mapping are computed with numpy over the whole batch.

Layout of a step's int32 buffer (see `StepLayout`): input ids [T], positions [T], slot mapping
[T], query start locations [B + 1], sequence lengths [B], logits rows [B], placeholder fills
(destination token index [B], source row of the previous step's sampled ids [B]), block tables
[B, W] -- T new tokens, B requests, W block-table columns. A decode-only step run by a CUDA
graph is padded to the graph's batch size, with W the full width (`StepLayout.for_graph`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from .scheduler import PLACEHOLDER_TOKEN, SchedulerOutput

PAD_SLOT = -1  # slot mapping of a padding token: the KV write skips it


@dataclass(frozen=True)
class StepLayout:
    """Offsets (in int32 elements) of one step's inputs in the packed buffer."""

    num_tokens: int
    num_seqs: int
    width: int

    @classmethod
    def for_graph(cls, batch_size: int, max_blocks: int) -> "StepLayout":
        return cls(batch_size, batch_size, max_blocks)

    @property
    def size(self) -> int:
        t, b = self.num_tokens, self.num_seqs
        return 3 * t + (b + 1) + 4 * b + b * self.width

    def views(self, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        """Named views of ``buf`` (host or device, int32) under this layout."""
        t, b, w = self.num_tokens, self.num_seqs, self.width
        sizes = [("input_ids", t), ("positions", t), ("slot_mapping", t),
                 ("query_start_loc", b + 1), ("seq_lens", b), ("logits_rows", b),
                 ("fill_dst", b), ("fill_src", b), ("block_tables", b * w)]
        out, off = {}, 0
        for name, n in sizes:
            out[name] = buf[off:off + n]
            off += n
        out["block_tables"] = out["block_tables"].view(b, w)
        return out


@dataclass
class StepInputs:
    """One step's inputs on the host. Arrays are views into the pinned buffer."""

    layout: StepLayout
    padded: bool  # the CUDA-graph layout
    host: dict[str, np.ndarray]
    sample_ids: list[str]  # requests that sample, in logits-row order
    sample_positions: list[int]  # position of each sampled token
    max_query_len: int
    max_seq_len: int
    query_start_loc: list[int]  # [num_reqs + 1]
    seq_lens: list[int]  # [num_reqs]
    num_fills: int = 0  # placeholder input tokens to take from the previous step's samples

    @property
    def num_reqs(self) -> int:
        """Real requests (the layout's B may include CUDA-graph padding)."""
        return len(self.seq_lens)


class InputBatch:
    """Slots, block tables and the pinned staging buffers of the running requests.

    ``max_num_seqs`` slots of ``max_blocks`` block-table columns each. Raises RuntimeError when
    more than ``max_num_seqs`` requests hold slots at once (the scheduler never schedules more).
    """

    def __init__(self, max_num_seqs: int, max_blocks: int, block_size: int,
                 max_num_tokens: int, pin_memory: bool, num_buffers: int = 2):
        self.max_num_seqs = max_num_seqs
        self.max_blocks = max_blocks
        self.block_size = block_size
        self.block_table = np.zeros((max_num_seqs, max_blocks), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_seqs, dtype=np.int32)
        self.slot_of: dict[str, int] = {}
        self._free = list(range(max_num_seqs - 1, -1, -1))
        cap = max(StepLayout(max_num_tokens, max_num_seqs, max_blocks).size,
                  StepLayout.for_graph(max_num_seqs, max_blocks).size)
        self.capacity = cap
        # several staging buffers, so that a buffer is never refilled while its previous
        # host-to-device copy may still be in flight (the caller waits on `copy_done`)
        self.buffers = [torch.zeros(cap, dtype=torch.int32, pin_memory=pin_memory)
                        for _ in range(num_buffers)]
        self.copy_done: list[object | None] = [None] * num_buffers
        self._next = 0

    # ---- slots --------------------------------------------------------------------------------

    def remove(self, request_ids) -> None:
        """Free the slots of finished or preempted requests (unknown ids are ignored)."""
        for rid in request_ids:
            slot = self.slot_of.pop(rid, None)
            if slot is not None:
                self.num_blocks[slot] = 0
                self._free.append(slot)

    def retire(self, so: SchedulerOutput) -> None:
        """Free the slots of the requests ``so`` reports finished or preempted (also when it
        schedules nothing: a preempted request comes back with a new block table). Idempotent."""
        self.remove(so.finished_request_ids)
        self.remove(so.preempted_request_ids)

    def _update_blocks(self, request_id: str, block_ids: list[int]) -> int:
        slot = self.slot_of.get(request_id)
        if slot is None:
            if not self._free:
                raise RuntimeError(f"more than max_num_seqs={self.max_num_seqs} requests hold "
                                   f"batch slots")
            slot = self._free.pop()
            self.slot_of[request_id] = slot
        have = int(self.num_blocks[slot])
        n = len(block_ids)
        if n > self.max_blocks:
            raise ValueError(f"request {request_id!r} has {n} blocks; the block table holds "
                             f"{self.max_blocks} (max_model_len / block_size)")
        if n > have:
            self.block_table[slot, have:n] = block_ids[have:]
            self.num_blocks[slot] = n
        return slot

    # ---- one step -----------------------------------------------------------------------------

    def prepare(self, so: SchedulerOutput,
                graph_bucket: Callable[[int], int | None] | None = None,
                last_rows: dict[str, int] | None = None) -> StepInputs:
        """Fill the next staging buffer with ``so``'s inputs.

        ``graph_bucket(num_reqs)``: for a decode-only step where every request samples, the
        CUDA-graph batch size to pad to (the graph layout: full-width block tables), or None
        for the compact eager layout. ``last_rows``: request id -> row of the previous step's
        sampled ids, for input tokens given as PLACEHOLDER_TOKEN (raises KeyError for a
        placeholder of a request that did not sample in the previous step).
        """
        self.retire(so)
        sched = so.scheduled
        b = len(sched)
        slots = np.empty(b, dtype=np.int64)
        qlens = np.empty(b, dtype=np.int64)
        starts = np.empty(b, dtype=np.int64)
        ids: list[int] = []
        sample_ids, sample_rows = [], []
        for i, sr in enumerate(sched):
            slots[i] = self._update_blocks(sr.request_id, sr.block_ids)
            qlens[i] = len(sr.token_ids)
            starts[i] = sr.start_pos
            ids.extend(sr.token_ids)
            if sr.sample:
                sample_ids.append(sr.request_id)
                sample_rows.append(i)
        t = len(ids)
        qsl = np.zeros(b + 1, dtype=np.int64)
        np.cumsum(qlens, out=qsl[1:])
        seq_lens = starts + qlens
        # positions: each request's start, then consecutive
        positions = np.repeat(starts - qsl[:-1], qlens) + np.arange(t)
        bs = self.block_size
        rows = np.repeat(slots, qlens)
        slot_mapping = self.block_table[rows, positions // bs] * bs + positions % bs
        graph_batch = None
        if graph_bucket is not None and t == b and len(sample_ids) == b:
            graph_batch = graph_bucket(b)
        if graph_batch is None:
            layout = StepLayout(t, b, int(self.num_blocks[slots].max()))
        else:
            layout = StepLayout.for_graph(graph_batch, self.max_blocks)
        buf = self._next_buffer()
        host = {k: v.numpy() for k, v in layout.views(buf).items()}
        pad_t, pad_b = layout.num_tokens, layout.num_seqs
        host["input_ids"][:t] = ids
        host["positions"][:t] = positions
        host["slot_mapping"][:t] = slot_mapping
        host["query_start_loc"][:b + 1] = qsl
        host["seq_lens"][:b] = seq_lens
        logits_rows = qsl[1:][sample_rows] - 1
        host["logits_rows"][:len(logits_rows)] = logits_rows
        host["block_tables"][:b] = self.block_table[slots, :layout.width]
        fills = np.flatnonzero(host["input_ids"][:t] == PLACEHOLDER_TOKEN)
        if len(fills):
            owners = np.searchsorted(qsl, fills, side="right") - 1
            host["fill_dst"][:len(fills)] = fills
            host["fill_src"][:len(fills)] = [last_rows[sched[i].request_id] for i in owners]
        if pad_b > b:  # CUDA-graph padding: one query token each, nothing written
            host["input_ids"][t:pad_t] = 0
            host["positions"][t:pad_t] = 0
            host["slot_mapping"][t:pad_t] = PAD_SLOT
            host["query_start_loc"][b + 1:] = np.arange(t + 1, pad_t + 1)
            host["seq_lens"][b:] = 1
            host["block_tables"][b:] = 0
        sample_positions = positions[logits_rows].tolist()
        return StepInputs(layout, graph_batch is not None, host, sample_ids,
                          sample_positions, int(qlens.max()), int(seq_lens.max()),
                          qsl.tolist(), seq_lens.tolist(), len(fills))

    def _next_buffer(self) -> torch.Tensor:
        i = self._next
        self._next = (i + 1) % len(self.buffers)
        done = self.copy_done[i]
        if done is not None:
            done.synchronize()  # the copy that last read this buffer has finished
            self.copy_done[i] = None
        self._current = i
        return self.buffers[i]

    def copy_to(self, device_buf: torch.Tensor, layout: StepLayout) -> torch.Tensor:
        """One host-to-device copy of the current buffer's ``layout.size`` elements into
        ``device_buf``; returns the device view (on the CPU, the host buffer itself)."""
        i = self._current
        n = layout.size
        if device_buf.device.type != "cuda":
            return self.buffers[i][:n]  # the host buffer is the input (steps are synchronous)
        dst = device_buf[:n]
        dst.copy_(self.buffers[i][:n], non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        self.copy_done[i] = ev
        return dst
