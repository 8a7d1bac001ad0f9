"""The request bodies of the HTTP API as pydantic models, defined once: `validate` checks a
parsed body against its model (every known field by type, messages and content parts by type
and value: a role that is no role, a text part whose text is no string, are 400s naming the
field), and openapi.py builds ``/openapi.json`` from the same models.

Types are strict (no coercion: ``"5"`` is no integer, ``1`` no boolean). Unknown top-level fields
are accepted, as OpenAI clients and benchmark tools send their own; the value ranges of sampling
fields are `SamplingParams.validate`'s and protocol.py's, which word them with their limits.
Shapes follow OpenAI's API and vLLM's extensions (vllm/entrypoints/openai/protocol.py).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import (BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, ValidationInfo,
                      field_validator)
from pydantic_core import PydanticCustomError

from pagebatch.request import MAX_LOGPROBS

from .protocol import ApiError

_TOP = ConfigDict(strict=True, extra="allow")  # unknown top-level fields: accepted

TokenIds = list[int]
Stop = Union[str, list[str]]


class TextPart(BaseModel):
    """A content part of a chat message: text only (no multimodal input in this version)."""

    model_config = ConfigDict(strict=True, extra="allow")
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    """The call of an assistant message's tool call: ``arguments`` is JSON text (OpenAI's)."""

    model_config = ConfigDict(strict=True, extra="allow")
    name: str
    arguments: str


class MessageToolCall(BaseModel):
    """A tool call an assistant message made (sent back in the next turn)."""

    model_config = ConfigDict(strict=True, extra="allow")
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    """One message of a conversation; other keys (``name``, ...) go to the chat template. An
    assistant message may carry ``tool_calls``; a ``tool`` message answers one by
    ``tool_call_id``."""

    # the document says what _content_required checks: content required, not null, unless
    # the role is assistant (JSON Schema's if / then)
    model_config = ConfigDict(strict=True, extra="allow", json_schema_extra={
        "if": {"properties": {"role": {"const": "assistant"}}},
        "else": {"required": ["content"],
                 "properties": {"content": {"not": {"type": "null"}}}}})
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = Field(
        None, validate_default=True,
        description="required (a string or text parts) except in an assistant message")
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None

    @field_validator("content")
    @classmethod
    def _content_required(cls, content: Any, info: ValidationInfo) -> Any:
        """As OpenAI's API: only an assistant message (e.g. one with tool_calls) may omit
        its content or give null."""
        role = info.data.get("role")
        if content is None and role is not None and role != "assistant":
            raise PydanticCustomError("missing", f"Field required in a {role} message")
        return content


class FunctionDefinition(BaseModel):
    """A tool's function: ``parameters`` is a JSON schema of its arguments object (none: no
    arguments); ``strict`` is accepted, enforcement is tool_choice's (docs/serving.md)."""

    model_config = ConfigDict(strict=True, extra="allow")
    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$",
                      description="1 to 64 letters, digits, '_', '-' or '.'")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    name: str


class NamedToolChoice(BaseModel):
    """``{"type": "function", "function": {"name": ...}}``: call that function."""

    model_config = ConfigDict(strict=True, extra="allow")
    type: Literal["function"]
    function: FunctionName


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    include_usage: bool | None = None


class _Common(BaseModel):
    """Fields both generation endpoints share (OpenAI's, then vLLM's sampling extensions)."""

    model_config = _TOP
    model: str | None = None
    user: str | None = None
    n: int | None = Field(None, ge=1, description="samples per prompt")
    max_tokens: int | None = Field(None, ge=0, description="0 only with echo (scores the prompt)")
    temperature: float | None = Field(None, ge=0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = Field(None, description="token id -> bias")
    stop: Stop | None = Field(None, description="a string or a list of strings")
    seed: int | None = Field(None, ge=-2**63, lt=2**63, description="a 64-bit integer")
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    # vLLM's extensions
    top_k: int | None = Field(None, ge=-1, description="-1 or 0: off")
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0, allow_inf_nan=False)
    min_tokens: int | None = Field(None, ge=0)
    ignore_eos: bool | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    priority: int | None = None
    cache_salt: str | None = None
    response_format: dict[str, Any] | None = Field(
        None, description="{\"type\": \"text\" | \"json_object\" | \"json_schema\", ...}")


class CompletionRequest(_Common):
    """``POST /v1/completions``."""

    prompt: Union[str, TokenIds, list[Union[str, TokenIds]]] = Field(
        description="a string, a list of strings, a list of token ids or a list of token-id "
                    "lists (non-empty)")
    echo: bool | None = None
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS,
                                 description="the number of top tokens")
    best_of: int | None = None


class ChatCompletionRequest(_Common):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    echo: bool | None = None
    tools: list[Tool] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = Field(
        None, description="'none', 'auto', 'required' or {\"type\": \"function\", "
                          "\"function\": {\"name\": ...}}")
    parallel_tool_calls: bool | None = None


class TokenizeRequest(BaseModel):
    """``POST /tokenize``: ``prompt`` or ``messages``."""

    model_config = _TOP
    model: str | None = None
    user: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    tools: list[Tool] | None = None
    add_special_tokens: bool | None = None


class DetokenizeRequest(BaseModel):
    """``POST /detokenize``."""

    model_config = _TOP
    model: str | None = None
    user: str | None = None
    tokens: TokenIds


def _path(loc: tuple[Any, ...]) -> str:
    """pydantic's error location as a field path: ``messages[0].content[1].text``."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _described(model: type[BaseModel], field: str) -> str | None:
    info = model.model_fields.get(field)
    return info.description if info is not None else None


def validate(model: type[BaseModel], body: dict[str, Any]) -> dict[str, Any]:
    """``body`` unchanged when it fits ``model``; else ApiError 400 whose message names the
    field (its path), what it must be and the value given, and whose param is the path."""
    errors = _errors(model, body)
    if errors:
        top = errors[0]["loc"][0] if errors[0]["loc"] else None
        union = sum(1 for err in errors if err["loc"][:1] == (top,)) > 1
        desc = _described(model, top) if isinstance(top, str) else None
        if union and desc:  # one field, several union members failed: say what it may be
            value = body.get(top)
            raise ApiError(400, f"{top} must be {desc}, got {value!r:.100}", param=top) from None
        # a union's members each fail: the deepest location is the one that says what is wrong
        locs = [_strip_union_tags(err["loc"]) for err in errors]
        deepest = max(locs, key=len)
        here = [err for err, loc in zip(errors, locs) if loc == deepest]
        path = _path(deepest)
        what = " or ".join(dict.fromkeys(err["msg"] for err in here))
        given = f", got {here[0]['input']!r:.100}" if here[0]["type"] != "missing" else ""
        raise ApiError(400, f"{path or 'body'}: {what}{given}", param=path or None) from None
    return body


# Items per pydantic call for long lists of messages and content parts: a call holds the GIL
# throughout (about 15 us an item), so 100k messages in one call would stall the event loop for
# seconds even from a worker thread; between calls the other threads run.
_CHUNK = 64
_MESSAGES = TypeAdapter(list[ChatMessage])
_PARTS = TypeAdapter(list[TextPart])
_TOOLS = TypeAdapter(list[Tool])


def _errors(model: type[BaseModel], body: dict[str, Any]) -> list[dict[str, Any]]:
    """pydantic's errors of ``body`` against ``model`` ([] when it fits); long ``messages``,
    content-part and ``tools`` lists are checked in pieces of _CHUNK items."""
    msgs = body.get("messages") if "messages" in model.model_fields else None
    long = isinstance(msgs, list) and (len(msgs) > _CHUNK or any(
        isinstance(m, dict) and isinstance(m.get("content"), list)
        and len(m["content"]) > _CHUNK for m in msgs))
    tools = body.get("tools") if "tools" in model.model_fields else None
    many_tools = isinstance(tools, list) and len(tools) > _CHUNK
    if not (long or many_tools):
        return _try(model.model_validate, body, ())
    shallow = {**body, **({"messages": [{"role": "user", "content": ""}]} if long else {}),
               **({"tools": []} if many_tools else {})}
    errors = _try(model.model_validate, shallow, ())
    if many_tools:
        for i in range(0, len(tools), _CHUNK):
            errors += _try(_TOOLS.validate_python, tools[i:i + _CHUNK], ("tools",), i)
            if errors:
                return errors
    if not long:
        return errors
    for i in range(0, len(msgs), _CHUNK):
        chunk = msgs[i:i + _CHUNK]
        for j, m in enumerate(chunk):
            parts = m.get("content") if isinstance(m, dict) else None
            if isinstance(parts, list) and len(parts) > _CHUNK:
                for k in range(0, len(parts), _CHUNK):
                    errors += _try(_PARTS.validate_python, parts[k:k + _CHUNK], (
                        "messages", i + j, "content", "list[TextPart]"), k)
                    if errors:
                        return errors
                chunk[j] = {**m, "content": []}  # (chunk is a copy)
        errors += _try(_MESSAGES.validate_python, chunk, ("messages",), i)
        if errors:
            return errors
    return errors


def _try(validate: Any, value: Any, prefix: tuple[Any, ...],
         offset: int = 0) -> list[dict[str, Any]]:
    """The errors of ``validate(value)``, their locations under ``prefix`` (a list's item
    indices moved by ``offset``)."""
    try:
        validate(value)
    except ValidationError as e:
        errors = e.errors(include_url=False)
        if not prefix:
            return errors
        return [{**err, "loc": prefix + (err["loc"][0] + offset,) + tuple(err["loc"][1:])}
                if err["loc"] and isinstance(err["loc"][0], int) else
                {**err, "loc": prefix + tuple(err["loc"])} for err in errors]
    return []


def _strip_union_tags(loc: tuple[Any, ...]) -> tuple[Any, ...]:
    """Drop pydantic's union member tags (``'str'``, ``'list[TextPart]'``) from a location."""
    return tuple(p for p in loc if isinstance(p, int) or ("[" not in p and p not in
                                                          ("str", "int", "float", "bool",
                                                           "TextPart", "none")))
