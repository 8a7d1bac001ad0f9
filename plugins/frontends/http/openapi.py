"""``GET /openapi.json``: the OpenAPI 3.1 document of the server, built from the request models
of schemas.py (the ones that validate the bodies) and the response shapes below, so that a
client generator or a fuzzer (tests/test_http_openapi.py runs schemathesis over it) sees what
the server checks."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

import pagebatch

from . import schemas

_REF = "#/components/schemas/{model}"


def _obj(props: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": required}


_NUM = {"type": "number"}
_INT = {"type": "integer"}
_STR = {"type": "string"}
_NULL_OBJ = {"type": ["object", "null"]}
_ERROR = _obj({"error": _obj({"message": _STR, "type": _STR,
                              "param": {"type": ["string", "null"]},
                              "code": {"type": ["string", "null"]}},
                             ["message", "type", "param", "code"])}, ["error"])
_USAGE = _obj({"prompt_tokens": _INT, "completion_tokens": _INT, "total_tokens": _INT},
              ["prompt_tokens", "completion_tokens", "total_tokens"])
_FINISH = {"type": ["string", "null"]}
_STOP_REASON = {"type": ["string", "integer", "null"]}
_COMPLETION = _obj({
    "id": _STR, "object": {"const": "text_completion"}, "created": _INT, "model": _STR,
    "choices": {"type": "array", "items": _obj(
        {"index": _INT, "text": _STR, "logprobs": _NULL_OBJ, "finish_reason": _FINISH,
         "stop_reason": _STOP_REASON}, ["index", "text", "finish_reason"])},
    "usage": _USAGE}, ["id", "object", "created", "model", "choices", "usage"])
_TOOL_CALL = _obj({"id": _STR, "type": {"const": "function"},
                   "function": _obj({"name": _STR, "arguments": _STR}, ["name", "arguments"])},
                  ["id", "type", "function"])
_CHAT = _obj({
    "id": _STR, "object": {"const": "chat.completion"}, "created": _INT, "model": _STR,
    "choices": {"type": "array", "items": _obj(
        {"index": _INT, "message": _obj({"role": {"const": "assistant"},
                                         "content": {"type": ["string", "null"]},
                                         "tool_calls": {"type": "array", "items": _TOOL_CALL}},
                                        ["role", "content"]),
         "logprobs": _NULL_OBJ, "finish_reason": _FINISH, "stop_reason": _STOP_REASON},
        ["index", "message", "finish_reason"])},
    "usage": _USAGE}, ["id", "object", "created", "model", "choices", "usage"])
_TOKENIZE = _obj({"tokens": {"type": "array", "items": _INT}, "count": _INT,
                  "max_model_len": _INT}, ["tokens", "count", "max_model_len"])
_DETOKENIZE = _obj({"prompt": _STR}, ["prompt"])
_MODELS = _obj({"object": {"const": "list"}, "data": {"type": "array", "items": _obj(
    {"id": _STR, "object": {"const": "model"}, "created": _INT, "owned_by": _STR,
     "max_model_len": _INT}, ["id", "object"])}}, ["object", "data"])
_VERSION = _obj({"version": _STR}, ["version"])

_ERRORS = {str(code): {"description": what, "content": {"application/json": {"schema": _ERROR}}}
           for code, what in ((400, "invalid input"), (401, "missing or wrong API key"),
                              (404, "unknown model"), (413, "body too large"),
                              (499, "client left"), (503, "engine dead or shutting down"))}


def _json(schema: dict[str, Any], stream: bool = False) -> dict[str, Any]:
    content = {"application/json": {"schema": schema}}
    if stream:  # "stream": true answers server-sent events
        content["text/event-stream"] = {"schema": _STR}
    return {"200": {"description": "OK", "content": content}, **_ERRORS}


def _post(model: type[BaseModel], summary: str, ok: dict[str, Any], stream: bool = False
          ) -> dict[str, Any]:
    return {"post": {
        "summary": summary, "operationId": model.__name__,
        "requestBody": {"required": True, "content": {"application/json": {
            "schema": {"$ref": _REF.format(model=model.__name__)}}}},
        "responses": _json(ok, stream)}}


def _get(summary: str, ok: dict[str, Any] | None, media: str = "application/json"
         ) -> dict[str, Any]:
    content = {media: {"schema": ok if ok is not None else _STR}}
    return {"get": {"summary": summary, "operationId": summary.replace(" ", "_"),
                    "responses": {"200": {"description": "OK", "content": content}}}}


def openapi_document(api_key: bool) -> dict[str, Any]:
    """The OpenAPI 3.1 document; with ``api_key`` the keyed routes declare bearer auth."""
    models = [schemas.CompletionRequest, schemas.ChatCompletionRequest,
              schemas.TokenizeRequest, schemas.DetokenizeRequest]
    components: dict[str, Any] = {}
    for m in models:
        js = m.model_json_schema(ref_template=_REF)
        components.update(js.pop("$defs", {}))
        components[m.__name__] = js
    paths = {
        "/v1/completions": _post(schemas.CompletionRequest, "completions", _COMPLETION, True),
        "/v1/chat/completions": _post(schemas.ChatCompletionRequest, "chat completions",
                                      _CHAT, True),
        "/tokenize": _post(schemas.TokenizeRequest, "tokenize", _TOKENIZE),
        "/detokenize": _post(schemas.DetokenizeRequest, "detokenize", _DETOKENIZE),
        "/v1/models": _get("models", _MODELS),
        "/version": _get("version", _VERSION),
        "/health": {"get": {"summary": "health", "operationId": "health", "responses": {
            "200": {"description": "the engine is alive"},
            "503": {"description": "the engine is dead or the server is shutting down"}}}},
    }
    doc: dict[str, Any] = {"openapi": "3.1.0",
                           "info": {"title": "pagebatch", "version": pagebatch.__version__},
                           "paths": paths, "components": {"schemas": components}}
    if api_key:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize",
                     "/v1/models"):
            for op in paths[path].values():
                op["security"] = [{"bearer": []}]
    return doc
