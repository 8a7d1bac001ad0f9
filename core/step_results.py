"""What a model step hands back, and how it gets to the host: `RunnerOutput`, the
`LaunchedStep` in flight, the one device-to-host copy, and the prompt log-prob jobs.

A launched step's results (sampled ids and any log-probs) start back to the host in one
non-blocking copy into pinned memory (`start_copy_back`); `collect` waits for it. Log-probs are
packed with the ids as fp64, which holds token ids and fp32 values exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from .runner_request import PromptLogprobsJob
from .request import LogprobsLists
from .sampler import LogprobsTensors, compute_logprobs, gather_logprobs

PROMPT_LOGPROBS_CHUNK = 512  # prompt rows per logits computation (bounds [rows, vocab] memory)


@dataclass
class RunnerOutput:
    """What one step gives back, on the host: request id -> sampled token id; log-probs of the
    sampled token (requests that asked for ``logprobs``) and of the prompt positions computed in
    this step (requests that asked for ``prompt_logprobs``), request id -> `LogprobsLists`."""

    sampled: dict[str, int]
    logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    prompt_logprobs: dict[str, LogprobsLists] = field(default_factory=dict)


@dataclass
class LaunchedStep:
    """A launched step (`ModelRunner.execute_async`): its device results and, once the copy
    back has started, the pinned host tensor they land in and the event that marks it done."""

    sample_ids: list[str]
    tokens: torch.Tensor | None = None  # [n] int64 on the device
    sample_lp: LogprobsTensors | None = None
    prompt_jobs: list[PromptLogprobsJob] = field(default_factory=list)
    prompt_lp: LogprobsTensors | None = None
    host: torch.Tensor | None = None
    done: Any = None  # torch.cuda.Event, None on the CPU
    logprob_widths: list[tuple[str, int]] = field(default_factory=list)  # (id, 1 + N)


def start_copy_back(h: LaunchedStep) -> LaunchedStep:
    """Start the one device-to-host copy of ``h``'s results: sampled ids, or, with
    log-probs, everything packed as fp64 (which holds token ids and fp32 values exactly)."""
    parts: list[torch.Tensor] = [] if h.tokens is None else [h.tokens]
    for lp in (h.sample_lp, h.prompt_lp):
        if lp is not None:
            parts += [lp.token_ids.flatten(), lp.logprobs.flatten(), lp.ranks]
    if not parts:
        return h
    packed = parts[0] if len(parts) == 1 else torch.cat([p.to(torch.float64) for p in parts])
    cuda = packed.device.type == "cuda"
    h.host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=cuda)
    h.host.copy_(packed, non_blocking=cuda)
    if cuda:
        h.done = torch.cuda.Event()
        h.done.record()
    return h


def collect(h: LaunchedStep) -> RunnerOutput:
    """Wait for a launched step and return its results on the host."""
    if h.done is not None:
        h.done.synchronize()
    if h.host is None:
        return RunnerOutput({})
    if h.sample_lp is None and h.prompt_lp is None:
        return RunnerOutput(dict(zip(h.sample_ids, h.host.tolist())))
    return _unpack(h)


def prompt_logprobs(compute_logits: Callable[[torch.Tensor], torch.Tensor],
                    hidden: torch.Tensor, jobs: list[PromptLogprobsJob], rows: torch.Tensor,
                    targets: torch.Tensor) -> LogprobsTensors:
    """Log-probs of every job's prompt rows, PROMPT_LOGPROBS_CHUNK rows of logits at a
    time, with the largest N of the jobs. rows: [m] int64, the jobs' rows of ``hidden``
    [T, H]; targets: [m] int64, the prompt token each row predicts (the step's sampling
    inputs, already on the device)."""
    num = max(j.num for j in jobs)
    parts = []
    for a in range(0, rows.shape[0], PROMPT_LOGPROBS_CHUNK):
        r = rows[a:a + PROMPT_LOGPROBS_CHUNK]
        lp = compute_logprobs(compute_logits(hidden[r]))
        parts.append(gather_logprobs(lp, targets[a:a + PROMPT_LOGPROBS_CHUNK], num))
    return LogprobsTensors(torch.cat([p.token_ids for p in parts]),
                           torch.cat([p.logprobs for p in parts]),
                           torch.cat([p.ranks for p in parts]))


def _unpack(h: LaunchedStep) -> RunnerOutput:
    """Split the packed fp64 copy of ``h`` into sampled ids and `LogprobsLists`."""
    step_lps: dict[str, LogprobsLists] = {}
    step_prompt_lps: dict[str, LogprobsLists] = {}
    sample_ids, tokens_t, sample_lp, jobs, prompt_lp = (
        h.sample_ids, h.tokens, h.sample_lp, h.prompt_jobs, h.prompt_lp)
    host = h.host.numpy()
    n = 0 if tokens_t is None else tokens_t.shape[0]
    tokens = host[:n].astype(np.int64).tolist()
    off = n

    def take(lp: LogprobsTensors) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        nonlocal off
        r, w = lp.token_ids.shape
        ids = host[off:off + r * w].astype(np.int64).reshape(r, w)
        vals = host[off + r * w:off + 2 * r * w].reshape(r, w)
        ranks = host[off + 2 * r * w:off + 2 * r * w + r].astype(np.int64)
        off += 2 * r * w + r
        return ids, vals, ranks

    if sample_lp is not None:
        ids, vals, ranks = take(sample_lp)
        for i, (rid, w) in enumerate(h.logprob_widths):
            step_lps[rid] = LogprobsLists(
                [ids[i, :w].tolist()], [vals[i, :w].tolist()], [int(ranks[i])])
    if prompt_lp is not None:
        ids, vals, ranks = take(prompt_lp)
        a = 0
        for j in jobs:
            b, w = a + len(j.targets), 1 + j.num
            step_prompt_lps[j.request_id] = LogprobsLists(
                ids[a:b, :w].tolist(), vals[a:b, :w].tolist(), ranks[a:b].tolist(), j.start)
            a = b
    return RunnerOutput(dict(zip(sample_ids, tokens)), step_lps, step_prompt_lps)
