"""The requests of ``pagebatch bench serve``: a fixed, seeded dataset of random prompts.

Lengths as vLLM's random dataset draws them: input and output lengths uniform integers in
[L * (1 - r), L * (1 + r)] for ``--range-ratio`` r (0: every request exactly L), each prompt
optionally preceded by one ``--shared-prefix-len`` prefix common to all requests (a system
prompt: the prefix cache's case). Prompts are token ids (exact lengths; /v1/completions) or as
many random words (text: any endpoint, the server's tokenizer decides the token count).

The lengths depend on ``seed`` only; the contents on ``seed`` and ``variant``, so the runs of a
``--rates`` sweep send requests of the same lengths but of different tokens (no run hits the
prefix cache that the one before left).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Union

WORDS = ("the of and to in is you that it he was for on are as with his they at be this "
         "have from or one had by word but not what all were we when your can said there use "
         "an each which she do how their if will up other about out many then them these so "
         "some her would make like him into time has look two more write go see number no way "
         "could people my than first water been call who oil its now find long down day did "
         "get come made may part").split()

Prompt = Union[str, list[int]]


@dataclass(frozen=True)
class ServeRequest:
    """One request: ``prompt`` (token ids or text), ``prompt_len`` (ids or words, the shared
    prefix included) and ``output_len`` (max_tokens)."""

    prompt: Prompt
    prompt_len: int
    output_len: int


@dataclass(frozen=True)
class DatasetSpec:
    """``num_prompts`` requests of ``input_len`` / ``output_len`` tokens (each scaled by
    ``range_ratio`` in [0, 1)), after ``shared_prefix_len`` common tokens; ``token_ids`` or
    text; ids drawn from [min(100, vocab_size // 4), min(vocab_size, 10000))."""

    num_prompts: int
    input_len: int
    output_len: int
    range_ratio: float = 0.0
    shared_prefix_len: int = 0
    token_ids: bool = True
    vocab_size: int = 32000
    seed: int = 0

    def check(self) -> None:
        """Raises ValueError naming the value and its limit."""
        for name, v, lo in (("num_prompts", self.num_prompts, 1), ("input_len", self.input_len, 1),
                            ("output_len", self.output_len, 1),
                            ("shared_prefix_len", self.shared_prefix_len, 0),
                            ("vocab_size", self.vocab_size, 2)):
            if v < lo:
                raise ValueError(f"--{name.replace('_', '-')} must be >= {lo}, got {v}")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError(f"--range-ratio must be in [0, 1), got {self.range_ratio}")


def length_range(n: int, ratio: float) -> tuple[int, int]:
    """The inclusive [low, high] of a length ``n`` scaled by ``ratio`` (low at least 1)."""
    return max(1, int(n * (1 - ratio))), max(1, int(n * (1 + ratio)))


def make_dataset(spec: DatasetSpec, variant: int = 0) -> list[ServeRequest]:
    """The requests of ``spec`` (raises ValueError when it is out of range); ``variant``
    changes the contents, not the lengths."""
    spec.check()
    lengths = random.Random(spec.seed)
    in_lo, in_hi = length_range(spec.input_len, spec.range_ratio)
    out_lo, out_hi = length_range(spec.output_len, spec.range_ratio)
    lens = [(lengths.randint(in_lo, in_hi), lengths.randint(out_lo, out_hi))
            for _ in range(spec.num_prompts)]
    rng = random.Random(f"pagebatch-bench-serve:{spec.seed}:{variant}")
    hi = min(spec.vocab_size, 10000)
    lo = min(100, spec.vocab_size // 4)

    def draw(k: int) -> list:
        if spec.token_ids:
            return [rng.randrange(lo, hi) for _ in range(k)]
        return [rng.choice(WORDS) for _ in range(k)]

    prefix = draw(spec.shared_prefix_len)
    out = []
    for n_in, n_out in lens:
        body = prefix + draw(n_in)
        prompt: Prompt = body if spec.token_ids else " ".join(body)
        out.append(ServeRequest(prompt, len(body), n_out))
    return out
