"""The model runner's per-request sampling state, and the step's `SamplingBatch` built from it.

`SamplingState` is plain Python, set once when the core admits a request. What changes every
step and is needed on the device stays there: `PenaltyState` keeps, per request with a penalty,
a row of output-token counts and a prompt-token mask ([slots, vocab] tensors), updated from the
sampled ids on the device (no list of output tokens is copied to the device, ever).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

import torch

from .request import GREEDY_EPS, SamplingParams
from .sampler import PenaltyBatch, SamplingBatch


@dataclass
class SamplingState:
    """What the runner keeps per request (set once, at admission).

    min_tokens_ids: EOS ids and stop_token_ids, masked out of the logits while fewer than
    min_tokens outputs exist. prompt_token_ids: kept only when a repetition penalty or prompt
    log-probs need them. next_prompt_logprob: prompt index of the next prompt log-prob to hand
    out (a preempted request recomputes its prompt without handing them out twice).
    penalty_slot: its row in `PenaltyState` (0 = none yet).
    """

    temperature: float
    top_k: int
    top_p: float
    seed: int
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    min_tokens_ids: list[int] = field(default_factory=list)
    num_prompt_tokens: int = 0
    prompt_token_ids: list[int] | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    next_prompt_logprob: int = 1
    penalty_slot: int = 0

    @classmethod
    def from_params(cls, sp: SamplingParams, seed: int, prompt_token_ids: list[int],
                    eos_token_ids: Iterable[int]) -> "SamplingState":
        keep_prompt = sp.repetition_penalty != 1.0 or sp.prompt_logprobs is not None
        return cls(
            temperature=float(sp.temperature), top_k=sp.top_k if sp.top_k > 0 else 0,
            top_p=float(sp.top_p), seed=seed, min_p=float(sp.min_p),
            presence_penalty=float(sp.presence_penalty),
            frequency_penalty=float(sp.frequency_penalty),
            repetition_penalty=float(sp.repetition_penalty),
            logit_bias=dict(sp.logit_bias) if sp.logit_bias else None,
            min_tokens=sp.min_tokens,
            min_tokens_ids=sorted(set(eos_token_ids) | set(sp.stop_token_ids))
            if sp.min_tokens > 0 else [],
            num_prompt_tokens=len(prompt_token_ids),
            prompt_token_ids=list(prompt_token_ids) if keep_prompt else None,
            logprobs=sp.logprobs, prompt_logprobs=sp.prompt_logprobs)

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)


class PenaltyState:
    """Device-resident penalty state: ``counts`` [slots, vocab] int32 (occurrences of each token
    in a request's output) and ``prompt_mask`` [slots, vocab] bool (its prompt tokens). Slot 0 is
    all zeros and stands for rows without penalties; a request gets a slot the first time it is
    sampled and keeps it until it finishes (preemption keeps it: the outputs stay). The tensors
    double when full."""

    def __init__(self, vocab_size: int, device: torch.device):
        self.vocab_size = vocab_size
        self.device = device
        self.counts = torch.zeros((0, vocab_size), dtype=torch.int32, device=device)
        self.prompt_mask = torch.zeros((0, vocab_size), dtype=torch.bool, device=device)
        self.free: list[int] = []

    def _grow(self) -> None:
        old = self.counts.shape[0]
        new = max(8, 2 * old)
        counts = torch.zeros((new, self.vocab_size), dtype=torch.int32, device=self.device)
        mask = torch.zeros((new, self.vocab_size), dtype=torch.bool, device=self.device)
        counts[:old] = self.counts
        mask[:old] = self.prompt_mask
        self.counts, self.prompt_mask = counts, mask
        self.free.extend(range(new - 1, max(old, 1) - 1, -1))  # slot 0 is never handed out

    def assign(self, state: SamplingState) -> None:
        """Give ``state`` a zeroed slot (with its prompt mask when it has a repetition
        penalty)."""
        if not self.free:
            self._grow()
        slot = self.free.pop()
        self.counts[slot].zero_()
        self.prompt_mask[slot].zero_()
        if state.repetition_penalty != 1.0 and state.prompt_token_ids:
            ids = torch.tensor(state.prompt_token_ids, dtype=torch.long, device=self.device)
            self.prompt_mask[slot, ids % self.vocab_size] = True
        state.penalty_slot = slot

    def release(self, state: SamplingState) -> None:
        if state.penalty_slot:
            self.free.append(state.penalty_slot)
            state.penalty_slot = 0

    def batch(self, states: list[SamplingState]) -> tuple[PenaltyBatch, torch.Tensor]:
        """The step's `PenaltyBatch` and its slot index [n] int64 (for `update`)."""
        for s in states:
            if s.has_penalties and not s.penalty_slot:
                self.assign(s)
        dev = self.device
        slots = to_device([s.penalty_slot for s in states], torch.long, dev)
        any_rep = any(s.repetition_penalty != 1.0 for s in states)

        def col(name: str) -> torch.Tensor:
            return to_device([getattr(s, name) for s in states], torch.float32, dev)

        return PenaltyBatch(
            output_counts=self.counts[slots],
            prompt_mask=self.prompt_mask[slots] if any_rep else None,
            presence=col("presence_penalty"), frequency=col("frequency_penalty"),
            repetition=col("repetition_penalty")), slots

    def update(self, slots: torch.Tensor, sampled: torch.Tensor) -> None:
        """Count the sampled ids [n] int64 of rows ``slots`` [n] int64, on the device (slot 0,
        the rows without penalties, gets + 0)."""
        self.counts.index_put_((slots, sampled), (slots > 0).to(torch.int32), accumulate=True)


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a tensor on ``device``; on CUDA through pinned memory without blocking
    the host (a copy from pageable memory would wait for the GPU to drain)."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


class SamplingStates:
    """Request id -> `SamplingState`, the `PenaltyState`, and the step's `SamplingBatch`."""

    def __init__(self, vocab_size: int, device: torch.device):
        self.vocab_size = vocab_size
        self.device = device
        self.states: dict[str, SamplingState] = {}
        self.penalties = PenaltyState(vocab_size, device)
        self._penalty_slots: torch.Tensor | None = None  # of the last batch, for update
        # id -> how many finished requests of that id still await their removal (the id was
        # added again before the old state's removal came)
        self._reused: dict[str, int] = {}

    def __getitem__(self, request_id: str) -> SamplingState:
        return self.states[request_id]

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.states

    def __len__(self) -> int:
        return len(self.states)

    def add(self, request_id: str, state: SamplingState) -> None:
        # an EOS id of a generation_config beyond the logits would fail every step
        state.min_tokens_ids = [t for t in state.min_tokens_ids if t < self.vocab_size]
        old = self.states.get(request_id)
        if old is not None:  # the id of a finished request, reused before its state was dropped
            self.penalties.release(old)
            self._reused[request_id] = self._reused.get(request_id, 0) + 1
        self.states[request_id] = state

    def remove(self, request_ids: Iterable[str]) -> None:
        """Drop the states of finished requests, one removal per finished request (an id
        reused since keeps its new state until its own finish is removed too)."""
        for rid in request_ids:
            pending = self._reused.get(rid)
            if pending:  # this removal is an older request's: the state is the new one's
                if pending == 1:
                    del self._reused[rid]
                else:
                    self._reused[rid] = pending - 1
                continue
            st = self.states.pop(rid, None)
            if st is not None:
                self.penalties.release(st)

    def batch(self, request_ids: list[str], positions: list[int]) -> SamplingBatch:
        """The `SamplingBatch` of rows ``request_ids``; positions: index of the token each row
        samples (its output count is ``position - num_prompt_tokens``)."""
        states = [self.states[r] for r in request_ids]
        dev = self.device
        temps = [s.temperature for s in states]
        top_k = [s.top_k for s in states]
        top_p = [s.top_p for s in states]
        all_greedy = all(t < GREEDY_EPS for t in temps)
        if all_greedy:  # argmax only: no per-row tensors (and no host-to-device copies)
            batch = SamplingBatch(None, None, None, None, None, True, False, False)
        else:
            batch = SamplingBatch(
                temperature=to_device(temps, torch.float32, dev),
                top_k=to_device(top_k, torch.long, dev),
                top_p=to_device(top_p, torch.float32, dev),
                seeds=to_device([s.seed for s in states], torch.long, dev),
                positions=to_device(positions, torch.long, dev),
                all_greedy=False,
                any_top_k=any(0 < k < self.vocab_size for k in top_k),
                any_top_p=any(p < 1.0 for p in top_p),
            )
        if any(s.min_p > 0.0 and s.temperature >= GREEDY_EPS for s in states):
            batch.min_p = to_device([s.min_p for s in states], torch.float32, dev)
        self._penalty_slots = None
        if any(s.has_penalties for s in states):
            batch.penalties, self._penalty_slots = self.penalties.batch(states)
        self._sparse_entries(batch, states, positions)
        lp_rows = [i for i, s in enumerate(states) if s.logprobs is not None]
        if lp_rows:
            batch.logprob_rows = to_device(lp_rows, torch.long, dev)
            batch.num_logprobs = max(states[i].logprobs for i in lp_rows)
        return batch

    def _sparse_entries(self, batch: SamplingBatch, states: list[SamplingState],
                        positions: list[int]) -> None:
        """logit_bias entries, and the min-tokens mask of rows still short of min_tokens."""
        b_rows, b_ids, b_vals, m_rows, m_ids = [], [], [], [], []
        for i, (s, pos) in enumerate(zip(states, positions)):
            if s.logit_bias:
                b_rows.extend([i] * len(s.logit_bias))
                b_ids.extend(s.logit_bias)
                b_vals.extend(s.logit_bias.values())
            if s.min_tokens_ids and pos - s.num_prompt_tokens < s.min_tokens:
                m_rows.extend([i] * len(s.min_tokens_ids))
                m_ids.extend(s.min_tokens_ids)
        dev = self.device
        if b_rows:
            batch.bias_rows = to_device(b_rows, torch.long, dev)
            batch.bias_token_ids = to_device(b_ids, torch.long, dev)
            batch.bias_values = to_device(b_vals, torch.float32, dev)
        if m_rows:
            batch.masked_rows = to_device(m_rows, torch.long, dev)
            batch.masked_token_ids = to_device(m_ids, torch.long, dev)

    def update(self, sampled: torch.Tensor) -> None:
        """After sampling the last batch: count its sampled ids [n] int64 (on the device)."""
        if self._penalty_slots is not None:
            self.penalties.update(self._penalty_slots, sampled)
            self._penalty_slots = None
