"""OpenAI request bodies -> (prompts, `SamplingParams`), and `RequestOutput`s -> OpenAI response
and stream-chunk bodies (shapes as OpenAI and vLLM's server define them).

Everything here is pure: no I/O, no engine. Unknown fields are ignored (benchmark clients send
their own); known OpenAI/vLLM fields that pagebatch does not support raise `ApiError` 400.
"""

from __future__ import annotations

import math
from typing import Any

from pagebatch.request import MAX_LOGPROBS, PositionLogprobs, SamplingParams

from .structured import structured_outputs
from .tools import tool_request

# Fields OpenAI or vLLM define that pagebatch does not implement: a 400, never silence.
UNSUPPORTED_COMMON = ("functions", "function_call", "audio", "prediction", "web_search_options",
                      "lora_request", "use_beam_search")
# (tools are a chat completions feature, in OpenAI's API and vLLM's)
UNSUPPORTED_COMPLETIONS = ("suffix", "tools", "tool_choice", "parallel_tool_calls")


class ApiError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type, param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


def _check_unsupported(body: dict[str, Any], names: tuple[str, ...]) -> None:
    for name in names:
        v = body.get(name)
        if v is None or v is False or v == [] or (name == "tool_choice" and v == "none"):
            continue
        why = ("tool calling is in chat completions only" if name.startswith(("tool", "parallel"))
               else "no legacy functions, audio, beam search or LoRA in this version; tools "
                    "replace functions")
        raise bad(f"{name!r} is not supported by pagebatch on this endpoint ({why}); remove "
                  f"the field", name)


def _int_keys(logit_bias: Any) -> dict[int, float] | None:
    if logit_bias is None:
        return None
    if not isinstance(logit_bias, dict):
        raise bad(f"logit_bias must be an object of token id -> bias, got {logit_bias!r:.100}",
                  "logit_bias")
    out = {}
    for k, v in logit_bias.items():
        try:
            out[int(k)] = v
        except (TypeError, ValueError):
            raise bad(f"logit_bias key {k!r} is not a token id", "logit_bias") from None
    return out


def _opt(body: dict[str, Any], name: str, default: Any) -> Any:
    v = body.get(name)
    return default if v is None else v


def flag(body: dict[str, Any], name: str, default: bool, param: str | None = None) -> bool:
    """A boolean field: true, false, or absent / null (``default``). Anything else is a 400
    (``bool("false")`` would be True)."""
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(f"{param or name} must be true or false, got {v!r:.50}", param or name)
    return v


def check_text(s: str, param: str) -> str:
    """``s`` unchanged when it is valid Unicode text; a 400 for a lone surrogate (JSON allows
    ``"\\ud800"``; the tokenizer cannot encode it)."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise bad(f"{param} is not valid Unicode text: a lone surrogate "
                  f"{s[e.start]!r} at character {e.start}", param) from None
    return s


# Fields the model's generation_config.json fills in when a request leaves them unset (vLLM's
# ``--generation-config auto``); its max_new_tokens (our max_tokens) caps max_tokens, as in vLLM.
MODEL_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def sampling_params(body: dict[str, Any], max_tokens: Any, logprobs: int | None,
                    max_n: int, defaults: dict[str, Any] | None = None) -> SamplingParams:
    """The fields both endpoints share. A field the body leaves unset (or null) takes the
    model's default from ``defaults`` (`LLMEngine.sampling_defaults`, see MODEL_DEFAULTS),
    else SamplingParams'. Range checks are SamplingParams.validate's (the engine runs it and
    raises SamplingParamsError, answered as a 400), but for the fields chat names differently
    (``max_completion_tokens``, ``top_logprobs``), which `chat_request` checks itself so that
    the 400 names them."""
    defaults = defaults or {}

    def pick(name: str, fallback: Any) -> Any:
        return _opt(body, name, defaults.get(name, fallback) if name in MODEL_DEFAULTS
                    else fallback)

    n = _opt(body, "n", 1)
    if isinstance(n, int) and not isinstance(n, bool) and n > max_n:
        raise bad(f"n={n} is more than this server allows (max_n_per_request={max_n})", "n")
    cap = defaults.get("max_tokens")
    if cap is not None and (max_tokens is None or (
            isinstance(max_tokens, int) and not isinstance(max_tokens, bool)
            and max_tokens > cap)):
        max_tokens = cap
    stop_ids = _opt(body, "stop_token_ids", [])
    return SamplingParams(
        n=n, temperature=pick("temperature", 1.0), top_p=pick("top_p", 1.0),
        top_k=pick("top_k", 0), min_p=pick("min_p", 0.0),
        presence_penalty=_opt(body, "presence_penalty", 0.0),
        frequency_penalty=_opt(body, "frequency_penalty", 0.0),
        repetition_penalty=pick("repetition_penalty", 1.0),
        logit_bias=_int_keys(body.get("logit_bias")), max_tokens=max_tokens,
        min_tokens=_opt(body, "min_tokens", 0), stop=body.get("stop"),
        stop_token_ids=stop_ids,
        include_stop_str_in_output=flag(body, "include_stop_str_in_output", False),
        ignore_eos=flag(body, "ignore_eos", False), logprobs=logprobs,
        seed=body.get("seed"), skip_special_tokens=flag(body, "skip_special_tokens", True))


def _check_priority_and_salt(body: dict[str, Any]) -> tuple[int, str | None]:
    priority = _opt(body, "priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise bad(f"priority must be an integer, got {priority!r:.50}", "priority")
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise bad(f"cache_salt must be a non-empty string, got {salt!r:.50}", "cache_salt")
    return priority, salt


def completion_request(body: dict[str, Any], max_prompts: int, max_n: int,
                       defaults: dict[str, Any] | None = None
                       ) -> tuple[list[dict[str, Any]], SamplingParams, dict[str, Any]]:
    """Parse a /v1/completions body. Returns engine prompts (dicts, with cache_salt when
    given), the sampling params (unset fields from ``defaults``, see `sampling_params`) and
    options: echo, stream, include_usage, priority, score_only (max_tokens 0 with echo: the
    prompt is scored, nothing generated)."""
    _check_unsupported(body, UNSUPPORTED_COMMON + UNSUPPORTED_COMPLETIONS)
    best_of = body.get("best_of")
    if best_of is not None and best_of != _opt(body, "n", 1):
        raise bad("best_of other than n is not supported", "best_of")
    prompts = _prompts(body.get("prompt"), max_prompts)
    priority, salt = _check_priority_and_salt(body)
    if salt is not None:
        prompts = [{**p, "cache_salt": salt} for p in prompts]
    echo = flag(body, "echo", False)
    logprobs = body.get("logprobs")
    if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int)):
        raise bad(f"logprobs must be an integer (the number of top tokens), got {logprobs!r}",
                  "logprobs")
    max_tokens = body["max_tokens"] if "max_tokens" in body else 16
    score_only = max_tokens == 0 and not isinstance(max_tokens, bool)
    if score_only:
        if not echo:
            raise bad("max_tokens=0 is only allowed with echo=true (to score the prompt)",
                      "max_tokens")
        max_tokens = 1  # one token is computed and dropped
    params = sampling_params(body, max_tokens, logprobs, max_n, defaults)
    params.structured_outputs = structured_outputs(body)
    if echo and logprobs is not None:
        params.prompt_logprobs = logprobs
    opts = dict(echo=echo, score_only=score_only, priority=priority, **_stream_opts(body))
    return prompts, params, opts


def _prompts(prompt: Any, max_prompts: int) -> list[dict[str, Any]]:
    def is_ids(x: Any) -> bool:
        return isinstance(x, list) and bool(x) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in x)

    if isinstance(prompt, str):
        out = [{"prompt": check_text(prompt, "prompt")}]
    elif is_ids(prompt):
        out = [{"prompt_token_ids": prompt}]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or is_ids(p)
                                                     for p in prompt):
        out = [{"prompt": check_text(p, f"prompt[{i}]")} if isinstance(p, str)
               else {"prompt_token_ids": p} for i, p in enumerate(prompt)]
    else:
        raise bad("prompt must be a string, a list of strings, a list of token ids or a list "
                  f"of token-id lists (non-empty), got {prompt!r:.100}", "prompt")
    if len(out) > max_prompts:
        raise bad(f"{len(out)} prompts in one request; this server allows "
                  f"{max_prompts} (max_prompts_per_request)", "prompt")
    return out


def _stream_opts(body: dict[str, Any]) -> dict[str, Any]:
    stream = flag(body, "stream", False)
    so = body.get("stream_options")
    if so is not None and not isinstance(so, dict):
        raise bad("stream_options must be an object", "stream_options")
    include_usage = flag(so or {}, "include_usage", False, "stream_options.include_usage")
    if so and not stream:
        raise bad("stream_options is only allowed with stream=true", "stream_options")
    return dict(stream=stream, include_usage=include_usage)


def chat_request(body: dict[str, Any], max_n: int, defaults: dict[str, Any] | None = None,
                 auto_tools: bool = False, exclude_tools_when_none: bool = False
                 ) -> tuple[list[dict[str, Any]], SamplingParams, dict[str, Any]]:
    """Parse a /v1/chat/completions body. Returns the messages (content parts flattened to
    text), the sampling params (unset fields from ``defaults``, see `sampling_params`) and
    options (stream, include_usage, priority, cache_salt, top_logprobs, tools: a
    `ToolRequest` or None; see tools.py, whose ``auto`` needs ``auto_tools``, a server with a
    tool-call parser). ``required`` or a named tool_choice sets the params' constraint (with
    another constraint: a 400 naming tool_choice)."""
    _check_unsupported(body, UNSUPPORTED_COMMON)
    if flag(body, "echo", False):
        raise bad("echo is not supported for chat completions", "echo")
    messages = _messages(body.get("messages"))
    priority, salt = _check_priority_and_salt(body)
    max_tokens = body.get("max_completion_tokens")
    if max_tokens is None:
        max_tokens = body.get("max_tokens")
    elif isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise bad(f"max_completion_tokens={max_tokens!r:.50} is invalid: must be an integer "
                  f">= 1", "max_completion_tokens")
    want = flag(body, "logprobs", False)  # null: the default, as OpenAI's API takes it
    top = body.get("top_logprobs")
    if top is not None:
        if not want:
            raise bad("top_logprobs needs logprobs=true", "top_logprobs")
        if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_LOGPROBS:
            raise bad(f"top_logprobs={top!r:.50} is invalid: must be an integer in "
                      f"[0, {MAX_LOGPROBS}]", "top_logprobs")
    logprobs = (top or 0) if want else None
    params = sampling_params(body, max_tokens, logprobs, max_n, defaults)
    params.structured_outputs = structured_outputs(body)
    tools = tool_request(body, auto_tools, exclude_tools_when_none)
    forced = tools.constraint() if tools is not None else None
    if forced is not None:
        if params.structured_outputs is not None:
            raise bad(f"tool_choice {body.get('tool_choice')!r:.100} and "
                      f"{params.structured_outputs.origin} both constrain the output; give one",
                      "tool_choice")
        params.structured_outputs = forced
    opts = dict(priority=priority, cache_salt=salt, top_logprobs=logprobs, tools=tools,
                **_stream_opts(body))
    return messages, params, opts


def _messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise bad("messages must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad(f"messages[{i}] must be an object with a string 'role'", "messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text":
                    raise bad(f"messages[{i}].content: only 'text' parts are supported "
                              f"(no multimodal input in this version)", "messages")
                texts.append(str(part.get("text", "")))
            content = "".join(texts)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise bad(f"messages[{i}].content must be a string or a list of text parts",
                      "messages")
        out.append({**m, "content": check_text(content, f"messages[{i}].content")})
    return out


# ---- responses ---------------------------------------------------------------------------------

def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _lp(x: float) -> float:
    return x if math.isfinite(x) else -9999.0  # JSON has no -inf (OpenAI's floor too)


def completion_logprobs(positions: list[PositionLogprobs | None], text_offset: int,
                        decode: Any, first_prompt_token: int | None = None) -> dict[str, list]:
    """OpenAI's completions logprobs object over some positions, offsets from
    ``text_offset``. A None position is the prompt's first token (``first_prompt_token``),
    which has no log-prob: its text is given with null log-prob and top log-probs, as OpenAI
    and vLLM do. ``decode(id)`` gives a token's text."""
    tokens, token_lps, tops, offsets = [], [], [], []
    off = text_offset
    for pos in positions:
        offsets.append(off)
        if pos is None:
            text = decode(first_prompt_token) if first_prompt_token is not None else ""
            tokens.append(text)
            token_lps.append(None)
            tops.append(None)
            off += len(text)
            continue
        tid, first = next(iter(pos.items()))
        text = first.decoded_token if first.decoded_token is not None else decode(tid)
        tokens.append(text)
        token_lps.append(_lp(first.logprob))
        tops.append({(lp.decoded_token if lp.decoded_token is not None else decode(t)):
                     _lp(lp.logprob) for t, lp in pos.items()})
        off += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}


def _chat_entry(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": _lp(logprob), "bytes": list(text.encode("utf-8"))}


def chat_logprobs(positions: list[PositionLogprobs], top_n: int, decode: Any
                  ) -> dict[str, list]:
    """OpenAI's chat logprobs object: per token, itself and its ``top_n`` most likely
    alternatives (by rank)."""
    content = []
    for pos in positions:
        tid, first = next(iter(pos.items()))
        entry = _chat_entry(first.decoded_token or decode(tid), first.logprob)
        top = sorted((lp.rank, t, lp) for t, lp in pos.items()
                     if lp.rank is not None and lp.rank <= top_n)[:top_n]
        entry["top_logprobs"] = [_chat_entry(lp.decoded_token or decode(t), lp.logprob)
                                 for _, t, lp in top]
        content.append(entry)
    return {"content": content}

