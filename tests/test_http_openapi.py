"""The served OpenAPI document (/openapi.json, built from schemas.py) and a bounded schemathesis
run against it on the tiny model (issue 25, item 2; vLLM's
tests/entrypoints/openai/test_openai_schema.py does the same): whatever it sends, no 5xx, and
every answer (2xx bodies above all) valid against the document. Plus the 400s of wrongly typed
values inside chat messages, each naming the field."""

from __future__ import annotations

import httpx
import pytest

from http_helpers import KEY, MODEL

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis.checks import (content_type_conformance, not_a_server_error,  # noqa: E402
                                 response_schema_conformance)

AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def api_schema(base):
    return schemathesis.openapi.from_url(base + "/openapi.json")


def test_document_names_the_routes(base):
    doc = httpx.get(base + "/openapi.json").json()  # open, like /health
    assert doc["openapi"].startswith("3.1")
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        assert "post" in doc["paths"][path] and doc["paths"][path]["post"]["security"]
    roles = doc["components"]["schemas"]["ChatMessage"]["properties"]["role"]["enum"]
    assert "user" in roles and "assistant" in roles


@pytest.mark.parametrize("message,param", [
    ({"role": "wizard", "content": "w4"}, "messages[0].role"),
    ({"role": 5, "content": "w4"}, "messages[0].role"),
    ({"role": "user", "content": [{"type": "text", "text": 5}]}, "messages[0].content[0].text"),
    ({"role": "user", "content": [{"type": "text", "text": "w4"}, {"type": "text"}]},
     "messages[0].content[1].text"),
    ({"role": "user", "content": [{"type": "text", "text": ["w4"]}]},
     "messages[0].content[0].text"),
    ({"role": "user", "content": "w4", "name": 3}, "messages[0].name"),
    ({"role": "user"}, "messages[0].content"),  # only an assistant message may omit it
    ({"role": "system", "content": None}, "messages[0].content"),
    ({"role": "tool", "tool_call_id": "c1"}, "messages[0].content"),
])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
def test_wrong_values_inside_messages_are_400(http, path, message, param):
    r = http.post(path, json={"model": MODEL, "messages": [message], "max_tokens": 2})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"], err
    assert err["type"] == "invalid_request_error"


def test_unknown_top_level_fields_stay_accepted(http):
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "w5", "max_tokens": 1,
                                           "some_client_field": {"x": 1}})
    assert r.status_code == 200, r.text


def test_strict_types_at_the_top(http):
    for field, value in (("max_tokens", "2"), ("temperature", "0.5"), ("n", 1.5),
                         ("stop", 5), ("logit_bias", {"5": "x"})):
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "w5", field: value})
        assert r.status_code == 400 and r.json()["error"]["param"].startswith(field), r.text


def _bounded(case) -> None:
    if case.method == "POST" and isinstance(case.body, dict):
        case.body.pop("stream", None)  # one body per answer (SSE bodies are not JSON)
        if isinstance(case.body.get("model"), str):
            case.body["model"] = MODEL  # else nearly every answer is the unknown model's 404
        if isinstance(case.body.get("max_tokens"), int) and case.body["max_tokens"] > 4:
            case.body["max_tokens"] = 4  # bounded: the tiny model, few tokens


def test_openapi_fuzz(base):
    """Each operation of the document with schemathesis' generated bodies: no 5xx; each
    answer's content type and body as the document says. Bounded (about 20 s on 2 cores)."""
    from hypothesis import given

    schema = schemathesis.openapi.from_url(base + "/openapi.json")
    ops = [result.ok() for result in schema.get_all_operations()]
    assert len(ops) >= 7
    statuses: dict[str, set[int]] = {}
    for op in ops:
        @given(case=op.as_strategy())
        @settings(max_examples=25 if op.method.upper() == "POST" else 3, deadline=None,
                  derandomize=True, database=None, suppress_health_check=list(HealthCheck))
        def run(case) -> None:
            _bounded(case)
            r = case.call_and_validate(base_url=base, headers=AUTH, timeout=30,
                                       checks=[not_a_server_error, response_schema_conformance,
                                               content_type_conformance])
            statuses.setdefault(op.path, set()).add(r.status_code)

        run()
    print(statuses)
    # the generated bodies reach the engine, not only the validation
    assert all(200 in codes for codes in statuses.values()), statuses


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "w5", "seed": 2**64}, "seed"),
    ("/v1/completions", {"prompt": "w5", "seed": -2**63 - 1}, "seed"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w4"}],
                              "response_format": {"type": "json_schema", "json_schema": {
                                  "name": 5, "schema": {"type": "object"}}}},
     "response_format.json_schema.name"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w4"}],
                              "response_format": {"type": "json_schema", "json_schema": {
                                  "name": "x", "schema": {}, "strict": "yes"}}},
     "response_format.json_schema.strict"),
    ("/v1/completions", {"prompt": "w5", "response_format": {"type": "yaml"}},
     "response_format.type"),  # taken on completions too (as vLLM), not ignored
    ("/tokenize", {"prompt": "w5", "messages": [{"role": "user", "content": "w4"}]},
     "messages"),
])
def test_values_no_longer_coerced_or_ignored(http, path, body, param):
    r = http.post(path, json={"model": MODEL, "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_seed_range_edges(http):
    for seed in (2**63 - 1, -2**63):
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "w5", "max_tokens": 1,
                                               "seed": seed})
        assert r.status_code == 200, r.text
