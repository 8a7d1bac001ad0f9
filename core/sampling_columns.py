"""The input batch's sampling columns: one entry per row for temperature, top-k, top-p, min-p,
seed, penalty row and values, logit-bias presence, min-tokens and log-probs, written once when a
request gets a row, and gathered with numpy for the rows that sample in a step.

`SamplingColumns.sections` turns a step's sampled rows into the host values of its sampling
sections (core/sampling_inputs.py) and the flags that pick the sampler's fast paths; the input
batch writes them into the step's one pinned buffer. Penalty rows (``PenaltyState`` slots, 0 =
none) are handed out here, on the host; the tensors live in core/penalties.py, and the rows given
to new requests and their prompt tokens travel in the step's sections, to be set on the device.
Prompt log-prob jobs (`SamplingColumns.prompt_logprob_jobs`) visit only the records with prompt
log-probs still to hand out, and none once those are sent.
"""

from __future__ import annotations

import numpy as np

from .request import GREEDY_EPS
from .runner_request import PromptLogprobsJob, RunnerRequest
from .sampling_inputs import SamplingFlags


# what a row uses beyond greedy argmax, as bits of `SamplingColumns.uses`
_RANDOM, _PENALTY, _LOGPROBS, _BIAS, _MIN_TOKENS = 1, 2, 4, 8, 16
_BITS = (_RANDOM, _PENALTY, _LOGPROBS, _BIAS, _MIN_TOKENS)


class SamplingColumns:
    """``num_rows`` rows of sampling parameters; ``vocab_size`` bounds token ids (None: tests).

    Per row, ``uses`` holds bits of what it needs beyond argmax (a draw, penalties, log-probs,
    logit bias, a min-tokens mask), and ``_num_using`` counts the rows with each bit, so that a
    step of plain greedy rows gathers no column at all."""

    def __init__(self, num_rows: int, vocab_size: int | None):
        n = num_rows
        self.vocab_size = vocab_size
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
        self.uses = np.zeros(n, dtype=np.int64)
        self._num_using = dict.fromkeys(_BITS, 0)
        self.num_penalty_slots = 1  # rows of PenaltyState wanted (slot 0 = no penalty)
        self.penalty_free: list[int] = []
        self._fresh_penalty: list[int] = []
        self._new_prompt_masks: list[tuple[int, list[int]]] = []
        # records with prompt log-probs still to hand out (request id -> record), and each
        # row's index in the current step (valid where ``slots[index[row]] == row``)
        self.prompt_logprobs_pending: dict[str, RunnerRequest] = {}
        self._step_index = np.zeros(n, dtype=np.int64)

    # ---- records and rows ---------------------------------------------------------------------

    def new_record(self, rec: RunnerRequest) -> None:
        """A request's first admission: its penalty row (zeroed, its prompt marked, on the
        device with the next step)."""
        st = rec.sampling
        if st.prompt_logprobs is not None and rec.next_prompt_logprob < st.num_prompt_tokens:
            self.prompt_logprobs_pending[rec.request_id] = rec
        if not st.has_penalties:
            return
        if not self.penalty_free:  # double the rows (slot 0 is never handed out)
            old = self.num_penalty_slots
            self.num_penalty_slots = max(8, 2 * old)
            self.penalty_free.extend(range(self.num_penalty_slots - 1, old - 1, -1))
        rec.penalty_slot = self.penalty_free.pop()
        self._fresh_penalty.append(rec.penalty_slot)
        if st.repetition_penalty != 1.0 and rec.prompt_token_ids:
            self._new_prompt_masks.append((rec.penalty_slot, rec.prompt_token_ids))

    def drop_record(self, rec: RunnerRequest) -> None:
        """A finished request: its penalty row is free again."""
        if rec.penalty_slot:
            self.penalty_free.append(rec.penalty_slot)
        self.prompt_logprobs_pending.pop(rec.request_id, None)

    def set_row(self, row: int, rec: RunnerRequest) -> None:
        """Write ``rec``'s parameters into ``row`` (once, when it gets the row)."""
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
        uses = ((_RANDOM if st.temperature >= GREEDY_EPS else 0)
                | (_PENALTY if rec.penalty_slot else 0)
                | (_LOGPROBS if st.logprobs is not None else 0)
                | (_BIAS if st.logit_bias else 0)
                | (_MIN_TOKENS if rec.min_tokens_ids and st.min_tokens else 0))
        self.uses[row] = uses
        for bit in _BITS:
            if uses & bit:
                self._num_using[bit] += 1

    def clear_row(self, row: int) -> None:
        """``row`` is free again (its request finished or was preempted)."""
        uses = int(self.uses[row])
        if uses:
            for bit in _BITS:
                if uses & bit:
                    self._num_using[bit] -= 1
            self.uses[row] = 0

    # ---- one step -----------------------------------------------------------------------------

    @property
    def idle(self) -> bool:
        """No row needs more than argmax and nothing waits to be set on the device: a step
        has no sampling section."""
        return (not self._fresh_penalty and not self._new_prompt_masks
                and not any(self._num_using.values()))

    def sections(self, rows: np.ndarray, positions: np.ndarray, sample_ids: list[str],
                 row_req: list[RunnerRequest | None], flags: SamplingFlags,
                 widths: list[tuple[str, int]]) -> dict[str, object]:
        """Host values of the sampling sections for the sampled ``rows`` [n] int64 (batch rows,
        in logits-row order), each sampling the token at index ``positions`` [n]; sets
        ``flags`` and appends (request id, 1 + N) to ``widths`` for rows with log-probs. Also
        hands out the penalty rows and prompt marks pending since the last step."""
        out: dict[str, object] = {}
        if self._fresh_penalty:
            out["fresh_penalty_slots"], self._fresh_penalty = self._fresh_penalty, []
        if self._new_prompt_masks:
            vocab = self.vocab_size
            masks, self._new_prompt_masks = self._new_prompt_masks, []
            out["pmask_slots"] = [s for s, p in masks for _ in p]
            out["pmask_ids"] = [t % vocab if vocab else t for _, p in masks for t in p]
        using = self._num_using
        if not len(rows) or not any(using.values()):  # plain greedy rows only
            return out
        temps = self.temperature[rows]
        if using[_RANDOM] and not (temps < GREEDY_EPS).all():
            flags.all_greedy = False
            top_k, top_p = self.top_k[rows], self.top_p[rows]
            vocab = self.vocab_size
            flags.any_top_k = bool(((top_k > 0) & (top_k < vocab if vocab else True)).any())
            flags.any_top_p = bool((top_p < 1.0).any())
            flags.top_k_width = top_k_width(top_k[temps >= GREEDY_EPS], vocab)
            out.update(seeds=self.seed[rows], top_k=top_k, positions=positions,
                       temperature=temps, top_p=top_p)
            min_p = self.min_p[rows]
            if ((min_p > 0.0) & (temps >= GREEDY_EPS)).any():
                flags.has_min_p = True
                out["min_p"] = min_p
        pen = self.penalty_slot[rows] if using[_PENALTY] else None
        if pen is not None and pen.any():
            rep = self.repetition[rows]
            flags.has_penalties, flags.any_repetition = True, bool((rep != 1.0).any())
            out.update(penalty_slots=pen, presence=self.presence[rows],
                       frequency=self.frequency[rows], repetition=rep)
        lp = self.logprobs[rows] if using[_LOGPROBS] else None
        lp_rows = np.flatnonzero(lp >= 0) if lp is not None else ()
        if len(lp_rows):
            out["logprob_rows"] = lp_rows
            flags.num_logprobs = int(lp[lp_rows].max())
            widths.extend((sample_ids[i], 1 + int(lp[i])) for i in lp_rows)
        if using[_BIAS] or using[_MIN_TOKENS]:
            self._sparse(rows, positions, row_req, out)
        return out

    def prompt_logprob_jobs(self, scheduled, slots: np.ndarray,
                            query_start_loc: list[int]) -> list[PromptLogprobsJob]:
        """Prompt log-prob jobs of a step: rows at positions p (< num_prompt_tokens - 1)
        predict prompt token p + 1; each prompt index is handed out once (a recompute after
        preemption skips those already sent). Only the records with prompt log-probs still to
        hand out (`prompt_logprobs_pending`) are visited, not the step's other rows; a record
        leaves once its last prompt index is handed out. ``scheduled``: the step's rows,
        ``slots`` [B] int64 their batch rows; jobs come in batch order."""
        pending = self.prompt_logprobs_pending
        where = self._step_index
        where[slots] = np.arange(len(slots))
        found = []
        for rec in pending.values():
            if rec.row >= 0:
                i = int(where[rec.row])
                if i < len(slots) and slots[i] == rec.row:  # scheduled in this step
                    found.append((i, rec))
        found.sort(key=lambda f: f[0])
        jobs = []
        for i, rec in found:
            sr = scheduled[i]
            num_prompt = rec.sampling.num_prompt_tokens
            first = max(sr.start_pos, rec.next_prompt_logprob - 1)
            end = min(sr.start_pos + len(sr.token_ids), num_prompt - 1)
            if first >= end:
                continue
            rec.next_prompt_logprob = end + 1
            if rec.next_prompt_logprob >= num_prompt:  # its last prompt index: nothing left
                del pending[rec.request_id]
            jobs.append(PromptLogprobsJob(
                sr.request_id, query_start_loc[i] + first - sr.start_pos, first + 1,
                rec.prompt_token_ids[first + 1:end + 1], rec.sampling.prompt_logprobs))
        return jobs

    def _sparse(self, rows: np.ndarray, positions: np.ndarray,
                row_req: list[RunnerRequest | None], out: dict) -> None:
        """logit_bias entries, and the min-tokens mask of rows still short of min_tokens."""
        b_rows, b_ids, b_vals, m_rows, m_ids = [], [], [], [], []
        for i in np.flatnonzero(self.has_bias[rows]).tolist():
            bias = row_req[rows[i]].sampling.logit_bias
            b_rows.extend([i] * len(bias))
            b_ids.extend(bias)
            b_vals.extend(bias.values())
        short = np.flatnonzero(positions - self.num_prompt[rows] < self.min_tokens[rows])
        for i in short.tolist():
            mt = row_req[rows[i]].min_tokens_ids
            m_rows.extend([i] * len(mt))
            m_ids.extend(mt)
        if b_rows:
            out.update(bias_rows=b_rows, bias_ids=b_ids, bias_values=b_vals)
        if m_rows:
            out.update(mask_rows=m_rows, mask_ids=m_ids)


MIN_CANDIDATES, MAX_CANDIDATES = 64, 1024


def top_k_width(top_k: np.ndarray, vocab: int | None) -> int:
    """Candidates per row for the sampler's top-k path (`SamplingBatch.top_k_width`), from the
    top_k [m] int64 of the rows that draw: the largest rounded up to a power of two, at least
    MIN_CANDIDATES (so that rows with small top_k always see the same width) and at most the
    vocabulary; 0 (the full-vocabulary path) when a row has top-k off or above
    MAX_CANDIDATES, or without a known vocabulary."""
    if not vocab or not len(top_k) or top_k.min() <= 0:
        return 0
    k = int(top_k.max())
    if k > MAX_CANDIDATES:
        return 0
    return min(max(MIN_CANDIDATES, 1 << (k - 1).bit_length()), vocab)
