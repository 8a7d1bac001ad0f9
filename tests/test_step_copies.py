"""One host-to-device copy of step inputs per step, greedy or sampled (issue 21).

CPU: every input tensor the sampler reads (temperature, top-k/p, min-p, seeds, positions,
penalty rows and values, logit-bias and min-tokens entries, log-prob rows) is a view of the
step's pinned staging buffer -- none was built from a host list on its own.
GPU: the profiler counts the host-to-device memcpys of decode steps: exactly one per step, for a
greedy batch and for a sampled one (temperature 0.8, top-p 0.95, top-k 50, seeds, penalties,
logit bias, min_tokens, logprobs). Skips without CUDA."""

from __future__ import annotations

import pytest
import torch

from pagebatch.sampler import PenaltyBatch, SamplingBatch

_FIELDS = ("temperature", "top_k", "top_p", "seeds", "positions", "min_p", "bias_rows",
           "bias_token_ids", "bias_values", "masked_rows", "masked_token_ids", "logprob_rows")


def _sampled_params(seed: int, max_tokens: int = 8):
    from pagebatch import SamplingParams

    return SamplingParams(temperature=0.8, top_p=0.95, top_k=50, seed=seed, min_p=0.01,
                          presence_penalty=0.3, frequency_penalty=0.2, repetition_penalty=1.1,
                          logit_bias={5: 2.0}, min_tokens=3, logprobs=2, max_tokens=max_tokens,
                          ignore_eos=True)


def _inputs(batch: SamplingBatch) -> list[tuple[str, torch.Tensor]]:
    out = [(f, getattr(batch, f)) for f in _FIELDS if getattr(batch, f) is not None]
    p: PenaltyBatch | None = batch.penalties
    if p is not None:
        out += [("presence", p.presence), ("frequency", p.frequency),
                ("repetition", p.repetition)]
    return out


def test_sampling_inputs_are_views_of_the_staging_buffer(tiny_model_dir):
    from pagebatch import LLM

    llm = LLM(str(tiny_model_dir), device="cpu", num_kv_blocks=64, block_size=4)
    runner = llm.engine.core.runner
    buffers = {b.untyped_storage().data_ptr() for b in runner.input_batch.buffers}
    seen: list[set[str]] = []
    sample = runner.sampler

    def spy(logits, batch):
        fields = _inputs(batch)
        for name, t in fields:
            assert t.untyped_storage().data_ptr() in buffers, f"{name} is not a buffer view"
        seen.append({n for n, _ in fields})
        return sample(logits, batch)

    runner.sampler = spy
    prompts = [{"prompt_token_ids": [3 + i, 4, 5, 6]} for i in range(3)]
    outs = llm.generate(prompts, [_sampled_params(i) for i in range(3)], use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)
    # every kind of input was there in some step (min-tokens masks only in the first three)
    assert set().union(*seen) == set(_FIELDS) | {"presence", "frequency", "repetition"}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_one_host_to_device_copy_per_decode_step(tmp_path, sampled, eager):
    from torch.profiler import ProfilerActivity, profile

    from conftest import build_tiny_model
    from pagebatch import LLM, SamplingParams

    folder = build_tiny_model(tmp_path / "tiny", hidden_size=256, intermediate_size=512,
                              num_attention_heads=8, num_key_value_heads=2,
                              max_position_embeddings=1024)
    llm = LLM(str(folder), device="cuda", enforce_eager=eager, async_scheduling=False,
              num_kv_blocks=256, block_size=16, max_num_seqs=8)
    engine = llm.engine
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for i in range(6):
        sp = _sampled_params(i, max_tokens=40) if sampled else greedy
        engine.add_request({"prompt_token_ids": [3 + i] * (5 + i)}, sp, request_id=f"r{i}")
    for _ in range(8):  # past the prefills and the min_tokens steps: decode steps only
        engine.step()
    torch.cuda.synchronize()
    steps = 10
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    h2d = [e for e in prof.events() if "HtoD" in e.name]
    assert len(h2d) == steps, [e.name for e in h2d]
    while engine.has_unfinished_requests:
        engine.step()
