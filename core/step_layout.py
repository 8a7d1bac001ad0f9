"""The layout of a step's model inputs in the packed int32 buffer (`StepLayout`).

Sections: input ids [T], positions [T], slot mapping [T], query start locations [B + 1],
sequence lengths [B], logits rows [B], placeholder fills (destination token index [B], source
row of the previous step's sampled ids [B]), block tables [B, W] -- T new tokens, B requests, W
block-table columns. A decode-only step run by a CUDA graph is padded to the graph's batch size,
with W the full width (`StepLayout.for_graph`); the graph reads these views of the device
buffer directly. The step's sampling inputs follow (core/sampling_inputs.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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
