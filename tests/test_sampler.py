"""The sampler on random logits, no model: each processor against a plain reference, seeded
determinism, and the empirical distribution of temperature sampling."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

import pytest
import torch

from pagebatch.request import GREEDY_EPS, SamplingParams
from pagebatch.sampler import (Sampler, apply_min_p, apply_penalties, apply_top_k_top_p,
                               counter_uniform, counter_uniform_at, order_keys_torch,
                               top_k_ids)
from pagebatch.sampling_columns import MAX_CANDIDATES, top_k_width
from pagebatch.sampling_state import SamplingState

from helpers_sampling import SamplingHarness

CPU = torch.device("cpu")


def _states(vocab: int, params: list[SamplingParams], prompts: list[list[int]] | None = None,
            seeds: list[int] | None = None, eos=(2,)) -> SamplingHarness:
    """Requests "r0", "r1", ... with sampling states as the engine core builds them, in the
    runner's input batch."""
    ss = SamplingHarness(vocab, CPU)
    for i, sp in enumerate(params):
        prompt = prompts[i] if prompts else [3, 4, 5]
        seed = seeds[i] if seeds else 1000 + i
        ss.add(f"r{i}", SamplingState.from_params(sp, seed, prompt, eos), prompt)
    return ss


def _sample(ss: SamplingHarness, logits: torch.Tensor, positions: list[int],
            ids: list[str] | None = None):
    ids = ids or [f"r{i}" for i in range(logits.shape[0])]
    batch = ss.batch(ids, positions)
    out = Sampler()(logits, batch)
    ss.update(out.token_ids)
    return out, batch


def _logits(n: int, vocab: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, vocab, generator=g) * scale


# ---- greedy, top-k, top-p, min-p -------------------------------------------------------------

def test_top_k_1_equals_greedy_with_the_same_tie_breaking():
    g = torch.Generator().manual_seed(1)
    logits = torch.randint(0, 4, (64, 50), generator=g).float()  # many exact ties at the max
    greedy = logits.argmax(dim=-1)
    assert (logits == logits.max(dim=-1, keepdim=True).values).sum(-1).gt(1).any()
    temps = [0.5, 1.0, 2.0, 4.0]  # powers of two: logits / T keeps the ties exact
    params = [SamplingParams(temperature=temps[i % 4], top_k=1) for i in range(64)]
    out, _ = _sample(_states(50, params), logits, [7] * 64)
    assert torch.equal(out.token_ids, greedy)
    params = [SamplingParams(temperature=0.0) for _ in range(64)]
    out, batch = _sample(_states(50, params), logits, [7] * 64)
    assert batch.all_greedy and torch.equal(out.token_ids, greedy)


def test_top_k_and_top_p_keep_the_right_sets():
    x = torch.tensor([[1.0, 3.0, 2.0, 0.0, 3.0]])
    kept = apply_top_k_top_p(x, torch.tensor([2]), None).isfinite()
    assert kept.tolist() == [[False, True, False, False, True]]  # the two 3.0s
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    kept = apply_top_k_top_p(probs.log(), None, torch.tensor([0.7])).isfinite()
    assert kept.tolist() == [[True, True, False, False]]  # 0.5 < 0.7 <= 0.8
    kept = apply_top_k_top_p(probs.log(), None, torch.tensor([0.1])).isfinite()
    assert kept.tolist() == [[True, False, False, False]]  # never empty


def test_order_keys_rank_like_a_stable_descending_sort():
    g = torch.Generator().manual_seed(5)
    x = (torch.randint(-6, 7, (8, 300), generator=g).float() * 0.25)  # many ties, +-0.0
    x[0, :4] = torch.tensor([-0.0, 0.0, float("-inf"), float("inf")])
    x[1] = -x[1]
    x[2] = float("-inf")
    order = order_keys_torch(x).argsort(dim=-1, descending=True)
    assert torch.equal(order, x.sort(dim=-1, descending=True, stable=True).indices)
    assert (x == 0).sum() and (torch.signbit(x) & (x == 0)).sum()  # both zeros were there


def test_top_k_width_rounds_up_and_falls_back():
    assert top_k_width(np.array([5, 50]), 128256) == 64
    assert top_k_width(np.array([1, 65]), 128256) == 128
    assert top_k_width(np.array([MAX_CANDIDATES]), 128256) == MAX_CANDIDATES
    assert top_k_width(np.array([MAX_CANDIDATES + 1]), 128256) == 0  # a full sort
    assert top_k_width(np.array([50, 0]), 128256) == 0  # a row without top-k
    assert top_k_width(np.array([6]), 50) == 50  # never wider than the vocabulary
    assert top_k_width(np.array([6]), None) == 0 and top_k_width(np.array([], int), 99) == 0


def _mixed_top_k_rows(n: int) -> list[SamplingParams]:
    temps, ks, ps, mps = [0.5, 0.8, 1.3, 2.0], [1, 5, 50, 64, 7], [1.0, 0.95, 0.5], [0.0, 0.05]
    return [SamplingParams(temperature=temps[i % 4], top_k=ks[i % 5], top_p=ps[i % 3],
                           min_p=mps[i % 2]) if i % 6 else SamplingParams(temperature=0.0)
            for i in range(n)]


@pytest.mark.parametrize("vocab", [3000, 9000])  # one top-k stage; two, the last chunk padded
def test_top_k_candidates_draw_the_full_vocabulary_paths_tokens(vocab):
    """Rows that all have 1 <= top_k <= 64 (with top-p, min-p, greedy rows among them) draw
    over 64 candidates; the tokens equal the full-vocabulary path's, at every width."""
    n = 60
    ss = _states(vocab, _mixed_top_k_rows(n))
    ids = [f"r{i}" for i in range(n)]
    for step in range(6):
        logits = (_logits(n, vocab, seed=step, scale=2.0) * 4).round() / 4  # ties
        batch = ss.batch(ids, [10 + step] * n)
        assert batch.top_k_width == 64
        fast = Sampler()(logits, batch).token_ids
        full = Sampler()(logits, dataclasses.replace(batch, top_k_width=0)).token_ids
        wide = Sampler()(logits, dataclasses.replace(batch, top_k_width=1024)).token_ids
        assert torch.equal(fast, full) and torch.equal(fast, wide)
        ss.update(fast)


def test_top_k_ids_are_the_first_of_a_stable_sort():
    x = (_logits(3, 10000, seed=4) * 2).round()  # ties everywhere
    for w in (1, 64, 1024):
        ref = x.sort(dim=-1, descending=True, stable=True).indices[:, :w]
        assert torch.equal(top_k_ids(x, w), ref)


def test_a_row_without_top_k_takes_the_full_path():
    ss = _states(500, [SamplingParams(temperature=1.0, top_k=5),
                       SamplingParams(temperature=1.0, top_p=0.9)])
    assert ss.batch(["r0", "r1"], [3, 3]).top_k_width == 0


def test_counter_uniform_at_equals_the_full_row():
    seeds, pos = torch.tensor([3, 9]), torch.tensor([0, 5])
    cols = torch.tensor([[7, 0, 999], [1, 2, 3]])
    full = counter_uniform(seeds, pos, 1000)
    assert torch.equal(counter_uniform_at(seeds, pos, cols), full.gather(1, cols))


def test_min_p_against_the_probability_definition():
    x = _logits(32, 100, seed=2)
    min_p = torch.rand(32, generator=torch.Generator().manual_seed(3))
    min_p[:4] = 0.0
    got = apply_min_p(x, min_p).isfinite()
    probs = x.softmax(dim=-1)
    want = probs >= min_p[:, None] * probs.max(dim=-1, keepdim=True).values
    assert torch.equal(got, want)
    assert got[:4].all()  # min_p = 0 is off


def test_min_p_sampling_never_draws_below_the_threshold():
    vocab, n = 40, 2000
    logits = _logits(1, vocab, seed=4).expand(n, vocab).contiguous()
    params = [SamplingParams(temperature=1.0, min_p=0.2, seed=5)] * n
    out, batch = _sample(_states(vocab, params, seeds=[5] * n), logits, list(range(n)))
    assert batch.min_p is not None and not batch.any_top_k and not batch.any_top_p
    probs = logits[0].softmax(-1)
    allowed = probs >= 0.2 * probs.max()
    assert allowed[out.token_ids].all()
    assert len(set(out.token_ids.tolist())) == int(allowed.sum())  # and reaches every allowed


# ---- penalties, logit bias, min_tokens -------------------------------------------------------

def _ref_penalties(logits: torch.Tensor, prompt: list[int], output: list[int],
                   presence: float, frequency: float, repetition: float) -> torch.Tensor:
    """A token-by-token reference of vLLM's / OpenAI's definitions."""
    x = logits.clone()
    for t in set(prompt) | set(output):
        x[t] = x[t] / repetition if x[t] > 0 else x[t] * repetition
    for t in set(output):
        x[t] -= frequency * output.count(t) + presence
    return x


def test_penalties_match_a_reference_with_the_counts_kept_on_the_device():
    """Three decode steps of four requests (one without penalties): the counts the device keeps
    from the sampled ids give the same penalized logits as the reference over Python lists."""
    vocab = 30
    params = [SamplingParams(temperature=1.0, presence_penalty=0.7, frequency_penalty=0.3,
                             repetition_penalty=1.5),
              SamplingParams(temperature=0.0, repetition_penalty=0.8),
              SamplingParams(temperature=1.0),
              SamplingParams(temperature=1.0, presence_penalty=-0.5, frequency_penalty=1.1)]
    prompts = [[1, 2, 3, 3], [4, 5, 6], [7], [8, 9, 9, 9]]
    ss = _states(vocab, params, prompts)
    outputs: list[list[int]] = [[] for _ in params]
    for step in range(6):
        logits = _logits(4, vocab, seed=10 + step)
        positions = [len(p) + len(o) for p, o in zip(prompts, outputs)]
        batch = ss.batch([f"r{i}" for i in range(4)], positions)
        assert batch.penalties is not None
        got = apply_penalties(logits, batch.penalties)
        for i, sp in enumerate(params):
            want = _ref_penalties(logits[i], prompts[i], outputs[i], sp.presence_penalty,
                                  sp.frequency_penalty, sp.repetition_penalty)
            torch.testing.assert_close(got[i], want, rtol=0, atol=1e-6)
        out = Sampler()(logits, batch)
        ss.update(out.token_ids)
        for i, t in enumerate(out.token_ids.tolist()):
            outputs[i].append(t)
    assert ss.penalties.counts[0].sum() == 0  # the shared row of requests without penalties
    ss.remove(["r0", "r1", "r2", "r3"])
    assert sorted(ss.penalties.free) == list(range(1, ss.penalties.counts.shape[0]))


def test_penalty_slots_grow_and_are_reused():
    vocab = 10
    n = 20
    params = [SamplingParams(frequency_penalty=1.0)] * n
    ss = _states(vocab, params)
    _sample(ss, _logits(n, vocab), [3] * n)
    slots = [ss[f"r{i}"].penalty_slot for i in range(n)]
    assert len(set(slots)) == n and 0 not in slots
    assert ss.penalties.counts.sum() == n  # one sampled token each
    ss.remove(["r0"])
    ss.add("new", SamplingState.from_params(SamplingParams(presence_penalty=1.0), 1, [1], [2]),
           [1])
    ss.batch(["new"], [1])
    assert ss["new"].penalty_slot == slots[0]
    assert ss.penalties.counts[slots[0]].sum() == 0  # zeroed for its new owner


def test_logit_bias_is_added():
    vocab = 20
    logits = _logits(3, vocab, seed=6)
    params = [SamplingParams(temperature=0.0, logit_bias={5: 100.0, 6: -3.5}),
              SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.7, logit_bias={0: -100.0})]
    ss = _states(vocab, params)
    batch = ss.batch(["r0", "r1", "r2"], [3, 3, 3])
    from pagebatch.sampler import apply_logits_processors
    got = apply_logits_processors(logits, batch)
    want = logits.clone()
    want[0, 5] += 100.0
    want[0, 6] -= 3.5
    want[2, 0] -= 100.0
    assert torch.equal(got, want)
    out = Sampler()(logits, batch)
    assert out.token_ids[0] == 5
    assert out.token_ids[1] == logits[1].argmax()


def test_min_tokens_masks_every_eos_id_and_stop_token_id():
    """EOS ids (the config's and generation_config's) and stop_token_ids are the most likely
    tokens, yet none is drawn until min_tokens outputs exist; then greedy picks one."""
    vocab, eos, stop = 16, (2, 7, 9), [11]
    banned = set(eos) | set(stop)
    logits = torch.zeros(1, vocab)
    for t in banned:
        logits[0, t] = 10.0 + t
    prompt = [3, 4, 5]
    for temp in (0.0, 1.0):
        sp = SamplingParams(temperature=temp, min_tokens=3, stop_token_ids=stop, seed=1)
        ss = _states(vocab, [sp], [prompt], eos=eos)
        for n_out in range(3):
            for _ in range(50):  # different draws: positions differ per draw
                out, _ = _sample(ss, logits, [len(prompt) + n_out])
                assert int(out.token_ids[0]) not in banned
                ss.bump_seed("r0")
        out, batch = _sample(ss, logits, [len(prompt) + 3])
        assert batch.masked_rows is None
        if temp == 0.0:
            assert int(out.token_ids[0]) == 11


# ---- temperature -----------------------------------------------------------------------------

def test_tiny_temperature_is_near_greedy_and_finite():
    vocab, n = 200, 64
    logits = _logits(n, vocab, seed=8, scale=30.0)  # logits up to ~±100
    top2 = logits.topk(2, dim=-1).values
    logits[:, 0] = top2[:, 0] + 0.01  # a clear (0.01) winner per row
    for t in (1e-4, GREEDY_EPS * 1.01, GREEDY_EPS * 0.5):
        params = [SamplingParams(temperature=t, logprobs=3, seed=i) for i in range(n)]
        out, batch = _sample(_states(vocab, params), logits, list(range(n)))
        assert (out.token_ids == 0).all(), t
        assert torch.isfinite(out.logprobs.logprobs).all()
    x = logits / 1e-4  # what the sampler divides: no overflow in fp32
    assert torch.isfinite(x).all() and torch.isfinite(x.softmax(-1)).all()


def test_seeded_rows_are_independent_of_batch_composition():
    vocab = 64
    base = _logits(1, vocab, seed=9)
    sp = SamplingParams(temperature=0.9, top_p=0.95, seed=42)
    alone, _ = _sample(_states(vocab, [sp], seeds=[42]), base, [17])
    others = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.3, top_k=5),
              SamplingParams(temperature=0.5, min_p=0.1, presence_penalty=1.0),
              SamplingParams(temperature=1.0, logit_bias={3: 5.0}, logprobs=2)]
    for k in range(len(others) + 1):
        params = others[:k] + [sp] + others[k:]
        logits = torch.cat([_logits(k, vocab, seed=11), base,
                            _logits(len(others) - k, vocab, seed=12)])
        seeds = [1, 2, 3, 4, 5]
        seeds[k] = 42
        out, _ = _sample(_states(vocab, params, seeds=seeds), logits, [5, 6, 7, 8, 9][:k]
                         + [17] + [5, 6, 7, 8][k:])
        assert out.token_ids[k] == alone.token_ids[0]


def test_counter_uniform_is_a_function_of_seed_position_and_column():
    u1 = counter_uniform(torch.tensor([3, 3, 4]), torch.tensor([0, 1, 0]), 1000)
    u2 = counter_uniform(torch.tensor([4, 3]), torch.tensor([0, 1]), 1000)
    assert torch.equal(u1[2], u2[0]) and torch.equal(u1[1], u2[1])
    assert not torch.equal(u1[0], u1[1]) and not torch.equal(u1[0], u1[2])
    assert 0.0 < float(u1.min()) and float(u1.max()) < 1.0
    assert abs(float(u1.mean()) - 0.5) < 0.02


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum()
    expected = probs * n
    return float(((counts - expected) ** 2 / expected).sum())


# chi-square 0.999 quantiles: a correct sampler fails one run in a thousand (the draws below are
# seeded, so each run is the same)
_CHI2_999 = {3: 16.27, 7: 24.32}


@pytest.mark.parametrize("temperature", [0.6, 1.0, 1.7])
def test_temperature_sampling_matches_softmax(temperature):
    vocab, n = 8, 20000
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5, 2.0, 1.5, -1.0, 0.2]])
    params = [SamplingParams(temperature=temperature, seed=7)] * n
    out, _ = _sample(_states(vocab, params, seeds=[7] * n), logits.expand(n, vocab),
                     list(range(n)))  # one seed, n positions: n independent draws
    counts = torch.bincount(out.token_ids, minlength=vocab).float()
    probs = (logits[0] / temperature).softmax(-1)
    assert _chi_square(counts, probs) < _CHI2_999[7]
    # the bound has power: the same counts against the distribution at T=1 (or T=0.6) fail
    other = (logits[0] / (1.0 if temperature != 1.0 else 0.6)).softmax(-1)
    assert _chi_square(counts, other) > 10 * _CHI2_999[7]


def test_top_k_top_p_sampling_matches_renormalized_softmax():
    vocab, n = 8, 20000
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5, 2.0, 1.5, -1.0, 0.2]])
    params = [SamplingParams(temperature=1.0, top_k=6, top_p=0.8, seed=3)] * n
    out, _ = _sample(_states(vocab, params, seeds=[3] * n), logits.expand(n, vocab),
                     list(range(n)))
    probs = logits[0].softmax(-1)
    order = probs.argsort(descending=True)
    keep = torch.zeros(vocab, dtype=torch.bool)
    mass = 0.0
    for t in order[:6].tolist():  # top-6, then the nucleus: tokens until mass >= 0.8
        if mass >= 0.8:
            break
        keep[t] = True
        mass += float(probs[t] / probs[order[:6]].sum())
    counts = torch.bincount(out.token_ids, minlength=vocab).float()
    assert (counts[~keep] == 0).all()
    kept = probs[keep] / probs[keep].sum()
    assert int(keep.sum()) == 4
    assert _chi_square(counts[keep], kept) < _CHI2_999[3]


# ---- log-probs -------------------------------------------------------------------------------

def test_logprobs_are_log_softmax_of_the_raw_logits():
    """Top-N, the sampled token's log-prob and rank come from the raw logits, before the
    penalties, the bias and the temperature (vLLM's default raw_logprobs)."""
    vocab = 50
    logits = _logits(4, vocab, seed=13)
    params = [SamplingParams(temperature=0.5, logprobs=5, presence_penalty=2.0,
                             logit_bias={1: 30.0}),
              SamplingParams(temperature=0.0),  # no logprobs in the same batch
              SamplingParams(temperature=1.0, logprobs=0, top_k=3),
              SamplingParams(temperature=0.0, logprobs=20)]
    out, batch = _sample(_states(vocab, params), logits, [3, 3, 3, 3])
    assert batch.logprob_rows.tolist() == [0, 2, 3] and batch.num_logprobs == 20
    ref = torch.log_softmax(logits, dim=-1)
    lp = out.logprobs
    assert lp.token_ids.shape == (3, 21) and lp.logprobs.shape == (3, 21)
    for j, row in enumerate([0, 2, 3]):
        tok = int(out.token_ids[row])
        assert int(lp.token_ids[j, 0]) == tok
        assert float(lp.logprobs[j, 0]) == pytest.approx(float(ref[row, tok]), abs=1e-6)
        assert int(lp.ranks[j]) == int((ref[row] >= ref[row, tok]).sum())
        top = ref[row].topk(20)
        assert lp.token_ids[j, 1:].tolist() == top.indices.tolist()
        torch.testing.assert_close(lp.logprobs[j, 1:], top.values)
    assert int(out.token_ids[0]) == 1  # the bias decided the draw ...
    assert int(lp.ranks[0]) > 1  # ... but the log-probs are the raw model's
    assert int(lp.ranks[2]) == 1  # greedy on raw logits is rank 1
    assert math.isclose(float(lp.logprobs[2].exp().sum() - lp.logprobs[2, 0].exp()),
                        float(ref[3].topk(20).values.exp().sum()), rel_tol=1e-5)
