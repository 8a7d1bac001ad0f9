"""The sampler's CUDA path on Llama-3's vocabulary (GPU only): the top-k candidate draw gives
the full-vocabulary path's tokens at every candidate width, also under exact ties, and torch's
CUDA top-k keeps the lowest indices among values tied at the k-th (`top_k_ids` relies on it)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pagebatch.sampler import Sampler, SamplingBatch, top_k_ids

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEVICE = torch.device("cuda")
VOCAB = 128256


def _ties(n: int, g: torch.Generator) -> torch.Tensor:
    return ((torch.randn(n, VOCAB, generator=g) * 3).round() / 2).to(DEVICE)


@pytest.mark.parametrize("n", [1, 5, 256])  # the chunked first stage below 32 rows
@pytest.mark.parametrize("w", [64, 1024])
def test_top_k_ids_are_the_first_of_a_stable_sort(n, w):
    g = torch.Generator().manual_seed(n + w)
    for x in (_ties(n, g), (torch.randn(n, VOCAB, generator=g) * 3).to(DEVICE)):
        ref = x.sort(dim=-1, descending=True, stable=True).indices[:, :w]
        assert torch.equal(top_k_ids(x, w), ref)


@pytest.mark.parametrize("n", [1, 256])
def test_top_k_candidates_draw_the_full_paths_tokens(n):
    """Rows with top-p, min-p and greedy rows among them, random and heavily tied logits."""
    g = torch.Generator().manual_seed(n)
    i = torch.arange(n)
    batch = SamplingBatch(
        temperature=torch.tensor([0.8, 1.0, 0.0, 1.5])[i % 4].to(DEVICE),
        top_k=torch.tensor([50, 1, 64, 20, 33])[i % 5].to(DEVICE),
        top_p=torch.tensor([0.95, 1.0, 0.5])[i % 3].to(DEVICE),
        seeds=(i * 7 + 1).to(DEVICE), positions=(i + 100).to(DEVICE), all_greedy=False,
        any_top_k=True, any_top_p=True, min_p=torch.tensor([0.0, 0.02])[i % 2].to(DEVICE),
        top_k_width=64)
    sampler = Sampler()
    for step in range(8):
        batch.positions += 1
        for logits in ((torch.randn(n, VOCAB, generator=g) * 3).to(DEVICE), _ties(n, g)):
            fast = sampler(logits, batch).token_ids
            full = sampler(logits, dataclasses.replace(batch, top_k_width=0)).token_ids
            wide = sampler(logits, dataclasses.replace(batch, top_k_width=1024)).token_ids
            assert torch.equal(fast, full), (step, (fast != full).nonzero().flatten())
            assert torch.equal(fast, wide), (step, (fast != wide).nonzero().flatten())
