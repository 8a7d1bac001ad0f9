"""Generation end to end: seeded sampling in mixed batches, n > 1, stop strings (streamed or
not), min_tokens, log-probs and prompt log-probs, tiny temperatures; on the tiny random Llama
and (marked slow) SmolLM2. Also the front half's text handling with SmolLM2's byte-level
tokenizer and no model."""

from __future__ import annotations

import json
import random
import shutil
import time

import pytest
import torch

from numerics import assert_greedy_match, top2_gaps
from pagebatch import LLM, SamplingParams
from pagebatch.detokenizer import IncrementalDetokenizer
from pagebatch.engine_core import EngineCoreOutput
from pagebatch.errors import InvalidRequestError, SamplingParamsError
from pagebatch.output import SampleState, StopStrings
from tiny import random_prompts


@pytest.fixture(scope="module")
def tiny_llm(tiny_model_dir):
    return LLM(str(tiny_model_dir), device="cpu", dtype="float32", num_kv_blocks=256,
               block_size=4, max_num_seqs=16)


def _stream(llm: LLM, prompt, params: SamplingParams) -> list:
    """Every RequestOutput of one request, step by step (what a streaming client sees)."""
    engine = llm.engine
    rid = engine.add_request(prompt, params)
    outs = []
    while engine.has_unfinished_requests:
        outs += [o for o in engine.step() if o.request_id == rid]
    return outs


def _all_blocks_free(llm: LLM) -> bool:
    kv = llm.engine.core.kv_cache
    return kv.num_free_blocks == kv.num_blocks and not llm.engine.core.scheduler.requests


def _mixed_params(n: int, max_tokens: int) -> list[SamplingParams]:
    """Every kind of request, mixed; the seeded ones are compared alone and batched."""
    kinds = [
        lambda i: SamplingParams(temperature=0.0, max_tokens=max_tokens),
        lambda i: SamplingParams(temperature=0.9, top_p=0.9, max_tokens=max_tokens, seed=i),
        lambda i: SamplingParams(temperature=1.2, top_k=20, presence_penalty=1.0,
                                 frequency_penalty=0.5, max_tokens=max_tokens, seed=i),
        lambda i: SamplingParams(temperature=0.7, min_p=0.05, repetition_penalty=1.3,
                                 max_tokens=max_tokens, seed=i, logprobs=3),
        lambda i: SamplingParams(temperature=1.0, logit_bias={17: 4.0, 18: -50.0},
                                 min_tokens=4, max_tokens=max_tokens, seed=i, n=2),
        lambda i: SamplingParams(temperature=0.8, max_tokens=max_tokens, seed=i,
                                 ignore_eos=True, prompt_logprobs=2),
    ]
    return [kinds[i % len(kinds)](100 + i) for i in range(n)]


def _same_samples(a, b) -> None:
    assert len(a.outputs) == len(b.outputs)
    for x, y in zip(a.outputs, b.outputs):
        assert x.token_ids == y.token_ids
        assert x.text == y.text
        if x.logprobs is not None:
            for px, py in zip(x.logprobs, y.logprobs):
                assert list(px) == list(py)
                for t in px:
                    assert px[t].logprob == pytest.approx(py[t].logprob, abs=1e-4)


# ---- tiny model -------------------------------------------------------------------------------

def test_seeded_requests_alone_equal_batched_with_15_others(tiny_llm):
    prompts = [{"prompt_token_ids": p} for p in random_prompts(16, seed=2)]
    params = _mixed_params(16, max_tokens=12)
    batched = tiny_llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs) for o in batched] == [p.n for p in params]
    for p, sp, b in zip(prompts, params, batched):
        if sp.seed is not None:
            _same_samples(tiny_llm.generate(p, sp, use_tqdm=False)[0], b)
    assert _all_blocks_free(tiny_llm)


def test_n_samples_are_four_seeded_requests(tiny_llm):
    p = {"prompt_token_ids": random_prompts(1, seed=3)[0]}
    sp = SamplingParams(temperature=1.0, max_tokens=10, n=4, seed=50, ignore_eos=True)
    out = tiny_llm.generate(p, sp, use_tqdm=False)[0]
    assert out.finished and [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert all(c.finish_reason == "length" and len(c.token_ids) == 10 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    for c in out.outputs:  # sample i is the request with seed + i (vLLM's derived seeds)
        solo = SamplingParams(temperature=1.0, max_tokens=10, seed=50 + c.index,
                              ignore_eos=True)
        assert tiny_llm.generate(p, solo, use_tqdm=False)[0].outputs[0].token_ids == c.token_ids
    unseeded = tiny_llm.generate(p, SamplingParams(max_tokens=5, n=4, ignore_eos=True),
                                 use_tqdm=False)[0]
    assert len(unseeded.outputs) == 4
    assert _all_blocks_free(tiny_llm)


def test_aborting_a_request_aborts_its_n_samples(tiny_llm):
    engine = tiny_llm.engine
    rid = engine.add_request({"prompt_token_ids": [5, 6, 7]},
                             SamplingParams(max_tokens=50, n=3, ignore_eos=True))
    engine.step()
    engine.step()
    outs = engine.abort_request([rid])
    assert len(outs) == 1 and outs[0].finished
    assert [c.finish_reason for c in outs[0].outputs] == ["abort"] * 3
    assert not engine.has_unfinished_requests and _all_blocks_free(tiny_llm)


def _greedy_text(llm: LLM, p, max_tokens: int = 14):
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return llm.generate(p, sp, use_tqdm=False)[0].outputs[0]


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_tokens_never_leaks(tiny_llm, include):
    p = {"prompt_token_ids": random_prompts(1, seed=4)[0]}
    free = _greedy_text(tiny_llm, p)
    words = free.text.split()
    stop = words[4][1:] + " " + words[5][:2]  # "84 w1": spans a token boundary
    idx = free.text.find(stop)
    want = free.text[:idx + len(stop)] if include else free.text[:idx]
    sp = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True,
                        stop=[stop, "no such text"], include_stop_str_in_output=include)
    final = tiny_llm.generate(p, sp, use_tqdm=False)[0].outputs[0]
    assert (final.text, final.finish_reason, final.stop_reason) == (want, "stop", stop)
    assert final.token_ids == free.token_ids[:len(final.token_ids)]
    assert len(final.token_ids) < len(free.token_ids)
    streamed = _stream(tiny_llm, p, sp)
    assert streamed[-1].outputs[0].text == want and streamed[-1].finished
    texts = [o.outputs[0].text for o in streamed]
    assert any(t and t != want for t in texts)  # it did stream
    for text in texts:  # each a prefix of the final text: deltas join to it, no part of the
        assert want.startswith(text)  # stop string is ever shown (unless included)
        assert include or stop not in text
    assert _all_blocks_free(tiny_llm)


def test_earliest_stop_string_wins(tiny_llm):
    p = {"prompt_token_ids": random_prompts(1, seed=4)[0]}
    words = _greedy_text(tiny_llm, p).text.split()
    late, early = words[6], words[2]
    out = tiny_llm.generate(p, SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True,
                                              stop=[late, early]), use_tqdm=False)[0]
    assert out.outputs[0].stop_reason == early and early not in out.outputs[0].text


def test_min_tokens_holds_for_every_eos_id(tiny_model_dir, tmp_path):
    """generation_config.json adds EOS ids; with each made the most likely token by a bias,
    the output still has min_tokens tokens before it, then ends on it."""
    folder = tmp_path / "extra-eos"
    shutil.copytree(tiny_model_dir, folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 40, 41]}))
    llm = LLM(str(folder), device="cpu", num_kv_blocks=64, block_size=4)
    assert {2, 40, 41} <= llm.engine.eos_token_ids
    p = {"prompt_token_ids": [9, 10, 11]}
    for stop_id in (2, 40, 41, 77):
        for temp in (0.0, 1.0):
            sp = SamplingParams(temperature=temp, seed=1, min_tokens=5, max_tokens=12,
                                stop_token_ids=[77], logit_bias={stop_id: 60.0})
            out = llm.generate(p, sp, use_tqdm=False)[0].outputs[0]
            assert len(out.token_ids) == 6 and out.token_ids[-1] == stop_id, (stop_id, out)
            assert not {2, 40, 41, 77} & set(out.token_ids[:5])
            assert out.finish_reason == "stop"
            assert out.stop_reason == (77 if stop_id == 77 else None)


def test_logprobs_and_prompt_logprobs_match_forward_scratch(tiny_model_dir):
    """Chunked prefill of 8 tokens a step, so prompt log-probs come in pieces."""
    llm = LLM(str(tiny_model_dir), device="cpu", dtype="float32", num_kv_blocks=64,
              block_size=4, enable_chunked_prefill=True, max_num_batched_tokens=8,
              max_model_len=64)
    prompt = random_prompts(1, seed=6)[0] + list(range(5, 21))
    sp = SamplingParams(temperature=0.8, seed=3, max_tokens=6, logprobs=3, prompt_logprobs=2,
                        ignore_eos=True)
    # a batch neighbour without log-probs
    other = {"prompt_token_ids": random_prompts(1, seed=7)[0]}
    out, _ = llm.generate([{"prompt_token_ids": prompt}, other],
                          [sp, SamplingParams(max_tokens=6)], use_tqdm=False)
    comp = out.outputs[0]
    ref = torch.log_softmax(llm.engine.core.runner.forward_scratch(prompt + comp.token_ids), -1)
    P = len(prompt)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == P
    for i in range(1, P):
        _check_position(out.prompt_logprobs[i], prompt[i], ref[i - 1], 2)
    assert len(comp.logprobs) == len(comp.token_ids) == 6
    for k, tok in enumerate(comp.token_ids):
        _check_position(comp.logprobs[k], tok, ref[P - 1 + k], 3)
    want = sum(float(ref[P - 1 + k, t]) for k, t in enumerate(comp.token_ids))
    assert comp.cumulative_logprob == pytest.approx(want, abs=1e-4)
    assert _all_blocks_free(llm)


def _check_position(d, token, ref_row, n) -> None:
    """d: token id -> Logprob; the actual token first, then the top-n of ref_row."""
    ids = list(d)
    assert ids[0] == token
    assert d[token].logprob == pytest.approx(float(ref_row[token]), abs=1e-4)
    above = int((ref_row > ref_row[token] + 1e-4).sum())  # ranks within float noise of ties
    assert above + 1 <= d[token].rank <= int((ref_row >= ref_row[token] - 1e-4).sum())
    top = ref_row.topk(n)
    assert set(top.indices.tolist()) <= set(ids) and len(d) in (n, n + 1)
    for t, v in zip(top.indices.tolist(), top.values.tolist()):
        assert d[t].logprob == pytest.approx(v, abs=1e-4)
    assert sorted(e.rank for t, e in d.items() if t != token or len(d) == n) == \
        list(range(1, n + 1))
    assert all(isinstance(e.decoded_token, str) for e in d.values())


def test_tiny_temperature_is_near_greedy(tiny_llm):
    runner = tiny_llm.engine.core.runner
    for p in random_prompts(3, seed=8):
        g = _greedy_text(tiny_llm, {"prompt_token_ids": p}, 16)
        t = tiny_llm.generate({"prompt_token_ids": p},
                              SamplingParams(temperature=1e-4, max_tokens=16, ignore_eos=True,
                                             seed=9), use_tqdm=False)[0].outputs[0]
        gaps = top2_gaps(runner.forward_scratch(p + g.token_ids)[len(p) - 1:-1])
        assert_greedy_match(g.token_ids, gaps, t.token_ids, eps=1e-2, what=str(p))
        assert t.text


BAD_PARAMS = [
    (SamplingParams(n=0), "n=0"),
    (SamplingParams(n=129), "128"),
    (SamplingParams(min_p=1.5), "min_p=1.5"),
    (SamplingParams(presence_penalty=3.0), "presence_penalty=3.0.*-2, 2"),
    (SamplingParams(frequency_penalty=float("nan")), "frequency_penalty"),
    (SamplingParams(repetition_penalty=0.0), "repetition_penalty=0.0.*> 0"),
    (SamplingParams(temperature=float("inf")), "temperature=inf"),
    (SamplingParams(logprobs=21), "logprobs=21.*20"),
    (SamplingParams(prompt_logprobs=-1), "prompt_logprobs=-1"),
    (SamplingParams(logit_bias={5: 101.0}), r"logit_bias\[5\]=101.0.*100"),
    (SamplingParams(logit_bias={"5": 1.0}), "logit_bias key '5'"),
    (SamplingParams(logit_bias={256: 1.0}), r"logit_bias.*256.*\[0, 256\)"),
    (SamplingParams(stop_token_ids=[300]), r"stop_token_ids.*300.*\[0, 256\)"),
    (SamplingParams(stop=""), "stop=''"),
    (SamplingParams(stop=["ok", 5]), "stop="),
    (SamplingParams(seed=1.5), "seed=1.5"),
]


@pytest.mark.parametrize("params,needle", BAD_PARAMS)
def test_bad_sampling_params_are_rejected(tiny_llm, params, needle):
    engine = tiny_llm.engine
    with pytest.raises(SamplingParamsError, match=needle):
        engine.add_request({"prompt_token_ids": [5, 6]}, params)
    assert not engine.has_unfinished_requests


def test_stop_strings_need_a_tokenizer(tiny_model_dir, tmp_path):
    folder = tmp_path / "no-tokenizer"
    folder.mkdir()
    shutil.copy(tiny_model_dir / "config.json", folder / "config.json")
    llm = LLM(str(folder), device="cpu", load_format="dummy", num_kv_blocks=64)
    with pytest.raises(InvalidRequestError, match="tokenizer"):
        llm.generate({"prompt_token_ids": [5]}, SamplingParams(stop="x"), use_tqdm=False)


# ---- the front half's text, with SmolLM2's byte-level tokenizer (no model) -------------------

TRICKY = "Grüße, 世界! 🎉🚀 naïve café — 👩‍👩‍👧 done. Ünïcödé ✓"


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


def test_incremental_detokenizer_never_emits_a_broken_character(smollm2_tokenizer):
    tok = smollm2_tokenizer
    prompt = tok("Say:")["input_ids"]
    ids = tok(TRICKY)["input_ids"]
    pieces = [tok.decode([i]) for i in ids]
    assert sum("\ufffd" in p for p in pieces) >= 4  # characters really are split across tokens
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = [detok.add_tokens([i]) for i in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == detok.text == tok.decode(ids) == TRICKY
    assert sum(d == "" for d in deltas) >= 4  # held back until the character was complete


def _feed(tok, ids: list[int], params: SamplingParams, finish_on_last: str | None = "length"):
    """Drive one SampleState token by token as the core would; returns its texts per step."""
    s = SampleState(0, "r", 0, params, IncrementalDetokenizer(tok, tok("Hi")["input_ids"]), None)
    texts, aborted = [], False
    for k, t in enumerate(ids):
        last = k == len(ids) - 1
        aborted = s.update(EngineCoreOutput("r", [t], finish_on_last if last else None))
        texts.append(s.text)
        if s.finished:
            break
    return s, texts, aborted


@pytest.mark.parametrize("stop", ["🚀", "café —", "é", "done. Ü"])
def test_stop_strings_on_multibyte_text(smollm2_tokenizer, stop):
    tok = smollm2_tokenizer
    ids = tok(TRICKY)["input_ids"]
    s, texts, aborted = _feed(tok, ids, SamplingParams(stop=stop))
    want = TRICKY[:TRICKY.find(stop)]
    assert (s.text, s.finish_reason, s.stop_reason, aborted) == (want, "stop", stop, True)
    assert len(s.token_ids) < len(ids)
    for text in texts:
        assert want.startswith(text) and "\ufffd" not in text and stop not in text
    s, texts, _ = _feed(tok, ids, SamplingParams(stop=stop, include_stop_str_in_output=True))
    assert s.text == TRICKY[:TRICKY.find(stop) + len(stop)]
    assert all(s.text.startswith(t) for t in texts)


def test_text_is_held_back_only_while_a_stop_string_could_complete(smollm2_tokenizer):
    tok = smollm2_tokenizer
    text = "abc xyz ab abd"
    ids = tok(text)["input_ids"]
    s, texts, aborted = _feed(tok, ids, SamplingParams(stop=["abcd", "zz"]))
    assert s.finish_reason == "length" and not aborted and s.text == text
    assert all(text.startswith(t) for t in texts)
    cut = StopStrings(["abcd", "zz"], False)
    assert cut.check("x abc") is None and cut.visible("x abc") == 2  # "abc" could grow
    assert cut.check("x abcz") is None and cut.visible("x abcz") == 5  # "z" could start "zz"
    assert cut.check("x abczz") == ("zz", 5)


def test_stop_token_text_is_not_shown(smollm2_tokenizer):
    """As vLLM: a request ended by a stop token id keeps the id but not its text."""
    tok = smollm2_tokenizer
    ids = tok("Hello world.")["input_ids"]
    s, texts, _ = _feed(tok, ids, SamplingParams(stop_token_ids=[ids[-1]]), "stop")
    assert s.token_ids == ids and s.stop_reason == ids[-1]
    assert s.text == tok.decode(ids[:-1])
    s, _, _ = _feed(tok, ids, SamplingParams(stop_token_ids=[ids[-1]],
                                             include_stop_str_in_output=True), "stop")
    assert s.text == "Hello world."


# ---- SmolLM2 ---------------------------------------------------------------------------------

TEXT_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land",
                "List three colors:"]


@pytest.mark.slow
def test_smollm2_seeded_request_alone_equals_batched(smollm2_llm):
    rng = random.Random(1)
    words = "the a cat dog runs over under house tree river blue red quickly slowly".split()
    prompts = TEXT_PROMPTS + [" ".join(rng.choice(words) for _ in range(rng.randint(2, 30)))
                              for _ in range(12)]
    params = _mixed_params(16, max_tokens=8)
    batched = smollm2_llm.generate(prompts, params, use_tqdm=False)
    for i in (1, 3, 10):  # seeded: top-p; min-p, repetition, logprobs; n=2, bias, min_tokens
        _same_samples(smollm2_llm.generate(prompts[i], params[i], use_tqdm=False)[0],
                      batched[i])
    assert _all_blocks_free(smollm2_llm)


@pytest.mark.slow
def test_smollm2_stop_strings_never_leak(smollm2_llm):
    prompt = "Count from one to ten in words: one, two,"
    free = _greedy_text(smollm2_llm, prompt, 24)
    assert " five" in free.text, free.text
    stop = " five"
    want = free.text[:free.text.find(stop)]
    sp = SamplingParams(temperature=0.0, max_tokens=24, stop=[stop, "eleven"])
    done = smollm2_llm.generate(prompt, sp, use_tqdm=False)[0].outputs[0]
    assert (done.text, done.stop_reason, done.finish_reason) == (want, stop, "stop")
    streamed = _stream(smollm2_llm, prompt, sp)
    assert streamed[-1].outputs[0].text == want
    for o in streamed:
        assert want.startswith(o.outputs[0].text) and stop not in o.outputs[0].text
    assert _all_blocks_free(smollm2_llm)


@pytest.mark.slow
def test_smollm2_tiny_temperature_and_n(smollm2_llm):
    prompt = TEXT_PROMPTS[0]
    g = _greedy_text(smollm2_llm, prompt, 10)
    t = smollm2_llm.generate(prompt, SamplingParams(temperature=1e-4, max_tokens=10,
                                                    ignore_eos=True), use_tqdm=False)[0]
    tok = smollm2_llm.get_tokenizer()
    ids = tok(prompt)["input_ids"]
    gaps = top2_gaps(smollm2_llm.engine.core.runner.forward_scratch(ids + g.token_ids)
                     [len(ids) - 1:-1])
    assert_greedy_match(g.token_ids, gaps, t.outputs[0].token_ids, eps=1e-2)
    assert t.outputs[0].text.strip() and "\ufffd" not in t.outputs[0].text
    four = smollm2_llm.generate(prompt, SamplingParams(temperature=1.0, n=4, max_tokens=6,
                                                       seed=0), use_tqdm=False)[0]
    assert [c.index for c in four.outputs] == [0, 1, 2, 3] and four.finished
    assert all(c.text for c in four.outputs)
    assert _all_blocks_free(smollm2_llm)


@pytest.mark.slow
def test_smollm2_prompt_logprobs(smollm2_llm):
    tok = smollm2_llm.get_tokenizer()
    prompt = "Paris is the capital of France."
    ids = tok(prompt)["input_ids"]
    out = smollm2_llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=3,
                                                      logprobs=5, prompt_logprobs=5),
                               use_tqdm=False)[0]
    comp = out.outputs[0]
    ref = torch.log_softmax(
        smollm2_llm.engine.core.runner.forward_scratch(ids + comp.token_ids), -1)
    assert len(out.prompt_logprobs) == len(ids) and out.prompt_logprobs[0] is None
    for i in range(1, len(ids)):
        _check_position(out.prompt_logprobs[i], ids[i], ref[i - 1], 5)
    for k, t in enumerate(comp.token_ids):
        _check_position(comp.logprobs[k], t, ref[len(ids) - 1 + k], 5)
        assert comp.logprobs[k][t].rank == 1  # greedy
    assert out.prompt_logprobs[ids.index(tok(" France")["input_ids"][0])] is not None


def _run_to_end(engine, prompt_ids: list[int], sp: SamplingParams, request_id: str) -> None:
    """Add one request and step the engine until nothing is left."""
    engine.add_request({"prompt_token_ids": prompt_ids}, sp, request_id=request_id)
    while engine.has_unfinished_requests:
        engine.step()


def test_a_request_id_can_be_reused_at_once(tiny_llm):
    """The id of a request that just finished is taken by a new one before the core dropped
    the old one's sampling state: the new request keeps its own."""
    engine = tiny_llm.engine
    sp = SamplingParams(temperature=0.5, max_tokens=3, seed=1, ignore_eos=True,
                        frequency_penalty=1.0)
    _run_to_end(engine, [5, 6], sp, "same")
    sp2 = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=1)
    engine.add_request({"prompt_token_ids": [7, 8]}, sp2, request_id="same")
    outs = []
    while engine.has_unfinished_requests:
        outs += engine.step()
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 4
    assert outs[-1].outputs[0].finish_reason == "length"
    assert len(outs[-1].outputs[0].logprobs) == 4


def test_a_reused_id_whose_new_request_ends_at_once_leaves_no_state(tiny_llm):
    """The old and the new request of one id both finish before the next step: the runner gets
    two removals for the id (one per request) and keeps no sampling state for it."""
    engine = tiny_llm.engine
    sp = SamplingParams(temperature=0.5, max_tokens=2, seed=1, ignore_eos=True,
                        repetition_penalty=1.2)
    _run_to_end(engine, [5, 6], sp, "twice")
    engine.add_request({"prompt_token_ids": [7, 8]}, sp, request_id="twice")
    engine.abort_request(["twice"])
    _run_to_end(engine, [9], SamplingParams(max_tokens=1), "other")
    _run_to_end(engine, [9], SamplingParams(max_tokens=1), "last")  # carries the finished ids
    states = engine.core.runner.input_batch.requests
    assert "twice" not in states and "other" not in states


def test_async_engine_streams_n_samples_with_stop_strings_and_logprobs(tiny_model_dir,
                                                                       tiny_llm):
    """Through AsyncEngine (the core behind a client on its output thread): one stream per
    request with all n samples, stop strings aborted in the core, log-probs across it."""
    import asyncio

    from pagebatch import AsyncEngine, EngineConfig

    p = {"prompt_token_ids": random_prompts(1, seed=4)[0]}
    free = _greedy_text(tiny_llm, p)
    stop = free.text.split()[3]
    want = free.text[:free.text.find(stop)]
    config = EngineConfig.from_sources(cli=dict(model=str(tiny_model_dir), device="cpu",
                                                dtype="float32", num_kv_blocks=96, block_size=4))
    engine = AsyncEngine.from_config(config, multiprocess=False)

    async def main():
        sp = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True, n=3, stop=stop,
                            logprobs=1, prompt_logprobs=1)
        return [o async for o in await engine.add_request(p, sp)]

    try:
        outs = asyncio.run(main())
        kv = engine.engine.core.core.kv_cache
        deadline = time.monotonic() + 5  # the core's aborts land on the output thread
        while kv.num_free_blocks != kv.num_blocks and time.monotonic() < deadline:
            time.sleep(0.01)
        assert kv.num_free_blocks == kv.num_blocks
        assert not engine.engine.core.core.scheduler.requests
    finally:
        engine.shutdown()
    final = outs[-1]
    assert final.finished and sum(o.finished for o in outs) == 1
    assert [c.index for c in final.outputs] == [0, 1, 2]
    for c in final.outputs:
        assert (c.text, c.finish_reason, c.stop_reason) == (want, "stop", stop)
        assert len(c.logprobs) == len(c.token_ids)
    assert len(final.prompt_logprobs) == len(p["prompt_token_ids"])
    for o in outs:
        assert all(want.startswith(c.text) for c in o.outputs)


def test_cli_generate_batches_several_prompts_and_prints_each(tiny_model_dir, capsys,
                                                             monkeypatch):
    """`pagebatch generate` with several --prompt: all are queued before the first step (one
    batch) and each output is printed, in the order given, equal to its own run alone."""
    from pagebatch.cli import main
    from pagebatch.engine import LLMEngine

    steps = []
    step = LLMEngine.step

    def spy(self):
        steps.append(1)
        return step(self)

    common = ["generate", str(tiny_model_dir), "--device", "cpu", "--num-kv-blocks", "64",
              "--temperature", "0", "--max-tokens", "4", "--ignore-eos"]
    alone = []
    for p in ("w5 w6", "w7"):
        assert main(common + ["--prompt", p]) == 0
        alone.append(capsys.readouterr().out)
    monkeypatch.setattr(LLMEngine, "step", spy)
    assert main(common + ["--prompt", "w5 w6", "--prompt", "w7"]) == 0
    assert capsys.readouterr().out == alone[0] + alone[1]
    assert len(steps) <= 4 + 1  # both decode in the same steps, not one after the other


def test_held_back_tail_is_the_longest_stop_string_prefix():
    """StopStrings.visible against the definition (the longest tail of the uncommitted text that
    begins some stop string), on texts and stop strings over a small alphabet."""
    import random

    from pagebatch.output import StopStrings

    rng = random.Random(0)
    for _ in range(3000):
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 6)))
                 for _ in range(rng.randint(1, 3))]
        text = "".join(rng.choice("ab") for _ in range(rng.randint(0, 8)))
        s = StopStrings(stops, include_in_output=False)
        s.committed = rng.randint(0, len(text))
        hold = max([k for st in stops for k in range(1, min(len(st) - 1, len(text) - s.committed)
                                                     + 1) if text.endswith(st[:k])], default=0)
        assert s.visible(text) == len(text) - hold, (stops, text, s.committed)


def test_stop_strings_are_bounded():
    """Stop strings are searched every step: their number and length are limited (a 400)."""
    from pagebatch.errors import SamplingParamsError
    from pagebatch.request import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS

    SamplingParams(stop=["x"] * MAX_STOP_STRINGS).validate()
    SamplingParams(stop="x" * MAX_STOP_STRING_CHARS).validate()
    for stop in (["x"] * (MAX_STOP_STRINGS + 1), ["y", "x" * (MAX_STOP_STRING_CHARS + 1)]):
        with pytest.raises(SamplingParamsError, match="at most") as e:
            SamplingParams(stop=stop).validate()
        assert len(str(e.value)) < 400


def test_chat_defaults_max_tokens_to_the_rest_of_the_context(tiny_llm):
    """LLM.chat without sampling params, as chat completions: max_tokens is what the context
    leaves (it was SamplingParams' 16)."""
    out = tiny_llm.chat([{"role": "user", "content": "w5"}], use_tqdm=False)[0]
    c = out.outputs[0]
    assert c.finish_reason == "stop" or (
        len(out.prompt_token_ids) + len(c.token_ids) == tiny_llm.engine.max_model_len), (
        len(c.token_ids), c.finish_reason)


def test_prefill_caps_keep_greedy_outputs(tiny_model_dir):
    """long_prefill_token_threshold and max_mixed_prefill_tokens reach the scheduler and only
    move prompt tokens between steps: greedy outputs equal those of an engine without caps."""
    prompts = [{"prompt_token_ids": p} for p in random_prompts(5, seed=11)]
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    def run(**caps):
        llm = LLM(str(tiny_model_dir), device="cpu", dtype="float32", num_kv_blocks=128,
                  block_size=4, enable_chunked_prefill=True, max_num_batched_tokens=64,
                  max_model_len=64, **caps)
        sched = llm.engine.core.scheduler
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        return outs, sched

    want, _ = run()
    got, sched = run(max_mixed_prefill_tokens=6, long_prefill_token_threshold=5)
    assert (sched.max_mixed_prefill, sched.max_chunk) == (6, 5)
    assert got == want
