"""The model runner's one record per request (`RunnerRequest`) and its prompt log-prob jobs."""

from __future__ import annotations

from dataclasses import dataclass

from .sampling_state import SamplingState


@dataclass
class RunnerRequest:
    """The runner's one record of a request, from its first scheduled step until it finishes.

    row: its row in the input batch while it runs, -1 while preempted. prompt_token_ids: kept
    when its sampling needs them (`SamplingState.needs_prompt`). min_tokens_ids: the sampling
    state's, without ids past the vocabulary. penalty_slot: its row in `PenaltyState` (0 =
    none). next_prompt_logprob: prompt index of the next prompt log-prob to hand out (a
    recompute after preemption does not hand them out twice).
    """

    request_id: str
    sampling: SamplingState
    prompt_token_ids: list[int] | None
    min_tokens_ids: list[int]
    row: int = -1
    penalty_slot: int = 0
    next_prompt_logprob: int = 1


@dataclass
class PromptLogprobsJob:
    """Prompt log-prob rows of one request in this step: flattened rows ``row0 ..
    row0 + len(targets) - 1`` predict prompt tokens ``targets``, the first at prompt index
    ``start``."""

    request_id: str
    row0: int
    start: int
    targets: list[int]
    num: int
