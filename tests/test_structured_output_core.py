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


def _admitted(core, rid: str) -> None:
    """Wait (10 s at most) until ``rid``'s constraint compiled and the request joined the
    scheduler: constraints compile on the manager's threads."""
    for _ in range(100):
        if rid not in core._grammar_wait:
            return
        assert core._admit_compiled(0.1) == []
    raise AssertionError(f"{rid} still waits for its constraint")


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
    _admitted(core, "c")
    core.step()
    assert "c" in core.structured
    core.abort_requests(["c"])
    assert not core.structured.has_requests


def test_an_id_in_use_is_refused_and_its_matcher_kept(core_llm):
    llm, backend = core_llm
    core = llm.engine.core
    sp = SamplingParams(max_tokens=8, structured_outputs=_allow(9))
    core.add_request(EngineCoreRequest("r", [5, 6], sp, frozenset(), 0))
    _admitted(core, "r")
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


# ---- compiles off the step loop -------------------------------------------------------------

class GatedBackend(FakeBackend):
    """A FakeBackend whose compiles of a spec in ``slow`` wait for ``release`` (a constraint
    that takes long to compile); a spec ``fail`` raises as a backend that cannot compile."""

    def __init__(self, slow=()):
        super().__init__()
        import threading

        self.slow = set(slow)
        self.release = threading.Event()

    def compile(self, constraint):
        if constraint.spec in self.slow:
            assert self.release.wait(30)
        if constraint.spec == "fail":
            from pagebatch.errors import SamplingParamsError

            raise SamplingParamsError(f"{constraint.field} cannot be compiled: too big",
                                      constraint.field)
        return super().compile(constraint)


@pytest.fixture
def gated(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), device="cpu", dtype="float32", num_kv_blocks=64,
              block_size=4, max_model_len=64, structured_outputs_compile_timeout=1.0)
    core = llm.engine.core
    backend = GatedBackend(slow={"11,12"})
    core.structured = StructuredOutputManager(lambda: backend, core.structured.vocab_size,
                                              core.config.max_num_seqs)
    yield core, backend
    backend.release.set()


def _run(core, until, limit_s=20.0):
    """Step the core, collecting outputs by request id, until ``until(outputs)``."""
    import time

    outs: dict[str, list] = {}
    end = time.monotonic() + limit_s
    while not until(outs):
        assert time.monotonic() < end, f"gave up waiting; outputs so far {outs}"
        for o in core.step():
            outs.setdefault(o.request_id, []).append(o)
    return outs


def _finished(*rids):
    return lambda outs: all(any(o.finish_reason for o in outs.get(r, [])) for r in rids)


def test_a_slow_compile_holds_back_only_its_own_request(gated):
    """While one request's constraint compiles, the core steps the others to the end; the
    waiting request is counted as waiting and joins the scheduler once compiled."""
    core, backend = gated
    core.add_request(EngineCoreRequest("slow", [5, 6], SamplingParams(
        max_tokens=4, ignore_eos=True, structured_outputs=_allow(11, 12)), frozenset(), 0))
    core.add_request(EngineCoreRequest("plain", [7, 8], SamplingParams(
        max_tokens=6, ignore_eos=True), frozenset(), 0))
    assert "slow" not in core.scheduler.requests and core.stats().num_waiting >= 1
    outs = _run(core, _finished("plain"))
    assert sum(len(o.new_token_ids) for o in outs["plain"]) == 6
    assert "slow" not in outs and "slow" in core._grammar_wait
    backend.release.set()
    outs = _run(core, _finished("slow"))
    tokens = [t for o in outs["slow"] for t in o.new_token_ids]
    assert len(tokens) == 4 and set(tokens) <= {11, 12}
    assert outs["slow"][-1].finish_reason == "length"
    assert not core.has_unfinished_requests and not core.structured.has_requests


def test_a_compile_past_the_timeout_or_failing_ends_its_request_with_the_field(gated):
    core, backend = gated
    for rid, so in (("slow", _allow(11, 12)), ("bad", SO(regex="fail"))):
        core.add_request(EngineCoreRequest(rid, [5], SamplingParams(
            max_tokens=4, structured_outputs=so), frozenset(), 0))
    outs = _run(core, _finished("slow", "bad"))
    slow, bad = outs["slow"][-1], outs["bad"][-1]
    assert slow.finish_reason == "error" and slow.error_param == "structured_outputs.regex"
    assert "structured_outputs_compile_timeout=1 s" in slow.error
    assert bad.finish_reason == "error" and "too big" in bad.error
    assert bad.error_param == "structured_outputs.regex"
    assert not core.has_unfinished_requests and not core._grammar_wait
    # the engine goes on: a request whose constraint compiles at once still runs
    core.add_request(EngineCoreRequest("ok", [5], SamplingParams(
        max_tokens=3, ignore_eos=True, structured_outputs=_allow(13)), frozenset(), 0))
    outs = _run(core, _finished("ok"))
    assert [t for o in outs["ok"] for t in o.new_token_ids] == [13, 13, 13]


def test_a_request_aborted_while_its_constraint_compiles_is_gone(gated):
    core, backend = gated
    core.add_request(EngineCoreRequest("slow", [5], SamplingParams(
        max_tokens=4, structured_outputs=_allow(11, 12)), frozenset(), 0))
    with pytest.raises(ValueError, match="already in the engine"):
        core.add_request(EngineCoreRequest("slow", [6], SamplingParams(max_tokens=2),
                                           frozenset(), 0))
    (out,) = core.abort_requests(["slow"])
    assert out.request_id == "slow" and out.finish_reason == "abort"
    assert not core.has_unfinished_requests
    backend.release.set()  # the compile ends later: nothing is admitted
    core._admit_compiled(0.1)
    assert "slow" not in core.scheduler.requests and "slow" not in core.structured
