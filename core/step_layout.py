"""The layout of a step's model inputs in the packed int32 buffer (`StepLayout`).

Sections: input ids [T], positions [T], slot mapping [T], query start locations [B + 1],
sequence lengths [B], logits rows [B], placeholder fills (destination token index [B], source
row of the previous step's sampled ids [B]), block tables [B, W] -- T new tokens, B requests, W
block-table columns. A hybrid model's KV cache groups after the first (core/kv_hybrid.py) add a
slot mapping [T] and block tables [B, W] each (``slot_mapping_1``, ``block_tables_1``, ...).
A decode-only step run by a CUDA graph is padded to the graph's batch size,
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
    num_groups: int = 1  # KV cache groups: each has its slot mapping and block tables

    @classmethod
    def for_graph(cls, batch_size: int, max_blocks: int, num_groups: int = 1) -> "StepLayout":
        return cls(batch_size, batch_size, max_blocks, num_groups)

    @property
    def size(self) -> int:
        t, b = self.num_tokens, self.num_seqs
        return 3 * t + (b + 1) + 4 * b + self.num_groups * (b * self.width) + (
            self.num_groups - 1) * t

    def views(self, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        """Named views of ``buf`` (host or device, int32) under this layout."""
        t, b, w = self.num_tokens, self.num_seqs, self.width
        sizes = [("input_ids", t), ("positions", t), ("slot_mapping", t),
                 ("query_start_loc", b + 1), ("seq_lens", b), ("logits_rows", b),
                 ("fill_dst", b), ("fill_src", b), ("block_tables", b * w)]
        for k in range(1, self.num_groups):
            sizes += [(f"slot_mapping_{k}", t), (f"block_tables_{k}", b * w)]
        out, off = {}, 0
        for name, n in sizes:
            out[name] = buf[off:off + n]
            off += n
        out["block_tables"] = out["block_tables"].view(b, w)
        for k in range(1, self.num_groups):
            out[f"block_tables_{k}"] = out[f"block_tables_{k}"].view(b, w)
        return out

    def group_views(self, views: dict[str, torch.Tensor]) -> list[tuple[torch.Tensor,
                                                                         torch.Tensor]]:
        """(slot mapping, block tables) of each KV cache group, from `views`' result."""
        return [(views["slot_mapping"], views["block_tables"])] + [
            (views[f"slot_mapping_{k}"], views[f"block_tables_{k}"])
            for k in range(1, self.num_groups)]
