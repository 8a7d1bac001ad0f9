"""The batched sampler, on the logits' device: logit bias, min-tokens masking, penalties, greedy,
temperature, min-p, top-k and top-p, and log-probs.

The order is vLLM v1's: log-probs of the raw model distribution first (vLLM's default
``raw_logprobs``); then logit bias and the min-tokens mask; then the repetition, frequency and
presence penalties; greedy rows take the argmax of those logits; the rest are divided by their
temperature and filtered by min-p, top-k and top-p before the draw. A processor runs only when
some row of the batch asks for it (a host flag or a None field in `SamplingBatch`), so a plain
greedy batch is one argmax.

Random draws use a counter-based generator keyed on (request seed, token position, vocab index):
the SplitMix64 finalizer (Steele et al., "Fast splittable pseudorandom number generators",
OOPSLA 2014) over 64-bit integer tensors. A seeded request therefore samples the same tokens
alone or in any batch, and there is no generator state to carry (graph-capturable). Sampling is
Gumbel-max: ``argmax(logits / T - log(-log u))`` equals a draw from ``softmax(logits / T)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .request import GREEDY_EPS

if TYPE_CHECKING:
    from .structured_output import StructuredOutputBatch


def _u64(c: int) -> int:
    """A uint64 constant as the int64 with the same bits."""
    return c - (1 << 64) if c >= (1 << 63) else c


_GOLDEN = _u64(0x9E3779B97F4A7C15)
_M1 = _u64(0xBF58476D1CE4E5B9)
_M2 = _u64(0x94D049BB133111EB)


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bits."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def counter_uniform(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """u in (0, 1): [n, vocab] fp32, a pure function of (seed, position, column).

    seeds, positions: [n] int64 on the target device.
    """
    col = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    return counter_uniform_at(seeds, positions, col[None, :])


def counter_uniform_at(seeds: torch.Tensor, positions: torch.Tensor,
                       cols: torch.Tensor) -> torch.Tensor:
    """`counter_uniform` at the vocabulary columns ``cols`` only: [n, w] int64 (or [1, w])
    -> [n, w] fp32, equal to ``counter_uniform(...)[i, cols[i, j]]``."""
    z = (seeds[:, None] * _GOLDEN + positions[:, None]) * _M1 + cols * _GOLDEN
    z = (z ^ _shr(z, 30)) * _M1
    z = (z ^ _shr(z, 27)) * _M2
    z = z ^ _shr(z, 31)
    bits = _shr(z, 41)  # top 23 bits: (bits + 0.5) / 2**23 is exact in fp32, so u < 1
    return (bits.float() + 0.5) * (1.0 / (1 << 23))


@dataclass
class PenaltyBatch:
    """Penalty inputs of one step, built only when some row has a penalty; rows without one carry
    neutral values (presence 0, frequency 0, repetition 1) and zero counts.

    output_counts: [n, vocab] int32, occurrences of each token in the row's output so far.
    prompt_mask: [n, vocab] bool, tokens of the row's prompt; None when no row has a repetition
    penalty. presence, frequency, repetition: [n] fp32.
    """

    output_counts: torch.Tensor
    prompt_mask: torch.Tensor | None
    presence: torch.Tensor
    frequency: torch.Tensor
    repetition: torch.Tensor


@dataclass
class SamplingBatch:
    """Per-row sampling parameters of one step, as tensors on the logits' device.

    temperature: [n] fp32 (below GREEDY_EPS = greedy); top_k: [n] int64 (0 = off); top_p: [n]
    fp32; seeds, positions: [n] int64 (position = index of the token being sampled).
    all_greedy / any_top_k / any_top_p: host flags that pick the fast paths. top_k_width: when
    > 0, every row that draws keeps at most that many tokens (1 <= top_k <= top_k_width): the
    draw runs over each row's top_k_width candidates instead of the whole vocabulary.
    min_p: [n] fp32, or None when no row asks. penalties: see `PenaltyBatch`, or None.
    bias_rows / bias_token_ids / bias_values: [m] int64, int64, fp32 (logit_bias entries), or
    None. masked_rows / masked_token_ids: [m] int64 entries set to -inf (EOS and stop token ids
    of rows still short of min_tokens), or None.
    logprob_rows: [r] int64 rows that want log-probs, or None; num_logprobs: the largest N
    among them (each row's own N is cut on the host).
    """

    temperature: torch.Tensor | None  # the five are None when all_greedy
    top_k: torch.Tensor | None
    top_p: torch.Tensor | None
    seeds: torch.Tensor | None
    positions: torch.Tensor | None
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    min_p: torch.Tensor | None = None
    penalties: PenaltyBatch | None = None
    bias_rows: torch.Tensor | None = None
    bias_token_ids: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None
    masked_rows: torch.Tensor | None = None
    masked_token_ids: torch.Tensor | None = None
    logprob_rows: torch.Tensor | None = None
    num_logprobs: int = 0
    top_k_width: int = 0


@dataclass
class LogprobsTensors:
    """Log-probs of r positions (vLLM's ``LogprobsTensors``): column 0 is the position's actual
    token, columns 1..N its top-N. token_ids: [r, 1+N] int64; logprobs: [r, 1+N] fp32;
    ranks: [r] int64, the actual token's rank (1 = most likely; ties count against it)."""

    token_ids: torch.Tensor
    logprobs: torch.Tensor
    ranks: torch.Tensor


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [n] int64
    logprobs: LogprobsTensors | None  # of batch.logprob_rows, None when no row asks


class Sampler:
    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """logits: [n, vocab] fp32 (not modified) -> sampled ids [n] int64 and log-probs."""
        raw = None
        if batch.logprob_rows is not None:
            raw = compute_logprobs(logits[batch.logprob_rows])
        logits = apply_logits_processors(logits, batch)
        tokens = sample(logits, batch)
        lp = None
        if raw is not None:
            lp = gather_logprobs(raw, tokens[batch.logprob_rows], batch.num_logprobs)
        return SamplerOutput(tokens, lp)


def apply_logits_processors(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Logit bias, the min-tokens mask and the penalties (out of place). logits: [n, vocab]."""
    if batch.bias_rows is not None:
        logits = logits.index_put((batch.bias_rows, batch.bias_token_ids), batch.bias_values,
                                  accumulate=True)
    if batch.masked_rows is not None:
        rows = batch.masked_rows
        logits = logits.index_put((rows, batch.masked_token_ids),
                                  torch.full(rows.shape, float("-inf"), device=logits.device))
    if batch.penalties is not None:
        logits = apply_penalties(logits, batch.penalties)
    return logits


def apply_token_bitmask(logits: torch.Tensor, batch: "StructuredOutputBatch",
                        sample_ids: list[str]) -> torch.Tensor:
    """Set the logits of tokens that ``batch``'s bitmask forbids to -inf (out of place).
    logits: [n, vocab] fp32, row i the logits of ``sample_ids[i]``; returns [n, vocab] fp32.
    Rows of requests not in the batch are untouched (core/structured_output.py). The batch's
    ``rows`` are its logits rows when set (the engine core's; ``sample_ids`` is then not read),
    else they are found by id. The bitmask and its rows go to the device as two asynchronous
    copies from pinned memory, only in steps with a constrained row."""
    if batch.rows is not None:
        picked, bitmask = batch.rows, batch.bitmask
    else:
        index = {rid: i for i, rid in enumerate(sample_ids)}
        pairs = [(index[rid], j) for j, rid in enumerate(batch.request_ids) if rid in index]
        picked, bitmask = [p[0] for p in pairs], batch.bitmask[[p[1] for p in pairs]]
    if not picked:
        return logits
    dev = logits.device
    rows = torch.tensor(picked, dtype=torch.long)
    words = torch.from_numpy(bitmask)
    if dev.type == "cuda":  # from pinned memory: the copies do not wait for the forward
        rows = rows.pin_memory().to(dev, non_blocking=True)
        words = words.pin_memory().to(dev, non_blocking=True)
    shifts = torch.arange(32, dtype=torch.int32, device=dev)
    allowed = ((words[:, :, None] >> shifts) & 1).bool().flatten(1)[:, :logits.shape[1]]
    out = logits.clone()
    out[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
    return out


def apply_penalties(logits: torch.Tensor, p: PenaltyBatch) -> torch.Tensor:
    """vLLM's (and OpenAI's) definitions. Repetition (CTRL, Keskar et al. 2019) over prompt and
    output tokens: a positive logit is divided by the penalty, a negative one multiplied.
    Frequency and presence over output tokens: ``logit -= frequency * count + presence *
    (count > 0)``. logits: [n, vocab] fp32 -> new [n, vocab] fp32."""
    counts = p.output_counts
    seen = counts > 0
    if p.prompt_mask is not None:
        rep = torch.where(seen | p.prompt_mask, p.repetition[:, None], 1.0)
        logits = torch.where(logits > 0, logits / rep, logits * rep)
    return (logits - p.frequency[:, None] * counts
            - p.presence[:, None] * seen.to(logits.dtype))


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` of [n, vocab]: on CUDA core/kernels/argmax.py (one row spread over
    many programs: torch's reduction gives a row one block, ~27 us at batch 1 on an H200)."""
    if x.is_cuda:
        from .kernels.argmax import argmax_rows

        return argmax_rows(x)
    return x.argmax(dim=-1)


def sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Greedy rows: argmax (first index on ties). Other rows: temperature, min-p, top-k, top-p,
    then a Gumbel-max draw. logits: [n, vocab] fp32 -> [n] int64."""
    greedy = row_argmax(logits)
    if batch.all_greedy:
        return greedy
    is_greedy = batch.temperature < GREEDY_EPS
    # fp32 and T >= GREEDY_EPS: |logits| / T stays far below fp32's range
    temp = torch.where(is_greedy, torch.ones_like(batch.temperature), batch.temperature)
    if batch.top_k_width:
        sampled = sample_top_k_candidates(logits, temp, batch)
        return torch.where(is_greedy, greedy, sampled)
    x = logits / temp[:, None]
    if batch.min_p is not None:
        x = apply_min_p(x, batch.min_p)
    if batch.any_top_k or batch.any_top_p:
        x = apply_top_k_top_p(x, batch.top_k if batch.any_top_k else None,
                              batch.top_p if batch.any_top_p else None)
    u = counter_uniform(batch.seeds, batch.positions, x.shape[-1])
    gumbel = -torch.log(-torch.log(u))
    sampled = row_argmax(x + gumbel)
    return torch.where(is_greedy, greedy, sampled)


def order_keys_torch(x: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
    """Sort keys of logits: x [n, V] fp32 at vocabulary ids ``ids`` (same shape, int64; default:
    the column index), ids < 2**32 -> [n, V] int64 that order like (value descending, id
    ascending), so that ``topk(keys, w)`` holds exactly the first w entries of a stable
    descending sort (no tie left for topk to break). Key: ``(ordered(x) << 32) | (0xFFFFFFFF -
    id)``; ``ordered`` maps fp32 bits to int32 in float order (a negative float's 31 low bits
    flipped; -0.0 made +0.0 first, as the zeros tie)."""
    b = torch.where(x == 0.0, 0.0, x.float()).view(torch.int32)
    b = b ^ ((b >> 31) & 0x7FFFFFFF)
    if ids is None:
        ids = torch.arange(x.shape[-1], device=x.device, dtype=torch.int64)
    return (b.to(torch.int64) << 32) | (0xFFFFFFFF - ids)


TOP_K_CHUNK = 2048  # columns per row piece of the first top-k stage, for few rows
TOP_K_MIN_ROWS = 32  # from this many rows, one topk over whole rows


def top_k_ids(logits: torch.Tensor, w: int) -> torch.Tensor:
    """Each row's first w vocabulary ids in (logit descending, id ascending) order: logits
    [n, V] fp32 -> [n, w] int64 (w <= V), the first w of a stable descending sort.

    On the CPU: ``topk`` of `order_keys_torch` (exact by construction). On CUDA: an fp32
    ``topk`` picks the candidates (torch's CUDA top-k takes the lowest indices among values
    tied at the k-th: tests/test_sampler_gpu.py holds it to that), then the keys of those
    candidates order them; with fewer than TOP_K_MIN_ROWS rows the first stage runs on pieces
    of TOP_K_CHUNK columns (one row then spreads over many thread blocks) and the keys pick
    the row's w among the pieces' candidates. On an H200 the whole sampled step takes 1.21 ms
    at 256 rows of 128256 this way, 6.79 ms with the sort (scripts/bench_sampler.py;
    docs/benchmarks.md, session 11)."""
    n, v = logits.shape
    if not logits.is_cuda:
        return _key_ids(order_keys_torch(logits).topk(w, dim=-1).values)
    chunks = -(-v // TOP_K_CHUNK)
    if n >= TOP_K_MIN_ROWS or chunks < 2 or w > TOP_K_CHUNK:
        vals, ids = logits.topk(w, dim=-1, sorted=False)
    else:
        padded = torch.nn.functional.pad(logits, (0, chunks * TOP_K_CHUNK - v),
                                         value=float("-inf"))
        vals, ids = padded.view(n * chunks, TOP_K_CHUNK).topk(w, dim=-1, sorted=False)
        base = torch.arange(0, chunks * TOP_K_CHUNK, TOP_K_CHUNK, device=logits.device)
        ids = (ids.view(n, chunks, w) + base[:, None]).view(n, chunks * w)
        vals = vals.view(n, chunks * w)  # padding: -inf at ids >= V, which rank last
    return _key_ids(order_keys_torch(vals, ids).topk(w, dim=-1).values)


def _key_ids(keys: torch.Tensor) -> torch.Tensor:
    return 0xFFFFFFFF - (keys & 0xFFFFFFFF)


def sample_top_k_candidates(logits: torch.Tensor, temp: torch.Tensor,
                            batch: SamplingBatch) -> torch.Tensor:
    """The draw of `sample` for batches whose drawing rows all have 1 <= top_k <=
    ``batch.top_k_width`` = w: the same tokens as the full-vocabulary path without a sort of the
    vocabulary. logits: [n, V] fp32; temp: [n] fp32 (1 for greedy rows) -> [n] int64.

    The candidates are each row's first w tokens in (logit descending, id ascending) order
    (`top_k_ids`); the row's top-k, min-p and top-p are applied to them in
    that order, and the Gumbel noise is `counter_uniform` at their ids, so the draw equals
    the full path's. A row's result does not depend on w, as long as the fp32 reductions over
    the candidates (softmax, cumsum) do not (w is the batch's largest top_k rounded up to a
    power of two of at least 64: rows with top_k <= 64 always see w = 64)."""
    ids = top_k_ids(logits, batch.top_k_width)  # [n, w] int64
    x = logits.gather(1, ids) / temp[:, None]  # descending per row
    w = ids.shape[1]
    keep = torch.arange(w, device=x.device)[None, :] < batch.top_k[:, None]
    if batch.min_p is not None:  # x[:, 0] is the row's largest
        keep &= x >= x[:, :1] + torch.log(batch.min_p)[:, None]
    if batch.any_top_p:
        probs = x.masked_fill(~keep, float("-inf")).softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass strictly above this token
        keep &= before < batch.top_p[:, None]
    keep[:, 0] = True
    u = counter_uniform_at(batch.seeds, batch.positions, ids)
    scores = x.masked_fill(~keep, float("-inf")) - torch.log(-torch.log(u))
    return ids.gather(1, scores.argmax(dim=-1, keepdim=True)).squeeze(1)


def apply_min_p(x: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is below ``min_p`` times the row's largest (Nguyen et al.,
    "Min-p sampling", 2024), in log space: keep ``x >= max(x) + log(min_p)``; no sort.
    x: [n, vocab] fp32 (temperature applied); min_p: [n] fp32, 0 = off."""
    threshold = x.amax(dim=-1, keepdim=True) + torch.log(min_p)[:, None]
    return x.masked_fill(x < threshold, float("-inf"))


def apply_top_k_top_p(x: torch.Tensor, top_k: torch.Tensor | None,
                      top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask logits outside each row's top-k and nucleus (top-p) to -inf. x: [n, vocab] fp32.

    top_k: [n] int64, 0 or >= vocab = off; top_p: [n] fp32, 1.0 = off. One sort, only when
    asked; a stable sort, so that among equal logits the lowest id ranks first, as argmax
    breaks ties (top_k=1 is greedy).
    """
    vocab = x.shape[-1]
    sorted_x, idx = x.sort(dim=-1, descending=True, stable=True)
    keep = torch.ones_like(sorted_x, dtype=torch.bool)
    if top_k is not None:
        k = torch.where(top_k <= 0, torch.full_like(top_k, vocab), top_k.clamp(max=vocab))
        keep &= torch.arange(vocab, device=x.device)[None, :] < k[:, None]
    if top_p is not None:
        probs = sorted_x.masked_fill(~keep, float("-inf")).softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass strictly above this token
        keep &= before < top_p[:, None]
    keep[:, 0] = True
    mask = torch.empty_like(keep).scatter_(1, idx, keep)
    return x.masked_fill(~mask, float("-inf"))


def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """[r, vocab] -> log_softmax in fp32."""
    return torch.log_softmax(logits.float(), dim=-1)


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor,
                    num: int) -> LogprobsTensors:
    """The actual tokens' log-probs and ranks plus each row's top-``num``.

    logprobs: [r, vocab] fp32 (log_softmax); token_ids: [r] int64; num >= 0.
    """
    tok = token_ids.long()[:, None]
    tok_lp = logprobs.gather(-1, tok)
    ranks = (logprobs >= tok_lp).sum(dim=-1)
    if num > 0:
        top_lp, top_ids = logprobs.topk(num, dim=-1)
        return LogprobsTensors(torch.cat([tok, top_ids], 1), torch.cat([tok_lp, top_lp], 1),
                               ranks)
    return LogprobsTensors(tok, tok_lp, ranks)
