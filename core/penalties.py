"""Device-resident penalty state: per request with a penalty, a row of output-token counts and a
prompt-token mask, updated from the sampled ids on the device (no list of output tokens is ever
copied to the device).

Rows ("penalty slots") are handed out on the host by the input batch (core/input_batch.py); this
class owns only the tensors. Every index it takes comes from the step's one host-to-device copy.
"""

from __future__ import annotations

import torch

from .sampler import PenaltyBatch


class PenaltyState:
    """``counts`` [slots, vocab] int32 (occurrences of each token in a request's output) and
    ``prompt_mask`` [slots, vocab] bool (its prompt tokens; allocated with the first repetition
    penalty). Slot 0 is all zeros and stands for rows without penalties. The tensors grow (to
    the input batch's slot count) on demand."""

    def __init__(self, vocab_size: int, device: torch.device):
        self.vocab_size = vocab_size
        self.device = device
        self.counts = torch.zeros((0, vocab_size), dtype=torch.int32, device=device)
        self.prompt_mask = torch.zeros((0, vocab_size), dtype=torch.bool, device=device)

    def ensure(self, num_slots: int) -> None:
        """Grow the tensors to at least ``num_slots`` rows (new rows zero)."""
        old = self.counts.shape[0]
        if num_slots <= old:
            return
        counts = torch.zeros((num_slots, self.vocab_size), dtype=torch.int32, device=self.device)
        mask = torch.zeros((num_slots, self.vocab_size), dtype=torch.bool, device=self.device)
        counts[:old] = self.counts
        mask[:old] = self.prompt_mask
        self.counts, self.prompt_mask = counts, mask

    def reset(self, slots: torch.Tensor, mask_slots: torch.Tensor | None,
              mask_ids: torch.Tensor | None) -> None:
        """Zero the rows ``slots`` [k] int64 given to new requests, then mark prompt tokens:
        ``prompt_mask[mask_slots[i], mask_ids[i]] = True`` ([m] int64 each, ids < vocab)."""
        if slots.numel():
            self.counts.index_fill_(0, slots, 0)
            self.prompt_mask.index_fill_(0, slots, False)
        if mask_slots is not None and mask_slots.numel():
            self.prompt_mask.index_put_((mask_slots, mask_ids),
                                        torch.ones_like(mask_slots, dtype=torch.bool))

    def batch(self, slots: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor,
              repetition: torch.Tensor, any_repetition: bool) -> PenaltyBatch:
        """The step's `PenaltyBatch` of rows ``slots`` [n] int64; presence / frequency /
        repetition: [n] fp32."""
        return PenaltyBatch(
            output_counts=self.counts[slots],
            prompt_mask=self.prompt_mask[slots] if any_repetition else None,
            presence=presence, frequency=frequency, repetition=repetition)

    def update(self, slots: torch.Tensor, sampled: torch.Tensor) -> None:
        """Count the sampled ids [n] int64 of rows ``slots`` [n] int64, on the device (slot 0,
        the rows without penalties, gets + 0)."""
        self.counts.index_put_((slots, sampled), (slots > 0).to(torch.int32), accumulate=True)
