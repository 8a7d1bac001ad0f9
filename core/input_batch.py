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

from .request import GREEDY_EPS
from .sampling_inputs import SamplingFlags, SamplingLayout, write_sections
from .sampling_state import SamplingState
from .scheduler import PLACEHOLDER_TOKEN, ScheduledRequest, SchedulerOutput
from .step_layout import PAD_SLOT, StepLayout

# int32 elements reserved on the device, past the dense sampling columns, for a step's sparse
# sampling entries (logit bias, min-tokens masks, new prompt masks, prompt log-prob rows); a
# step with more ships them in a second copy (`InputBatch.copy_to`)
SPARSE_RESERVE = 1 << 16

__all__ = ["InputBatch", "PAD_SLOT", "RunnerRequest", "StepInputs", "StepLayout"]


@dataclass
class RunnerRequest:
    """The runner's one record of a request, from its first scheduled step until it finishes.

    row: its row in the input batch while it runs, -1 while preempted. prompt_token_ids: kept
    when its sampling needs them (`SamplingState.needs_prompt`). min_tokens_ids: the sampling
    state's, without ids past the vocabulary. penalty_slot: its row in `PenaltyState` (0 =
    none). next_prompt_logprob: prompt index of the next prompt log-prob to hand out (a
    recompute after preemption does not hand them out twice).
    """

    request_id: str
    sampling: SamplingState
    prompt_token_ids: list[int] | None
    min_tokens_ids: list[int]
    row: int = -1
    penalty_slot: int = 0
    next_prompt_logprob: int = 1


@dataclass
class PromptLogprobsJob:
    """Prompt log-prob rows of one request in this step: flattened rows ``row0 ..
    row0 + len(targets) - 1`` predict prompt tokens ``targets``, the first at prompt index
    ``start``."""

    request_id: str
    row0: int
    start: int
    targets: list[int]
    num: int


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
    num_fresh_penalty_slots: int = 0

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
                 vocab_size: int | None = None):
        self.max_num_seqs = max_num_seqs
        self.max_blocks = max_blocks
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.pin_memory = pin_memory
        n = max_num_seqs
        self.block_table = np.zeros((n, max_blocks), dtype=np.int32)
        self.num_blocks = np.zeros(n, dtype=np.int32)
        # sampling columns, one entry per row
        self.temperature = np.zeros(n, dtype=np.float32)
        self.top_k = np.zeros(n, dtype=np.int64)
        self.top_p = np.ones(n, dtype=np.float32)
        self.min_p = np.zeros(n, dtype=np.float32)
        self.seed = np.zeros(n, dtype=np.int64)
        self.penalty_slot = np.zeros(n, dtype=np.int64)
        self.presence = np.zeros(n, dtype=np.float32)
        self.frequency = np.zeros(n, dtype=np.float32)
        self.repetition = np.ones(n, dtype=np.float32)
        self.has_bias = np.zeros(n, dtype=bool)
        self.min_tokens = np.zeros(n, dtype=np.int64)  # 0 when it masks no id
        self.num_prompt = np.zeros(n, dtype=np.int64)
        self.logprobs = np.full(n, -1, dtype=np.int64)  # -1: none
        self.requests: dict[str, RunnerRequest] = {}
        self.row_req: list[RunnerRequest | None] = [None] * n
        self._free = list(range(n - 1, -1, -1))
        # penalty rows (slot 0 = no penalty): handed out here, tensors in core/penalties.py
        self.num_penalty_slots = 1
        self._penalty_free: list[int] = []
        self._fresh_penalty: list[int] = []
        self._new_prompt_masks: list[tuple[int, list[int]]] = []
        self._num_prompt_logprobs = 0  # records that ask for prompt log-probs
        step = max(StepLayout(max_num_tokens, n, max_blocks).size,
                   StepLayout.for_graph(n, max_blocks).size)
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
            if rec.penalty_slot:
                self._penalty_free.append(rec.penalty_slot)
            if rec.sampling.prompt_logprobs is not None:
                self._num_prompt_logprobs -= 1

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
            mt_ids = [t for t in st.min_tokens_ids
                      if self.vocab_size is None or t < self.vocab_size]
            rec = RunnerRequest(rid, st, list(new.prompt_token_ids) if st.needs_prompt
                                else None, mt_ids)
            self.requests[rid] = rec
            if st.prompt_logprobs is not None:
                self._num_prompt_logprobs += 1
            if st.has_penalties:
                self._assign_penalty_slot(rec)
        self._free_row(rec)  # (a resumed request's row is already free)
        if not self._free:
            raise RuntimeError(f"more than max_num_seqs={self.max_num_seqs} requests hold "
                               f"batch rows")
        row = rec.row = self._free.pop()
        self.row_req[row] = rec
        st = rec.sampling
        self.temperature[row] = st.temperature
        self.top_k[row] = st.top_k
        self.top_p[row] = st.top_p
        self.min_p[row] = st.min_p
        self.seed[row] = st.seed
        self.penalty_slot[row] = rec.penalty_slot
        self.presence[row] = st.presence_penalty
        self.frequency[row] = st.frequency_penalty
        self.repetition[row] = st.repetition_penalty
        self.has_bias[row] = bool(st.logit_bias)
        self.min_tokens[row] = st.min_tokens if rec.min_tokens_ids else 0
        self.num_prompt[row] = st.num_prompt_tokens
        self.logprobs[row] = -1 if st.logprobs is None else st.logprobs
        self.num_blocks[row] = 0
        return row

    def _assign_penalty_slot(self, rec: RunnerRequest) -> None:
        if not self._penalty_free:  # double the rows (slot 0 is never handed out)
            old = self.num_penalty_slots
            self.num_penalty_slots = max(8, 2 * old)
            self._penalty_free.extend(range(self.num_penalty_slots - 1, old - 1, -1))
        rec.penalty_slot = self._penalty_free.pop()
        self._fresh_penalty.append(rec.penalty_slot)
        if rec.sampling.repetition_penalty != 1.0 and rec.prompt_token_ids:
            self._new_prompt_masks.append((rec.penalty_slot, rec.prompt_token_ids))

    def _set_blocks(self, row: int, request_id: str, block_ids: list[int], append: bool) -> None:
        have = int(self.num_blocks[row]) if append else 0
        n = have + len(block_ids)
        if n > self.max_blocks:
            raise ValueError(f"request {request_id!r} has {n} blocks; the block table holds "
                             f"{self.max_blocks} (max_model_len / block_size)")
        self.block_table[row, have:n] = block_ids
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
        sample_rows = []
        for i, sr in enumerate(sched):
            slots[i] = self._row_of(sr)
            qlens[i] = len(sr.token_ids)
            starts[i] = sr.start_pos
            ids.extend(sr.token_ids)
            if sr.sample:
                sample_rows.append(i)
        sample_ids = [sched[i].request_id for i in sample_rows]
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
        logits_rows = qsl[1:][sample_rows] - 1
        sample_positions = positions[logits_rows]
        inp = StepInputs(layout, graph_batch is not None, {}, sample_ids,
                         sample_positions.tolist(), int(qlens.max()), int(seq_lens.max()),
                         qsl.tolist(), seq_lens.tolist())
        sections = self._sampling_sections(inp, sched, slots, sample_rows, sample_positions)
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
        if inp.sampling is not None:
            write_sections({k: v.numpy() for k, v in inp.sampling.views(buf).items()},
                           sections)
        return inp

    def _sampling_sections(self, inp: StepInputs, sched: list[ScheduledRequest],
                           slots: np.ndarray, sample_rows: list[int],
                           sample_positions: np.ndarray) -> dict[str, object]:
        """The step's sampling sections (host values) and flags (set on ``inp``)."""
        out: dict[str, object] = {}
        flags = inp.flags
        if self._fresh_penalty:
            out["fresh_penalty_slots"] = self._fresh_penalty
            inp.num_fresh_penalty_slots = len(self._fresh_penalty)
            self._fresh_penalty = []
        if self._new_prompt_masks:
            vocab = self.vocab_size
            out["pmask_slots"] = [s for s, p in self._new_prompt_masks for _ in p]
            out["pmask_ids"] = [t % vocab if vocab else t
                                for _, p in self._new_prompt_masks for t in p]
            self._new_prompt_masks = []
        self._prompt_logprob_sections(inp, sched, slots, out)
        if not sample_rows:
            return out
        rows = slots[sample_rows]
        pos = sample_positions + 1  # index of the token each row samples
        temps = self.temperature[rows]
        if not (temps < GREEDY_EPS).all():
            flags.all_greedy = False
            top_k, top_p = self.top_k[rows], self.top_p[rows]
            vocab = self.vocab_size
            flags.any_top_k = bool(((top_k > 0) & (top_k < vocab if vocab else True)).any())
            flags.any_top_p = bool((top_p < 1.0).any())
            out.update(seeds=self.seed[rows], top_k=top_k, positions=pos, temperature=temps,
                       top_p=top_p)
            min_p = self.min_p[rows]
            if ((min_p > 0.0) & (temps >= GREEDY_EPS)).any():
                flags.has_min_p = True
                out["min_p"] = min_p
        pen = self.penalty_slot[rows]
        if pen.any():
            rep = self.repetition[rows]
            flags.has_penalties, flags.any_repetition = True, bool((rep != 1.0).any())
            out.update(penalty_slots=pen, presence=self.presence[rows],
                       frequency=self.frequency[rows], repetition=rep)
        lp = self.logprobs[rows]
        lp_rows = np.flatnonzero(lp >= 0)
        if len(lp_rows):
            out["logprob_rows"] = lp_rows
            flags.num_logprobs = int(lp[lp_rows].max())
            inp.logprob_widths = [(inp.sample_ids[i], 1 + int(lp[i])) for i in lp_rows]
        self._sparse_sections(rows, pos, out)
        return out

    def _sparse_sections(self, rows: np.ndarray, pos: np.ndarray, out: dict) -> None:
        """logit_bias entries, and the min-tokens mask of rows still short of min_tokens."""
        b_rows, b_ids, b_vals, m_rows, m_ids = [], [], [], [], []
        for i in np.flatnonzero(self.has_bias[rows]).tolist():
            bias = self.row_req[rows[i]].sampling.logit_bias
            b_rows.extend([i] * len(bias))
            b_ids.extend(bias)
            b_vals.extend(bias.values())
        short = np.flatnonzero(pos - self.num_prompt[rows] < self.min_tokens[rows])
        for i in short.tolist():
            mt = self.row_req[rows[i]].min_tokens_ids
            m_rows.extend([i] * len(mt))
            m_ids.extend(mt)
        if b_rows:
            out.update(bias_rows=b_rows, bias_ids=b_ids, bias_values=b_vals)
        if m_rows:
            out.update(mask_rows=m_rows, mask_ids=m_ids)

    def _prompt_logprob_sections(self, inp: StepInputs, sched: list[ScheduledRequest],
                                 slots: np.ndarray, out: dict) -> None:
        """Prompt log-prob jobs of the rows that ask for them: rows at positions p (<
        num_prompt_tokens - 1) predict prompt token p + 1; each prompt index is handed out once
        (a recompute after preemption skips those already sent)."""
        if not self._num_prompt_logprobs:
            return
        jobs = []
        for i, sr in enumerate(sched):
            rec = self.row_req[slots[i]]
            num = rec.sampling.prompt_logprobs
            if num is None:
                continue
            first = max(sr.start_pos, rec.next_prompt_logprob - 1)
            end = min(sr.start_pos + len(sr.token_ids), rec.sampling.num_prompt_tokens - 1)
            if first >= end:
                continue
            rec.next_prompt_logprob = end + 1
            jobs.append(PromptLogprobsJob(sr.request_id,
                                          inp.query_start_loc[i] + first - sr.start_pos,
                                          first + 1, rec.prompt_token_ids[first + 1:end + 1],
                                          num))
        if jobs:
            inp.prompt_jobs = jobs
            out["plp_rows"] = [j.row0 + k for j in jobs for k in range(len(j.targets))]
            out["plp_targets"] = [t for j in jobs for t in j.targets]

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
