"""The one shared helper for comparing numerics (DESIGN.md, "Testing numerics").

Float sums change with batch composition, chunking and kernels. "The same greedy tokens" means
identical, except that two runs may part ways right after a near-tie in the reference: a
position where the reference's top-2 log-probability gap is below NEAR_TIE_EPS. Logits are
compared on the same tokens within LOGITS_ATOL (fp32).
"""

from __future__ import annotations

import torch

NEAR_TIE_EPS = 1e-3  # log-prob units; fp32 engines here agree to ~1e-5 on SmolLM2's logits
LOGITS_ATOL = 2e-3  # fp32, absolute, on logits of magnitude up to ~30
LOGITS_RTOL = 1e-4


def top2_gaps(logits: torch.Tensor) -> list[float]:
    """logits: [n, vocab] -> gap between the best and second-best log-prob at each row."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    top = lp.topk(2, dim=-1).values
    return (top[:, 0] - top[:, 1]).tolist()


def assert_greedy_match(ref_tokens: list[int], ref_gaps: list[float], got_tokens: list[int],
                        eps: float = NEAR_TIE_EPS, what: str = "") -> None:
    """Tokens equal up to the end, or up to a first difference at a near-tie of the reference.

    ref_gaps[i] is the reference's top-2 gap when it chose ref_tokens[i].
    """
    n = min(len(ref_tokens), len(got_tokens))
    for i in range(n):
        if ref_tokens[i] != got_tokens[i]:
            assert ref_gaps[i] < eps, (
                f"{what}: tokens part at position {i} ({ref_tokens[i]} vs {got_tokens[i]}) "
                f"where the reference's top-2 gap {ref_gaps[i]:.2e} is not a near-tie "
                f"(< {eps})\nref: {ref_tokens}\ngot: {got_tokens}")
            return
    assert len(ref_tokens) == len(got_tokens), (
        f"{what}: same tokens but different lengths {len(ref_tokens)} vs {len(got_tokens)}")


def greedy_one_by_one(llm, prompts: list[list[int]],
                      sp) -> tuple[list[list[int]], list[list[float]]]:
    """An engine's greedy tokens for each prompt generated alone (every decode step one row),
    and the top-2 gap where each token was chosen (one forward over prompt + tokens)."""
    runner = llm.engine.core.runner
    tokens, gaps = [], []
    for p in prompts:
        t = list(llm.generate({"prompt_token_ids": p}, sp, use_tqdm=False)[0].outputs[0]
                 .token_ids)
        tokens.append(t)
        gaps.append(top2_gaps(runner.forward_scratch(p + t[:-1])[len(p) - 1:]))
    return tokens, gaps


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy tokens from a transformers model (stopping at EOS, which is included) and the
    top-2 gap of the raw logits at each step."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens,
                             do_sample=False,
                             output_logits=True, return_dict_in_generate=True,
                             pad_token_id=0)
    tokens = out.sequences[0, len(prompt):].tolist()
    logits = torch.cat([x.float() for x in out.logits], dim=0)
    return tokens, top2_gaps(logits)
