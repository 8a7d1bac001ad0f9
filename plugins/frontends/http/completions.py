"""POST /v1/completions and /v1/chat/completions: parse, queue (every input error is a 400
before anything is sent), then answer in one body or as server-sent events."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pagebatch.request import CompletionOutput, RequestOutput

from . import protocol as proto
from . import schemas, tool_calls
from .errors import as_api_error, error_response, new_id, request_failed
from .streams import EventStreamResponse, merge, sse, until_disconnected
from .tool_calls import ToolCallStream
from .tools import template_messages

if TYPE_CHECKING:
    from .server import Server


@dataclass
class _RequestProgress:
    """One engine request of an HTTP request, as its outputs arrive."""

    last_output: float | None = None  # time.monotonic() of its last output with tokens
    tokens: int = 0  # token ids of its longest sample in its last output
    final: RequestOutput | None = None  # its finished output
    prompt_tokens: int = 0  # from its outputs (0 until the first)


@dataclass
class _ChoiceProgress:
    """What a stream has sent of one choice."""

    chars: int = 0  # characters of its text
    tokens: int = 0  # its token ids (log-prob rows)
    text_offset: int = 0  # the text_offset of its next log-prob token (completions)
    done: bool = False  # its finish_reason
    calls: ToolCallStream | None = None  # what it sent through a tool-call parser (chat)


class _Tracker:
    """Per-request latency metrics (TTFT, ITL, e2e) and token counts as outputs arrive."""

    def __init__(self, server: "Server", n_requests: int) -> None:
        self.m = server.metrics
        self.t0 = time.monotonic()
        self.requests = [_RequestProgress() for _ in range(n_requests)]

    def seen(self, i: int, out: RequestOutput) -> None:
        now = time.monotonic()
        req = self.requests[i]
        req.prompt_tokens = len(out.prompt_token_ids)
        tokens = max((len(c.token_ids) for c in out.outputs), default=0)
        if tokens > req.tokens:
            if req.last_output is None:
                self.m.ttft.observe(now - self.t0)
            else:
                self.m.itl.observe(now - req.last_output)
            # one output per step, except where the stream fell behind and got the newest of
            # several (AsyncEngine._iterate): those steps came back to back, gaps of 0
            for _ in range(tokens - req.tokens - 1):
                self.m.itl.observe(0.0)
            req.last_output, req.tokens = now, tokens
        if out.finished:
            req.final = out
            reason = out.outputs[0].finish_reason or "abort"
            self.m.request_done(len(out.prompt_token_ids),
                                sum(len(c.token_ids) for c in out.outputs), reason, now - self.t0)

    def close(self, prompt_lens: list[int]) -> None:
        """Requests that never finished (client gone, error): count them as aborted."""
        now = time.monotonic()
        for i, req in enumerate(self.requests):
            if req.final is None:
                self.m.request_done(prompt_lens[i], 0, "abort", now - self.t0)


class Completions:
    def __init__(self, server: "Server") -> None:
        self.s = server

    # ---- /v1/completions ----------------------------------------------------------------------

    def _completion_body(self, body: dict[str, Any]) -> tuple:
        """A checked /v1/completions body's prompts, params and options (on a worker thread
        when the body is large, see `Server.read_json`)."""
        s = self.s
        s.check_model_and_user(body)
        return proto.completion_request(body, s.settings.max_prompts_per_request,
                                        s.settings.max_n_per_request, s.sampling_defaults)

    def _chat_body(self, body: dict[str, Any]) -> tuple:
        """A checked chat body's messages (as the template takes them), params and options."""
        s = self.s
        s.check_model_and_user(body)
        messages, params, opts = proto.chat_request(
            body, s.settings.max_n_per_request, s.sampling_defaults,
            auto_tools=s.settings.enable_auto_tool_choice and s.tool_parser is not None,
            exclude_tools_when_none=s.settings.exclude_tools_when_tool_choice_none)
        return template_messages(messages), params, opts

    async def completions(self, request: Request) -> Response:
        s = self.s
        try:
            s.check_accepting()
            prompts, params, opts = await s.read_json(request, schemas.CompletionRequest,
                                                      self._completion_body)
            rid = new_id("cmpl")
            rids, streams = await s.start(prompts, params, opts["priority"], rid)
        except Exception as e:
            return error_response(as_api_error(e))
        created = int(time.time())
        result = await self._stream_or_collect(
            request, self._completion_stream(rid, created, rids, streams, opts, params.n),
            rids, streams, opts)
        if isinstance(result, Response):
            return result
        choices, n_prompt, n_gen = [], 0, 0
        for i, out in enumerate(result):
            n_prompt += len(out.prompt_token_ids)
            for c in out.outputs:
                choice, k = self._completion_choice(out, c, opts)
                choice["index"] = i * params.n + c.index
                choices.append(choice)
                n_gen += k
        return JSONResponse({"id": rid, "object": "text_completion", "created": created,
                             "model": s.model_name, "choices": choices,
                             "usage": proto.usage(n_prompt, n_gen)})

    async def _stream_or_collect(self, request: Request, events: AsyncIterator[str],
                                 rids: list[str], streams: list[AsyncIterator],
                                 opts: dict[str, Any]) -> Response | list[RequestOutput]:
        """With ``stream: true`` the SSE response of ``events``; else the finished outputs, or
        an error response (the request failed) or a 499 (the client left first)."""
        if opts["stream"]:
            return EventStreamResponse(events)
        try:
            result = await until_disconnected(request, self._collect(rids, streams))
        except Exception as e:
            return error_response(as_api_error(e))
        return Response(status_code=499) if result is None else result

    async def _collect(self, rids: list[str], streams: list[AsyncIterator]
                       ) -> list[RequestOutput]:
        tracker = _Tracker(self.s, len(streams))
        try:
            async for i, out in merge(streams):
                tracker.seen(i, out)
        finally:
            await self.s.abort(rids)
            tracker.close([0] * len(streams))
        finals = [r.final for r in tracker.requests]
        for out in finals:
            if out.error is not None:
                raise request_failed(out)
        return finals  # type: ignore[return-value]

    def _echo_text(self, out: RequestOutput) -> str:
        if out.prompt is not None:
            return out.prompt
        tok = self.s.tokenizer
        return tok.decode(out.prompt_token_ids) if tok is not None else ""

    def _completion_choice(self, out: RequestOutput, c: CompletionOutput,
                           opts: dict[str, Any]) -> tuple[dict[str, Any], int]:
        """A non-streaming choice and its number of generated tokens."""
        score_only = opts["score_only"]
        text = "" if score_only else c.text
        positions: list = [] if score_only or c.logprobs is None else list(c.logprobs)
        prefix = ""
        if opts["echo"]:
            prefix = self._echo_text(out)
            if out.prompt_logprobs is not None:
                positions = list(out.prompt_logprobs) + positions
        logprobs = None
        if c.logprobs is not None or (opts["echo"] and out.prompt_logprobs is not None):
            logprobs = proto.completion_logprobs(positions, 0, self.s.decode,
                                                 out.prompt_token_ids[0])
        reason = "length" if score_only else c.finish_reason
        return ({"text": prefix + text, "logprobs": logprobs, "finish_reason": reason,
                 "stop_reason": c.stop_reason}, 0 if score_only else len(c.token_ids))

    async def _completion_stream(self, rid: str, created: int, rids: list[str],
                                 streams: list[AsyncIterator], opts: dict[str, Any],
                                 n: int) -> AsyncIterator[str]:
        s = self.s
        choices: dict[int, _ChoiceProgress] = {}  # by choice index, from its first output
        n_gen = 0
        tracker = _Tracker(s, len(streams))

        def chunk(choice: dict[str, Any]) -> str:
            return sse({"id": rid, "object": "text_completion", "created": created,
                        "model": s.model_name, "choices": [choice], "usage": None})

        try:
            async for i, out in merge(streams):
                tracker.seen(i, out)
                if out.error is not None:
                    raise request_failed(out)
                for c in out.outputs:
                    idx = i * n + c.index
                    ch = choices.get(idx)
                    first = ch is None
                    if ch is None:
                        ch = choices[idx] = _ChoiceProgress()
                    elif ch.done:
                        continue
                    text = "" if opts["score_only"] else c.text[ch.chars:]
                    positions = ([] if opts["score_only"] or c.logprobs is None
                                 else c.logprobs[ch.tokens:])
                    prefix = ""
                    if first and opts["echo"]:
                        prefix = self._echo_text(out)
                        if out.prompt_logprobs is not None:
                            positions = list(out.prompt_logprobs) + list(positions)
                    new_tokens = len(c.token_ids) > ch.tokens  # (vLLM's rule: a chunk per
                    ch.chars, ch.tokens = len(c.text), len(c.token_ids)  # step with new ids,
                    reason = c.finish_reason  # even while the detokenizer holds text back)
                    if not (prefix or text or reason or positions or new_tokens):
                        continue
                    lps = None
                    if c.logprobs is not None or (first and out.prompt_logprobs is not None):
                        start = ch.text_offset  # offsets run on across chunks
                        lps = proto.completion_logprobs(positions, start, s.decode,
                                                        out.prompt_token_ids[0])
                        ch.text_offset = start + sum(len(t) for t in lps["tokens"])
                    if reason is not None:
                        ch.done = True
                        n_gen += 0 if opts["score_only"] else len(c.token_ids)
                    yield chunk({"index": idx, "text": prefix + text, "logprobs": lps,
                                 "finish_reason": ("length" if opts["score_only"] and reason
                                                   else reason),
                                 "stop_reason": c.stop_reason})
            if opts["include_usage"]:
                yield sse({"id": rid, "object": "text_completion", "created": created,
                           "model": s.model_name, "choices": [],
                           "usage": proto.usage(sum(r.prompt_tokens for r in tracker.requests),
                                                n_gen)})
        except Exception as e:  # the stream is open: an error event, then [DONE]
            yield sse(as_api_error(e).body())
        finally:
            await s.abort(rids)
            tracker.close([r.prompt_tokens for r in tracker.requests])
        yield "data: [DONE]\n\n"

    # ---- /v1/chat/completions -----------------------------------------------------------------

    async def chat(self, request: Request) -> Response:
        s = self.s
        try:
            s.check_accepting()
            messages, params, opts = await s.read_json(request, schemas.ChatCompletionRequest,
                                                       self._chat_body)
            tools = opts["tools"]
            opts["tool_parser"] = tool_calls.output_parser(tools, s.tool_parser)
            if opts["tool_parser"] is not None:
                opts["tool_parser"].adjust_request(params)
            try:
                prompt = await s.engine.chat_prompt(
                    messages, params.max_tokens,
                    tools.render if tools is not None else None)
            except proto.ApiError:
                raise
            except Exception as e:  # template errors (jinja) are the messages' fault
                if isinstance(e, (ValueError, TypeError)) or "Template" in type(e).__name__:
                    raise proto.bad(f"messages do not fit the chat template: {e}",
                                    "messages") from None
                raise
            if opts["cache_salt"] is not None:
                prompt["cache_salt"] = opts["cache_salt"]
            rid = new_id("chatcmpl")
            rids, streams = await s.start([prompt], params, opts["priority"], rid)
        except Exception as e:
            return error_response(as_api_error(e))
        created = int(time.time())
        result = await self._stream_or_collect(
            request, self._chat_stream(rid, created, rids, streams, opts, params.n),
            rids, streams, opts)
        if isinstance(result, Response):
            return result
        out = result[0]
        choices = []
        for c in out.outputs:
            lps = (proto.chat_logprobs(c.logprobs, opts["top_logprobs"], s.decode)
                   if c.logprobs is not None else None)
            message, reason = tool_calls.chat_message(c.text, c.finish_reason, opts["tools"],
                                                      opts["tool_parser"])
            choices.append({"index": c.index, "message": message, "logprobs": lps,
                            "finish_reason": reason, "stop_reason": c.stop_reason})
        n_gen = sum(len(c.token_ids) for c in out.outputs)
        return JSONResponse({"id": rid, "object": "chat.completion", "created": created,
                             "model": s.model_name, "choices": choices,
                             "usage": proto.usage(len(out.prompt_token_ids), n_gen)})

    async def _chat_stream(self, rid: str, created: int, rids: list[str],
                           streams: list[AsyncIterator], opts: dict[str, Any],
                           n: int) -> AsyncIterator[str]:
        s = self.s
        choices: dict[int, _ChoiceProgress] = {}  # by choice index, from its first output
        n_gen = 0
        tracker = _Tracker(s, 1)
        parser = opts["tool_parser"]

        def chunk(choice: dict[str, Any]) -> str:
            return sse({"id": rid, "object": "chat.completion.chunk", "created": created,
                        "model": s.model_name, "choices": [choice], "usage": None})

        try:
            for i in range(n):  # the first chunk of each choice carries the role
                yield chunk({"index": i, "delta": {"role": "assistant", "content": ""},
                             "logprobs": None, "finish_reason": None})
            async for _, out in merge(streams):
                tracker.seen(0, out)
                if out.error is not None:
                    raise request_failed(out)
                for c in out.outputs:
                    ch = choices.get(c.index)
                    if ch is None:
                        ch = choices[c.index] = _ChoiceProgress()
                    elif ch.done:
                        continue
                    text = c.text[ch.chars:]
                    positions = c.logprobs[ch.tokens:] if c.logprobs is not None else []
                    new_tokens = len(c.token_ids) > ch.tokens  # a chunk per step with new ids
                    ch.chars, ch.tokens = len(c.text), len(c.token_ids)
                    if not (text or c.finish_reason or positions or new_tokens):
                        continue
                    lps = (proto.chat_logprobs(positions, opts["top_logprobs"], s.decode)
                           if c.logprobs is not None else None)
                    reason = c.finish_reason
                    if reason is not None:
                        ch.done = True
                        n_gen += len(c.token_ids)
                    delta: dict[str, Any] = {"content": text} if text else {}
                    if parser is not None:  # the text goes through the tool-call parser
                        calls = ch.calls
                        if calls is None:
                            calls = ch.calls = ToolCallStream(opts["tools"], parser)
                        delta = calls.delta(c.text, final=reason is not None)
                        reason = tool_calls.finish_reason(opts["tools"], reason, calls.called)
                    yield chunk({"index": c.index, "delta": delta, "logprobs": lps,
                                 "finish_reason": reason, "stop_reason": c.stop_reason})
            if opts["include_usage"]:
                yield sse({"id": rid, "object": "chat.completion.chunk", "created": created,
                           "model": s.model_name, "choices": [],
                           "usage": proto.usage(tracker.requests[0].prompt_tokens, n_gen)})
        except Exception as e:
            yield sse(as_api_error(e).body())
        finally:
            await s.abort(rids)
            tracker.close([tracker.requests[0].prompt_tokens])
        yield "data: [DONE]\n\n"
