"""The engine core's structured output bookkeeping (core/structured_output.py, its use in
core/engine_core.py), with fake matchers: a constraint parsed once per request, the bitmask
filled only for constrained rows into one buffer kept across steps, the matchers advanced by
their own tokens only, a finished, failed or aborted request no longer tracked, and an id in
use refused without touching the matcher of the request that holds it."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from pagebatch import LLM, SamplingParams
from pagebatch.engine_core import EngineCoreRequest
from pagebatch.structured_output import (StructuredOutputManager, StructuredOutputsParams as SO,
                                         bitmask_width)

V = 70  # vocabulary of the fake backend's bitmask
W = bitmask_width(V)


def _words(allowed, width: int = W) -> np.ndarray:
    row = np.zeros(width, dtype=np.uint32)
    for t in allowed:
        row[t // 32] |= np.uint32(1 << (t % 32))
    return row.view(np.int32)


class FakeMatcher:
    """Allows the tokens of ``allowed`` (any order, any number); records what it is asked."""

    def __init__(self, allowed):
        self.allowed = frozenset(allowed)
        self.accepted: list[int] = []
        self.fills = 0

    def accept_token(self, token_id):
        if token_id not in self.allowed:
            return False
        self.accepted.append(token_id)
        return True

    def fill_next_token_bitmask(self, bitmask, index):
        self.fills += 1
        bitmask[index] = _words(self.allowed, bitmask.shape[1])

    def is_terminated(self):
        return False


class FakeBackend:
    """``regex`` constraints whose spec is a comma-separated list of the allowed token ids."""

    def __init__(self):
        self.matchers: list[FakeMatcher] = []

    def compile(self, constraint):
        return [int(t) for t in constraint.spec.split(",") if t]

    def matcher(self, compiled):
        self.matchers.append(FakeMatcher(compiled))
        return self.matchers[-1]


def _allow(*ids) -> SO:
    return SO(regex=",".join(map(str, ids)) or ",")


# ---- the manager, no model ------------------------------------------------------------------

def test_the_constraint_is_parsed_once_and_travels_with_the_params(monkeypatch):
    calls = []
    parse = SO._parse
    monkeypatch.setattr(SO, "_parse", lambda self: calls.append(1) or parse(self))
    so = SO(json={"type": "object", "properties": {"a": {"type": "integer"}}})
    SamplingParams(structured_outputs=so).validate()  # the front half's check
    c = so.constraint()  # the front half's compile check
    core_side = pickle.loads(pickle.dumps(so))  # to the engine core's process
    assert core_side.constraint() == c and core_side.constraint().field == c.field
    assert len(calls) == 1
    # not a field: equality and hashing are the params' own
    assert so == SO(json={"type": "object", "properties": {"a": {"type": "integer"}}})
    fresh = SO(regex="a")
    fresh.constraint()
    assert fresh == SO(regex="a") and hash(fresh) == hash(SO(regex="a"))


def test_the_bitmask_fills_only_constrained_rows_into_one_buffer():
    backend = FakeBackend()
    m = StructuredOutputManager(lambda: backend, V, max_num_seqs=8)
    m.add_request("b", _allow(3, 40))
    m.add_request("d", _allow(69))
    assert m.batch(["a", "c"]) is None
    first = m.batch(["a", "b", "c", "d"])
    assert first.request_ids == ["b", "d"] and first.rows == [1, 3]
    assert first.bitmask.shape == (2, W)
    assert first.bitmask.tolist() == [_words([3, 40]).tolist(), _words([69]).tolist()]
    buf = first.bitmask.base
    assert buf is not None and buf.shape == (8, W)
    second = m.batch(["d", "x"])  # the same buffer, row 0 overwritten whole
    assert second.bitmask.base is buf and second.rows == [0]
    assert second.bitmask.tolist() == [_words([69]).tolist()]
    assert [mt.fills for mt in backend.matchers] == [1, 2]
    m.remove(["b", "d"])
    assert not m.has_requests and m.batch(["b", "d"]) is None


def test_more_constrained_rows_than_max_num_seqs_grow_the_buffer():
    m = StructuredOutputManager(FakeBackend, V, max_num_seqs=1)
    for rid in "abc":
        m.add_request(rid, _allow(5))
    out = m.batch(["a", "b", "c"])
    assert out.bitmask.shape == (3, W) and out.rows == [0, 1, 2]
    assert all(r == _words([5]).tolist() for r in out.bitmask.tolist())


def test_a_forbidden_token_is_explained_from_the_matcher_state():
    m = StructuredOutputManager(FakeBackend, V)
    m.add_request("stuck", _allow())  # nothing allowed: a dead end
    m.add_request("masked", _allow(7))  # 7 allowed, something else sampled
    m.batch(["stuck", "masked"])
    stuck, masked = m.accept("stuck", 7), m.accept("masked", 9)
    assert "no token can continue it" in str(stuck)
    assert "token 9 was sampled, which it forbids" in str(masked)
    # the error names the request field (the HTTP 400's param)
    assert stuck.param == masked.param == "structured_outputs.regex"
    assert m.accept("masked", 7) is None and m.accept("unconstrained", 9) is None


# ---- in the engine core (the tiny model on the CPU, a fake backend) -------------------------

@pytest.fixture
def core_llm(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), device="cpu", dtype="float32", num_kv_blocks=64,
              block_size=4, max_model_len=64)
    core = llm.engine.core
    backend = FakeBackend()
    core.structured = StructuredOutputManager(lambda: backend, core.structured.vocab_size,
                                              core.config.max_num_seqs)
    return llm, backend


def _gen(llm, prompts, params):
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


def test_matchers_see_only_their_tokens_and_finished_requests_are_untracked(core_llm):
    llm, backend = core_llm
    plain = [SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
             SamplingParams(temperature=0.9, seed=3, max_tokens=5, ignore_eos=True)]
    prompts = ["w5 w6", "w7 w8 w9"]
    solo = [_gen(llm, [p], [sp])[0].token_ids for p, sp in zip(prompts, plain)]
    allowed = (11, 12, 13)
    outs = _gen(llm, [prompts[0], "w4", prompts[1], "w3 w3"], [
        plain[0], SamplingParams(temperature=1.0, seed=1, max_tokens=6, ignore_eos=True,
                                 structured_outputs=_allow(*allowed)),
        plain[1], SamplingParams(temperature=0.0, max_tokens=3, structured_outputs=_allow())])
    assert [outs[0].token_ids, outs[2].token_ids] == solo
    assert set(outs[1].token_ids) <= set(allowed) and len(outs[1].token_ids) == 6
    assert outs[3].finish_reason == "error"
    ok = next(mt for mt in backend.matchers if mt.allowed == frozenset(allowed))
    assert ok.accepted == list(outs[1].token_ids)
    # every constrained request finished (length, error): none tracked, overlap allowed again
    assert not llm.engine.core.structured.has_requests


def test_an_aborted_constrained_request_is_untracked(core_llm):
    llm, _ = core_llm
    core = llm.engine.core
    core.add_request(EngineCoreRequest("c", [5, 6], SamplingParams(
        max_tokens=8, structured_outputs=_allow(9)), frozenset(), 0))
    core.step()
    assert "c" in core.structured
    core.abort_requests(["c"])
    assert not core.structured.has_requests


def test_an_id_in_use_is_refused_and_its_matcher_kept(core_llm):
    llm, backend = core_llm
    core = llm.engine.core
    sp = SamplingParams(max_tokens=8, structured_outputs=_allow(9))
    core.add_request(EngineCoreRequest("r", [5, 6], sp, frozenset(), 0))
    tracked = core.structured._requests["r"]
    with pytest.raises(ValueError, match="already in the engine"):
        core.add_request(EngineCoreRequest("r", [7], SamplingParams(
            max_tokens=8, structured_outputs=_allow(4)), frozenset(), 0))
    assert core.structured._requests["r"] is tracked
    assert core.scheduler.requests["r"].prompt_token_ids == [5, 6]
    core.abort_requests(["r"])


def test_a_constraint_the_core_process_cannot_compile_names_its_field():
    """In `pagebatch serve` the engine core runs in its own process: a request it cannot add
    (its backend refuses to compile the constraint) ends with an error output that keeps the
    field (the HTTP frontend's 400 param), and the loop goes on."""
    from pagebatch.core_proc import CoreBusyLoop
    from pagebatch.errors import SamplingParamsError

    class Core:
        has_work = False

        def add_request(self, r):
            raise SamplingParamsError("guided_json cannot be compiled: no", "guided_json")

    loop = CoreBusyLoop(Core())
    loop.inbox.put(EngineCoreRequest("r", [5], SamplingParams(), frozenset(), 0))
    (out,) = loop.run_once(timeout=0)
    assert (out.request_id, out.finish_reason, out.error_param) == ("r", "error", "guided_json")
    assert "cannot be compiled" in out.error
