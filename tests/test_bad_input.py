"""Every bad input gets a typed error naming the value and the limit, raised before anything is
queued, while other requests keep running."""

from __future__ import annotations

import pytest

from pagebatch import LLM, SamplingParams
from pagebatch.errors import (ConfigError, ContextLengthError, InvalidRequestError,
                              InvalidTokenError, ModelNotFoundError, PluginError,
                              SamplingParamsError, CacheTooSmallError)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir), device="cpu", num_kv_blocks=64, block_size=4,
               max_model_len=128)


BAD_REQUESTS = [
    ("", SamplingParams(), InvalidRequestError, "empty"),
    ({"prompt_token_ids": []}, SamplingParams(), InvalidRequestError, "empty"),
    ({"prompt_token_ids": [5, 256]}, SamplingParams(), InvalidTokenError, "256"),
    ({"prompt_token_ids": [5, -1]}, SamplingParams(), InvalidTokenError, "-1"),
    ({"prompt_token_ids": ["a"]}, SamplingParams(), InvalidRequestError, "integers"),
    ({"prompt_token_ids": [5] * 100}, SamplingParams(max_tokens=29), ContextLengthError, "128"),
    ({"prompt_token_ids": [5] * 128}, SamplingParams(max_tokens=None), ContextLengthError,
     "128"),
    ({"prompt_token_ids": [5]}, SamplingParams(temperature=-0.5), SamplingParamsError, "-0.5"),
    ({"prompt_token_ids": [5]}, SamplingParams(temperature=float("nan")), SamplingParamsError,
     "temperature"),
    ({"prompt_token_ids": [5]}, SamplingParams(max_tokens=0), SamplingParamsError,
     "max_tokens=0"),
    ({"prompt_token_ids": [5]}, SamplingParams(top_p=0.0), SamplingParamsError, "top_p"),
    ({"prompt_token_ids": [5]}, SamplingParams(top_k=-3), SamplingParamsError, "top_k"),
    ({"prompt_token_ids": [5]}, SamplingParams(min_tokens=9, max_tokens=4), SamplingParamsError,
     "min_tokens"),
    (42, SamplingParams(), InvalidRequestError, "int"),
]


@pytest.mark.parametrize("prompt,params,exc,needle", BAD_REQUESTS)
def test_bad_request_is_rejected_while_others_finish(llm, prompt, params, exc, needle):
    engine = llm.engine
    good = [engine.add_request({"prompt_token_ids": [7, 8, 9, i + 3]},
                               SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
            for i in range(3)]
    engine.step()
    waiting_before = len(engine.core.scheduler.requests)
    with pytest.raises(exc, match=needle):
        engine.add_request(prompt, params)
    assert len(engine.core.scheduler.requests) == waiting_before  # nothing queued
    done = {}
    while engine.has_unfinished_requests:
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert sorted(done) == sorted(good)
    assert all(len(o.outputs[0].token_ids) == 6 for o in done.values())
    kv = engine.core.kv_cache
    assert kv.num_free_blocks == kv.num_blocks


def test_generate_validates_every_prompt_before_queueing(llm):
    with pytest.raises(InvalidTokenError):
        llm.generate([{"prompt_token_ids": [5, 6]}, {"prompt_token_ids": [999]}],
                     use_tqdm=False)
    assert not llm.engine.has_unfinished_requests


def test_unknown_model():
    with pytest.raises(ModelNotFoundError, match="no-such-model"):
        LLM("no-such-model")


def test_unknown_plugin(tiny_model_dir):
    with pytest.raises(PluginError, match="flash_magic.*registered.*torch_ref"):
        LLM(str(tiny_model_dir), device="cpu", num_kv_blocks=64, attention_backend="flash_magic")
    with pytest.raises(PluginError, match="'lifo'"):
        LLM(str(tiny_model_dir), device="cpu", num_kv_blocks=64, scheduling_policy="lifo")


@pytest.mark.parametrize("kwargs,needle", [
    ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"dtype": "float8"}, "float8"),
    ({"max_num_sequences": 4}, "did you mean 'max_num_seqs'"),
    ({"max_model_len": 4096}, "max_position_embeddings=256"),
    ({"max_model_len": 256, "max_num_batched_tokens": 100, "enable_chunked_prefill": False},
     "max_num_batched_tokens=100"),
])
def test_bad_config_value(tiny_model_dir, kwargs, needle):
    with pytest.raises(ConfigError, match=needle):
        LLM(str(tiny_model_dir), device="cpu", num_kv_blocks=64, **kwargs)


def test_cache_too_small_for_one_request(tiny_model_dir):
    with pytest.raises(CacheTooSmallError, match="max_model_len=256"):
        LLM(str(tiny_model_dir), device="cpu", num_kv_blocks=4, block_size=16)
