"""`pagebatch bench`'s weights figure (core/bench.py weight_bytes): parameters and persistent
buffers, each storage once; derived non-persistent caches left out."""

from __future__ import annotations

import torch

from pagebatch.bench import weight_bytes


def test_weight_bytes_counts_tied_storage_once_and_skips_caches():
    model = torch.nn.Module()
    model.embed = torch.nn.Embedding(10, 4)  # 40 fp32 = 160 bytes
    model.head = torch.nn.Linear(4, 10, bias=False)
    model.head.weight = model.embed.weight  # tied
    model.register_buffer("qweight", torch.zeros(3, 5, dtype=torch.int32))  # 60 bytes
    model.register_buffer("cos_sin", torch.zeros(1000), persistent=False)  # not weights
    assert weight_bytes(model) == 160 + 60
