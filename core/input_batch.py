"""The persistent input batch: the runner's record of each request, the running requests' rows
(block tables and sampling columns) kept across steps, and one step's inputs packed into a
single pinned host buffer so that they reach the device in one copy.

Everything arrives through the `SchedulerOutput` (core/scheduler.py): a request scheduled for
the first time or resumed after preemption brings its `NewRequestData` (prompt, sampling state)
and its whole block table; it gets a *row* (of ``block_table`` and of every sampling column),
written once. A running request brings only the blocks it gained, appended to its row. Finished
ids drop the record and free the row; preempted ids free the row and keep the record (its
penalty row and prompt log-prob progress survive the recompute).

Per step, positions and the slot mapping are computed with numpy over the whole batch, the
sampled rows' columns gathered with numpy; the model inputs (`StepLayout`, core/step_layout.py)
and the sampling inputs (`SamplingLayout`, core/sampling_inputs.py) go into one pinned buffer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from .kv_hybrid import deinterleave
from .runner_request import PromptLogprobsJob, RunnerRequest
from .sampling_columns import SamplingColumns
from .sampling_inputs import SamplingFlags, SamplingLayout, write_sections
from .sampling_state import SamplingState
from .scheduler import PLACEHOLDER_TOKEN, ScheduledRequest, SchedulerOutput
from .step_layout import PAD_SLOT, StepLayout

# int32 elements reserved on the device, past the dense sampling columns, for a step's sparse
# sampling entries (logit bias, min-tokens masks, new prompt masks, prompt log-prob rows); a
# step with more ships them in a second copy (`InputBatch.copy_to`)
SPARSE_RESERVE = 1 << 16

__all__ = ["InputBatch", "PromptLogprobsJob", "RunnerRequest", "StepInputs"]


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
    sampling: SamplingLayout | None = None
    flags: SamplingFlags = field(default_factory=SamplingFlags)
    prompt_jobs: list[PromptLogprobsJob] = field(default_factory=list)
    logprob_widths: list[tuple[str, int]] = field(default_factory=list)  # (id, 1 + N)

    @property
    def num_reqs(self) -> int:
        """Real requests (the layout's B may include CUDA-graph padding)."""
        return len(self.seq_lens)

    @property
    def size(self) -> int:
        """int32 elements of the packed buffer that this step uses."""
        return self.layout.size if self.sampling is None else self.sampling.end


class InputBatch:
    """Records, rows and the pinned staging buffers of the running requests.

    ``max_num_seqs`` rows of ``max_blocks`` block-table columns each; ``vocab_size`` bounds the
    token ids of min-tokens masks (None: unbounded, for tests). Raises RuntimeError when more
    than ``max_num_seqs`` requests hold rows at once (the scheduler never schedules more) or a
    running request arrives that was never new.
    """

    def __init__(self, max_num_seqs: int, max_blocks: int, block_size: int,
                 max_num_tokens: int, pin_memory: bool, num_buffers: int = 2,
                 vocab_size: int | None = None, num_kv_groups: int = 1):
        self.max_num_seqs = max_num_seqs
        self.max_blocks = max_blocks
        self.block_size = block_size
        self.pin_memory = pin_memory
        self.num_kv_groups = g = num_kv_groups
        n = max_num_seqs
        # one table per KV cache group (core/kv_hybrid.py: block ids arrive interleaved)
        self.block_tables = [np.zeros((n, max_blocks), dtype=np.int32) for _ in range(g)]
        self.block_table = self.block_tables[0]
        self.num_blocks = np.zeros(n, dtype=np.int32)
        self.sampling = SamplingColumns(n, vocab_size)
        self.requests: dict[str, RunnerRequest] = {}
        self.row_req: list[RunnerRequest | None] = [None] * n
        self._free = list(range(n - 1, -1, -1))
        step = max(StepLayout(max_num_tokens, n, max_blocks, g).size,
                   StepLayout.for_graph(n, max_blocks, g).size)
        # + the dense sampling columns (5 int64 and 6 fp32 per row) and the sparse reserve
        self.capacity = step + 1 + 16 * n + SPARSE_RESERVE
        # several staging buffers, so that a buffer is never refilled while its previous
        # host-to-device copy may still be in flight (the caller waits on `copy_done`)
        self.buffers = [torch.zeros(self.capacity, dtype=torch.int32, pin_memory=pin_memory)
                        for _ in range(num_buffers)]
        self.copy_done: list[object | None] = [None] * num_buffers
        self._next = 0

    @property
    def slot_of(self) -> dict[str, int]:
        """Request id -> row, of the requests holding a row (for tests and tools)."""
        return {rid: r.row for rid, r in self.requests.items() if r.row >= 0}

    # ---- records and rows ---------------------------------------------------------------------

    def remove(self, request_ids) -> None:
        """Drop the records of finished requests and free their rows (unknown ids: ignored)."""
        for rid in request_ids:
            rec = self.requests.pop(rid, None)
            if rec is None:
                continue
            self._free_row(rec)
            self.sampling.drop_record(rec)

    def preempt(self, request_ids) -> None:
        """Free the rows of preempted requests; their records stay until they finish."""
        for rid in request_ids:
            rec = self.requests.get(rid)
            if rec is not None:
                self._free_row(rec)

    def retire(self, so: SchedulerOutput) -> None:
        """Apply ``so``'s finished, then preempted ids (also when it schedules nothing: a
        preempted request comes back with a new block table). Idempotent."""
        self.remove(so.finished_request_ids)
        self.preempt(so.preempted_request_ids)

    def _free_row(self, rec: RunnerRequest) -> None:
        if rec.row >= 0:
            self.sampling.clear_row(rec.row)
            self.num_blocks[rec.row] = 0
            self.row_req[rec.row] = None
            self._free.append(rec.row)
            rec.row = -1

    def _admit(self, sr: ScheduledRequest) -> int:
        """Take in a new or resumed request: its record (once), a row, its columns."""
        rid, new = sr.request_id, sr.new
        rec = self.requests.get(rid)
        if rec is None:
            st = new.sampling or SamplingState(0.0, 0, 1.0, 0)
            vocab = self.sampling.vocab_size
            mt_ids = [t for t in st.min_tokens_ids if vocab is None or t < vocab]
            rec = RunnerRequest(rid, st, list(new.prompt_token_ids) if st.needs_prompt
                                else None, mt_ids)
            self.requests[rid] = rec
            self.sampling.new_record(rec)
        self._free_row(rec)  # (a resumed request's row is already free)
        if not self._free:
            raise RuntimeError(f"more than max_num_seqs={self.max_num_seqs} requests hold "
                               f"batch rows")
        row = rec.row = self._free.pop()
        self.row_req[row] = rec
        self.sampling.set_row(row, rec)
        return row

    def _set_blocks(self, row: int, request_id: str, block_ids: list[int], append: bool) -> None:
        have = int(self.num_blocks[row]) if append else 0
        g = self.num_kv_groups
        n = have + len(block_ids) // g
        if n > self.max_blocks:
            raise ValueError(f"request {request_id!r} has {n} blocks; the block table holds "
                             f"{self.max_blocks} (max_model_len / block_size)")
        if g == 1:
            self.block_table[row, have:n] = block_ids
        else:
            for table, ids in zip(self.block_tables, deinterleave(block_ids, g)):
                table[row, have:n] = ids
        self.num_blocks[row] = n

    def _row_of(self, sr: ScheduledRequest) -> int:
        if sr.new is not None:
            row = self._admit(sr)
            self._set_blocks(row, sr.request_id, sr.new_block_ids, append=False)
            return row
        rec = self.requests.get(sr.request_id)
        if rec is None or rec.row < 0:
            raise RuntimeError(f"request {sr.request_id!r} is scheduled as running but the "
                               f"runner never took it in as new (or it was preempted)")
        if sr.new_block_ids:
            self._set_blocks(rec.row, sr.request_id, sr.new_block_ids, append=True)
        return rec.row

    # ---- one step -----------------------------------------------------------------------------

    def prepare(self, so: SchedulerOutput,
                graph_bucket: Callable[[int], int | None] | None = None,
                last_rows: dict[str, int] | None = None) -> StepInputs:
        """Apply ``so`` to the records and rows, and fill the next staging buffer with its
        inputs: the model's, then the sampling ones.

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
        sample_rows, sample_ids = [], []
        for i, sr in enumerate(sched):
            slots[i] = self._row_of(sr)
            qlens[i] = len(sr.token_ids)
            starts[i] = sr.start_pos
            ids.extend(sr.token_ids)
            if sr.sample:
                sample_rows.append(i)
                sample_ids.append(sr.request_id)
        t = len(ids)
        qsl = np.zeros(b + 1, dtype=np.int64)
        np.cumsum(qlens, out=qsl[1:])
        seq_lens = starts + qlens
        # positions: each request's start, then consecutive
        positions = np.repeat(starts - qsl[:-1], qlens) + np.arange(t)
        bs = self.block_size
        rows = np.repeat(slots, qlens)
        cols, offsets = positions // bs, positions % bs
        slot_mapping = self.block_table[rows, cols] * bs + offsets
        graph_batch = None
        if graph_bucket is not None and t == b and len(sample_ids) == b:
            graph_batch = graph_bucket(b)
        g = self.num_kv_groups
        if graph_batch is None:
            layout = StepLayout(t, b, int(self.num_blocks[slots].max()), g)
        else:
            layout = StepLayout.for_graph(graph_batch, self.max_blocks, g)
        logits_rows = qsl[1:][sample_rows] - 1
        sample_positions = positions[logits_rows]
        inp = StepInputs(layout, graph_batch is not None, {}, sample_ids,
                         sample_positions.tolist(), int(qlens.max()), int(seq_lens.max()),
                         qsl.tolist(), seq_lens.tolist())
        sections = {} if self.sampling.idle else self.sampling.sections(
            slots[sample_rows], sample_positions + 1, sample_ids, self.row_req, inp.flags,
            inp.logprob_widths)
        if self.sampling.prompt_logprobs_pending:  # only those rows are visited
            inp.prompt_jobs = self.sampling.prompt_logprob_jobs(sched, slots,
                                                                inp.query_start_loc)
            if inp.prompt_jobs:
                sections["plp_rows"] = [j.row0 + k for j in inp.prompt_jobs
                                        for k in range(len(j.targets))]
                sections["plp_targets"] = [t for j in inp.prompt_jobs for t in j.targets]
        counts = {k: len(v) for k, v in sections.items()}
        inp.sampling = SamplingLayout.build(layout.size, counts) if counts else None
        buf = self._next_buffer(inp.size)
        host = {k: v.numpy() for k, v in layout.views(buf).items()}
        inp.host = host
        pad_t, pad_b = layout.num_tokens, layout.num_seqs
        host["input_ids"][:t] = ids
        host["positions"][:t] = positions
        host["slot_mapping"][:t] = slot_mapping
        host["query_start_loc"][:b + 1] = qsl
        host["seq_lens"][:b] = seq_lens
        host["logits_rows"][:len(logits_rows)] = logits_rows
        host["block_tables"][:b] = self.block_table[slots, :layout.width]
        for k in range(1, g):
            table = self.block_tables[k]
            host[f"slot_mapping_{k}"][:t] = table[rows, cols] * bs + offsets
            host[f"block_tables_{k}"][:b] = table[slots, :layout.width]
        fills = np.flatnonzero(host["input_ids"][:t] == PLACEHOLDER_TOKEN)
        if len(fills):
            owners = np.searchsorted(qsl, fills, side="right") - 1
            host["fill_dst"][:len(fills)] = fills
            host["fill_src"][:len(fills)] = [last_rows[sched[i].request_id] for i in owners]
            inp.num_fills = len(fills)
        if pad_b > b:  # CUDA-graph padding: one query token each, nothing written
            host["input_ids"][t:pad_t] = 0
            host["positions"][t:pad_t] = 0
            host["slot_mapping"][t:pad_t] = PAD_SLOT
            host["query_start_loc"][b + 1:] = np.arange(t + 1, pad_t + 1)
            host["seq_lens"][b:] = 1
            host["block_tables"][b:] = 0
            for k in range(1, g):
                host[f"slot_mapping_{k}"][t:pad_t] = PAD_SLOT
                host[f"block_tables_{k}"][b:] = 0
        if inp.sampling is not None:
            write_sections({k: v.numpy() for k, v in inp.sampling.views(buf).items()},
                           sections)
        return inp

    def _next_buffer(self, size: int) -> torch.Tensor:
        i = self._next
        self._next = (i + 1) % len(self.buffers)
        done = self.copy_done[i]
        if done is not None:
            done.synchronize()  # the copy that last read this buffer has finished
            self.copy_done[i] = None
        if self.buffers[i].numel() < size:  # a step with very many sparse sampling entries
            self.buffers[i] = torch.zeros(size, dtype=torch.int32, pin_memory=self.pin_memory)
        self._current = i
        return self.buffers[i]

    def copy_to(self, device_buf: torch.Tensor, inp: StepInputs) -> tuple[torch.Tensor,
                                                                          torch.Tensor]:
        """One host-to-device copy of the current buffer's ``inp.size`` elements into
        ``device_buf``; returns the device buffer of the model inputs and that of the sampling
        inputs (the same one, unless this step's sparse sampling entries overflow
        ``device_buf``: then they go in a second copy). On the CPU both are the host buffer
        itself (steps are synchronous)."""
        i = self._current
        host = self.buffers[i]
        n = inp.size
        if device_buf.device.type != "cuda":
            return host, host
        samp = None
        if n > device_buf.numel():  # the overflow path: the sampling inputs separately
            samp = torch.empty(n, dtype=torch.int32, device=device_buf.device)
            a = inp.sampling.offset
            samp[a:n].copy_(host[a:n], non_blocking=True)
            n = inp.layout.size
        dst = device_buf[:n]
        dst.copy_(host[:n], non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        self.copy_done[i] = ev
        return device_buf, device_buf if samp is None else samp
