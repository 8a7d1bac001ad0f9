"""The engine-core boundary's one interface (core/core_protocol.py): an `EngineCore` used
directly, `InprocClient` and `MPClient` have the same members with the same signatures and
return types, and on the tiny model their aborts, steps and stats give the same types."""

from __future__ import annotations

import inspect
import time
import types
import typing
from functools import partial

import pytest

from pagebatch import SamplingParams
from pagebatch.core_client import InprocClient, MPClient
from pagebatch.core_protocol import EngineCoreClient
from pagebatch.engine import LLMEngine
from pagebatch.engine_core import EngineCore, EngineCoreOutput, EngineCoreRequest, EngineCoreStats
from procs import one_thread_children
from tiny import engine_config

IMPLEMENTATIONS = [EngineCore, InprocClient, MPClient]
MEMBERS = ["add_request", "abort_requests", "step", "has_unfinished_requests", "stats",
           "shutdown"]
tiny_config = partial(engine_config, keys=dict(device="cpu", dtype="float32", num_kv_blocks=64,
                                               block_size=4, max_model_len=128))


def _accepts(impl: inspect.Signature, proto: inspect.Signature) -> list[str]:
    """What a call by the protocol's signature would get wrong on ``impl`` (self left out):
    positional-only parameters by position, the others by name, kind and default."""
    P = inspect.Parameter
    mine = list(impl.parameters.values())[1:]
    problems = []
    for i, want in enumerate(list(proto.parameters.values())[1:]):
        if want.kind is P.POSITIONAL_ONLY:
            if i >= len(mine) or mine[i].kind not in (P.POSITIONAL_ONLY,
                                                      P.POSITIONAL_OR_KEYWORD):
                problems.append(f"no positional parameter {i} ({want.name})")
            continue
        have = impl.parameters.get(want.name)
        if have is None or have.kind is not want.kind or have.default != want.default:
            problems.append(f"parameter {want} is {have}")
    return problems


def _returns(fn) -> set:
    """The return type as a set of alternatives (``X | None`` -> {X, NoneType})."""
    hint = typing.get_type_hints(fn)["return"]
    return set(typing.get_args(hint)) if typing.get_origin(hint) in (
        typing.Union, types.UnionType) else {hint}


@pytest.mark.parametrize("impl", IMPLEMENTATIONS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("name", MEMBERS)
def test_same_members_signatures_and_return_types(impl, name):
    want, have = getattr(EngineCoreClient, name), getattr(impl, name, None)
    assert have is not None, f"{impl.__name__} has no {name}"
    if isinstance(want, property):
        assert isinstance(have, property), f"{impl.__name__}.{name} is not a property"
        want, have = want.fget, have.fget
    assert not _accepts(inspect.signature(have), inspect.signature(want)), (
        _accepts(inspect.signature(have), inspect.signature(want)))
    assert _returns(have) <= _returns(want), (impl.__name__, name)


def _abort_after_tokens(core_like) -> tuple[list, list[EngineCoreOutput]]:
    """Add one long request, step until it has a token, abort it, step until it is finished.
    Returns (what abort_requests returned, every output after it)."""
    sp = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    core_like.add_request(EngineCoreRequest("long", [5, 6, 7], sp, frozenset(), 0))
    deadline = time.monotonic() + 60
    while not any(o.new_token_ids for o in core_like.step(timeout=5)):
        assert time.monotonic() < deadline
    returned = core_like.abort_requests(["long"])
    later = []
    while core_like.has_unfinished_requests:
        assert time.monotonic() < deadline
        later += core_like.step(timeout=5)
    return returned, later


def test_every_core_aborts_and_reports_alike(tiny_model_dir):
    with one_thread_children():
        mp = MPClient(tiny_config(tiny_model_dir))
    cores = {"EngineCore": EngineCore.from_config(tiny_config(tiny_model_dir)),
             "InprocClient": InprocClient(EngineCore.from_config(tiny_config(tiny_model_dir))),
             "MPClient": mp}
    try:
        for name, core_like in cores.items():
            assert isinstance(core_like, EngineCoreClient), name
            returned, later = _abort_after_tokens(core_like)
            assert isinstance(returned, list), name
            assert all(isinstance(o, EngineCoreOutput) for o in returned + later), name
            aborts = [o for o in returned + later if o.finish_reason is not None]
            assert [(o.request_id, o.finish_reason) for o in aborts] == [("long", "abort")], name
            assert type(core_like.stats()) is EngineCoreStats, name
    finally:
        for core_like in cores.values():
            core_like.shutdown()


def test_llm_engine_takes_any_of_them(tiny_model_dir):
    core = EngineCore.from_config(tiny_config(tiny_model_dir))
    engine = LLMEngine(tiny_config(tiny_model_dir), core=lambda *args: InprocClient(core))
    rid = engine.add_request({"prompt_token_ids": [5, 6]}, SamplingParams(max_tokens=3))
    outs = []
    while engine.has_unfinished_requests:
        outs += engine.step()
    assert outs[-1].request_id == rid and outs[-1].finished
    assert isinstance(engine.core.stats(), EngineCoreStats)
    engine.shutdown()
