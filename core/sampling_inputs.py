"""A step's sampling inputs: where they sit in the step's packed buffer, and the `SamplingBatch`
the sampler reads from their device views.

The input batch (core/input_batch.py) writes them right after the step's model inputs, in the
same pinned buffer, so that a sampled step still makes one host-to-device copy. Fields are
64-bit integers (indices, seeds) or fp32 values, laid out as named sections: the int64 ones
first (the section starts at an even int32 offset, so an int64 view is aligned), then the fp32
ones. A section is empty when no row of the step needs it (a greedy step has none at all).

Sections, n = rows that sample: seeds, top_k, positions (of the token each row samples),
temperature, top_p [n]; min_p [n] (when a row uses it); penalty_slots, presence, frequency,
repetition [n] (when a row has a penalty); logprob_rows [r]; bias_rows, bias_ids, bias_values
(logit_bias entries); mask_rows, mask_ids (EOS / stop ids of rows short of min_tokens);
fresh_penalty_slots (penalty rows given to new requests, zeroed on the device); pmask_slots,
pmask_ids (prompt tokens of new requests with a repetition penalty); plp_rows, plp_targets
(prompt log-prob rows of the flattened batch and the prompt tokens they predict).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .sampler import SamplingBatch

I64_FIELDS = ("seeds", "top_k", "positions", "penalty_slots", "logprob_rows", "bias_rows",
              "bias_ids", "mask_rows", "mask_ids", "fresh_penalty_slots", "pmask_slots",
              "pmask_ids", "plp_rows", "plp_targets")
F32_FIELDS = ("temperature", "top_p", "min_p", "presence", "frequency", "repetition",
              "bias_values")


@dataclass(frozen=True)
class SamplingLayout:
    """Offsets of one step's sampling sections. ``offset``: first int32 element in the step
    buffer (even). ``counts``: elements per field, `I64_FIELDS` then `F32_FIELDS`."""

    offset: int
    counts: tuple[int, ...]

    @classmethod
    def build(cls, offset: int, counts: dict[str, int]) -> "SamplingLayout":
        return cls(offset + offset % 2, tuple(counts.get(f, 0) for f in I64_FIELDS + F32_FIELDS))

    @property
    def size(self) -> int:
        """int32 elements, from ``offset``."""
        n64 = sum(self.counts[:len(I64_FIELDS)])
        return 2 * n64 + sum(self.counts[len(I64_FIELDS):])

    @property
    def end(self) -> int:
        return self.offset + self.size

    def views(self, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        """Named views of the int32 ``buf`` (host or device): int64 and fp32 tensors."""
        n64 = sum(self.counts[:len(I64_FIELDS)])
        region = buf[self.offset:self.end]
        i64, f32 = region[:2 * n64].view(torch.int64), region[2 * n64:].view(torch.float32)
        out, a, b = {}, 0, 0
        for name, n in zip(I64_FIELDS, self.counts):
            out[name] = i64[a:a + n]
            a += n
        for name, n in zip(F32_FIELDS, self.counts[len(I64_FIELDS):]):
            out[name] = f32[b:b + n]
            b += n
        return out


@dataclass
class SamplingFlags:
    """Host flags of a step's sampling (they pick the sampler's fast paths)."""

    all_greedy: bool = True
    any_top_k: bool = False
    any_top_p: bool = False
    has_min_p: bool = False
    has_penalties: bool = False
    any_repetition: bool = False
    num_logprobs: int = 0
    top_k_width: int = 0


def write_sections(host: dict[str, np.ndarray], values: dict[str, object]) -> None:
    """Copy each host list / array of ``values`` into its section of the host views."""
    for name, vals in values.items():
        if len(vals):
            host[name][:] = vals


def sampling_batch(v: dict[str, torch.Tensor] | None, flags: SamplingFlags,
                   penalties) -> SamplingBatch:
    """The step's `SamplingBatch` over the device views ``v`` of its sampling sections (None:
    a greedy step with no sampling inputs); ``penalties``: the runner's `PenaltyState`
    (core/penalties.py)."""
    if flags.all_greedy:  # argmax only
        batch = SamplingBatch(None, None, None, None, None, True, False, False)
        if v is None:
            return batch
    else:
        batch = SamplingBatch(v["temperature"], v["top_k"], v["top_p"], v["seeds"],
                              v["positions"], False, flags.any_top_k, flags.any_top_p,
                              top_k_width=flags.top_k_width)
    if flags.has_min_p:
        batch.min_p = v["min_p"]
    if flags.has_penalties:
        batch.penalties = penalties.batch(v["penalty_slots"], v["presence"], v["frequency"],
                                          v["repetition"], flags.any_repetition)
    if v["bias_rows"].numel():
        batch.bias_rows, batch.bias_token_ids = v["bias_rows"], v["bias_ids"]
        batch.bias_values = v["bias_values"]
    if v["mask_rows"].numel():
        batch.masked_rows, batch.masked_token_ids = v["mask_rows"], v["mask_ids"]
    if v["logprob_rows"].numel():
        batch.logprob_rows = v["logprob_rows"]
        batch.num_logprobs = flags.num_logprobs
    return batch


