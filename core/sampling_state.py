"""`SamplingState`: a request's sampling parameters as the model runner needs them.

Built once, in `EngineCore.add_request`, from the `SamplingParams` and the seed the front half
drew, and kept on the `Request`; it reaches the runner inside the scheduler output's new-request
record (the first time the request is scheduled, or when it resumes after preemption). It is
plain data (no torch): the runner writes it into its input batch's sampling columns
(core/sampling_columns.py) once, when the request gets a row.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from .request import SamplingParams


@dataclass(frozen=True)
class SamplingState:
    """What the runner keeps per request (set once, at admission).

    top_k: 0 = off. seed: 63-bit, the request's own or one drawn for it. min_tokens_ids: EOS ids
    and stop_token_ids, masked out of the logits while fewer than min_tokens outputs exist.
    num_prompt_tokens: the prompt's length (a sampled position minus it is the output count).
    logprobs / prompt_logprobs: the N asked for, or None.
    """

    temperature: float
    top_k: int
    top_p: float
    seed: int
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    min_tokens_ids: tuple[int, ...] = field(default_factory=tuple)
    num_prompt_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    @classmethod
    def from_params(cls, sp: SamplingParams, seed: int, prompt_token_ids: list[int],
                    eos_token_ids: Iterable[int]) -> "SamplingState":
        return cls(
            temperature=float(sp.temperature), top_k=sp.top_k if sp.top_k > 0 else 0,
            top_p=float(sp.top_p), seed=seed, min_p=float(sp.min_p),
            presence_penalty=float(sp.presence_penalty),
            frequency_penalty=float(sp.frequency_penalty),
            repetition_penalty=float(sp.repetition_penalty),
            logit_bias=dict(sp.logit_bias) if sp.logit_bias else None,
            min_tokens=sp.min_tokens,
            min_tokens_ids=tuple(sorted(set(eos_token_ids) | set(sp.stop_token_ids)))
            if sp.min_tokens > 0 else (),
            num_prompt_tokens=len(prompt_token_ids),
            logprobs=sp.logprobs, prompt_logprobs=sp.prompt_logprobs)

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def needs_prompt(self) -> bool:
        """Whether the runner keeps the prompt's token ids (a repetition penalty's prompt mask,
        prompt log-probs' targets)."""
        return self.repetition_penalty != 1.0 or self.prompt_logprobs is not None
