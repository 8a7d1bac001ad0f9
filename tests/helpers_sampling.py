"""A sampling harness for tests without a model: requests' sampling states go into a real
`InputBatch` (its sampling columns) through scheduler outputs, each `batch` call is one decode
step of the chosen rows, and the `SamplingBatch` is read from the step buffer's sampling
sections exactly as the model runner reads it (on the CPU the buffer is the input)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from pagebatch.input_batch import InputBatch
from pagebatch.penalties import PenaltyState
from pagebatch.sampler import SamplingBatch
from pagebatch.sampling_inputs import sampling_batch
from pagebatch.sampling_state import SamplingState
from pagebatch.scheduler import NewRequestData, ScheduledRequest, SchedulerOutput

_BLOCK = 1 << 20  # one block covers any position: block ids play no part here


class SamplingHarness:
    def __init__(self, vocab_size: int, device: torch.device, max_num_seqs: int = 1 << 15):
        self.ib = InputBatch(max_num_seqs, 1, _BLOCK, max_num_seqs, pin_memory=False,
                             vocab_size=vocab_size)
        self.device = device
        self.state = PenaltyState(vocab_size, device)
        self._new: dict[str, NewRequestData] = {}
        self._finished: list[str] = []
        self._slots: torch.Tensor | None = None

    def add(self, request_id: str, state: SamplingState, prompt: list[int]) -> None:
        """A request the next `batch` takes in as new (its first row)."""
        self._new[request_id] = NewRequestData(list(prompt), state)

    def remove(self, request_ids: list[str]) -> None:
        """Finished requests: their records and penalty rows go now."""
        self.ib.remove(request_ids)

    def __getitem__(self, request_id: str):
        return self.ib.requests[request_id]

    @property
    def penalties(self) -> SimpleNamespace:
        """The device counts and the free penalty rows."""
        return SimpleNamespace(counts=self.state.counts, free=self.ib.sampling.penalty_free)

    def bump_seed(self, request_id: str) -> None:
        """Give a request's row the next seed (a different draw at the same position)."""
        self.ib.sampling.seed[self.ib.requests[request_id].row] += 1

    def batch(self, request_ids: list[str], positions: list[int]) -> SamplingBatch:
        """One decode step of rows ``request_ids``; positions: index of the token each row
        samples."""
        rows = []
        for rid, pos in zip(request_ids, positions):
            new = self._new.pop(rid, None)
            rows.append(ScheduledRequest(rid, [0], pos - 1, [0] if new else [], True, new))
        so = SchedulerOutput(rows, len(rows), self._finished)
        self._finished = []
        inp = self.ib.prepare(so)
        buf = self.ib.buffers[self.ib._current]
        s = inp.sampling.views(buf) if inp.sampling is not None else None
        if s is not None:
            s = {k: v.to(self.device) for k, v in s.items()}
            self.state.ensure(self.ib.sampling.num_penalty_slots)
            self.state.reset(s["fresh_penalty_slots"], s["pmask_slots"], s["pmask_ids"])
        self._slots = s["penalty_slots"] if inp.flags.has_penalties else None
        return sampling_batch(s, inp.flags, self.state)

    def update(self, sampled: torch.Tensor) -> None:
        """After sampling the last batch: count its sampled ids [n] int64."""
        if self._slots is not None:
            self.state.update(self._slots, sampled)
            self._slots = None
